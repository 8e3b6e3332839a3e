"""Delta pushes into a vLLM engine (the session's in-process CPU engine, tiny model) over gloo:
five real AdamW steps of a bf16 trainer, then a corrupted delta repaired by a full push.

Run with a Python that has vLLM: ``python -m pytest tests/integration/test_delta_sync_vllm.py``.
The engine gets its original weights back at the end.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDictBase

from lmcollect.collectors.lockstep.collector import LLMCollector
from lmcollect.data import keys
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import TransformersPolicy
from tests.factories import CorruptsNextDelta, corrupted_encoding, perturbed_model
from tests.integration.conftest import MAX_NEW_TOKENS, QUESTIONS, chat_batch

pytest.importorskip("vllm")
from lmcollect.weight_sync.group_sender import ProcessGroupPushSender  # noqa: E402
from lmcollect.weight_sync.vllm_updater import vLLMUpdater  # noqa: E402
from lmcollect.weight_sync import PushConfig  # noqa: E402

pytestmark = pytest.mark.integration

ATOL = 1e-4
LR = 1e-5  # bf16: about a fifth of the elements change per AdamW step


class CorruptingSender(ProcessGroupPushSender):
    """Flips one bit of the next delta on its way to the workers (the trainer's base stays right)."""

    corrupt_next = False

    def plan(self, payload: Any, targets: list) -> Any:
        prepared = super().plan(payload, targets)
        if self.corrupt_next and prepared is not None and prepared.encoded is not None:
            self.corrupt_next = False
            prepared.encoded = corrupted_encoding(prepared.encoded)
        return prepared


class CorruptingUpdater(CorruptsNextDelta, vLLMUpdater):
    sender_class = CorruptingSender


def adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def fp32_reference(trainer: torch.nn.Module, model_dir: Path) -> TransformersPolicy:
    """A fresh fp32 model holding the bf16 trainer's weights (exact: bf16 values are fp32 values)."""
    model, tokenizer = load_model_and_tokenizer(model_dir)
    model.load_state_dict(trainer.state_dict())
    return TransformersPolicy(model, tokenizer, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS)


def assert_same_answers(got: TensorDictBase, want: TensorDictBase) -> None:
    for i in range(want.batch_size[0]):
        assert torch.equal(got[i][keys.TOKENS_FULL], want[i][keys.TOKENS_FULL]), f"element {i}"
        torch.testing.assert_close(got[i][keys.LOG_PROBS_RESPONSE], want[i][keys.LOG_PROBS_RESPONSE], atol=ATOL, rtol=0)


def test_delta_pushes_answer_like_a_fresh_model_and_a_corrupted_delta_is_repaired(greedy_policy: Any, model_dir: Path) -> None:
    trainer = perturbed_model(model_dir, seed=4).to(torch.bfloat16)
    updater = CorruptingUpdater(config=PushConfig(delta=True, convert_dtype=True, verify=True, timeout_s=60))
    env = ChatEnv(arithmetic_dataset(16, seed=0), reward_fn=MathAnswerReward(), batch_size=4, seed=0)
    collector = LLMCollector(env, policy=greedy_policy, dialog_turns_per_batch=4, weight_updater=updater, track_policy_version=True)
    v0 = collector.policy_version  # counts on from the session engine's version (earlier tests pushed into it)
    td = chat_batch(QUESTIONS)
    try:
        collector.update_policy_weights_(trainer)  # the engine holds the checkpoint: the full weights
        assert updater.last_push_stats.kind == "full"
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR)
        for step in range(5):
            adamw_step(trainer, optimizer, seed=step)
            collector.update_policy_weights_(trainer)  # verify=True: the patched copies' CRC32s agree
            stats, (info,) = updater.last_push_stats, updater.last_push_info
            assert (stats.kind, stats.num_full, info["push"]["kind"], info["push"]["refused"]) == ("delta", 0, "delta", None)
            assert 0 < stats.num_changed < stats.numel and stats.nbytes < 0.5 * stats.full_nbytes
        assert collector.policy_version == v0 + 6
        assert_same_answers(greedy_policy(td), fp32_reference(trainer, model_dir)(td))

        adamw_step(trainer, optimizer, seed=10)
        updater.corrupt_next = True
        collector.update_policy_weights_(trainer)
        stats, (info,) = updater.last_push_stats, updater.last_push_info
        assert (stats.kind, stats.num_repaired, info["push"]["kind"]) == ("full", 1, "full")
        assert "checksum" in info["push"]["after_refused_delta"]["refused"]
        assert collector.policy_version == v0 + 7  # one push, one version, though two transfers
        assert_same_answers(greedy_policy(td), fp32_reference(trainer, model_dir)(td))
        batch = collector.next().reshape(-1)
        assert batch[keys.POLICY_VERSION].tolist() == [v0 + 7] * batch.numel()
    finally:
        collector.shutdown()
        updater.close()
        vLLMUpdater.from_policy(greedy_policy).push_weights(load_model_and_tokenizer(model_dir)[0])


