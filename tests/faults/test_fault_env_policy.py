"""Broken envs and policies: an error naming the env index / key, and no turn collected before it lost.

Each case runs two steps of two guessing games (4 turns waiting in the collector for a batch of
6), then the env or policy breaks on the third step. The error must reach the caller; the 4
turns must still come out in the next batch, with their trajectory ids and step counts intact.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from benchmarks.soak import account_turns
from lmcollect import LLMCollector
from lmcollect.ray import RayReplayBuffer
from lmcollect.ray.collector import RayLLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs.chat_env import RewardError
from tests.faults.fault_factories import NEVER, GuessingEnv, GuessingPolicy, InjectedFault

BATCH = 6  # 3 steps of 2 envs: the fault on step 3 finds 4 turns waiting
TURNS_BEFORE = 4

@dataclass(frozen=True)
class Case:
    make_env: Callable[[], Any]
    make_policy: Callable[[], Any]
    error: type[Exception]
    message: str
    """What the error must say (a regex)."""
    names: str
    """What the error names, for the fault table."""
    env_advanced: bool = False
    """The env took the step it reported badly, so its dialogs cannot go on: reset() first."""


CASES = {
    "env raises": Case(lambda: GuessingEnv("raise", 3), GuessingPolicy, InjectedFault, r"env step 3 failed",
                       "the env's own error, unchanged (it names no env index)"),
    "env task raises": Case(lambda: GuessingEnv("task_raises", 3), GuessingPolicy, RewardError,
                            r"failed on env element 0 with InjectedFault", "RewardError naming env element 0 and its dialog"),
    "env step without done": Case(lambda: GuessingEnv("no_done", 3), GuessingPolicy, ValueError,
                                  r"returned no \('next', 'done'\) at env index 0\.\.1",
                                  "ValueError naming env indices 0..1 and ('next', 'done')", env_advanced=True),
    "env step without reward": Case(lambda: GuessingEnv("no_reward", 3), GuessingPolicy, ValueError,
                                    r"returned no \('next', 'reward'\) at env index 0\.\.1",
                                    "ValueError naming env indices 0..1 and ('next', 'reward')", env_advanced=True),
    "policy raises": Case(GuessingEnv, lambda: GuessingPolicy("raise", 3), InjectedFault, r"policy call 3 failed",
                          "the policy's own error, unchanged (it names no env index)"),
    "policy log-probs shorter than tokens": Case(
        GuessingEnv, lambda: GuessingPolicy("short_log_probs", 3), ValueError,
        r"\('log_probs', 'response'\) for \d+ \('tokens', 'response'\) at env index 1",
        "ValueError naming env index 1 and both keys",
    ),
}


def ids(batch) -> list[tuple[int, int]]:
    return [(int(t[keys.TRAJ_IDS]), int(t[keys.STEP_COUNT])) for t in flatten_turns(batch)]


@pytest.mark.fault_timeout(30)
@pytest.mark.parametrize("name", list(CASES))
def test_local_collector_names_the_fault_and_keeps_earlier_turns(name: str, fault_table) -> None:
    case = CASES[name]
    collector = LLMCollector(case.make_env(), policy=case.make_policy(), dialog_turns_per_batch=BATCH)
    started = time.monotonic()
    with pytest.raises(case.error, match=case.message):
        collector.next()
    time_to_error = time.monotonic() - started
    assert collector.turns_run == collector.num_buffered_turns == TURNS_BEFORE
    if case.env_advanced:
        collector.reset()
    after = flatten_turns(collector.next())
    steps_before = [int(t[keys.STEP_COUNT]) for t in after[0:2] + after[3:5]]  # (slot, step) order: 3 steps a slot
    assert steps_before == [0, 1, 0, 1], "the turns collected before the fault were lost"
    accounting = account_turns(after + flatten_turns(collector.next()))
    collector.shutdown()
    assert accounting["duplicated"] == accounting["lost"] == 0, accounting
    recovery = "reset(), then collection goes on" if case.env_advanced else "the next call collects on"
    fault_table.add(name, f"{name} on step 3 (local LLMCollector, 4 turns waiting)", f"{case.names}; {recovery}",
                    time_to_error, accounting["lost"])


@pytest.mark.integration
@pytest.mark.fault_timeout(90)
def test_ray_collector_in_the_background_surfaces_the_fault_and_writes_every_earlier_turn(ray_cluster, fault_table) -> None:
    """start() in the actor: the fault stops the collection thread; is_running() raises it, the
    buffer keeps every batch written, and start() again writes the turns that were waiting."""
    buffer = RayReplayBuffer(capacity=1000)
    collector = RayLLMCollector(
        GuessingEnv,
        policy_factory=functools.partial(GuessingPolicy, "short_log_probs", 8),
        dialog_turns_per_batch=BATCH,
        replay_buffer=buffer,
        num_cpus=0.25,
        call_timeout_s=120,  # a loaded CI machine answers slowly; a hang still ends the case
    )
    try:
        collector.start()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"background collection failed: ValueError.*at env index 1"):
            while collector.is_running():
                time.sleep(0.05)
        time_to_error = time.monotonic() - started
        assert buffer.write_count == 12 and collector.turns_run == 14  # 2 batches written, 2 turns waiting
        collector.start()  # the fault was one bad call: collection goes on with the waiting turns
        while buffer.write_count < 24:
            assert collector.is_running()
            time.sleep(0.05)
        with collector.pause():  # the collector keeps writing: read the whole buffer in one call while it cannot
            accounting = account_turns(buffer.state_dict()["storage"])
    finally:
        collector.shutdown()
        buffer.shutdown()
    assert accounting["duplicated"] == 0 and accounting["lost"] == 0, accounting
    fault_table.add(
        "policy log-probs shorter than tokens (Ray, background)",
        "bad policy output on call 8 in a RayLLMCollector actor collecting into a RayReplayBuffer",
        "is_running() raises the ValueError naming env index 1; start() again resumes",
        time_to_error,
        accounting["lost"],
    )


def test_faulty_env_and_policy_work_when_no_fault_is_due() -> None:
    collector = LLMCollector(GuessingEnv("raise", NEVER), policy=GuessingPolicy("raise", NEVER), dialog_turns_per_batch=BATCH)
    assert len(ids(collector.next())) == BATCH
    collector.shutdown()
