"""EngineRouter over plain in-process engines: least-loaded routing, affinity, control on every replica."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future

import pytest
import torch

from lmcollect.engines import (
    EngineCapabilities,
    EngineClosedError,
    EngineProtocol,
    EngineRequest,
    EngineResult,
    WorkerRpcEngine,
    worker_rpc_engine_of,
)
from lmcollect.engines.router import EngineRouter, ReplicaLoadError
from lmcollect.engines.weight_group import GroupPush, join_weight_group, weight_receiver_nodes
from lmcollect.engines.sampling import SamplingConfig


class HeldEngine:
    """An EngineProtocol engine whose requests stay in flight until the test finishes them."""

    def __init__(self, name: str, *, refuse_loads: bool = False) -> None:
        self.name = name
        self.refuse_loads = refuse_loads
        self.pending: list[tuple[EngineRequest, Future[EngineResult]]] = []
        self.events: list[str] = []
        self._version = -1

    def submit(self, request: EngineRequest) -> Future[EngineResult]:
        future: Future[EngineResult] = Future()
        self.pending.append((request, future))
        return future

    def finish_all(self) -> None:
        for request, future in self.pending:
            n = len(request.prompt_ids)
            future.set_result(EngineResult(
                tokens=torch.zeros(n, dtype=torch.long), log_probs=torch.zeros(n),
                token_versions=torch.full((n,), self._version), finish_reason="length",
            ))
        self.pending.clear()

    def pause(self) -> None:
        self.events.append("pause")

    def resume(self) -> None:
        self.events.append("resume")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        names = [name for name, _ in named_tensors]
        if self.refuse_loads or names != ["w"]:
            raise ValueError(f"weight push rejected by {self.name}, no weight was changed")
        self._version = version
        self.events.append(f"load {version}")

    def weight_metadata(self) -> tuple[dict, dict]:
        return {"w": (torch.float32, torch.Size([1]))}, {}

    def set_version(self, version: int) -> None:
        self._version = version
        self.events.append(f"label {version}")

    def reset_prefix_cache(self) -> None:
        self.events.append("reset")

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_in_flight(self) -> int:
        return sum(not future.done() for _, future in self.pending)

    def close(self) -> None:
        for _, future in self.pending:
            if not future.done():
                future.set_exception(EngineClosedError(f"{self.name} closed"))
        self.events.append("close")


def request(affinity: str | None = None) -> EngineRequest:
    return EngineRequest(prompt_ids=[1, 2], affinity=affinity)


def replicas(n: int = 3) -> list[HeldEngine]:
    return [HeldEngine(f"e{i}") for i in range(n)]


def test_least_loaded_routing_fills_an_idle_pool_evenly() -> None:
    engines = replicas()
    router = EngineRouter(engines)
    assert isinstance(router, EngineProtocol)
    for _ in range(6):
        router.submit(request())
    assert [e.num_in_flight for e in engines] == [2, 2, 2] and router.num_in_flight == 6
    engines[1].finish_all()
    router.submit(request())
    router.submit(request())
    assert [e.num_in_flight for e in engines] == [2, 2, 2]  # both went to the replica that had room


def test_same_affinity_same_replica_even_when_it_is_busier() -> None:
    engines = replicas(2)
    router = EngineRouter(engines)
    router.submit(request("dialog-a"))
    first = router.replica_of("dialog-a")
    for _ in range(3):
        router.submit(request("dialog-a"))
    assert engines[first].num_in_flight == 4 and engines[1 - first].num_in_flight == 0
    router.submit(request("dialog-b"))  # a new dialog goes where the load is
    assert router.replica_of("dialog-b") == 1 - first


def test_affinities_are_forgotten_least_recently_used_first() -> None:
    router = EngineRouter(replicas(2), max_affinities=2)
    for name in ("a", "b", "a", "c"):
        router.submit(request(name))
    assert router.replica_of("b") is None
    assert router.replica_of("a") is not None and router.replica_of("c") is not None


def test_concurrent_submits_stay_balanced() -> None:
    engines = replicas(4)
    router = EngineRouter(engines)
    threads = [threading.Thread(target=lambda: [router.submit(request()) for _ in range(25)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [e.num_in_flight for e in engines] == [25, 25, 25, 25]


def test_control_calls_reach_every_replica() -> None:
    engines = replicas()
    router = EngineRouter(engines)
    router.pause()
    router.load_weights(iter([("w", torch.zeros(1))]), version=3)  # an iterator, read once, reaches all
    router.reset_prefix_cache()
    router.resume()
    assert all(e.events == ["pause", "load 3", "reset", "resume"] for e in engines)
    assert router.version == 3


def test_loads_refused_everywhere_or_somewhere() -> None:
    engines = replicas(2)
    router = EngineRouter(engines)
    with pytest.raises(ValueError, match="no weight was changed"):
        router.load_weights([("bad", torch.zeros(1))], version=1)
    assert router.version == -1
    engines[1].refuse_loads = True
    with pytest.raises(ReplicaLoadError, match=r"replicas \[1\].*versions now \{0: 2, 1: -1\}"):
        router.load_weights([("w", torch.zeros(1))], version=2)
    assert router.version == -1  # the oldest any replica holds


def test_close_fails_pending_futures_on_every_replica() -> None:
    engines = replicas(2)
    router = EngineRouter(engines)
    futures = [router.submit(request()) for _ in range(4)]
    router.close()
    router.close()  # idempotent
    assert all(isinstance(f.exception(timeout=1), EngineClosedError) for f in futures)
    assert all(e.events == ["close"] for e in engines)


def test_bad_settings_name_the_knob() -> None:
    with pytest.raises(ValueError, match="engines is empty"):
        EngineRouter([])
    with pytest.raises(TypeError, match=r"engines\[1\]"):
        EngineRouter([HeldEngine("e0"), object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_affinities"):
        EngineRouter(replicas(1), max_affinities=0)


def test_a_push_through_the_router_reaches_requests_in_flight_on_every_replica() -> None:
    from lmcollect.testing.scripted_engine import ScriptedEngine

    engines = [ScriptedEngine(num_tokens=40, token_delay_s=0.005) for _ in range(2)]
    router = EngineRouter(engines)
    try:
        long = EngineRequest(prompt_ids=[1], sampling=SamplingConfig(max_new_tokens=40))
        futures = [router.submit(long) for _ in range(4)]
        assert [e.num_in_flight for e in engines] == [2, 2]
        deadline = time.monotonic() + 10
        while min(e.num_steps for e in engines) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)  # every response has tokens under the old weights
        router.pause()
        router.load_weights([("tag", torch.ones(1))], version=1)
        router.reset_prefix_cache()
        router.resume()
        for future in futures:
            versions = future.result(timeout=30).token_versions
            assert versions[0] == -1 and versions[-1] == 1  # one response, both versions
            assert torch.equal(versions, versions.sort().values)  # old tokens, then new ones
        assert router.version == 1
    finally:
        router.close()


class WorkerHeldEngine(HeldEngine):
    """A HeldEngine with worker processes (a WorkerRpcEngine): answers each RPC with its arguments."""

    capabilities = EngineCapabilities(loads_group_pushes=True)

    def __init__(self, name: str, *, num_replicas: int = 1) -> None:
        super().__init__(name)
        self._num_replicas = num_replicas

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    def collective_rpc_each(self, method: str, args_per_replica: list[tuple], kwargs: dict | None = None) -> list:
        self.events.append(f"rpc {method}")
        return [(self.name, args) for args in args_per_replica]

    def load_weights(self, source, *, version: int):
        if not isinstance(source, GroupPush):
            return super().load_weights(source, version=version)
        self.broadcast.wait()  # a broadcast reaches no worker until every worker receives
        self._version = version
        self.events.append(f"group load {version}")
        return [(self.name, source.worker_args())] * self._num_replicas


def test_worker_rpcs_are_split_over_replicas_in_order() -> None:
    a, b = WorkerHeldEngine("a"), WorkerHeldEngine("b", num_replicas=2)
    router = EngineRouter([a, b])
    assert isinstance(router, WorkerRpcEngine) and router.num_replicas == 3
    answers = router.collective_rpc_each("receive_weights", [(1,), (2,), (3,)])
    assert answers == [("a", (1,)), ("b", (2,)), ("b", (3,))]
    with pytest.raises(ValueError, match="arguments for 2 replicas; this router has 3"):
        router.collective_rpc_each("receive_weights", [(1,), (2,)])
    router.set_version(4)
    assert a.version == b.version == 4 and "label 4" in a.events


def test_a_group_push_is_received_by_every_replica_at_once_and_ranks_follow_replicas() -> None:
    a, b = WorkerHeldEngine("a"), WorkerHeldEngine("b", num_replicas=2)
    a.broadcast = b.broadcast = threading.Barrier(2, timeout=10)  # hangs (then breaks) if loaded one by one
    router = EngineRouter([a, b])
    try:
        reports = router.load_weights(GroupPush(timeout_s=5.0, verify=True), version=3)
        assert reports == [("a", (5.0, True)), ("b", (5.0, True)), ("b", (5.0, True))]
        assert a.version == b.version == 3
        join_weight_group(router, {"port": 1}, ranks_per_replica=2)  # tensor-parallel 2: ranks 1-2, 3-4, 5-6
        assert b.events[-1] == "rpc init_weight_group" and a.events[-1] == "rpc init_weight_group"
        assert weight_receiver_nodes(router) == [("a", ()), ("b", ()), ("b", ())]
    finally:
        router.close()


def test_join_gives_each_replica_its_first_rank() -> None:
    engine = WorkerHeldEngine("a", num_replicas=3)
    calls = []
    engine.collective_rpc_each = lambda method, args, kwargs=None: calls.append((method, args))
    join_weight_group(engine, {"port": 1}, ranks_per_replica=2)
    assert calls == [("init_weight_group", [({"port": 1}, 1), ({"port": 1}, 3), ({"port": 1}, 5)])]


def test_a_router_of_engines_without_workers_is_not_a_worker_rpc_engine() -> None:
    router = EngineRouter(replicas(2))
    assert isinstance(router, EngineProtocol) and not isinstance(router, WorkerRpcEngine)
    assert worker_rpc_engine_of(router) is None
    with pytest.raises(AttributeError, match="RayRemoteWeightUpdater"):
        router.collective_rpc_each("receive_weights", [(1,), (2,)])
