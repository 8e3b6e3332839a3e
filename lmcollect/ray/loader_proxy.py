"""ActorWeightLoader: a collector actor's WeightLoader as seen from the trainer (the updaters' Ray target)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import ray
from ray.actor import ActorHandle

from lmcollect.ray.carrier import put_weights
from lmcollect.weight_sync.loader import LoadOptions
from lmcollect.weight_sync.target import Metadata, Wait
from lmcollect.weights.version import PushVersion

Remember = Callable[..., None]
"""``remember(payload_ref, version=, convert_dtype=)``: a ``RayLLMCollector`` keeps its last push
to give a restarted actor back its weights."""


class ActorWeightLoader:
    """The :class:`~lmcollect.weight_sync.target.WeightTarget` of a collector running as a Ray actor:
    each call is the actor's weight method (its loader's, through the collector's spec doors).

    ``remember``: called with each full push's ObjectRef (a ``RayLLMCollector`` re-sends it to its
    actor if the actor restarts). ``call_timeout_s``: longest a blocking call waits (None: no limit).
    The ``*_ref`` methods start a call and return its ObjectRef, for updaters that wait on many
    actors at once.
    """

    def __init__(
        self, actor: ActorHandle, *, remember: Remember | None = None, call_timeout_s: float | None = None
    ) -> None:
        if not isinstance(actor, ActorHandle):
            raise TypeError(f"ActorWeightLoader needs a collector actor's handle, got {type(actor).__name__}.")
        self.actor = actor
        self._remember = remember
        self.call_timeout_s = call_timeout_s

    def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        return ray.get(ref, timeout=self.call_timeout_s if timeout_s is None else timeout_s)

    def _wait(self, ref: Any, answer: Callable[[Any], Any] | None = None) -> Wait:
        """``wait(timeout_s)`` for ``ref``: its result, through ``answer`` when given."""

        def wait(timeout_s: float | None = None) -> Any:
            found = self._get(ref, timeout_s)
            return found if answer is None else answer(found)

        return wait

    # ------------------------------------------------------------------ started calls (ObjectRefs)
    def load_ref(self, payload_ref: Any, options: LoadOptions, *, remember: bool = True) -> ray.ObjectRef:
        """Start the actor's load of the push behind ``payload_ref`` (``remember``: a full push,
        kept for a restart). Only the options that differ from their defaults travel, so actors
        of other kinds need not know them."""
        if remember and self._remember is not None:
            self._remember(payload_ref, version=options.version, convert_dtype=options.convert_dtype)
        given = {
            field.name: getattr(options, field.name)
            for field in dataclasses.fields(options)
            if field.name != "version" and getattr(options, field.name) != field.default
        }
        return self.actor.receive_weights.remote(payload_ref, version=options.version, **given)

    def metadata_ref(self, model_id: str = "policy") -> ray.ObjectRef:
        return self.actor.weight_metadata.remote(model_id)

    def version_index_ref(self) -> ray.ObjectRef:
        return self.actor.version_index.remote()

    # ------------------------------------------------------------------ WeightTarget
    def metadata(self, model_id: str = "policy") -> tuple[Metadata, dict[str, str]]:
        return self._get(self.metadata_ref(model_id))

    def version_index(self) -> int:
        return int(self._get(self.version_index_ref()))

    def increment_version(self) -> None:
        self._get(self.actor.increment_version.remote())

    def load(self, weights: Any, options: LoadOptions | None = None, *, model_id: str = "policy") -> Any:
        """Put ``weights`` into the object store once and load them in the actor; the engine's report."""
        if model_id != "policy":
            raise ValueError(f"model_id={model_id!r}: a push through a collector actor loads 'policy' only.")
        return self._get(self.load_ref(put_weights(weights), options or LoadOptions())).report

    def submit_load(self, source: Any, *, version: PushVersion | None) -> Wait:
        return self._wait(self.actor.receive_weights.remote(source, version=version), lambda found: found.report)

    def submit_join_weight_group(self, connection_info: dict[str, Any], *, ranks_per_replica: int) -> Wait:
        return self._wait(
            self.actor.join_policy_weight_group.remote(connection_info, ranks_per_replica=ranks_per_replica)
        )

    def receiver_nodes(self) -> list[str | None]:
        return self._get(self.actor.policy_weight_receiver_nodes.remote())

    def owner_node(self) -> str | None:
        return self._get(self.actor.process_info.remote())["node_id"]

    def num_replicas(self) -> int:
        return int(self._get(self.actor.policy_engine_num_replicas.remote()))

    def __repr__(self) -> str:
        return f"ActorWeightLoader({self.actor!r})"
