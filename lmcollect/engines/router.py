"""One engine in front of several: least-loaded routing, dialog affinity, control calls to every replica."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from lmcollect.engines.kv_policy import KVPolicy, PushCost, check_kv_policy, configure_kv_policy, push_costs_of
from lmcollect.engines.protocol import (
    EngineCapabilities,
    EngineClosedError,
    EngineProtocol,
    EngineRequest,
    EngineResult,
    WorkerRpcEngine,
    capabilities_of,
    check_engine_loads,
)
from lmcollect.engines.weight_group import GroupPush
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.delta import WeightDelta
from lmcollect.weights.lora import LoraAdapter
from lmcollect.weights.version import PushVersion, VersionCounter

__all__ = ["EngineRouter", "ReplicaLoadError"]

T = TypeVar("T")


class ReplicaLoadError(RuntimeError):
    """A weight load succeeded on some replicas and failed on others: they now hold different versions."""


class EngineRouter:
    """Spreads requests over replicas of one model; itself an :class:`EngineProtocol`.

    Routing, per request:

    1. a request whose ``affinity`` was seen before goes to the replica that served it (the
       dialog's earlier turns are in that replica's prefix cache);
    2. any other goes to the least-loaded replica (fewest ``num_in_flight``; ties go to the one
       picked longest ago, so an idle pool is filled evenly), which its affinity then sticks to.

    Affinities are remembered up to ``max_affinities`` (least recently used forgotten first: a
    forgotten dialog only loses its cache hits). ``pause``, ``resume``, ``load_weights`` and
    ``reset_prefix_cache`` run on every replica at once and return when all have; the replicas are
    plain :class:`EngineProtocol` objects (in-process engines, or proxies of Ray engine actors).

    Args:
        engines: the replicas (at least one), all serving the same model.
        max_affinities: how many affinities to remember.

    Example::

        router = EngineRouter([engine_a, engine_b])
        future = router.submit(EngineRequest(prompt_ids=ids, affinity="dialog-17"))
    """

    def __init__(self, engines: Sequence[EngineProtocol], *, max_affinities: int = 100_000) -> None:
        engines = list(engines)
        if not engines:
            raise ValueError("engines is empty; EngineRouter needs at least one engine to route to.")
        for index, engine in enumerate(engines):
            if not isinstance(engine, EngineProtocol):
                raise TypeError(f"engines[{index}] is a {type(engine).__name__}, not an EngineProtocol engine.")
        if isinstance(max_affinities, bool) or not isinstance(max_affinities, int) or max_affinities < 1:
            raise ValueError(f"max_affinities must be an int >= 1 (affinities remembered), got {max_affinities!r}.")
        self.engines: Sequence[EngineProtocol] = engines
        self.max_affinities = max_affinities
        self._affinities: OrderedDict[str, int] = OrderedDict()  # affinity -> replica index, LRU order
        self._last_pick = [0] * len(engines)  # pick counter at each replica's last pick (tie-break)
        self._num_picks = 0
        self._lock = threading.Lock()  # picks and their submits, in one order
        self._closed = False
        self._fan_out = ThreadPoolExecutor(len(engines), thread_name_prefix="lmcollect-engine-router")
        # The router's own counter, taken on each load every replica applied: replicas may live in
        # other processes (Ray actors), where no counter can be shared. Starts at the oldest held.
        self._counter = VersionCounter(start=min(engine.version for engine in engines))

    # ------------------------------------------------------------------ requests
    def submit(self, request: EngineRequest) -> Future[EngineResult]:
        """Send ``request`` to its replica (see the class docstring) and return that replica's future."""
        with self._lock:  # the next pick sees this request in its replica's load
            if self._closed:
                raise EngineClosedError("this EngineRouter is closed; build a new one.")
            index = self._pick(request.affinity)
            return self.engines[index].submit(request)

    def replica_of(self, affinity: str) -> int | None:
        """The replica index an affinity sticks to now (None: not remembered)."""
        with self._lock:
            return self._affinities.get(affinity)

    def _pick(self, affinity: str | None) -> int:
        index = self._affinities.get(affinity) if affinity is not None else None
        if index is None:
            loads = [engine.num_in_flight for engine in self.engines]
            index = min(range(len(self.engines)), key=lambda i: (loads[i], self._last_pick[i]))
        self._num_picks += 1
        self._last_pick[index] = self._num_picks
        if affinity is not None:
            self._affinities[affinity] = index
            self._affinities.move_to_end(affinity)
            if len(self._affinities) > self.max_affinities:
                self._affinities.popitem(last=False)
        return index

    # ------------------------------------------------------------------ control, on every replica
    def pause(self) -> None:
        """Pause every replica; returns once all are paused."""
        self._on_every(lambda engine: engine.pause())

    def resume(self) -> None:
        """Resume every replica."""
        self._on_every(lambda engine: engine.resume())

    def load_weights(
        self,
        source: Iterable[tuple[str, torch.Tensor]] | WeightBuckets | GroupPush | LoraAdapter | WeightDelta,
        *,
        version: int | PushVersion,
    ) -> list[Any] | None:
        """Load the same weights into every replica (each checks them before writing any).

        A push every replica refuses raises that refusal (nothing changed anywhere); one that only
        some replicas refuse raises :class:`ReplicaLoadError` naming which hold which version.
        A :class:`~lmcollect.engines.weight_group.GroupPush` is received by every replica at once
        (the broadcast needs all of them); returns their workers' reports, replica by replica.
        """
        check_engine_loads(self, source)  # a kind some replica does not load: refused before any loads
        if isinstance(source, GroupPush):
            reports = self._load_group_push(source, version)
            self._counter.take(version)
            return reports
        # every replica reads them: an adapter, a delta or buckets as they are, tensors as a list
        weights = (
            source if isinstance(source, (LoraAdapter, WeightDelta, WeightBuckets)) else list(dict(source).items())
        )
        errors = self._on_every(lambda engine: engine.load_weights(weights, version=version), raise_first=False)
        failures = {i: error for i, error in enumerate(errors) if error is not None}
        if not failures:
            self._counter.take(version)
            return None
        failed, first = list(failures), next(iter(failures.values()))
        if len(failed) == len(self.engines):
            raise first
        versions = {i: engine.version for i, engine in enumerate(self.engines)}
        raise ReplicaLoadError(
            f"loading version {version} failed on replicas {failed} ({first!r}) and succeeded on "
            f"the others; versions now {versions}. Push again, or close the failed replicas."
        ) from first

    @property
    def capabilities(self) -> EngineCapabilities:
        """What every replica does (a payload kind, the KV policy "keep"), or any replica (push costs,
        which are listed replica by replica); the router keeps a version counter of its own."""
        each = [capabilities_of(engine) for engine in self.engines]
        return EngineCapabilities(
            loads_full_weights=all(c.loads_full_weights for c in each),
            loads_group_pushes=all(c.loads_group_pushes for c in each),
            loads_lora_adapters=all(c.loads_lora_adapters for c in each),
            loads_weight_deltas=all(c.loads_weight_deltas for c in each),
            sets_kv_policy=all(c.sets_kv_policy for c in each),
            meters_push_costs=any(c.meters_push_costs for c in each),
            has_version_counter=True,
        )

    def _load_group_push(self, push: GroupPush, version: int | PushVersion) -> list[Any]:
        engines = [self._worker_engine(i) for i in range(len(self.engines))]  # all checked before any receives
        futures = [self._fan_out.submit(engine.load_weights, push, version=version) for engine in engines]
        return self._gather(futures, "receive_weights")

    def weight_metadata(self) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """Replica 0's (all replicas serve the same model)."""
        return self.engines[0].weight_metadata()

    def set_version(self, version: int) -> None:
        """Label every replica's next tokens with ``version``."""
        self._on_every(lambda engine: engine.set_version(version))
        self._counter.take(version)

    @property
    def num_replicas(self) -> int:
        """Replicas as a :class:`~lmcollect.engines.WorkerRpcEngine` counts them (each engine's own, summed)."""
        return sum(self._worker_engine(i).num_replicas for i in range(len(self.engines)))

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` on every replica's workers at once, replica ``i`` with ``args_per_replica[i]``
        (a weight receive waits for the trainer's broadcast, so all must be under way together)."""
        counts = [self._worker_engine(i).num_replicas for i in range(len(self.engines))]
        if len(args_per_replica) != sum(counts):
            raise ValueError(f"got arguments for {len(args_per_replica)} replicas; this router has {sum(counts)}.")
        starts = [sum(counts[:i]) for i in range(len(counts))]
        futures = [
            self._fan_out.submit(
                self._worker_engine(i).collective_rpc_each, method, args_per_replica[s : s + n], kwargs
            )
            for i, (s, n) in enumerate(zip(starts, counts, strict=True))
        ]
        return self._gather(futures, method)

    @staticmethod
    def _gather(futures: list[Future], what: str) -> list[Any]:
        """Every replica's answers, in order; a replica's failure is raised naming it."""
        answers: list[Any] = []
        for index, future in enumerate(futures):
            try:
                answers += future.result()
            except (ValueError, TypeError):  # a refusal: the same on every replica, so no name needed
                raise
            except Exception as exc:  # name the replica: the caller reports which engine failed (or died)
                raise RuntimeError(f"replica {index} failed during {what}: {exc}") from exc
        return answers

    def _worker_engine(self, index: int) -> WorkerRpcEngine:
        """Replica ``index`` as a WorkerRpcEngine; AttributeError if it is not one (so that
        ``isinstance(router, WorkerRpcEngine)`` is False for a router of such replicas)."""
        engine = self.engines[index]
        if not isinstance(engine, WorkerRpcEngine):
            raise AttributeError(
                f"replica {index} ({type(engine).__name__}) has no worker processes to call; process-group pushes "
                "(vLLMUpdater) need vLLM replicas. Push with RayRemoteWeightUpdater instead."
            )
        return engine

    def reset_prefix_cache(self) -> None:
        """Reset every replica's prefix cache."""
        self._on_every(lambda engine: engine.reset_prefix_cache())

    def set_kv_policy(self, kv_policy: KVPolicy) -> None:
        """Every replica takes ``kv_policy``; checked on each first, so a replica that cannot keep
        refuses before any changes."""
        check_kv_policy(kv_policy)
        if kv_policy != "recompute":
            for engine in self.engines:
                if not capabilities_of(engine).sets_kv_policy:
                    configure_kv_policy(engine, kv_policy)  # raises, naming the engine
        self._on_every(lambda engine: configure_kv_policy(engine, kv_policy))

    def push_costs(self) -> list[PushCost]:
        """Every replica's recent loads' cost, replica by replica."""
        return [cost for engine in self.engines for cost in push_costs_of(engine)]

    @property
    def version(self) -> int:
        """The version every replica holds: the oldest at start, then each load all replicas applied
        (one that some refused leaves it, see :class:`ReplicaLoadError`)."""
        return self._counter.index

    @property
    def version_counter(self) -> VersionCounter:
        """The counter of :attr:`version` (a collector driving this router reads it)."""
        return self._counter

    @property
    def num_in_flight(self) -> int:
        """Requests in flight on all replicas together."""
        return sum(engine.num_in_flight for engine in self.engines)

    def close(self) -> None:
        """Close every replica (each fails its pending futures), then the router's threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._on_every(lambda engine: engine.close())
        finally:
            self._fan_out.shutdown(wait=True)

    def _on_every(self, call: Callable[[EngineProtocol], T], *, raise_first: bool = True) -> list[BaseException | None]:
        """``call(engine)`` on every replica at once; waits for all. The first error is raised
        (after all finished) unless ``raise_first=False``, which returns each replica's error or None."""
        futures = [self._fan_out.submit(call, engine) for engine in self.engines]
        errors = [future.exception() for future in futures]
        first = next((error for error in errors if error is not None), None)
        if raise_first and first is not None:
            raise first
        return errors
