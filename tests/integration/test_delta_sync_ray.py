"""Delta pushes into RayLLMCollector actors (bf16 tiny model): real AdamW steps, a corrupted delta,
workers behind the base, and a restarted worker, each ending with the trainer's exact weights."""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lmcollect.ray.collector import CollectorActorError, RayLLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from lmcollect.ray.object_store import ObjectStorePushSender
from lmcollect.ray.updater import RayRemoteWeightUpdater
from lmcollect.weight_sync import PushConfig
from tests.factories import CorruptsNextDelta, corrupted_encoding, make_arithmetic_env, perturbed_model

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 6
LR = 1e-5  # bf16: about a fifth of the elements change per AdamW step


def make_bf16_policy(model_path: str) -> TransformersPolicy:
    model, tokenizer = load_model_and_tokenizer(model_path)
    return TransformersPolicy(model.to(torch.bfloat16), tokenizer, max_new_tokens=MAX_NEW_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def collectors(ray_cluster, tiny_model_path: Path):
    """Two bf16 collectors; the second comes back after a crash (max_restarts=1)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # pytest imports this file by its bare name
    out: list = [None, None]

    def build(i: int) -> None:
        out[i] = RayLLMCollector(
            make_arithmetic_env,
            policy_factory=functools.partial(make_bf16_policy, str(tiny_model_path)),
            dialog_turns_per_batch=4,
            track_policy_version=True,
            remote_config={"num_cpus": 0.25, "max_restarts": i},
        )

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c is not None for c in out), "a collector failed to start (see the log)"
    yield out
    for c in out:
        c.shutdown()


@pytest.fixture(scope="module")
def trainer(tiny_model_path: Path) -> torch.nn.Module:
    return perturbed_model(tiny_model_path, seed=3).to(torch.bfloat16)


def adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def assert_holds(collector: RayLLMCollector, model: torch.nn.Module) -> None:
    got, want = collector.cascade_execute("policy.model.state_dict"), model.state_dict()
    assert got.keys() == want.keys()
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{collector!r} differs from the trainer in {bad[:3]}"


class CorruptingSender(ObjectStorePushSender):
    """Flips one bit of the next delta on its way to the workers (the driver's base stays right)."""

    corrupt_next = False

    def _plan_delta(self, weights, targets):
        plan = super()._plan_delta(weights, targets)
        if self.corrupt_next and plan.encoded is not None:
            self.corrupt_next = False
            plan.encoded = corrupted_encoding(plan.encoded)
        return plan


class CorruptingUpdater(CorruptsNextDelta, RayRemoteWeightUpdater):
    sender_class = CorruptingSender


@pytest.fixture(scope="module")
def updater(collectors, trainer) -> CorruptingUpdater:
    return CorruptingUpdater(trainer, collectors, config=PushConfig(delta=True, timeout_s=60))


def test_five_delta_pushes_after_adamw_steps_answer_like_a_fresh_model(collectors, trainer, updater, tiny_model_path) -> None:
    updater.push_weights()  # nothing to start from: the full weights
    assert updater.last_push_stats.kind == "full" and updater.last_push_stats.num_full == 2
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR)
    for step in range(5):
        adamw_step(trainer, optimizer, seed=step)
        handle = updater.push_weights(wait=step % 2 == 1)  # with and without waiting
        if handle is not None:
            handle.wait()
        stats = updater.last_push_stats
        assert (stats.kind, stats.num_full, stats.num_repaired) == ("delta", 0, 0)
        assert 0 < stats.num_changed < stats.numel and stats.nbytes < 0.5 * stats.full_nbytes
    assert [c.policy_version for c in collectors] == [updater.version] * 2
    fresh, tokenizer = load_model_and_tokenizer(tiny_model_path)
    fresh = fresh.to(torch.bfloat16)
    fresh.load_state_dict(trainer.state_dict())
    reference = TransformersPolicy(fresh, tokenizer, max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the actors: the same bf16 kernels, the same sums
    try:
        for collector in collectors:
            assert_holds(collector, trainer)
            turns = flatten_turns(collector.next())
            assert {int(t[keys.POLICY_VERSION]) for t in turns} == {updater.version}
            _, responses, log_probs = reference.generate([t[keys.TEXT_PROMPT] for t in turns])
            for turn, response, lp in zip(turns, responses, log_probs):
                assert torch.equal(turn[keys.TOKENS_RESPONSE], response)
                torch.testing.assert_close(turn[keys.LOG_PROBS_RESPONSE], lp)
    finally:
        torch.set_num_threads(threads)


def test_a_corrupted_delta_is_refused_and_repaired_by_a_full_push(collectors, trainer, updater) -> None:
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR)
    adamw_step(trainer, optimizer, seed=10)
    updater.corrupt_next = True
    updater.push_weights()
    stats = updater.last_push_stats
    assert (stats.kind, stats.num_repaired, stats.num_full) == ("delta", 2, 2)
    assert [c.policy_version for c in collectors] == [updater.version] * 2
    for collector in collectors:
        assert_holds(collector, trainer)
    adamw_step(trainer, optimizer, seed=11)
    updater.push_weights()  # the repaired workers hold the base again: deltas resume
    assert (updater.last_push_stats.kind, updater.last_push_stats.num_full) == ("delta", 0)


def test_a_worker_left_out_gets_the_full_weights_and_the_other_a_delta(collectors, trainer, updater) -> None:
    with torch.no_grad():
        trainer.model.norm.weight.add_(0.5)
    updater.push_weights(worker_ids=[0])
    assert (updater.last_push_stats.kind, updater.last_push_stats.num_full) == ("delta", 0)
    behind = collectors[1].policy_version
    with torch.no_grad():
        trainer.model.norm.weight.add_(0.5)
    updater.push_weights()
    stats = updater.last_push_stats
    assert (stats.kind, stats.num_full, stats.num_repaired) == ("delta", 1, 0)
    assert behind < collectors[1].policy_version == collectors[0].policy_version == updater.version
    for collector in collectors:
        assert_holds(collector, trainer)


def test_a_restarted_worker_refuses_the_delta_and_gets_the_full_weights(collectors, trainer, updater) -> None:
    phoenix = collectors[1]
    updater.push_weights()  # a base both workers hold, whichever tests ran before in this module
    with torch.no_grad():
        trainer.model.norm.weight.add_(0.5)
    updater.push_weights()
    assert (updater.last_push_stats.kind, updater.last_push_stats.num_full) == ("delta", 0)
    os.kill(phoenix.process_info()["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # the next call finds the actor restarted and restores its last full push
        try:
            restored = phoenix.policy_version
            break
        except CollectorActorError:
            assert time.monotonic() < deadline, "the collector did not come back"
    assert restored < updater.version  # the full push it remembers is older than the deltas since
    with torch.no_grad():
        trainer.model.norm.weight.add_(0.5)
    updater.push_weights()
    stats = updater.last_push_stats
    assert (stats.kind, stats.num_repaired) == ("delta", 1)  # the driver thought it held the base
    assert [c.policy_version for c in collectors] == [updater.version] * 2
    for collector in collectors:
        assert_holds(collector, trainer)


def test_auto_delta_follows_the_link_rate_the_cost_model_is_given(collectors, trainer) -> None:
    """delta="auto": over a slow link the push after the first is a delta; over a fast one, with a
    model under which deltas stop paying at a few Gbit/s, every push is full and no base is kept."""
    from lmcollect.weights.cost_model import PushCostModel

    model = PushCostModel(per_byte_s=0.2e-9, delta_per_full_byte_s=1e-9)  # 5% deltas pay below ~7 Gbit/s
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR)
    for link_gbit, kinds in ((0.1, ["full", "delta"]), (400.0, ["full", "full"])):
        config = PushConfig(delta="auto", link_gbit=link_gbit, cost_model=model, timeout_s=60)
        auto = RayRemoteWeightUpdater(trainer, collectors, config=config)
        seen = []
        for step in range(2):
            adamw_step(trainer, optimizer, seed=20 + step)
            auto.push_weights(version=max(c.policy_version for c in collectors) + 1)
            seen.append(auto.last_push_stats.kind)
        assert seen == kinds and auto.uses_delta == (kinds[-1] == "delta"), (link_gbit, seen)
    for collector in collectors:
        assert_holds(collector, trainer)
