"""Agents over VLLMEngine: the agent tests that matter (token exactness across calls, tool messages and
tools in the prompt, GRPO groups, per-call budgets) on the session's in-process vLLM engine (the tiny
model, see tests/integration/conftest.py), as tests/unit/test_agents*.py check them on TransformersEngine
and the scripted engine. Few dialogs: one collector batch per test. Skipped where vLLM is not installed.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from lmcollect.agents import AgentEnv, AgentServer
from lmcollect.collectors import ContinuousLLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.engines.sampling import SamplingConfig
from tests.unit.test_agent_frameworks import framework_agent
from tests.unit.test_agents import TOOLS, dialogs_of, text
from tests.unit.test_agents_apis import two_calls

pytest.importorskip("vllm")

pytestmark = pytest.mark.integration

SAMPLING = SamplingConfig(max_new_tokens=12, min_new_tokens=2, temperature=1.0)


@pytest.fixture(scope="module")
def server():
    with AgentServer() as shared:
        shared.start()
        yield shared


def tool_agent(ctx, row):
    """Two calls with tools and budgets of their own: the reply echoed as the client returned it, then a
    tool result (for the reply's call, if the model wrote one) before the second call."""
    client = ctx.openai()
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    reply = client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, max_tokens=6)
    message = reply.choices[0].message
    call_id = message.tool_calls[0].id if message.tool_calls else "call_0"
    messages += [message, {"role": "tool", "tool_call_id": call_id, "content": "42"}]
    client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, max_tokens=5)
    return float(len(message.content or "") % 2)  # rewards that differ within a group


def collect_turns(env: AgentEnv, engine: Any, tokenizer: Any, turns: int) -> tuple[list, int]:
    collector = ContinuousLLMCollector([env], engine=engine, tokenizer=tokenizer, sampling=SAMPLING,
                                       dialog_turns_per_batch=turns, track_policy_version=True)
    with collector:
        collected = flatten_turns(collector.next())
        mismatches = collector.num_prefix_mismatches
    env.close()
    return collected, mismatches


def assert_token_exact(pairs: list, tokenizer: Any) -> None:
    for first, second in pairs:
        assert torch.equal(second[keys.TOKENS_PROMPT][: first[keys.TOKENS_FULL].numel()], first[keys.TOKENS_FULL])
        retokenized = tokenizer(text(second, keys.TEXT_PROMPT), add_special_tokens=False)["input_ids"]
        assert bool(second[keys.PREFIX_MISMATCH]) == (retokenized != second[keys.TOKENS_PROMPT].tolist())
        for turn in (first, second):
            assert turn[keys.LOG_PROBS_RESPONSE].numel() == turn[keys.TOKENS_RESPONSE].numel() > 0
            assert set(turn[keys.TOKEN_VERSIONS].tolist()) == {int(turn[keys.POLICY_VERSION])}


def test_agent_calls_with_tools_groups_and_budgets_over_vllm(server, engine, greedy_policy) -> None:
    tokenizer = greedy_policy.tokenizer
    rows = [{"prompt": f"What is {i} + 1?"} for i in range(4)]
    env = AgentEnv(rows, tool_agent, batch_size=4, repeats=2, seed=0, server=server)
    turns, mismatches = collect_turns(env, engine, tokenizer, turns=8)  # groups of 2 two-call runs, whole
    dialogs = dialogs_of(turns)
    assert len(dialogs) >= 4 and all(len(steps) == 2 for steps in dialogs.values()) and env.stats.runs_failed == 0
    assert_token_exact(list(dialogs.values()), tokenizer)
    groups: dict[int, set] = defaultdict(set)
    for first, second in dialogs.values():
        assert int(first[keys.SAMPLING_MAX_NEW_TOKENS]) == 6 and int(second[keys.SAMPLING_MAX_NEW_TOKENS]) == 5
        assert first[keys.TOKENS_RESPONSE].numel() <= 6 and second[keys.TOKENS_RESPONSE].numel() <= 5
        assert "42" in text(second, keys.TEXT_PROMPT)  # the tool message, rendered by the model's template
        assert int(first[keys.GROUP_ID]) == int(second[keys.GROUP_ID])
        groups[int(first[keys.GROUP_ID])].add(int(first[keys.TRAJ_IDS]))
        assert float(first[keys.NEXT_REWARD]) == 0.0  # the run's reward goes on its last turn
    assert len(groups) == len(dialogs) // 2 and all(len(runs) == 2 for runs in groups.values())  # whole groups
    assert {text(t, keys.TEXT_PROMPT).count("What is") for t in turns} == {1}
    assert mismatches == sum(bool(t[keys.PREFIX_MISMATCH]) for t in turns)


@pytest.mark.parametrize("agent", ["responses", "openai-agents-chat"])
def test_streamed_responses_and_a_framework_agent_are_token_exact_over_vllm(
    agent, server, engine, greedy_policy
) -> None:
    """In-process: two Responses calls (the reply's items echoed back), or the OpenAI Agents SDK continuing
    its first run's conversation."""
    tokenizer = greedy_policy.tokenizer
    if agent == "responses":
        program, rows = two_calls("responses"), [{"prompt": f"What is {i} + 1?"} for i in range(2)]
    else:
        program = framework_agent(agent)
        rows = [{"prompt": f"add {i} {i + 2}", "answer": str(2 * i + 2), "then": True} for i in range(2)]
    env = AgentEnv(rows, program, batch_size=2, seed=0, server=server, transport="in_process")
    turns, mismatches = collect_turns(env, engine, tokenizer, turns=4)
    pairs = [steps for steps in dialogs_of(turns).values() if len(steps) == 2]
    assert pairs and env.stats.runs_failed == 0 and env.stats.calls_rewritten == 0
    assert_token_exact(pairs, tokenizer)
    assert mismatches == sum(bool(t[keys.PREFIX_MISMATCH]) for t in turns)
