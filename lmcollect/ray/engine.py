"""Engines in Ray actors behind :class:`EngineProtocol`: a proxy per actor, a router over several.

:class:`RayEngine` builds an engine inside an actor (``engine_factory`` runs there, so no model
travels through the driver) and answers for it in the caller's process: ``submit`` returns a
future at once (the actor awaits the engine's own future, so many requests run at once), control
calls (``pause``, ``resume``, ``load_weights``, ``reset_prefix_cache``) wait for the actor.
:func:`ray_engine_replicas` starts N of them behind an :class:`~lmcollect.engines.router.EngineRouter`
(least-loaded routing, one dialog's turns on one replica), which a ``ContinuousLLMCollector`` takes
as its engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from lmcollect.engines.kv_policy import KVPolicy, PushCost, configure_kv_policy, push_costs_of
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
from lmcollect.engines.router import EngineRouter
from lmcollect.engines.weight_group import GroupPush
from lmcollect.plumbing import forwarded
from lmcollect.ray.bounded import DEFAULT_CALL_TIMEOUT_S, get_within
from lmcollect.ray.carrier import ray_payload
from lmcollect.ray.cluster import actor_options, init_ray
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.delta import WeightDelta
from lmcollect.weights.lora import LoraAdapter
from lmcollect.weights.version import PushVersion, VersionCounter

__all__ = ["RayEngine", "ray_engine_replicas", "start_ray_engines"]

_ACTOR_DEFAULTS = {"num_cpus": 1, "max_concurrency": 1000}


@dataclass(frozen=True)
class _Started:
    """What the proxy learns of its actor's engine once it has started."""

    version: int
    worker_replicas: int | None  # None: the engine has no worker processes (not a WorkerRpcEngine)
    capabilities: EngineCapabilities


class _EngineHost:
    """The actor's body: one engine, requests awaited concurrently on the actor's event loop."""

    def __init__(self, engine_factory: Callable[[], EngineProtocol]) -> None:
        self.engine = engine_factory()

    async def generate(self, request: EngineRequest) -> EngineResult:
        return await asyncio.wrap_future(self.engine.submit(request))

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        # blocking engine calls (pause waits for a decoding step) run off the event loop
        return await asyncio.to_thread(getattr(self.engine, method), *args, **kwargs)

    async def set_kv_policy(self, kv_policy: str) -> None:
        await asyncio.to_thread(configure_kv_policy, self.engine, kv_policy)

    async def push_costs(self) -> list[PushCost]:
        return push_costs_of(self.engine)

    async def load_weights(
        self,
        source: dict[str, torch.Tensor] | WeightBuckets | GroupPush | LoraAdapter | WeightDelta,
        version: int | PushVersion,
    ) -> list[Any] | None:
        check_engine_loads(self.engine, source)  # a kind the engine does not load: refused by name, here
        if isinstance(source, GroupPush):  # the engine's workers receive the broadcast
            return await asyncio.to_thread(_worker_rpc_engine(self.engine).load_weights, source, version=version)
        # buckets mapped from the object store go as they are (the engine reads them through views)
        weights = source.items() if isinstance(source, dict) else source
        return await asyncio.to_thread(self.engine.load_weights, weights, version=version)

    async def version(self) -> int:
        return self.engine.version

    async def started(self) -> _Started:
        replicas = self.engine.num_replicas if isinstance(self.engine, WorkerRpcEngine) else None
        return _Started(self.engine.version, replicas, capabilities_of(self.engine))

    async def collective_rpc_each(self, method: str, args_per_replica: list[tuple], kwargs: dict | None) -> list[Any]:
        engine = _worker_rpc_engine(self.engine)
        return await asyncio.to_thread(engine.collective_rpc_each, method, args_per_replica, kwargs)

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.close)


