"""Weight pushes that arrive late, relabel, or overflow on conversion; replay-buffer states that lie; outputs cut short.

Part of the security suite (issue "Closed by default"): each test feeds one attack or accident and
asserts the refusal and that nothing changed.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from lmcollect.buffers.replay_buffer import ReplayBuffer
from lmcollect.cli.rollouts import write_records
from lmcollect.collectors import LLMCollector
from lmcollect.collectors.lockstep.rwlock import LockTimeoutError
from lmcollect.files import write_text_atomically
from lmcollect.weight_sync.local import LocalWeightUpdater
from lmcollect.weights.version import PushVersion
from tests.factories import HungActor, SmallModelPolicy, make_arithmetic_env, make_engine_that_hangs_on_pause, run_in_thread

WAIT_S = 20.0


def _collector(policy: SmallModelPolicy | None = None) -> LLMCollector:
    return LLMCollector(
        make_arithmetic_env(), policy=policy or SmallModelPolicy(), dialog_turns_per_batch=1, track_policy_version=True
    )


def _weights(value: float, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, value, dtype=dtype) for name, t in SmallModelPolicy().model.state_dict().items()}


def _held(collector: LLMCollector) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in collector.policy.model.state_dict().items()}


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.01)


# ---------------------------------------------------------------------- out-of-order pushes
def test_a_late_push_lands_after_a_newer_one_is_refused_and_the_newer_weights_keep_their_label() -> None:
    collector = _collector()
    turn_under_way = collector._policy_lock.read()  # a policy call under way: loads wait for it
    turn_under_way.__enter__()
    try:
        newer = run_in_thread(lambda: collector.receive_weights(_weights(2.0), version=PushVersion(2)))
        _wait_for(lambda: collector._policy_lock.num_writers_waiting == 1, "push 2 to wait for the turn")
        late = run_in_thread(lambda: collector.receive_weights(_weights(1.0), version=PushVersion(1)))
        time.sleep(0.2)  # let the late push reach the locks (before the fix it queued for the write lock)
    finally:
        turn_under_way.__exit__(None, None, None)
    newer()
    with pytest.raises(ValueError, match="pushed version 1 is older than this collector's version 2"):
        late()
    assert collector.policy_version == 2
    assert all(torch.all(t == 2.0) for t in collector.policy.model.state_dict().values())


def test_a_second_push_under_the_same_index_is_refused_and_the_same_push_again_is_taken() -> None:
    collector = _collector()
    first = PushVersion(3, "first-push")
    collector.receive_weights(_weights(1.0), version=first)
    before = _held(collector)
    with pytest.raises(ValueError, match="already holds version 3 of another push"):
        collector.receive_weights(_weights(9.0), version=PushVersion(3, "forged"))
    assert all(torch.equal(before[k], v) for k, v in _held(collector).items())
    collector.receive_weights(_weights(1.0), version=first)  # a retry of the same push is idempotent
    assert collector.policy_version == 3


def test_a_push_finite_in_fp32_but_infinite_in_the_models_fp16_is_refused_with_nothing_loaded() -> None:
    policy = SmallModelPolicy()
    policy.model.half()
    collector = _collector(policy)
    updater = LocalWeightUpdater(convert_dtype=True)
    collector.weight_updater = updater
    before = _held(collector)
    weights = _weights(0.5)
    weights["norm.weight"][0] = 1e5  # fp16 holds at most 65504: the cast makes it inf
    with pytest.raises(ValueError, match=r"'norm.weight' holds NaN or infinite values once cast to torch.float16"):
        updater.push_weights(weights)
    assert all(torch.equal(before[k], v) for k, v in _held(collector).items())
    assert collector.policy_version == 0
    updater.push_weights(_weights(0.5))  # in range: converted and loaded
    assert collector.policy.model.norm.weight.dtype == torch.float16 and collector.policy_version == 1


def test_a_weight_load_that_cannot_get_the_lock_gives_up_naming_the_knob() -> None:
    collector = _collector()
    collector.weight_lock_timeout_s = 0.3
    before = _held(collector)
    with collector._policy_lock.read():  # a turn that never ends
        with pytest.raises(LockTimeoutError, match="collector.weight_lock_timeout_s=0.3"):
            collector.receive_weights(_weights(4.0), version=PushVersion(1))
    assert all(torch.equal(before[k], v) for k, v in _held(collector).items())
    assert collector.policy_version == 0
    collector.receive_weights(_weights(4.0), version=PushVersion(1))  # the lock is usable again
    assert collector.policy_version == 1


# ---------------------------------------------------------------------- replay-buffer states
def _filled_buffer() -> ReplayBuffer:
    """Three turns in a buffer of four (not full: the next write goes to index 3)."""
    buffer = ReplayBuffer(capacity=4, seed=0)
    batch = next(iter(LLMCollector(make_arithmetic_env(), policy=SmallModelPolicy(), dialog_turns_per_batch=4)))
    buffer.extend(batch.reshape(-1)[:3])
    assert (len(buffer), buffer.state_dict()["cursor"]) == (3, 3)
    return buffer


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("cursor", 9, "cursor=9 is outside 0..3"),
        ("cursor", -1, "cursor=-1 is outside"),
        ("cursor", 1, "a buffer not yet full writes next at 3"),
        ("write_count", 1, "write_count=1 is below the 3 turns stored"),
        ("storage", ["not a turn"] * 3, "something other than one-turn TensorDicts"),
        ("storage", None, "over the capacity 4"),
    ],
)
def test_a_replay_buffer_state_with_out_of_range_fields_is_refused_and_the_buffer_unchanged(field, value, message) -> None:
    source, target = _filled_buffer(), _filled_buffer()
    state = source.state_dict()
    state[field] = value if value is not None else state["storage"] * 2
    before = target.state_dict()
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    after = target.state_dict()
    assert (after["cursor"], after["write_count"], len(after["storage"])) == (before["cursor"], before["write_count"], len(before["storage"]))
    assert all(a is b for a, b in zip(after["storage"], before["storage"]))


# ---------------------------------------------------------------------- outputs written whole or not at all
def test_a_crash_while_writing_rollouts_leaves_the_earlier_file_whole(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "rollouts.jsonl"
    write_records([{"turn": 1}, {"turn": 2}], path)
    calls = {"n": 0}
    real_dumps = json.dumps

    def dumps_then_crash(record, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # killed midway through the new file
        return real_dumps(record, *args, **kwargs)

    monkeypatch.setattr("lmcollect.cli.rollouts.json.dumps", dumps_then_crash)
    with pytest.raises(KeyboardInterrupt):
        write_records([{"turn": 3}, {"turn": 4}, {"turn": 5}], path)
    monkeypatch.undo()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"turn": 1}, {"turn": 2}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollouts.jsonl"]  # no temporary file left behind


def test_a_failed_html_write_leaves_the_earlier_page(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    write_text_atomically(page, "<html>old</html>")

    with pytest.raises(UnicodeError):  # the encoder fails midway through the new page
        write_text_atomically(page, "<html>new " + "x" * 100_000 + "\ud800</html>")
    assert page.read_text() == "<html>old</html>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


# ---------------------------------------------------------------------- a hung actor (every Ray surface)
def test_a_hung_replay_buffer_actor_raises_naming_call_timeout_s(ray_cluster) -> None:
    from lmcollect.ray.buffer import RayReplayBuffer
    from lmcollect.ray.bounded import CallTimeoutError

    actor = ray_cluster.remote(num_cpus=0.05, max_concurrency=4)(HungActor).remote()
    try:
        buffer = RayReplayBuffer._from_actor(actor, capacity=4, call_timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(CallTimeoutError, match=r"RayReplayBuffer.sample got no answer within call_timeout_s=0.5"):
            buffer.sample(2)
        assert time.monotonic() - started < WAIT_S
    finally:
        ray_cluster.kill(actor)


def test_a_hung_engine_actor_raises_naming_call_timeout_s(ray_cluster) -> None:
    from lmcollect.ray.bounded import CallTimeoutError
    from lmcollect.ray.engine import RayEngine

    engine = RayEngine(make_engine_that_hangs_on_pause, remote_config={"num_cpus": 0.05}, call_timeout_s=0.5)
    try:
        with pytest.raises(CallTimeoutError, match=r"RayEngine.pause got no answer within call_timeout_s=0.5"):
            engine.pause()
    finally:
        ray_cluster.kill(engine.actor)


def test_a_hung_weight_mailbox_raises_naming_its_knob(ray_cluster) -> None:
    from lmcollect.ray.bounded import CallTimeoutError
    from lmcollect.ray.object_store import RayObjectStoreReceiver

    mailbox = ray_cluster.remote(num_cpus=0.05, max_concurrency=2)(HungActor).remote()
    try:
        receiver = RayObjectStoreReceiver(mailbox, call_timeout_s=0.5)
        with pytest.raises(CallTimeoutError, match=r"RayObjectStoreReceiver.receive \(latest\) got no answer within make_receiver\(call_timeout_s=...\)=0.5"):
            receiver.receive()
    finally:
        ray_cluster.kill(mailbox)
