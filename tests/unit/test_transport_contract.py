"""The transport contract (tests/transport_contract.py) for the pairs without Ray: the in-process
``LocalWeightUpdater`` into its collector, ``SharedMemorySender`` -> ``SharedMemoryReceiver`` and
``ProcessGroupSender`` -> ``ProcessGroupReceiver`` over gloo on loopback (the receiver in a thread).
The Ray object store pair runs the same checks in tests/integration/test_transport_contract_ray.py.
Every pair pushes into a collector over the tiny transformers model (a fresh one per test)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupReceiver, ProcessGroupSender
from lmcollect.transports.shared_memory import SharedMemorySender
from lmcollect.weight_sync import LocalWeightUpdater
from lmcollect.weights.delta import DeltaConfig
from lmcollect.weights.version import PushVersion
from tests.factories import run_in_thread
from tests.transport_contract import CHECKS, SchemePullPair, TransportPair, tiny_collector

PULL_TIMEOUT_S = 0.5  # how long a shared-memory pull waits for a push that never comes
GROUP_TIMEOUT_S = 5.0  # the process group's bound on every wait (the dead-peer call's bound)


class LocalPair(TransportPair):
    """A ``LocalWeightUpdater`` and the collector it pushes into (its peer: gone once collected)."""

    supports = frozenset({"adapter", "version", "dead_peer"})
    bound_s = 2.0

    def __init__(self, model_path: Path) -> None:
        self.updater = LocalWeightUpdater()
        super().__init__(tiny_collector(model_path, weight_updater=self.updater))
        self.policy = self.collector.policy
        self._last: Any = None

    def push(self, weights: Any, *, version: int | None = None) -> None:
        self.updater.push_weights(weights, version=version)
        self._last = weights

    def last_kind(self) -> str:
        assert self.updater.last_push_stats is not None
        return self.updater.last_push_stats.kind

    def kill_peer(self) -> None:
        self.collector.shutdown()
        self.collector = None  # type: ignore[assignment] - the updater holds it weakly: it is gone now
        gc.collect()

    def call_after_peer_died(self) -> None:
        self.push(self._last)

    def close(self) -> None:
        if self.collector is not None:
            self.collector.shutdown()
        self.policy.close()


class SharedMemoryPair(SchemePullPair):
    """A ``SharedMemorySender`` and one receiver registered with the collector (one process: no peer)."""

    bound_s = PULL_TIMEOUT_S + 2.0

    def __init__(self, model_path: Path) -> None:
        sender = SharedMemorySender()
        super().__init__(tiny_collector(model_path), sender, sender.make_receiver(timeout_s=PULL_TIMEOUT_S))

    def kill_peer(self) -> None:
        self.sender.close()

    def call_after_peer_died(self) -> None:
        self.collector.receive_weights()

    def close(self) -> None:
        self.collector.shutdown()
        self.collector.policy.close()


class ProcessGroupPair(TransportPair):
    """A ``ProcessGroupSender`` (delta pushes on) and a ``ProcessGroupReceiver`` registered with the
    collector, over gloo on loopback; each push's receive runs in a thread, as a collector's would."""

    supports = frozenset({"delta", "version", "dead_peer"})
    bound_s = GROUP_TIMEOUT_S + 5.0

    def __init__(self, model_path: Path) -> None:
        super().__init__(tiny_collector(model_path))
        config = ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=GROUP_TIMEOUT_S, delta=DeltaConfig())
        self.sender = ProcessGroupSender(config)
        self.receiver = ProcessGroupReceiver(timeout_s=GROUP_TIMEOUT_S)
        self.collector.register_scheme_receiver({"policy": self.receiver}, synchronize_weights=False)
        self.receiver.set_connection_info(self.sender.connection_info(), worker_idx=0)
        joined = run_in_thread(self.receiver.connect)
        self.sender.connect()
        joined()
        self._last: Any = None

    def push(self, weights: Any, *, version: int | None = None) -> None:
        prepared = self.sender.prepare(weights)  # the sender's checks: a refused push sends nothing
        pulled = run_in_thread(self.collector.receive_weights, timeout_s=GROUP_TIMEOUT_S + 10)
        self.sender.send(prepared, version=None if version is None else PushVersion(version))
        pulled()
        self._last = weights

    def last_kind(self) -> str:
        assert self.sender.last_push_stats is not None
        return self.sender.last_push_stats.kind

    def kill_peer(self) -> None:
        self.receiver.close()

    def call_after_peer_died(self) -> None:
        self.sender.send({name: t + 1 for name, t in self._last.items()})  # a full push: every tensor changed

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.collector.shutdown()
        self.collector.policy.close()


PAIRS: dict[str, Callable[[Path], TransportPair]] = {
    "local": LocalPair,
    "shared_memory": SharedMemoryPair,
    "process_group": ProcessGroupPair,
}


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("kind", list(PAIRS))
def test_transport_contract(kind: str, check: str, tiny_model_path: Path) -> None:
    pair = PAIRS[kind](tiny_model_path)
    try:
        CHECKS[check](pair)
    finally:
        pair.close()