class RayEngine:
    """An :class:`EngineProtocol` engine living in a Ray actor.

    Args:
        engine_factory: builds the engine inside the actor (e.g. a ``TransformersEngine`` over a
            model loaded there, or a ``VLLMEngine``); pickled by Ray.
        remote_config: actor options (default: 1 CPU, 1000 concurrent calls).
        ray_init_config: ``ray.init`` arguments if Ray is not running yet.
        start_timeout_s: longest the actor and its engine may take to start.
        call_timeout_s: longest any other call into the actor (pause, a weight load, a worker
            RPC) waits; a hung actor raises :class:`~lmcollect.ray.bounded.CallTimeoutError`
            naming the knob. Generation requests are futures: their callers bound them.
    """

    def __init__(
        self,
        engine_factory: Callable[[], EngineProtocol],
        *,
        remote_config: dict[str, Any] | None = None,
        ray_init_config: dict[str, Any] | None = None,
        start_timeout_s: float = 900.0,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        ((actor, started),) = _launch(
            engine_factory,
            1,
            remote_config=remote_config,
            ray_init_config=ray_init_config,
            start_timeout_s=start_timeout_s,
        )
        self._attach(actor, started, call_timeout_s)

    @classmethod
    def _of_actor(cls, actor: Any, started: _Started, call_timeout_s: float) -> RayEngine:
        engine = cls.__new__(cls)
        engine._attach(actor, started, call_timeout_s)
        return engine

    def _attach(self, actor: Any, started: _Started, call_timeout_s: float) -> None:
        self._actor = actor
        # the actor's engine counts in its process; this proxy's counter takes each load / set_version made here
        self._counter, self._worker_replicas = VersionCounter(start=started.version), started.worker_replicas
        # the actor's engine's, as this proxy offers them: no check_finite keyword, no checkpoint_weights
        self._capabilities = replace(
            started.capabilities, checks_finite_in_copy=False, checkpoints_weights=False, has_version_counter=True
        )
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._pending: set[Future] = set()  # submitted through this proxy, not answered yet
        self._closed = False

    def submit(self, request: EngineRequest) -> Future[EngineResult]:
        if self._closed:
            raise EngineClosedError("this RayEngine is closed (its actor is gone); build a new one.")
        future = self._actor.generate.remote(request).future()
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _get(self, ref: Any, call: str, *, timeout_s: float | None = None) -> Any:
        return get_within(
            ref, timeout_s=timeout_s or self.call_timeout_s, call=f"RayEngine.{call}", knob="call_timeout_s"
        )

    def pause(self) -> None:
        self._get(self._actor.call.remote("pause"), "pause")

    def resume(self) -> None:
        self._get(self._actor.call.remote("resume"), "resume")

    capabilities = forwarded(
        "_capabilities",
        "What the actor's engine does beyond the core protocol, as this proxy passes it on "
        "(see :class:`~lmcollect.engines.protocol.EngineCapabilities`).",
    )

    def load_weights(
        self,
        source: Iterable[tuple[str, torch.Tensor]] | WeightBuckets | GroupPush | LoraAdapter | WeightDelta,
        *,
        version: int | PushVersion,
    ) -> list[Any] | None:
        # weights: one object-store copy, checked by the engine before it writes (buckets as numpy
        # buffers, which the actor maps without another copy); a kind it does not load never travels
        check_engine_loads(self, source)
        payload: Any
        if isinstance(source, GroupPush):
            payload = source
        else:
            payload = ray_payload(
                source if isinstance(source, (WeightBuckets, LoraAdapter, WeightDelta)) else dict(source)
            )
        wait_s = max(self.call_timeout_s, source.timeout_s or 0.0) if isinstance(source, GroupPush) else None
        reports = self._get(self._actor.load_weights.remote(payload, version), "load_weights", timeout_s=wait_s)
        self._counter.take(version)
        return reports

    def weight_metadata(self) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        return self._get(self._actor.call.remote("weight_metadata"), "weight_metadata")

    def set_version(self, version: int) -> None:
        self._get(self._actor.call.remote("set_version", version), "set_version")
        self._counter.take(version)

    def reset_prefix_cache(self) -> None:
        self._get(self._actor.call.remote("reset_prefix_cache"), "reset_prefix_cache")

    def set_kv_policy(self, kv_policy: KVPolicy) -> None:
        """The actor's engine takes ``kv_policy`` (or refuses it, naming the fix)."""
        self._get(self._actor.set_kv_policy.remote(kv_policy), "set_kv_policy")

    def push_costs(self) -> list[PushCost]:
        """The actor's engine's recent loads' cost (see :class:`~lmcollect.engines.kv_policy.PushCost`)."""
        return self._get(self._actor.push_costs.remote(), "push_costs")

    @property
    def num_replicas(self) -> int:
        """The actor's engine's replicas, if it is a :class:`~lmcollect.engines.WorkerRpcEngine` (vLLM: 1).

        Raises AttributeError otherwise, so ``isinstance(ray_engine, WorkerRpcEngine)`` tells."""
        if self._worker_replicas is None:
            raise AttributeError(_NO_WORKERS)
        return self._worker_replicas

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``collective_rpc_each`` on the actor's engine (vLLM's workers; see ``WorkerRpcEngine``)."""
        return self._get(
            self._actor.collective_rpc_each.remote(method, args_per_replica, kwargs), f"collective_rpc_each({method!r})"
        )

    version = forwarded(
        "_counter.index",
        "The engine's weight version: its own at start, then each load_weights / set_version made here.",
    )
    version_counter = forwarded(
        "_counter", "The counter of :attr:`version` (a collector driving this engine reads it)."
    )

    @property
    def num_in_flight(self) -> int:
        """Requests submitted through this proxy and not answered yet (counted here: no round trip)."""
        return len(self._pending)

    actor = forwarded("_actor", "The handle of the Ray actor the engine lives in.")

    def close(self) -> None:
        """Close the engine (its pending futures fail with ``EngineClosedError``) and end the actor. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self._get(self._actor.close.remote(), "close")
            except RayActorError:  # the actor died before: nothing left to close
                return
            with self._lock:
                pending = list(self._pending)
            # the engine failed them; their answers (EngineClosedError) are on the way: let them
            # arrive before the actor goes, or they would fail as "actor died" instead
            concurrent.futures.wait(pending, timeout=self.call_timeout_s)
        finally:
            ray.kill(self._actor)


