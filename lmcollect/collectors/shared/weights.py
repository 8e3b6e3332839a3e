"""A collector's weight methods (the spec's): its updater, receiver schemes and model lookup, each
load forwarded to its :class:`~lmcollect.weight_sync.loader.WeightLoader`."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lmcollect.collectors.shared.attr_path import resolve_attr_path
from lmcollect.collectors.shared.trajectories import id_base
from lmcollect.collectors.shared.versioning import PolicyVersion
from lmcollect.engines.kv_policy import PushCost, push_costs_of
from lmcollect.engines.protocol import engine_of
from lmcollect.engines.weight_group import join_weight_group
from lmcollect.weight_sync.base import resolve_updater
from lmcollect.weight_sync.loader import Hold, LoadOptions, WeightLoader
from lmcollect.weight_sync.target import WeightTarget
from lmcollect.weights.version import PushVersion


def attach_updater(collector: Any, updater: Any, policy: Any) -> None:
    """``collector.weight_updater = updater`` for local and Ray collectors: an updater class is
    built with ``from_policy(policy)`` first (its constructor if that gives None), then registered."""
    updater = resolve_updater(updater, policy)
    collector._weight_updater = updater
    if updater is not None:
        updater.register_collector(collector)


class HoldsWeightUpdater:
    """The ``weight_updater`` attribute of every collector, local or Ray: setting it goes through
    :func:`attach_updater`, which builds an updater class from :meth:`_updater_policy` first."""

    _weight_updater: Any

    def _updater_policy(self) -> Any:
        """The policy an updater class is built from (``from_policy``)."""
        raise NotImplementedError

    def weight_target(self) -> WeightTarget:
        """What a weight updater pushes into (:class:`~lmcollect.weight_sync.target.WeightTarget`):
        the collector's weight loader, or a proxy of its actor's. An updater asks once, when it registers."""
        raise NotImplementedError

    @property
    def weight_updater(self) -> Any:
        """The weight updater; None: there is none (a Ray collector's pushes then go straight to its actor)."""
        return self._weight_updater

    @weight_updater.setter
    def weight_updater(self, updater: Any) -> None:
        attach_updater(self, updater, self._updater_policy())


class WeightReceiverMixin(HoldsWeightUpdater):
    """Weight-update methods shared by the local collector (and, through it, the Ray one).

    A push does not run through the collector: :attr:`weight_loader` loads it into the policy's
    engine (or torch module) and the engine's version counter takes the push's version, which the
    collector reads as its own. The methods here are the spec's doors to it.
    """

    policy: Any
    _tracker: Any  # the collector's TrajectoryTracker
    _policy_version: PolicyVersion | None  # set by the collector (None: versions not tracked)
    weight_loader: WeightLoader

    def _init_weight_sync(
        self, weight_updater: Any, *, hold: Hold | None = None, on_loaded: Callable[[], None] | None = None
    ) -> None:
        """``hold``: what a load into a lockstep policy waits for (its policy write lock);
        ``on_loaded``: called after each load into the engine."""
        self._receiver_schemes: dict[str, Any] = {}
        self._weight_updater = None
        self._worker_idx: int | None = None
        # weak links back to the collector: an updater holds the loader, and must not keep the
        # collector alive (it serves the collector as long as the collector lives)
        self.weight_loader = WeightLoader(
            self.policy,
            version=self._policy_version,
            hold=hold,
            models=_weak_call(self.get_model),
            on_loaded=None if on_loaded is None else _weak_call(on_loaded),
        )
        if weight_updater is not None:
            self.weight_updater = weight_updater

    def _updater_policy(self) -> Any:
        return self.policy

    @property
    def worker_idx(self) -> int | None:
        """This collector's index among its siblings (set by whoever launched it)."""
        if self._worker_idx is None:
            raise RuntimeError("worker_idx has not been set; set collector.worker_idx = i when launching workers.")
        return self._worker_idx

    @worker_idx.setter
    def worker_idx(self, value: int | None) -> None:
        self.set_worker_idx(value)

    def set_worker_idx(self, worker_idx: int | None, restarts: int = 0) -> None:
        """Set the worker index: trajectory and group ids of worker ``i`` lie in
        ``[i * 2**32, (i + 1) * 2**32)`` (each restart of its actor in a fresh ``2**26`` sub-block)."""
        if worker_idx is not None and (
            isinstance(worker_idx, bool) or not isinstance(worker_idx, int) or worker_idx < 0
        ):
            raise ValueError(f"worker_idx must be an int >= 0 or None, got {worker_idx!r}.")
        self._worker_idx = worker_idx
        if worker_idx is not None:
            self._tracker.set_id_base(id_base(worker_idx, restarts))

    def get_policy_model(self) -> Any:
        """The policy's model (``policy.model`` when it has one, else the policy itself)."""
        return self.weight_loader.model()

    def push_costs(self) -> list[PushCost]:
        """What the recent pushes cost the policy's engine, oldest first: each load's call and the
        keys/values it made the engine compute again (:class:`~lmcollect.engines.kv_policy.PushCost`;
        the last push's recompute grows until every request it dropped has run again). Empty for
        policies without an engine that meters its loads."""
        engine = engine_of(self.policy)
        return push_costs_of(engine) if engine is not None else []

    def get_model(self, model_id: str) -> Any:
        """The model behind ``model_id``: "policy" or an id registered by register_scheme_receiver."""
        if model_id == "policy":
            return self.get_policy_model()
        if model_id in self._receiver_schemes:
            model = getattr(self._receiver_schemes[model_id], "model", None)
            return model if model is not None else self.get_policy_model()
        known = ["policy", *self._receiver_schemes]
        raise ValueError(f"unknown model_id {model_id!r}; known ids: {known}.")

    def init_updater(self, *args: Any, **kwargs: Any) -> None:
        """Call ``init(*args, **kwargs)`` on the weight updater."""
        if self._weight_updater is None:
            raise RuntimeError("this collector has no weight_updater; pass weight_updater=... first.")
        self._weight_updater.init(*args, **kwargs)

    def weight_metadata(
        self, model_id: str = "policy"
    ) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """What the model accepts: name -> (dtype, shape) of its distinct tensors, and tied aliases."""
        return self.weight_loader.metadata(model_id)

    def update_policy_weights_(self, policy_or_weights: Any = None, worker_ids: Any = None, **kwargs: Any) -> Any:
        """Push weights through the weight updater, or apply them here when there is none."""
        if self._weight_updater is not None:
            return self._weight_updater.push_weights(policy_or_weights, worker_ids=worker_ids, **kwargs)
        if worker_ids not in (None, 0, [0]):
            raise ValueError(f"worker_ids={worker_ids!r}: a collector without a weight_updater has one worker, 0.")
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}: they are for a weight_updater, and there is none.")
        if policy_or_weights is None and not self._receiver_schemes:
            raise ValueError(
                "update_policy_weights_() has nothing to push or pull: this collector has no weight_updater "
                "and no receiver schemes. Pass the weights (update_policy_weights_(model_or_weights)), give "
                "the collector a weight_updater with policy_weights, or register_scheme_receiver(...)."
            )
        if policy_or_weights is not None:
            self.receive_weights(policy_or_weights)
        else:
            self.receive_weights()
        return None

    def receive_weights(
        self,
        policy_or_weights: Any = None,
        *,
        weights: Any = None,
        policy: Any = None,
        model_id: str = "policy",
        convert_dtype: bool = False,
        version: PushVersion | None = None,
        zero_copy: bool = False,
        allow_non_finite: bool = False,
    ) -> Any:
        """Load the weights given (see :meth:`WeightLoader.load`), or pull them from the registered
        receiver schemes (no weights given). Returns what the engine reports of the load (its
        workers' reports for a process-group push; else None).

        Given weights are checked against the model and loaded in place, all or nothing: a
        missing, extra, misshapen or wrongly typed tensor (or a ``version`` older than the
        collector's) raises one ValueError before anything changes. Then the cache is reset and
        the version taken. ``version``: the push's version (None: one more than now); updaters
        pass theirs. ``convert_dtype``: cast floating tensors to the model's dtypes.
        ``allow_non_finite``: load weights holding NaN or Inf (as the model will hold them), which
        are refused otherwise; updaters pass True, having checked the push before sending it.

        ``weights`` may be a :class:`~lmcollect.weights.delta.WeightDelta` (a delta push, with
        its ``version``): applied only onto the push it was made from, and its checksums verified
        after writing; otherwise it raises ``DeltaRejectedError`` with the old weights and version
        kept, and the updater sends a full push.

        ``zero_copy=True``: the model's tensors are pointed at ``weights`` instead of copied (see
        :func:`~lmcollect.weights.tensors.share_weights_`; a Ray push maps the object store's
        shared memory, so collectors on one node share one copy). A later copying or delta load
        first gives the model private tensors again. An engine copies the weights into its own.

        ``weights`` may be a :class:`~lmcollect.engines.weight_group.GroupPush` (a ``vLLMUpdater``
        push): the engine's workers receive the trainer's broadcast inside the engine's load.

        ``weights`` may be :class:`~lmcollect.weights.buckets.WeightBuckets` (what a Ray push
        carries): an engine gets them as they are, not packed again (a ``VLLMEngine`` keeps their
        buffers as its workers' base: do not write into them after the push).
        """
        given = [x for x in (policy_or_weights, weights, policy) if x is not None]
        if len(given) > 1:
            raise ValueError("pass only one of policy_or_weights, weights= and policy=.")
        options = LoadOptions(
            version=version, convert_dtype=convert_dtype, zero_copy=zero_copy, allow_non_finite=allow_non_finite
        )
        if given:
            return self.weight_loader.load(given[0], options, model_id=model_id)
        _refuse_push_options_without_weights(options)
        self._pull_from_schemes()
        return None

    def _pull_from_schemes(self) -> None:
        for scheme_model_id, scheme in self._receiver_schemes.items():
            apply = functools.partial(self._load_pulled, model_id=scheme_model_id)
            timeout_s = getattr(scheme, "timeout_s", None)
            if hasattr(scheme, "receive_into"):
                scheme.receive_into(apply, timeout_s=timeout_s)
            else:
                received = scheme.receive(timeout_s=timeout_s)
                if received is not None:
                    apply(received)

    def _load_pulled(self, weights: Any, *, model_id: str, version: PushVersion | None = None) -> Any:
        """Load what a receiver scheme pulled (with the version its push carried, if any): checked
        (or allowed) by its sender, so NaN/Inf are not refused again."""
        return self.weight_loader.load(weights, LoadOptions(version=version, allow_non_finite=True), model_id=model_id)

    # ------------------------------------------------------------------ an engine with worker processes
    # A vLLM engine holds its weights in its workers: a vLLMUpdater forms a process group with
    # them (join), then each push is a load of GroupPush(...) started before the trainer sends
    # (the workers' receive returns only once it has). Through the actor for a Ray collector.
    def policy_engine_num_replicas(self) -> int:
        """How many engine replicas the policy's engine has (1 for an in-process engine)."""
        return self.weight_loader.num_replicas()

    def join_policy_weight_group(self, connection_info: dict[str, Any], *, ranks_per_replica: int) -> None:
        """The policy engine's workers join a trainer's weight group (see :func:`~lmcollect.engines.weight_group.join_weight_group`)."""
        join_weight_group(self.weight_loader.worker_engine(), connection_info, ranks_per_replica=ranks_per_replica)

    def policy_weight_receiver_nodes(self) -> list[str | None]:
        """The Ray node of each of the policy engine's workers (None: outside Ray, in this collector's process)."""
        return self.weight_loader.receiver_nodes()

    def weight_target(self) -> WeightTarget:
        """What a weight updater pushes into: this collector's :attr:`weight_loader` (an updater
        learns it once, when it registers with the collector)."""
        return self.weight_loader

    def register_scheme_receiver(
        self, weight_recv_schemes: dict[str, Any], *, synchronize_weights: bool = True
    ) -> None:
        """Register receiver schemes ({model_id: scheme}); optionally pull weights right away."""
        for model_id, scheme in weight_recv_schemes.items():
            init = getattr(scheme, "init_on_receiver", None)
            if callable(init):
                init(model_id=model_id, context=self)
            self._receiver_schemes[model_id] = scheme
        if synchronize_weights:
            self.receive_weights()

    def cascade_execute(self, attr_path: str, *args: Any, **kwargs: Any) -> Any:
        """Call the callable at ``attr_path`` (attribute and item access only) with the arguments."""
        target = resolve_attr_path(self, attr_path)
        if not callable(target):
            raise TypeError(f"{attr_path!r} resolves to a {type(target).__name__}, which is not callable.")
        return target(*args, **kwargs)


def _weak_call(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (bound to a collector) called through a weak reference to its collector."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            raise RuntimeError("the collector this weight loader served is gone.")
        return bound(*args, **kwargs)

    return call


def _refuse_push_options_without_weights(given: LoadOptions) -> None:
    """``receive_weights()`` without weights pulls from the receiver schemes, which carry their own
    version and layout: options that describe given weights would be silently ignored there."""
    ignored = [field.name for field in dataclasses.fields(given) if getattr(given, field.name) != field.default]
    if ignored:
        raise TypeError(
            f"receive_weights() got {', '.join(f'{name}=' for name in ignored)} but no weights: those options describe "
            "given weights; pass the weights too (receive_weights(weights, ...)), or drop them to pull from the "
            "registered receiver schemes (each push carries its own version)."
        )
