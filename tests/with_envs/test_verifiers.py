"""The verifiers adapter on real verifiers (v0) environments (the verifiers extra, `make test-envs`): multi-turn and tool rollouts under both collectors with groups."""
from __future__ import annotations

import pickle

import pytest

from lmcollect.agents import AgentEnv
from lmcollect.data import keys
from lmcollect.envs import make_env
from lmcollect.policies import SamplingConfig

pytest.importorskip("verifiers")  # the verifiers extra, in .venv-envs (`make test-envs`: it cannot share vLLM's venv)

from lmcollect.compat.verifiers import VerifiersAgent, verifiers_env  # noqa: E402 - after the extra's check
from tests.env_adapters import check_prompts_extend_full_tokens, collect_turns, dialogs_of, groups_of  # noqa: E402
from tests.with_envs.vf_envs import adding_player, bisecting_player, load_environment  # noqa: E402

ENV_ID = "tests.with_envs.vf_envs"  # verifiers' load_environment imports this module
SAMPLING = SamplingConfig(max_new_tokens=96)  # a <tool_call> block is ~70 bytes


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_a_multi_turn_rollout_is_one_turn_per_model_call_with_groups(kind: str) -> None:
    def make() -> AgentEnv:
        return make_env(f"verifiers:{ENV_ID}", env_args={"kind": "guess"}, batch_size=4, repeats=2, seed=0)

    turns = collect_turns(kind, make, bisecting_player, 16, SAMPLING)
    assert check_prompts_extend_full_tokens(turns) >= 4
    ended = [dialog for dialog in dialogs_of(turns) if bool(dialog[-1][keys.NEXT_DONE])]
    assert len(ended) >= 2
    for dialog in ended:
        assert [float(t[keys.NEXT_REWARD]) for t in dialog] == [0.0] * (len(dialog) - 1) + [1.0]  # the rubric's reward
        hints = [m.content for m in dialog[-1][keys.HISTORY_PROMPT].messages if m.role == "user"][1:]
        assert set(hints) <= {"higher", "lower"}  # the env's own messages
    assert max(len({int(t[keys.TRAJ_IDS]) for t in g}) for g in groups_of(turns).values()) == 2


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_a_tool_env_offers_its_tools_and_runs_the_models_calls(kind: str) -> None:
    def make() -> AgentEnv:
        return verifiers_env(load_environment("tool", 8), batch_size=2, repeats=2, seed=0)

    turns = collect_turns(kind, make, adding_player, 8, SAMPLING)
    assert check_prompts_extend_full_tokens(turns) >= 2
    for dialog in dialogs_of(turns):
        assert [float(t[keys.NEXT_REWARD]) for t in dialog] == [0.0, 1.0]
        prompt = dialog[-1][keys.HISTORY_PROMPT]
        assert [m.role for m in prompt.messages] == ["user", "assistant", "tool"]
        assert [tool["function"]["name"] for tool in prompt.tools] == ["add"]


def test_group_scored_rubrics_and_env_objects_across_processes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"its rubric scores whole groups \(pair_bonus\).*lmcollect's repeats="):
        verifiers_env(load_environment("group", 2))
    with pytest.raises(ValueError, match="its rubric scores whole groups"):
        make_env(f"verifiers:{ENV_ID}", env_args={"kind": "group"})
    agent = VerifiersAgent(env_id=ENV_ID, env_args={"kind": "guess"})
    assert pickle.loads(pickle.dumps(agent)) == agent  # named: loaded where it runs
    with pytest.raises(TypeError, match="name it instead"):
        pickle.dumps(VerifiersAgent(env=load_environment("guess", 2)))


def test_an_env_loads_off_the_main_thread_without_its_signal_handlers() -> None:
    """Regression: verifiers' Environment installs SIGINT/SIGTERM handlers as it is built, which raised
    "signal only works in main thread" where a RayContinuousLLMCollector's actor builds its env (a worker thread)."""
    import signal
    import threading

    import verifiers.legacy.envs.environment as vf_environment

    handler = signal.getsignal(signal.SIGTERM)
    built: list[AgentEnv] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:  # num_rows=3: env args no other test loads (envs are loaded once per process)
            built.append(make_env(f"verifiers:{ENV_ID}", env_args={"kind": "guess", "num_rows": 3}, batch_size=2))
        except BaseException as exc:  # reported on the main thread below
            errors.append(exc)

    thread = threading.Thread(target=build, name="collector-thread")
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "loading the verifiers env did not finish within 60 s"
    assert not errors, f"loading off the main thread failed: {errors[0]!r}"
    assert len(built) == 1 and built[0].agent.env_args == {"kind": "guess", "num_rows": 3}
    assert signal.getsignal(signal.SIGTERM) is handler  # nothing installed
    assert vf_environment.signal is signal  # the module's own signal again
    built[0].close()
