"""The OpenEnv and verifiers adapters in the Ray collectors (RayLLMCollector, RayContinuousLLMCollector) with GRPO groups.

The env is built inside the collector's actor from a picklable factory (a ``functools.partial`` of the
adapter's builder over envs importable by name), and so are the scripted policy or engine; each turn's
prompt tokens must start with the previous turn's full tokens, and every group arrives whole.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest

from lmcollect.data import keys
from lmcollect.envs import make_env
from lmcollect.policies import SamplingConfig

pytestmark = pytest.mark.integration
pytest.importorskip("openenv")  # the extras, in .venv-envs (`make test-envs`: they cannot share vLLM's venv)
pytest.importorskip("verifiers")

from lmcollect.compat.openenv import openenv_env  # noqa: E402 - after the extras' check
from tests.env_adapters import check_prompts_extend_full_tokens, check_whole_groups, collect_turns_in_ray  # noqa: E402
from tests.with_envs.openenv_envs import (  # noqa: E402
    CalculatorMcpEnvironment,
    GuessEnvironment,
    bisecting_guesser,
    calculator_player,
    guess_action,
    hint_text,
)
from tests.with_envs.vf_envs import bisecting_player  # noqa: E402

SAMPLING = SamplingConfig(max_new_tokens=48)
TOOL_SAMPLING = SamplingConfig(max_new_tokens=96)  # a <tool_call> block is ~70 bytes
VF_ENV = "verifiers:tests.with_envs.vf_envs"  # verifiers' load_environment imports this module (in the actor too)

# (env factory, player, turns per batch, dialogs in flight, sampling): each env has batch_size == dialogs in flight
CASES = {
    "openenv": (
        partial(openenv_env, GuessEnvironment, action_of=guess_action, text_of=hint_text, max_turns=5,
                batch_size=4, repeats=2, seed=1),
        bisecting_guesser, 16, 4, SAMPLING,
    ),
    "openenv-mcp-tools": (
        partial(openenv_env, CalculatorMcpEnvironment, tools=True, text_of=hint_text, batch_size=2, repeats=2,
                max_turns=3),
        calculator_player, 8, 2, TOOL_SAMPLING,
    ),
    "verifiers-multi-turn": (
        partial(make_env, VF_ENV, env_args={"kind": "guess"}, batch_size=4, repeats=2, seed=0),
        bisecting_player, 16, 4, SAMPLING,
    ),
}


@pytest.mark.parametrize(
    "case, kinds",
    [  # each collector starts an actor (~6-9 s: it imports openenv or verifiers); MCP tools go under one collector only
        ("openenv", ("lockstep", "continuous")),
        ("openenv-mcp-tools", ("continuous",)),
        ("verifiers-multi-turn", ("lockstep", "continuous")),  # continuous: built on the actor's worker thread
    ],
    ids=["openenv-both", "openenv-mcp-tools-continuous", "verifiers-both"],
)
def test_the_env_built_in_the_actor_keeps_turns_token_exact_and_groups_whole(
    ray_cluster, case: str, kinds: tuple[str, ...]
) -> None:
    make, player, num_turns, in_flight, sampling = CASES[case]
    with ThreadPoolExecutor(len(kinds)) as pool:  # the actors start side by side (their start-up is most of the time)
        runs = {
            kind: pool.submit(collect_turns_in_ray, kind, make, player, num_turns, sampling, dialogs_in_flight=in_flight)
            for kind in kinds
        }
        collected = {kind: run.result(timeout=300) for kind, run in runs.items()}
    for kind, turns in collected.items():
        assert len(turns) >= num_turns, kind
        assert check_prompts_extend_full_tokens(turns) >= 2, kind
        assert max(float(t[keys.NEXT_REWARD]) for t in turns) == 1.0, kind
        assert check_whole_groups(turns, 2) >= 1, kind
