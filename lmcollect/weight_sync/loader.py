"""The receiving end of every push: one load into a policy's engine, or into its torch module in place."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lmcollect.engines.protocol import (
    EngineProtocol,
    WorkerRpcEngine,
    capabilities_of,
    check_engine_loads,
    engine_of,
    refuse_stale_push,
    version_counter_of,
    worker_rpc_engine_of,
)
from lmcollect.engines.weight_group import GroupPush, join_weight_group, weight_receiver_nodes
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
from lmcollect.weights.version import PolicyVersion, PushVersion

NO_GROUP_ENGINE = (
    "this collector's policy ({policy}) has no engine with worker processes (lmcollect.engines.WorkerRpcEngine); "
    "a vLLMUpdater needs a VLLMPolicy or a VLLMEngine. Push with RayRemoteWeightUpdater instead."
)
NO_LORA_ENGINE = (
    "this collector's policy ({policy}) has no engine that loads LoRA adapters (TransformersEngine, VLLMEngine "
    "and the engines routing to them do); use a TransformersPolicy, a VLLMPolicy or a continuous collector over "
    "one of those engines, or push the merged model (model.merge_and_unload()) as full weights."
)

Hold = Callable[[], AbstractContextManager[Any]]


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How one push is loaded (what ``receive_weights`` takes beside the weights)."""

    version: PushVersion | None = None
    """The push's version (None: one more than the version held); updaters pass theirs."""
    convert_dtype: bool = False
    """Cast floating tensors to the dtypes the model holds (else a dtype mismatch is refused)."""
    zero_copy: bool = False
    """Point a torch module's tensors at the pushed memory instead of copying (an engine copies anyway)."""
    allow_non_finite: bool = False
    """Load weights holding NaN or Inf; updaters pass True, having checked the push before sending it."""


