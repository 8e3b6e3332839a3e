"""The OpenEnv adapter on real OpenEnv objects (the openenv extra, `make test-envs`): in-process, over its WebSocket client, MCP tools, both collectors with groups."""

from __future__ import annotations

import logging
import pickle

import pytest

from lmcollect.data import keys
from lmcollect.envs import ChatEnv, make_env
from lmcollect.policies import SamplingConfig

pytest.importorskip("openenv")  # the openenv extra, in .venv-envs (`make test-envs`: it cannot share vLLM's venv)

from openenv.core.generic_client import GenericEnvClient  # noqa: E402 - after the extra's check
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation  # noqa: E402
from openenv.core.mcp_client import MCPToolClient  # noqa: E402

from lmcollect.compat.openenv import OpenEnvTask, openenv_env  # noqa: E402
from tests.env_adapters import check_prompts_extend_full_tokens, collect_turns, dialogs_of, groups_of  # noqa: E402
from tests.with_envs.openenv_envs import (  # noqa: E402
    CalculatorMcpEnvironment,
    GuessAction,
    GuessEnvironment,
    GuessObservation,
    bisecting_guesser,
    calculator_player,
    guess_action,
    hint_text,
    served,
)


TOOL_SAMPLING = SamplingConfig(max_new_tokens=96)  # a <tool_call> block is ~70 bytes


def guess_env(**kwargs) -> ChatEnv:
    return openenv_env(GuessEnvironment, action_of=guess_action, text_of=hint_text, max_turns=5, **kwargs)


def check_guess_dialogs(turns: list) -> None:
    assert check_prompts_extend_full_tokens(turns) >= 4
    for dialog in dialogs_of(turns):
        rewards = [float(t[keys.NEXT_REWARD]) for t in dialog]
        assert rewards[:-1] == [0.0] * (len(dialog) - 1) and rewards[-1] in (0.0, 1.0)
    assert any(float(t[keys.NEXT_REWARD]) == 1.0 for t in turns)


def test_in_process_environment_reset_text_is_the_opening_and_hints_the_next_prompts() -> None:
    env = guess_env(batch_size=2, repeats=2, seed=0)
    try:
        td = env.reset()
        assert [m.content for m in td[keys.HISTORY_PROMPT][0].messages] == [
            "Guess my number from 0 to 9. Write only the number."
        ]
        td[keys.HISTORY_FULL] = [p.append("assistant", "4") for p in td[keys.HISTORY_PROMPT]]
        out = env.step(td)
        hints = [p.messages[-1].content for p in out["next", keys.HISTORY_PROMPT]]
        assert hints[0] == hints[1] and hints[0] in ("higher", "lower", "right")  # one group: the same reset seed
    finally:
        env.close()
    assert pickle.loads(pickle.dumps(env.task)).action_of("I say 7").guess == 7


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_in_process_under_both_collectors_with_groups(kind: str) -> None:
    turns = collect_turns(kind, lambda: guess_env(batch_size=4, repeats=2, seed=1), bisecting_guesser, 24)
    check_guess_dialogs(turns)
    assert max(len({int(t[keys.TRAJ_IDS]) for t in g}) for g in groups_of(turns).values()) == 2


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_a_loopback_server_through_its_websocket_client(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    with served(GuessEnvironment, GuessAction, GuessObservation, max_sessions=4) as url:
        with caplog.at_level(logging.WARNING, logger="lmcollect.compat.openenv"):
            make_env(
                f"openenv:{url}",
                client=GenericEnvClient,
                action_of=lambda t: {"guess": guess_action(t).guess},
                text_of=lambda o: o["hint"] if isinstance(o, dict) else o.hint,
                batch_size=8,
                max_sessions=4,
            ).close()
        assert "the server allows 4 sessions but this env keeps 8 dialogs in flight" in caplog.text
        crowded = make_env(f"openenv:{url}", client=GenericEnvClient, action_of=guess_action, batch_size=5)
        with pytest.raises(RuntimeError, match="refused another session.*raise the server's max_concurrent_envs"):
            crowded.reset()
        crowded.close()

        def make() -> ChatEnv:
            return make_env(
                f"openenv:{url}",
                client=GenericEnvClient,
                action_of=lambda t: {"guess": guess_action(t).guess},
                text_of=lambda o: o["hint"],
                batch_size=4,
                repeats=2,
                max_turns=5,
                max_sessions=4,
                seed=1,
            )

        check_guess_dialogs(collect_turns(kind, make, bisecting_guesser, 24))


def check_tool_dialogs(turns: list) -> None:
    assert check_prompts_extend_full_tokens(turns) >= 2
    for dialog in dialogs_of(turns):
        assert [float(t[keys.NEXT_REWARD]) for t in dialog] == [0.0, 1.0]
        prompt = dialog[-1][keys.HISTORY_PROMPT]
        assert [m.role for m in prompt.messages] == ["user", "assistant", "tool"] and prompt.messages[
            -1
        ].content == "42"
        assert {tool["function"]["name"] for tool in prompt.tools} == {"add", "submit"}  # offered to the model


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_mcp_tools_are_offered_and_the_models_tool_calls_reach_them(kind: str) -> None:
    def make() -> ChatEnv:
        return openenv_env(
            CalculatorMcpEnvironment, tools=True, text_of=hint_text, batch_size=2, repeats=2, max_turns=3
        )

    check_tool_dialogs(collect_turns(kind, make, calculator_player, 8, TOOL_SAMPLING))


def test_mcp_tools_over_the_server() -> None:
    with served(
        CalculatorMcpEnvironment, CallToolAction, CallToolObservation, max_sessions=4
    ) as url:  # as OpenEnv serves MCP envs

        def make() -> ChatEnv:
            return make_env(
                f"openenv:{url}",
                client=MCPToolClient,
                tools=True,
                text_of=lambda o: o.hint,
                batch_size=2,
                repeats=2,
                max_turns=3,
            )

        check_tool_dialogs(collect_turns("continuous", make, calculator_player, 8, TOOL_SAMPLING))


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match="pass action_of="):
        OpenEnvTask(GuessEnvironment)
    with pytest.raises(ValueError, match="pass client=MyEnvClient"):
        make_env("openenv:127.0.0.1:9")
    env = openenv_env(lambda: object(), action_of=guess_action)
    with pytest.raises(RuntimeError, match="must return an openenv Environment or an EnvClient"):
        env.reset()
    env.close()