def test_process_group_delta_pushes_into_a_continuous_collector(greedy_policy: Any, model_dir: Path) -> None:
    from lmcollect.collectors import ContinuousLLMCollector
    from lmcollect.data.turns import flatten_turns
    from lmcollect.engines.sampling import SamplingConfig

    trainer = perturbed_model(model_dir, seed=8).to(torch.bfloat16)
    updater = vLLMUpdater(config=PushConfig(delta=True, convert_dtype=True, verify=True, timeout_s=60))
    env = ChatEnv(arithmetic_dataset(16, seed=0), reward_fn=MathAnswerReward(), batch_size=1, seed=0)
    collector = ContinuousLLMCollector(
        [env], engine=greedy_policy.engine, tokenizer=greedy_policy.tokenizer, dialog_turns_per_batch=2,
        sampling=SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS), weight_updater=updater,
        track_policy_version=True,
    )
    try:
        collector.update_policy_weights_(trainer)  # the workers' base: the full weights
        assert updater.last_push_stats.kind == "full"
        collector.next()
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR)
        adamw_step(trainer, optimizer, seed=0)
        collector.update_policy_weights_(trainer)  # between two decoding steps; verify=True: CRC32s agree
        stats = updater.last_push_stats
        assert (stats.kind, stats.num_full) == ("delta", 0) and 0 < stats.num_changed < stats.numel
        turns = [t for _ in range(3) for t in flatten_turns(collector.next())]  # the first ones ran ahead
        delta_version = collector.version_index()  # the restoring push below reads into the engine's counter too
    finally:
        collector.shutdown()
        updater.close()
        vLLMUpdater.from_policy(greedy_policy).push_weights(load_model_and_tokenizer(model_dir)[0])
    reference = fp32_reference(trainer, model_dir)
    pushed = [t for t in turns if int(t.get(keys.TOKEN_VERSIONS).min()) == delta_version]
    assert pushed, "no turn ran wholly under the delta's weights"
    for turn in pushed:  # every token of it from the patched weights: log-probs of a forward pass of the trainer's
        full, num_prompt = turn.get(keys.TOKENS_FULL), turn.get(keys.TOKENS_PROMPT).numel()
        with torch.no_grad():
            logits = reference.model(full.unsqueeze(0)).logits[0].float()
        want = torch.log_softmax(logits, -1)[num_prompt - 1 : -1].gather(1, full[num_prompt:, None])[:, 0]
        torch.testing.assert_close(turn.get(keys.LOG_PROBS_RESPONSE), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("link_gbit", "kinds"),
    [(0.1, ["full", "delta", "delta"]),  # a slow link: the delta pays
     (1000.0, ["full", "full", "full"])],  # a fast one: the engine reloads everything anyway, and comparing costs more
)  # fmt: skip
def test_auto_delta_chooses_by_the_link_rate_and_the_vllm_cost_model(
    greedy_policy: Any, model_dir: Path, link_gbit: float, kinds: list[str]
) -> None:
    trainer = perturbed_model(model_dir, seed=9).to(torch.bfloat16)
    updater = vLLMUpdater(config=PushConfig(delta="auto", link_gbit=link_gbit, convert_dtype=True, verify=True, timeout_s=60))
    env = ChatEnv(arithmetic_dataset(4, seed=0), reward_fn=MathAnswerReward(), batch_size=1, seed=0)
    collector = LLMCollector(
        env, policy=greedy_policy, dialog_turns_per_batch=1, weight_updater=updater, track_policy_version=True
    )  # versions count on from the session engine's
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR)
    pushed = []
    try:
        for step in range(3):
            collector.update_policy_weights_(trainer)  # verify=True: the workers hold what was sent
            pushed.append(updater.last_push_stats.kind)
            adamw_step(trainer, optimizer, seed=step)
        assert pushed == kinds and updater.uses_delta is (link_gbit < 1)  # no copy of the weights kept when full
    finally:
        collector.shutdown()
        updater.close()
        vLLMUpdater.from_policy(greedy_policy).push_weights(load_model_and_tokenizer(model_dir)[0])


def test_auto_delta_options_are_checked() -> None:
    with pytest.raises(ValueError, match="link_gbit must be positive"):
        vLLMUpdater(config=PushConfig(delta="auto", link_gbit=0))
    with pytest.raises(ValueError, match="set delta='auto'"):
        vLLMUpdater(config=PushConfig(delta=True, link_gbit=10))