class WeightLoader:
    """Loads pushes into one policy: the engine behind it when the engine holds the weights (its
    ``load_weights(payload, version=)`` checks and loads; a sender's buckets reach it as packed),
    else the policy's torch module, in place. One push at a time, all or nothing: a refused push
    (names, shapes, dtypes, NaN/Inf, a stale version, a delta on another base) changes nothing.

    ``policy``: an engine (a continuous collector's: loads pause it between two decoding steps) or
    a policy (its turns wait for ``hold``, the collector's policy write lock). ``version``: the
    collector's version, which reads the engine's counter when there is one (None: untracked).
    ``models``: the model of a receiver scheme's ``model_id`` ("policy": the policy's model).
    ``on_loaded``: called after each load into the engine (a continuous collector wakes its dialogs).
    """

    def __init__(
        self,
        policy: Any,
        *,
        version: PolicyVersion | None,
        hold: Hold | None = None,
        models: Callable[[str], Any] | None = None,
        on_loaded: Callable[[], None] | None = None,
    ) -> None:
        self.policy = policy
        self.version = version
        self._hold = hold
        self._models = models
        self._on_loaded = on_loaded
        # One push at a time, its version checked, loaded and taken inside: a late push N can
        # never land after N+1 (it is refused as older), whatever the actor's max_concurrency.
        self.lock = threading.RLock()
        self.held_push: PushVersion | None = None  # the push whose weights the model holds (delta base)
        self._shared_models: set[int] = set()  # id() of models whose tensors map a push (zero_copy)
        self._thread: ThreadPoolExecutor | None = None  # pushes started before the trainer sends

    def __repr__(self) -> str:
        return f"WeightLoader({type(self.policy).__name__})"

    # ------------------------------------------------------------------ what is loaded into
    def model(self, model_id: str = "policy") -> Any:
        """The model ``model_id`` names (``policy.model`` when the policy has one, else the policy)."""
        if model_id == "policy" or self._models is None:
            return getattr(self.policy, "model", self.policy)
        return self._models(model_id)

    def engine(self, model_id: str = "policy") -> EngineProtocol | None:
        """The engine a load of ``model_id`` goes to: the policy when it is one, the engine behind
        it when that holds the weights (no torch module here, e.g. an EnginePolicy over vLLM); None:
        the load writes into the model's torch module."""
        if isinstance(self.policy, EngineProtocol):
            if model_id != "policy":
                raise ValueError(
                    f"model_id={model_id!r}: a collector over an engine receives weights for 'policy' only."
                )
            return self.policy
        if model_id != "policy" or isinstance(self.model(model_id), torch.nn.Module):
            return None
        return engine_of(self.policy)

    def worker_engine(self) -> WorkerRpcEngine:
        """The engine whose worker processes a process-group push goes to."""
        engine = worker_rpc_engine_of(self.policy)
        if engine is None:
            raise TypeError(NO_GROUP_ENGINE.format(policy=type(self.policy).__name__))
        return engine

    def metadata(self, model_id: str = "policy") -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """What the model accepts: name -> (dtype, shape) of its distinct tensors, and tied aliases."""
        engine = self.engine(model_id)
        return engine.weight_metadata() if engine is not None else expected_metadata(self.model(model_id))

    # ------------------------------------------------------------------ the updater's target (WeightTarget)
    def version_index(self) -> int:
        """The version index of the weights held: the collector's (0 before any push), else the
        engine's (an untracked collector's, or a bare engine's); 0 when neither counts."""
        if self.version is not None:
            return self.version.index
        engine = engine_of(self.policy)
        return max(engine.version, 0) if engine is not None else 0

    def increment_version(self) -> None:
        """Bump the collector's version without new weights (nothing when versions are not tracked)."""
        if self.version is not None:
            self.version.increment()

    def num_replicas(self) -> int:
        """How many replicas the engine with worker processes has."""
        return self.worker_engine().num_replicas

    def receiver_nodes(self) -> list[str | None]:
        """The Ray node of each worker of the engine (None: outside Ray, in this process)."""
        return weight_receiver_nodes(self.worker_engine())

    def owner_node(self) -> str | None:
        """The Ray node of this process: None (an actor's proxy answers its own node)."""
        return None

    def submit_join_weight_group(
        self, connection_info: dict[str, Any], *, ranks_per_replica: int
    ) -> Callable[[float | None], Any]:
        """Start the engine's workers joining a trainer's weight group on this loader's thread (see
        :func:`~lmcollect.engines.weight_group.join_weight_group`); returns ``wait(timeout_s)``."""
        engine = self.worker_engine()
        return self.run_in_thread(join_weight_group, engine, connection_info, ranks_per_replica=ranks_per_replica)

    # ------------------------------------------------------------------ loads
    def load(self, weights: Any, options: LoadOptions | None = None, *, model_id: str = "policy") -> Any:
        """Load one push (see ``LLMCollector.receive_weights``); returns the engine's report, if any."""
        options = options or LoadOptions()
        if is_lora_source(weights):
            weights = lora_adapter(weights)
        with self.lock:
            engine: Any = self.engine(model_id)
            if isinstance(weights, GroupPush):  # to the engine whose worker processes joined the group
                engine = self.worker_engine() if model_id == "policy" else None
                if engine is None:
                    raise TypeError(NO_GROUP_ENGINE.format(policy=type(self.policy).__name__))
            if engine is None and isinstance(weights, LoraAdapter):  # merged by the engine, which keeps the base
                engine = engine_of(self.policy) if model_id == "policy" else None
                if engine is None:
                    raise TypeError(NO_LORA_ENGINE.format(policy=type(self.policy).__name__))
                self._unshare(self.model(model_id))
            if engine is not None:
                return self._load_into_engine(engine, weights, options)
            target = self.model(model_id)
            if isinstance(weights, WeightDelta):
                self._apply_delta(target, weights, options.version)
            else:
                self._load_into_module(target, weights, options)
            return None

    def submit_load(
        self, source: GroupPush | LoraAdapter, *, version: PushVersion | None
    ) -> Callable[[float | None], Any]:
        """Start :meth:`load` of a process-group push on a thread; returns ``wait(timeout_s)`` for the
        workers' reports (the load returns only once the trainer has sent). A push older than the
        weights held is refused here, before the trainer sends."""
        self.check_version(version)
        engine = engine_of(self.policy)
        if version is not None and self.version is None and engine is not None:  # untracked: the engine's own
            refuse_stale_push(version.index, engine.version, type(engine).__name__)
        return self.run_in_thread(self.load, source, LoadOptions(version=version))

    def run_in_thread(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[float | None], Any]:
        """Start ``call`` on this loader's one thread; returns ``wait(timeout_s)`` for its result."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="lmcollect-weight-group")
        return self._thread.submit(call, *args, **kwargs).result

    def take_version(self, version: PushVersion) -> None:
        """Take ``version`` without new weights (a state whose weights are elsewhere), checked first."""
        with self.lock:
            self.check_version(version)
            with self._held():
                self._finish_update(version)

    def _load_into_module(self, target: Any, weights: Any, options: LoadOptions) -> None:
        """Full weights into a torch module: checked, then weights, cache and version change
        together while no policy call runs (waits at most one turn), so every turn's
        policy_version names the weights that produced it."""
        convert_dtype, version = options.convert_dtype, options.version
        weights = to_weight_dict(weights, like=target)
        if not options.allow_non_finite:
            refuse_non_finite(weights, [expected_metadata(target)] if convert_dtype else None)
        self.check_version(version)
        with self._held():
            self.held_push = None  # until the load succeeded
            if options.zero_copy:
                share_weights_(target, weights, convert_dtype=convert_dtype)
                self._shared_models.add(id(target))
            else:
                self._unshare(target)
                load_weights_(target, weights, convert_dtype=convert_dtype)
            self._finish_update(version)
            self.held_push = version

    def _load_into_engine(self, engine: EngineProtocol, weights: Any, options: LoadOptions) -> Any:
        """A push into an engine that holds its own weights: checked by the engine, loaded while no
        token is generated; the engine resets its cache and its version counter takes the push's
        version (index and uuid), which the collector reads as its own.

        A :class:`~lmcollect.weights.delta.WeightDelta` (with ``version``) must apply to the push
        held (checked here), then goes to the engine as it is: engines whose capabilities have
        ``loads_weight_deltas`` check and apply it, and a rejected one changes nothing.
        Other engines refuse deltas, naming the fix.
        """
        version = options.version
        self.check_version(version)
        source, extra = self._engine_source(engine, weights, options)
        loaded: int | PushVersion = version if version is not None else self._next_index(engine)
        held, self.held_push = self.held_push, None  # until the load succeeded
        # A continuous collector's engine whose counter is the collector's version takes the version
        # inside its load, which lands between two decoding steps by itself (each token records its
        # version): no pause, so the copy overlaps decoding and the only stall is the load. Otherwise
        # load, reset and version change while no token is generated: a lockstep policy's turn (one
        # version for all its tokens) waits, an engine with a counter of its own is paused.
        separate_version = self.version is not None and not self.version.shares(version_counter_of(engine))
        hold = separate_version or not isinstance(self.policy, EngineProtocol)
        with self._held() if hold else contextlib.nullcontext():
            try:
                report = engine.load_weights(source, version=loaded, **extra)
            except (DeltaRejectedError, ValueError):
                self.held_push = held  # a refused load (a check, a delta, a stale push) changed nothing
                raise
            if separate_version:
                self._finish_update(version, cache_reset=True)  # an engine without a counter of its own
            self.held_push = version
        if self._on_loaded is not None:
            self._on_loaded()
        return report

    def _engine_source(self, engine: EngineProtocol, weights: Any, options: LoadOptions) -> tuple[Any, dict[str, Any]]:
        """What ``engine.load_weights`` takes for ``weights``, and its keywords: a process-group push,
        a LoRA adapter, a delta or a sender's :class:`~lmcollect.weights.buckets.WeightBuckets` as
        they are (buckets unless ``convert_dtype`` must cast them), other tensors cast to the
        engine's dtypes with ``convert_dtype``. NaN/Inf are refused by the engine while it copies
        (``check_finite=True``, where it ``checks_finite_in_copy``), else here, read through views
        of the buckets' bytes."""
        if isinstance(weights, GroupPush):
            if not isinstance(engine, WorkerRpcEngine):
                raise TypeError(NO_GROUP_ENGINE.format(policy=type(self.policy).__name__))
            return weights, {}
        check_engine_loads(engine, weights)
        if isinstance(weights, LoraAdapter):
            return weights, {}
        if isinstance(weights, WeightDelta):
            if options.version is None:
                raise TypeError("a delta push needs the version it brings (version=PushVersion(...)).")
            check_delta_base(weights, self.held_push)
            return weights, {}
        buckets = weights if isinstance(weights, WeightBuckets) else None
        weights = to_weight_dict(weights)  # of buckets: views of their bytes
        if options.convert_dtype:  # cast here to what the engine holds: every engine then checks dtypes strictly
            cast = cast_to_held(weights, *engine.weight_metadata())
            if any(cast[name] is not tensor for name, tensor in weights.items()):
                buckets, weights = None, cast  # new tensors: the engine packs them (once)
        # a sender's buckets go on as they are: the engine checks their layout and reads their bytes
        source = buckets if buckets is not None else weights.items()
        if options.allow_non_finite:
            return source, {}
        if capabilities_of(engine).checks_finite_in_copy:
            return source, {"check_finite": True}
        refuse_non_finite(weights)  # the values as the engine will hold them
        return source, {}

    def _apply_delta(self, target: Any, delta: WeightDelta, version: PushVersion | None) -> None:
        """Check the delta (base version, names, dtypes, positions), then, while no policy call
        runs, write it, verify its checksums (undone on a mismatch), reset the cache, take ``version``."""
        if version is None:
            raise TypeError("a delta push needs the version it brings (version=PushVersion(...)).")
        self.check_version(version)
        if id(target) in self._shared_models:
            with self._held():
                self._unshare(target)
        targets, aliases = unique_targets(target)
        prepared = prepare_delta(delta, targets, held_version=self.held_push, aliases=aliases)
        with self._held():
            check_delta_base(delta, self.held_push)  # again: no other push got in since the check
            prepared.apply_()
            self._finish_update(version)
            self.held_push = version

    # ------------------------------------------------------------------ checks
    def check_version(self, version: PushVersion | None) -> None:
        """Raise if ``version`` is not a push's version or is older than the one held."""
        if version is not None and not isinstance(version, PushVersion):
            raise TypeError(f"version must be a PushVersion (built by a weight updater), got {type(version).__name__}.")
        if version is not None and self.version is not None:
            self.version.check(version)

    def check_loadable(self, weights: Any, *, convert_dtype: bool, allow_non_finite: bool) -> None:
        """Raise ValueError if loading ``weights`` (a model's state dict) into the policy would be
        refused: names, shapes, dtypes, NaN/Inf (unless ``allow_non_finite``). Changes nothing."""
        engine = self.engine("policy")
        if engine is not None:
            metadata, aliases = engine.weight_metadata()
            weights = to_weight_dict(weights)
            if convert_dtype:
                weights = cast_to_held(weights, metadata, aliases)
            check_weights(weights, metadata, aliases=aliases)
        else:
            target = self.model("policy")
            weights = to_weight_dict(weights, like=target)
            metadata, aliases = expected_metadata(target)
            check_weights(weights, metadata, aliases=aliases, convert_dtype=convert_dtype)
        if not allow_non_finite:
            refuse_non_finite(weights, [(metadata, aliases)] if convert_dtype and engine is None else None)

    # ------------------------------------------------------------------ a state's weights
    def state(self) -> dict[str, Any]:
        """The policy's weights for a ``state_dict``: ``policy_state_dict`` (the weights) and
        ``lora_adapter`` (a LoRA adapter merged on top of them, as :meth:`LoraAdapter.state`, or None).

        An engine that merges adapters and can give what it holds (``capabilities.checkpoints_weights``:
        ``TransformersEngine``, ``VLLMEngine``) gives its base and the adapter merged on it, so a
        restore loads the base as a full push and merges the adapter again: the restored engine
        holds the same weights and the same base, and the next adapter replaces this one instead of
        stacking on it. Otherwise the model's ``state_dict()``, or the state of the engine's torch
        module (``ScriptedEngine``); None when the weights are in no process here."""
        engine = engine_of(self.policy)
        if engine is not None and capabilities_of(engine).checkpoints_weights:
            held = engine.checkpoint_weights()  # type: ignore[attr-defined]  # declared by checkpoints_weights
            base, adapter = held if held is not None else (None, None)
            return {"policy_state_dict": base, "lora_adapter": None if adapter is None else adapter.state()}
        source = getattr(engine, "model", None) if self.engine("policy") is not None else self.model("policy")
        state_dict = getattr(source, "state_dict", None)
        return {"policy_state_dict": state_dict() if callable(state_dict) else None, "lora_adapter": None}

    def restore(self, state: Any, options: LoadOptions) -> None:
        """Load the weights of a ``state_dict`` (see :meth:`state`) as pushes of ``version``: the
        weights in full (with ``options``), then the LoRA adapter merged
        on them, if any. The adapter and its merge into the saved base are checked first, so a state
        whose adapter does not fit (or overflows) changes nothing."""
        adapter_state = state.get("lora_adapter")
        adapter = None if adapter_state is None else LoraAdapter.from_state(adapter_state)
        if adapter is not None:
            self._check_saved_adapter(adapter, state.get("policy_state_dict"))
        with self.lock:
            self.load(state["policy_state_dict"], options)
            if adapter is not None:
                self.load(adapter, LoadOptions(version=options.version))

    def _check_saved_adapter(self, adapter: LoraAdapter, base: Any) -> None:
        missing = [name for name in adapter.layers if base is None or name not in base]
        if missing:
            raise ValueError(
                f"this state holds a LoRA adapter without the base weights it was merged into ({missing[:3]}); "
                "it was not saved by lmcollect."
            )
        engine = engine_of(self.policy)
        if engine is None:
            raise TypeError(NO_LORA_ENGINE.format(policy=type(self.policy).__name__))
        check_engine_loads(engine, adapter)
        check_adapter(adapter, self.metadata()[0], receiver="this collector's model")
        check_merge(adapter, {name: base[name] for name in adapter.layers}, receiver="the saved base weights")

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """No token is generated inside: an engine policy is paused (its requests kept), a lockstep
        policy's turns wait for ``hold``."""
        if isinstance(self.policy, EngineProtocol):
            self.policy.pause()
            try:
                yield
            finally:
                self.policy.resume()
        elif self._hold is not None:
            with self._hold():
                yield
        else:
            yield

    def _unshare(self, target: Any) -> None:
        """Private, writable tensors for a model a zero-copy push had pointed at shared memory."""
        if id(target) in self._shared_models:
            unshare_weights_(target)
            self._shared_models.discard(id(target))

    def _finish_update(self, version: PushVersion | None, *, cache_reset: bool = False) -> None:
        """After new weights are in (while no token is generated): reset the prefix cache (unless
        ``cache_reset``: an engine's ``load_weights`` did), take the version."""
        reset_cache = getattr(self.policy, "reset_prefix_cache", None)
        if callable(reset_cache) and not cache_reset:
            reset_cache()
        if self.version is None:
            return  # untracked (-1) stays untracked; an engine counts its loads itself
        if version is None:
            self.version.increment()
        else:
            self.version.set(version)

    def _next_index(self, engine: EngineProtocol) -> int:
        """The version index a load about to be taken gives ``engine``: the next of the counter it
        shares with the collector (untracked: the engine counts its loads itself)."""
        if self.version is not None:
            return self.version.index + 1
        return max(engine.version, 0) + 1


def refuse_non_finite(weights: dict[str, torch.Tensor], receivers: list[tuple[dict, dict]] | None = None) -> None:
    """One ValueError naming every floating tensor of ``weights`` that holds NaN or Inf, checked as
    ``receivers`` (``(metadata, aliases)`` of the models that will hold them) hold them when given."""
    held = narrowest_held_dtypes(weights, receivers) if receivers else None
    raise_if_problems(non_finite_problems(weights, dtypes=held))
