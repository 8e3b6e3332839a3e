"""The target an updater pushes into: a collector's WeightLoader (or a bare engine's), never the collector."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmcollect.collectors import LLMCollector
from lmcollect.engines.weight_group import GroupPush
from lmcollect.testing import ScriptedEngine
from lmcollect.weight_sync import LocalWeightUpdater, WeightLoader, WeightTarget
from lmcollect.weight_sync.vllm_updater import vLLMUpdater
from lmcollect.weights.version import PushVersion
from tests.unit.test_weight_sync import make_collector, trained


class GroupEngine(ScriptedEngine):
    """A ScriptedEngine that also has worker processes (a WorkerRpcEngine): it records each load's
    version and answers a process-group push as its workers would."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[Any] = []

    @property
    def num_replicas(self) -> int:
        return 1

    def collective_rpc_each(self, method: str, args_per_replica: list[tuple], kwargs: dict | None = None) -> list:
        return [None for _ in args_per_replica]

    def load_weights(self, named_tensors: Any, *, version: int | PushVersion) -> Any:
        self.loaded.append(version)
        if isinstance(named_tensors, GroupPush):
            self.version_counter.take(version)
            return [{"rank": 1}]
        return super().load_weights(named_tensors, version=version)


def test_a_bare_engine_takes_the_pushed_version_with_its_uuid() -> None:
    """vLLMUpdater.from_policy(engine): the engine takes the push's version (index and uuid), as a
    collector would, not a fresh version id of the same index."""
    engine = GroupEngine()
    updater = vLLMUpdater.from_policy(engine)
    assert updater is not None
    target = updater._target()
    assert isinstance(target, WeightLoader) and isinstance(target, WeightTarget)
    pushed = PushVersion(3, "the-push")
    report = target.submit_load(GroupPush(timeout_s=5.0), version=pushed)(5.0)
    assert report == [{"rank": 1}]
    assert engine.loaded == [pushed]
    assert (engine.version_counter.index, engine.version_counter.uuid) == (3, "the-push")
    assert target.version_index() == 3  # what a new updater counts on from
    with pytest.raises(ValueError, match="newer"):  # refused before the trainer would send
        target.submit_load(GroupPush(timeout_s=5.0), version=PushVersion(2))


def test_the_updater_learns_its_target_once_and_pushes_without_the_collector() -> None:
    updater = LocalWeightUpdater()
    collector = make_collector(weight_updater=updater)
    assert updater._target() is collector.weight_loader is collector.weight_target()
    calls: list[str] = []
    for name in ("receive_weights", "weight_metadata", "version_index", "increment_version"):

        def refuse(*args: Any, _name: str = name, **kwargs: Any) -> None:
            calls.append(_name)
            raise AssertionError(f"the updater called collector.{_name}")

        setattr(collector, name, refuse)
    model = trained()
    updater.push_weights(model)
    updater.increment_version()
    assert calls == []
    assert collector.policy_version == 2  # the push, then the bump
    assert torch.equal(collector.get_policy_model().embed.weight, model.embed.weight)


def test_a_collector_without_a_live_target_refuses_pushes_by_name() -> None:
    with pytest.raises(RuntimeError, match="no live collector"):
        LocalWeightUpdater().push_weights(trained())
    assert isinstance(make_collector(), LLMCollector)
