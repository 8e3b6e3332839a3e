"""The target an updater pushes into: a collector's WeightLoader (or a bare engine's), never the collector."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lmcollect.collectors import LLMCollector
from lmcollect.engines.weight_group import GroupPush
from lmcollect.testing import ScriptedEngine
from lmcollect.weight_sync import LocalWeightUpdater, WeightLoader, WeightTarget, WeightUpdaterBase
from lmcollect.weight_sync.sender import EachWorkerSender, PushSender
from lmcollect.weights.delta import PushStats
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


class RecordingSender(PushSender[int]):
    """Records the loop's calls; refuses a push whose weights hold a tensor named "bad"."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def before_push(self) -> None:
        self.calls.append("before_push")

    def prepare(self, weights: Any) -> Any:
        self.calls.append("prepare")
        return weights

    def check(self, payload: Any, worker_ids: list[int]) -> None:
        self.calls.append(f"check {worker_ids}")
        if "bad" in payload:
            raise ValueError("bad")

    def plan(self, payload: Any, targets: list[int]) -> str:
        self.calls.append(f"plan {targets}")
        return "the plan"

    def send(self, payload: Any, targets: list[int], pushed: PushVersion, plan: Any) -> str:
        self.calls.append(f"send {targets} v{pushed.index} {plan}")
        self.last_push_stats = PushStats.full(4, num_full=len(targets))
        return "sent"

    def wait(self, sent: Any, targets: list[int], pushed: PushVersion, *, wait: bool, on_done: Any) -> None:
        self.calls.append(f"wait {sent} {wait}")
        on_done()


class RecordingUpdater(WeightUpdaterBase[int]):
    def __init__(self) -> None:
        super().__init__()
        self.sender = RecordingSender()
        self.register_post_hook(lambda: self.sender.calls.append("post hook"))

    def all_worker_ids(self) -> list[int]:
        return [0, 1, 2]

    def _skip_update(self, worker_id: int) -> bool:
        return worker_id == 1

    def _make_sender(self) -> RecordingSender:
        return self.sender

    def _sync_weights_with_worker(self, *, worker_id: int, server_weights: Any, version: PushVersion) -> None:
        raise AssertionError("the sender sends")


def test_one_loop_calls_each_stage_of_the_sender_once_in_order() -> None:
    updater = RecordingUpdater()
    updater.push_weights({"w": torch.zeros(1)})
    assert updater.sender.calls == [
        "before_push", "prepare", "check [0, 1, 2]", "plan [0, 2]", "send [0, 2] v1 the plan", "wait sent True",
        "post hook",
    ]  # fmt: skip
    stats = updater.last_push_stats
    assert stats is not None and stats.num_full == 2 and stats.call_s is not None and updater.version == 1
    updater.sender.calls.clear()
    with pytest.raises(ValueError, match="bad"):  # refused at the check: no version handed out, nothing sent
        updater.push_weights({"bad": torch.zeros(1)}, worker_ids=[2])
    assert updater.sender.calls == ["before_push", "prepare", "check [2]"] and updater.version == 1
    updater.push_weights({"w": torch.zeros(1)})
    assert updater.version == 2  # the refused push's version was not taken


def test_a_custom_updater_with_only_the_spec_hooks_pushes_through_each_worker_sender() -> None:
    class Hooks(WeightUpdaterBase[int]):
        def __init__(self) -> None:
            super().__init__()
            self.sent: list[tuple[int, int]] = []

        def all_worker_ids(self) -> list[int]:
            return [0, 1]

        def _validate(self, weights: Any, worker_ids: list[int]) -> None:
            if "bad" in weights:
                raise ValueError("bad weights")

        def _sync_weights_with_worker(self, *, worker_id: int, server_weights: Any, version: PushVersion) -> None:
            self.sent.append((worker_id, version.index))

    updater = Hooks()
    assert isinstance(updater.push_sender, EachWorkerSender)
    updater.push_weights({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="bad weights"):
        updater.push_weights({"bad": torch.zeros(2)})
    assert updater.sent == [(0, 1), (1, 1)] and updater.version == 1
