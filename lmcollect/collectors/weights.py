"""The weight-receiving side of a collector: updater, receiver schemes, versions, model lookup."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from lmcollect.collectors.attr_path import resolve_attr_path
from lmcollect.collectors.trajectories import id_base
from lmcollect.collectors.versioning import PolicyVersion
from lmcollect.engines.kv_policy import PushCost, push_costs_of
from lmcollect.engines.protocol import (
    EngineProtocol,
    WorkerRpcEngine,
    check_engine_loads,
    engine_of,
    worker_rpc_engine_of,
)
from lmcollect.engines.weight_group import GroupPush, join_weight_group, weight_receiver_nodes
from lmcollect.weight_sync.base import resolve_updater
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.delta import DeltaRejectedError, WeightDelta, check_delta_base, prepare_delta
from lmcollect.weights.lora import LoraAdapter, check_adapter, check_merge, is_lora_source, lora_adapter
from lmcollect.weights.tensors import (
    cast_to_held,
    check_weights,
    expected_metadata,
    load_weights_,
    narrowest_held_dtypes,
    non_finite_problems,
    raise_if_problems,
    share_weights_,
    to_weight_dict,
    unique_targets,
    unshare_weights_,
)
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)

_NO_GROUP_ENGINE = (
    "this collector's policy ({policy}) has no engine with worker processes (lmcollect.engines.WorkerRpcEngine); "
    "a vLLMUpdater needs a VLLMPolicy or a VLLMEngine. Push with RayRemoteWeightUpdater instead."
)
_NO_LORA_ENGINE = (
    "this collector's policy ({policy}) has no engine that loads LoRA adapters (TransformersEngine, VLLMEngine "
    "and the engines routing to them do); use a TransformersPolicy, a VLLMPolicy or a continuous collector over "
    "one of those engines, or push the merged model (model.merge_and_unload()) as full weights."
)


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

    @property
    def weight_updater(self) -> Any:
        """The weight updater; None: there is none (a Ray collector's pushes then go straight to its actor)."""
        return self._weight_updater

    @weight_updater.setter
    def weight_updater(self, updater: Any) -> None:
        attach_updater(self, updater, self._updater_policy())


class WeightReceiverMixin(HoldsWeightUpdater):
    """Weight-update methods shared by the local collector (and, through it, the Ray one).

    Every applied update goes through :meth:`receive_weights` (for a vLLM engine's process-group
    push too, as a :class:`~lmcollect.engines.weight_group.GroupPush`), which sets the policy version exactly once: to the version the
    push carries (assigned by the updater), or one more than before for a push without one.
    """

    policy: Any
    _policy_lock: Any  # a ReadWriteLock owned by the collector
    _tracker: Any  # the collector's TrajectoryTracker
    _policy_version: PolicyVersion | None  # set by the collector (None: versions not tracked)

    if TYPE_CHECKING:  # defined by the collector's CollectorVersionMixin

        def version_index(self) -> int: ...

    def _init_weight_sync(self, weight_updater: Any) -> None:
        self._receiver_schemes: dict[str, Any] = {}
        self._weight_updater = None
        self._worker_idx: int | None = None
        self._held_push: PushVersion | None = None  # the push whose weights the model holds (delta base)
        self._shared_models: set[int] = set()  # id() of models whose tensors map a push (zero_copy)
        self._weight_group_thread: ThreadPoolExecutor | None = None  # submit_join_weight_group / submit_receive_weights
        # One push at a time, its version checked, loaded and taken inside: a late push N can
        # never land after N+1 (it is refused as older), whatever the actor's max_concurrency.
        self._push_lock = threading.RLock()
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
        return getattr(self.policy, "model", self.policy)

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
        target = self.get_model(model_id)
        engine = self._engine_holding(model_id, target)
        return engine.weight_metadata() if engine is not None else expected_metadata(target)

    def _weights_for_state(self) -> dict[str, Any]:
        """The policy's weights for a ``state_dict``: ``policy_state_dict`` (the weights) and
        ``lora_adapter`` (a LoRA adapter merged on top of them, as :meth:`LoraAdapter.state`, or None).

        An engine that merges adapters and can give what it holds (``checkpoint_weights``:
        ``TransformersEngine``, ``VLLMEngine``) gives its base and the adapter merged on it, so a
        restore loads the base as a full push and merges the adapter again: the restored engine
        holds the same weights and the same base, and the next adapter replaces this one instead of
        stacking on it. Otherwise the model's ``state_dict()``, or the state of the engine's torch
        module (``ScriptedEngine``); None when the weights are in no process here."""
        engine = engine_of(self.policy)
        checkpoint_weights = getattr(engine, "checkpoint_weights", None)
        if callable(checkpoint_weights):
            held = checkpoint_weights()
            base, adapter = held if held is not None else (None, None)
            return {"policy_state_dict": base, "lora_adapter": None if adapter is None else adapter.state()}
        model = self.get_policy_model()
        source = getattr(engine, "model", None) if self._engine_holding("policy", model) is not None else model
        state_dict = getattr(source, "state_dict", None)
        return {"policy_state_dict": state_dict() if callable(state_dict) else None, "lora_adapter": None}

    def _restore_weights(self, state: Any, *, version: PushVersion | None, **load_options: Any) -> None:
        """Load the weights of a ``state_dict`` (see :meth:`_weights_for_state`) as pushes of
        ``version``: the weights in full (with ``load_options``, e.g. ``convert_dtype``), then the
        LoRA adapter merged on them, if any. The adapter and its merge into the saved base are
        checked first, so a state whose adapter does not fit (or overflows) changes nothing."""
        adapter_state = state.get("lora_adapter")
        adapter = None if adapter_state is None else LoraAdapter.from_state(adapter_state)
        if adapter is not None:
            base = state.get("policy_state_dict")
            missing = [name for name in adapter.layers if base is None or name not in base]
            if missing:
                raise ValueError(
                    f"this state holds a LoRA adapter without the base weights it was merged into ({missing[:3]}); "
                    "it was not saved by lmcollect."
                )
            engine = engine_of(self.policy)
            if engine is None:
                raise TypeError(_NO_LORA_ENGINE.format(policy=type(self.policy).__name__))
            check_engine_loads(engine, adapter)
            check_adapter(adapter, self.weight_metadata()[0], receiver="this collector's model")
            check_merge(adapter, {name: base[name] for name in adapter.layers}, receiver="the saved base weights")
        with self._push_lock:
            self._apply_weights(state["policy_state_dict"], version=version, **load_options)
            if adapter is not None:
                self._apply_weights(adapter, version=version)

    def _engine_holding(self, model_id: str, target: Any) -> EngineProtocol | None:
        """The engine behind the policy when it holds the weights itself (no torch module here to
        load into, e.g. an EnginePolicy or a continuous collector over vLLM); else None."""
        if model_id != "policy" or isinstance(target, torch.nn.Module):
            return None
        return engine_of(self.policy)

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
        """The collector side of every push: load the weights given, or pull them from the
        registered receiver schemes (no weights given). Returns what the engine reports of the
        load (its workers' reports for a process-group push; else None).

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
        first gives the model private tensors again.

        ``weights`` may be a :class:`~lmcollect.engines.weight_group.GroupPush` (a ``vLLMUpdater``
        push): the engine's workers receive the trainer's broadcast inside the engine's load.

        ``weights`` may be :class:`~lmcollect.weights.buckets.WeightBuckets` (what a Ray push
        carries): an engine gets them as they are, not packed again (a ``VLLMEngine`` keeps their
        buffers as its workers' base: do not write into them after the push).
        """
        given = [x for x in (policy_or_weights, weights, policy) if x is not None]
        if len(given) > 1:
            raise ValueError("pass only one of policy_or_weights, weights= and policy=.")
        if given:
            return self._apply_weights(
                given[0], model_id=model_id, convert_dtype=convert_dtype, version=version, zero_copy=zero_copy,
                allow_non_finite=allow_non_finite,
            )  # fmt: skip
        _refuse_push_options_without_weights(
            convert_dtype=convert_dtype, version=version, zero_copy=zero_copy, allow_non_finite=allow_non_finite
        )
        for scheme_model_id, scheme in self._receiver_schemes.items():
            # what a scheme brings was checked (or allowed) by its sender
            apply = functools.partial(self._apply_weights, model_id=scheme_model_id, allow_non_finite=True)
            timeout_s = getattr(scheme, "timeout_s", None)
            if hasattr(scheme, "receive_into"):
                scheme.receive_into(apply, timeout_s=timeout_s)
            else:
                received = scheme.receive(timeout_s=timeout_s)
                if received is not None:
                    apply(received)
        return None

    def _apply_weights(
        self,
        weights: Any,
        *,
        model_id: str = "policy",
        convert_dtype: bool = False,
        version: PushVersion | None = None,
        zero_copy: bool = False,
        allow_non_finite: bool = False,
    ) -> Any:
        """:meth:`receive_weights` of given weights (see there)."""
        if is_lora_source(weights):
            weights = lora_adapter(weights)
        with self._push_lock:
            return self._apply_leaf(
                weights,
                model_id=model_id,
                convert_dtype=convert_dtype,
                version=version,
                zero_copy=zero_copy,
                allow_non_finite=allow_non_finite,
            )

    def _apply_leaf(
        self,
        weights: Any,
        *,
        model_id: str,
        convert_dtype: bool,
        version: PushVersion | None,
        zero_copy: bool,
        allow_non_finite: bool,
    ) -> Any:
        """:meth:`_apply_weights` into this collector's own model (under the push lock)."""
        target = self.get_model(model_id)
        engine = self._engine_holding(model_id, target)
        if engine is not None:
            return self._load_into_engine(
                engine, weights, convert_dtype=convert_dtype, version=version, allow_non_finite=allow_non_finite
            )
        if isinstance(weights, GroupPush):
            raise TypeError(_NO_GROUP_ENGINE.format(policy=type(self.policy).__name__))
        if isinstance(weights, LoraAdapter):  # merged by the policy's engine, which keeps the base
            policy_engine = engine_of(self.policy) if model_id == "policy" else None
            if policy_engine is None:
                raise TypeError(_NO_LORA_ENGINE.format(policy=type(self.policy).__name__))
            self._unshare(target)
            return self._load_into_engine(
                policy_engine, weights, convert_dtype=convert_dtype, version=version, allow_non_finite=allow_non_finite
            )
        if isinstance(weights, WeightDelta):
            self._apply_delta(target, weights, version)
            return
        weights = to_weight_dict(weights, like=target)
        if not allow_non_finite:
            refuse_non_finite(weights, [expected_metadata(target)] if convert_dtype else None)
        self._check_version(version)
        # Weights, cache and version change together while no policy call runs (waits at most
        # one turn), so every turn's policy_version names the weights that produced it.
        with self._policy_lock.write():
            self._held_push = None  # until the load succeeded
            if zero_copy:
                share_weights_(target, weights, convert_dtype=convert_dtype)
                self._shared_models.add(id(target))
            else:
                self._unshare(target)
                load_weights_(target, weights, convert_dtype=convert_dtype)
            self._finish_update(version)
            self._held_push = version
        return None

    def _load_into_engine(
        self,
        engine: EngineProtocol,
        weights: Any,
        *,
        convert_dtype: bool,
        version: PushVersion | None,
        allow_non_finite: bool,
    ) -> Any:
        """A push into an engine that holds its own weights: checked by the engine, loaded while no
        token is generated (see :meth:`_engine_held`); the engine resets its cache and its version
        counter takes the push's version (index and uuid), which this collector reads as its own
        (see :func:`~lmcollect.collectors.versioning.make_policy_version`).

        A :class:`~lmcollect.weights.delta.WeightDelta` (with ``version``) must apply to the push
        held (index and uuid, checked here), then goes to the engine as it is: engines whose
        ``loads_weight_deltas`` is True (``TransformersEngine`` writes it in place, ``VLLMEngine``
        in its workers) check and apply it, and a rejected one changes nothing. Other engines refuse
        deltas, naming the fix.
        """
        self._check_version(version)
        source = self._engine_source(
            engine, weights, convert_dtype=convert_dtype, version=version, allow_non_finite=allow_non_finite
        )
        loaded: int | PushVersion = version if version is not None else self._loaded_version_index(engine)
        held, self._held_push = self._held_push, None  # until the load succeeded
        with self._engine_held():
            try:
                report = engine.load_weights(source, version=loaded)
            except (DeltaRejectedError, ValueError):
                self._held_push = held  # a refused load (a check, a delta, a stale push) changed nothing
                raise
            if self._policy_version is not None and not self._policy_version.shares(
                getattr(engine, "version_counter", None)
            ):  # an engine without a counter of its own (outside this library): take the version here
                self._finish_update(version, cache_reset=True)
            self._held_push = version
        return report

    def _engine_source(
        self,
        engine: EngineProtocol,
        weights: Any,
        *,
        convert_dtype: bool,
        version: PushVersion | None,
        allow_non_finite: bool,
    ) -> Any:
        """What ``engine.load_weights`` takes for ``weights``: a process-group push, a LoRA adapter,
        a delta or a sender's :class:`~lmcollect.weights.buckets.WeightBuckets` as they are (buckets
        unless ``convert_dtype`` must cast them), other tensors cast to the engine's dtypes with
        ``convert_dtype``. NaN/Inf are refused here, read through views of the buckets' bytes."""
        if isinstance(weights, GroupPush):
            if not isinstance(engine, WorkerRpcEngine):
                raise TypeError(_NO_GROUP_ENGINE.format(policy=type(self.policy).__name__))
            return weights
        check_engine_loads(engine, weights)
        if isinstance(weights, LoraAdapter):
            return weights
        if isinstance(weights, WeightDelta):
            if version is None:
                raise TypeError("a delta push needs the version it brings (version=PushVersion(...)).")
            check_delta_base(weights, self._held_push)
            return weights
        buckets = weights if isinstance(weights, WeightBuckets) else None
        weights = to_weight_dict(weights)  # of buckets: views of their bytes
        if convert_dtype:  # cast here to what the engine holds: every engine then checks dtypes strictly
            cast = cast_to_held(weights, *engine.weight_metadata())
            if any(cast[name] is not tensor for name, tensor in weights.items()):
                buckets, weights = None, cast  # new tensors: the engine packs them (once)
        if not allow_non_finite:
            refuse_non_finite(weights)  # the values as the engine will hold them
        # a sender's buckets go on as they are: the engine checks their layout and reads their bytes
        return buckets if buckets is not None else weights.items()

    def _check_loadable(
        self, weights: Any, *, convert_dtype: bool, allow_non_finite: bool, engine: EngineProtocol | None = None
    ) -> None:
        """Raise ValueError if loading ``weights`` (a model's state dict) into the policy would be
        refused: names, shapes, dtypes, NaN/Inf (unless ``allow_non_finite``). Changes nothing.
        ``engine``: the engine loads go to (None: the one holding the policy's weights, if any)."""
        target = self.get_policy_model()
        engine = engine if engine is not None else self._engine_holding("policy", target)
        if engine is not None:
            metadata, aliases = engine.weight_metadata()
            weights = to_weight_dict(weights)
            if convert_dtype:
                weights = cast_to_held(weights, metadata, aliases)
            check_weights(weights, metadata, aliases=aliases)
        else:
            weights = to_weight_dict(weights, like=target)
            metadata, aliases = expected_metadata(target)
            check_weights(weights, metadata, aliases=aliases, convert_dtype=convert_dtype)
        if not allow_non_finite:
            refuse_non_finite(weights, [(metadata, aliases)] if convert_dtype and engine is None else None)

    def _unshare(self, target: Any) -> None:
        """Private, writable tensors for a model a zero-copy push had pointed at shared memory."""
        if id(target) in self._shared_models:
            unshare_weights_(target)
            self._shared_models.discard(id(target))

    def _apply_delta(self, target: Any, delta: WeightDelta, version: PushVersion | None) -> None:
        """Check the delta (base version, names, dtypes, positions), then, under the policy write
        lock, write it, verify its checksums (undone on a mismatch), reset the cache, take ``version``."""
        if version is None:
            raise TypeError("a delta push needs the version it brings (version=PushVersion(...)).")
        self._check_version(version)
        if id(target) in self._shared_models:
            with self._policy_lock.write():
                self._unshare(target)
        targets, aliases = unique_targets(target)
        prepared = prepare_delta(delta, targets, held_version=self._held_push, aliases=aliases)
        with self._policy_lock.write():
            check_delta_base(delta, self._held_push)  # again: no other push got in since the check
            prepared.apply_()
            self._finish_update(version)
            self._held_push = version

    def _check_version(self, version: PushVersion | None) -> None:
        if version is not None and not isinstance(version, PushVersion):
            raise TypeError(f"version must be a PushVersion (built by a weight updater), got {type(version).__name__}.")
        if version is not None and self._policy_version is not None:
            self._policy_version.check(version)

    def _finish_update(self, version: PushVersion | None, *, cache_reset: bool = False) -> None:
        """After new weights are in (while no token is generated): reset the prefix cache (unless
        ``cache_reset``: an engine's ``load_weights`` did), take the version. An engine behind the
        policy shares the version's counter, so it labels the tokens it generates from now on with it."""
        reset_cache = getattr(self.policy, "reset_prefix_cache", None)
        if callable(reset_cache) and not cache_reset:
            reset_cache()
        if self._policy_version is None:
            return  # untracked (-1) stays untracked; an engine counts its loads itself
        if version is None:
            self._policy_version.increment()
        else:
            self._policy_version.set(version)

    # ------------------------------------------------------------------ an engine with worker processes
    # A vLLM engine holds its weights in its workers: a vLLMUpdater forms a process group with
    # them (join), then each push is receive_weights(GroupPush(...)) started before the trainer
    # sends (the workers' receive returns only once it has). Through the actor for a Ray collector.
    def _worker_engine(self) -> WorkerRpcEngine:
        engine = worker_rpc_engine_of(self.policy)
        if engine is None:
            raise TypeError(_NO_GROUP_ENGINE.format(policy=type(self.policy).__name__))
        return engine

    @contextlib.contextmanager
    def _engine_held(self) -> Iterator[None]:
        """No token is generated inside: a continuous engine is paused (its requests kept), a
        lockstep policy's turns wait for the policy lock."""
        if isinstance(self.policy, EngineProtocol):  # a continuous collector's engine
            self.policy.pause()
            try:
                yield
            finally:
                self.policy.resume()
        else:
            with self._policy_lock.write():
                yield

    def policy_engine_num_replicas(self) -> int:
        """How many engine replicas the policy's engine has (1 for an in-process engine)."""
        return self._worker_engine().num_replicas

    def join_policy_weight_group(self, connection_info: dict[str, Any], *, ranks_per_replica: int) -> None:
        """The policy engine's workers join a trainer's weight group (see :func:`~lmcollect.engines.weight_group.join_weight_group`)."""
        join_weight_group(self._worker_engine(), connection_info, ranks_per_replica=ranks_per_replica)

    def policy_weight_receiver_nodes(self) -> list[str | None]:
        """The Ray node of each of the policy engine's workers (None: outside Ray, in this collector's process)."""
        return weight_receiver_nodes(self._worker_engine())

    def submit_join_weight_group(
        self, connection_info: dict[str, Any], *, ranks_per_replica: int
    ) -> Callable[[float | None], Any]:
        """Start :meth:`join_policy_weight_group` on a thread; returns ``wait(timeout_s)``."""
        return self._submit(self.join_policy_weight_group, connection_info, ranks_per_replica=ranks_per_replica)

    def submit_receive_weights(
        self, source: GroupPush | LoraAdapter, *, version: PushVersion | None
    ) -> Callable[[float | None], Any]:
        """Start :meth:`receive_weights` of a process-group push on a thread; returns ``wait(timeout_s)``
        for the workers' reports (the receive returns only once the trainer has sent). A push older
        than the weights held is refused here, before the trainer sends."""
        self._check_version(version)
        return self._submit(self.receive_weights, source, version=version)

    def _submit(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[float | None], Any]:
        if self._weight_group_thread is None:
            self._weight_group_thread = ThreadPoolExecutor(1, thread_name_prefix="lmcollect-weight-group")
        return self._weight_group_thread.submit(call, *args, **kwargs).result

    def _loaded_version_index(self, engine: EngineProtocol) -> int:
        """The version index a load about to be taken gives ``engine``: the next of the counter it
        shares with this collector (untracked: the engine counts its loads itself)."""
        if self._policy_version is not None:
            return self.version_index() + 1
        return max(engine.version, 0) + 1

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


def refuse_non_finite(weights: dict[str, torch.Tensor], receivers: list[tuple[dict, dict]] | None = None) -> None:
    """One ValueError naming every floating tensor of ``weights`` that holds NaN or Inf, checked as
    ``receivers`` (``(metadata, aliases)`` of the models that will hold them) hold them when given."""
    held = narrowest_held_dtypes(weights, receivers) if receivers else None
    raise_if_problems(non_finite_problems(weights, dtypes=held))


def _refuse_push_options_without_weights(
    *, convert_dtype: bool, version: Any, zero_copy: bool, allow_non_finite: bool
) -> None:
    """``receive_weights()`` without weights pulls from the receiver schemes, which carry their own
    version and layout: options that describe given weights would be silently ignored there."""
    options = {
        "version": version is not None,
        "convert_dtype": convert_dtype,
        "zero_copy": zero_copy,
        "allow_non_finite": allow_non_finite,
    }
    ignored = [name for name, set_ in options.items() if set_]
    if ignored:
        raise TypeError(
            f"receive_weights() got {', '.join(f'{name}=' for name in ignored)} but no weights: those options describe "
            "given weights; pass the weights too (receive_weights(weights, ...)), or drop them to pull from the "
            "registered receiver schemes (each push carries its own version)."
        )