_NO_WORKERS = (
    "this engine has no worker processes to call; process-group pushes (vLLMUpdater) need a vLLM engine "
    "(VLLMEngine). Push with RayRemoteWeightUpdater instead."
)


def _worker_rpc_engine(engine: EngineProtocol) -> WorkerRpcEngine:
    if not isinstance(engine, WorkerRpcEngine):
        raise TypeError(f"{type(engine).__name__}: {_NO_WORKERS}")
    return engine


def start_ray_engines(
    engine_factory: Callable[[], EngineProtocol],
    *,
    num_replicas: int,
    remote_config: dict[str, Any] | None = None,
    ray_init_config: dict[str, Any] | None = None,
    start_timeout_s: float = 900.0,
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
) -> list[RayEngine]:
    """``num_replicas`` :class:`RayEngine` actors, started at once (the other arguments are RayEngine's).

    If any fails to start within ``start_timeout_s``, all of them are killed and the error names the knob."""
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}.")
    launched = _launch(
        engine_factory,
        num_replicas,
        remote_config=remote_config,
        ray_init_config=ray_init_config,
        start_timeout_s=start_timeout_s,
    )
    return [RayEngine._of_actor(actor, started, call_timeout_s) for actor, started in launched]


def _launch(
    engine_factory: Callable[[], EngineProtocol],
    num_engines: int,
    *,
    remote_config: dict[str, Any] | None,
    ray_init_config: dict[str, Any] | None,
    start_timeout_s: float,
) -> list[tuple[Any, _Started]]:
    """Start the engine actors at once; each one's (actor, what its engine is) once all have started."""
    init_ray(ray_init_config)
    actor_cls = ray.remote(**actor_options(remote_config, defaults=_ACTOR_DEFAULTS))(_EngineHost)
    actors = [actor_cls.remote(engine_factory) for _ in range(num_engines)]
    try:
        started = get_within(  # also surfaces start-up errors here
            [actor.started.remote() for actor in actors],
            timeout_s=start_timeout_s, call="RayEngine start-up", knob="start_timeout_s",
        )  # fmt: skip
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return list(zip(actors, started, strict=True))


def ray_engine_replicas(
    engine_factory: Callable[[], EngineProtocol],
    *,
    num_replicas: int,
    remote_config: dict[str, Any] | None = None,
    ray_init_config: dict[str, Any] | None = None,
) -> EngineRouter:
    """``num_replicas`` :class:`RayEngine` actors behind one :class:`EngineRouter`."""
    return EngineRouter(
        start_ray_engines(
            engine_factory, num_replicas=num_replicas, remote_config=remote_config, ray_init_config=ray_init_config
        )
    )
