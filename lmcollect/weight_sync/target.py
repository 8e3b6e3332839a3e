"""WeightTarget: what an updater pushes into (a collector's WeightLoader, or a proxy of an actor's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from lmcollect.weight_sync.loader import LoadOptions
from lmcollect.weights.version import PushVersion

Metadata = dict[str, tuple[torch.dtype, torch.Size]]
Wait = Callable[[float | None], Any]
"""``wait(timeout_s)``: the call's result once it is done (a join: None; a load: the engine's report)."""


@runtime_checkable
class WeightTarget(Protocol):
    """The receiving end an updater pushes into: one policy's loader.

    :class:`~lmcollect.weight_sync.loader.WeightLoader` implements it in-process; a Ray collector's
    actor is reached through a proxy of its loader (``lmcollect.ray.loader_proxy``). An updater
    learns its target once, when a collector registers (``collector.weight_target()``), or from a
    bare engine (``vLLMUpdater.from_policy``), and never calls the collector after that.
    """

    def metadata(self, model_id: str = "policy") -> tuple[Metadata, dict[str, str]]:
        """What the model accepts: name -> (dtype, shape) of its distinct tensors, and tied aliases."""
        ...

    def version_index(self) -> int:
        """The version index the weights held carry (0 before any push)."""
        ...

    def increment_version(self) -> None:
        """Bump the version without new weights (for receivers that cannot take the push's version)."""
        ...

    def load(self, weights: Any, options: LoadOptions | None = None, *, model_id: str = "policy") -> Any:
        """Load one push (checked, all or nothing, with the push's version in ``options``); returns
        the engine's report of the load, if any."""
        ...

    # ------------------------------------------------------------------ process-group pushes
    def submit_load(self, source: Any, *, version: PushVersion | None) -> Wait:
        """Start the load of a push without waiting (a process-group push: the workers receive
        while the trainer sends); returns ``wait(timeout_s)`` for the engine's report."""
        ...

    def submit_join_weight_group(self, connection_info: dict[str, Any], *, ranks_per_replica: int) -> Wait:
        """Start the engine's workers joining a trainer's weight group; returns ``wait(timeout_s)``."""
        ...

    def receiver_nodes(self) -> list[str | None]:
        """The Ray node of each of the engine's workers (None: in the loader's own process)."""
        ...

    def owner_node(self) -> str | None:
        """The Ray node of the loader's process (None: this process)."""
        ...

    def num_replicas(self) -> int:
        """How many replicas the engine has (each a tensor-parallel group of workers)."""
        ...
