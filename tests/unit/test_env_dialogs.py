"""The core of outside environments in ChatEnv: role-tagged replies, opening prompts, stateful tasks (retry, reset, restore)."""
from __future__ import annotations

import re

import pytest
import torch
from tensordict import TensorDict

from lmcollect.data import History, keys
from lmcollect.data.history import Message
from lmcollect.data.turns import non_tensor_values
from lmcollect.envs import ChatEnv, PromptDataset, RewardError, StatefulTask, TaskReply
from tests.env_adapters import check_prompts_extend_full_tokens, collect_turns, dialogs_of, groups_of

ROWS = [{"prompt": "", "target": n} for n in (2, 3, 4)]


class Counter:
    """An outside environment's session: its step changes it."""

    def __init__(self, target: int) -> None:
        self.target, self.count, self.steps = target, 0, 0


class CountingTask:
    """Count from 1 to the row's target, one number per turn: a stateful task that opens its dialogs
    itself and answers with a tool message and a user message."""

    def __init__(self, fail_once_on: int | None = None) -> None:
        self.ended: list[Counter] = []
        self.num_steps = 0
        self.fail_once_on = fail_once_on

    def start(self, sample, rng) -> Counter:
        return Counter(int(sample["target"]))

    def opening_prompt(self, state: Counter, sample) -> str:
        return f"Count to {state.target}, one number per turn."

    def respond(self, state: Counter, history: History) -> TaskReply:
        if self.fail_once_on == state.target:
            self.fail_once_on = None
            raise ConnectionError("the environment server dropped the request")
        self.num_steps += 1
        state.steps += 1
        said = re.findall(r"-?\d+", history.last("assistant").content)
        if said and int(said[-1]) == state.count + 1:
            state.count += 1
        done = state.count == state.target
        return TaskReply(
            reward=float(done), done=done, messages=[("tool", f"count={state.count}"), ("user", "Next number?")]
        )

    def end(self, state: Counter) -> None:
        self.ended.append(state)


def counting_player(history: History) -> str:
    counts = [int(m.content.removeprefix("count=")) for m in history.messages if m.role == "tool"]
    return str((counts[-1] if counts else 0) + 1)


def counting_env(task: CountingTask | None = None, *, batch_size: int = 3, repeats: int = 1, seed: int = 0) -> ChatEnv:
    return ChatEnv(
        ROWS, task=task or CountingTask(), batch_size=batch_size, repeats=repeats, max_turns=6, seed=seed,
        system_prompt="Be brief.",
    )


def answer(env: ChatEnv, td, replies: list[str] | None = None):
    prompts = list(td[keys.HISTORY_PROMPT])
    replies = replies or [counting_player(p) for p in prompts]
    td[keys.HISTORY_FULL] = [p.append("assistant", r) for p, r in zip(prompts, replies)]
    return td


def test_a_task_reply_appends_its_role_tagged_messages_in_order() -> None:
    env = counting_env(batch_size=1)
    td = env.step(answer(env, env.reset()))
    messages = td["next", *keys.HISTORY_PROMPT][0].messages
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[-2:] == (Message("tool", "count=1"), Message("user", "Next number?"))


def test_a_task_reply_refuses_assistant_messages_and_two_ways_of_saying_the_same() -> None:
    assert TaskReply(reward=0, done=False, env_message="hi").next_messages == (Message("user", "hi"),)
    assert TaskReply(reward=0, done=False, messages=[{"role": "tool", "content": "4"}]).messages == (Message("tool", "4"),)
    with pytest.raises(ValueError, match="assistant turns are the model's own"):
        TaskReply(reward=0, done=False, messages=[("assistant", "I said so")])
    with pytest.raises(ValueError, match="pass messages=.* alone"):
        TaskReply(reward=0, done=False, env_message="a", messages=[("user", "b")])
    with pytest.raises(TypeError, match="list of messages"):
        TaskReply(reward=0, done=False, messages="user: hi")


def test_an_opening_task_writes_the_first_prompt_after_the_system_prompt() -> None:
    env = counting_env()
    firsts = [h.messages for h in env.reset()[keys.HISTORY_PROMPT]]
    targets = [s["target"] for s in env.current_samples]
    assert firsts == [
        (Message("system", "Be brief."), Message("user", f"Count to {t}, one number per turn.")) for t in targets
    ]


def test_a_retried_step_does_not_step_a_stateful_task_twice() -> None:
    """Element 2's environment fails once: the step raises and commits nothing; the retry gets the
    recorded replies of the elements already stepped, so each environment took each turn once."""
    task = CountingTask(fail_once_on=4)
    env = ChatEnv(PromptDataset([ROWS[0], ROWS[2]], shuffle=False), task=task, batch_size=2, seed=0, max_turns=6)
    assert isinstance(task, StatefulTask)
    td = answer(env, env.reset())
    with pytest.raises(RewardError, match="ConnectionError"):
        env.step(td)
    assert task.num_steps == 1  # the other element was stepped before the failure
    out = env.step(td)
    assert task.num_steps == 2  # the retry stepped only the element that failed
    assert [h.messages[-2].content for h in out["next", *keys.HISTORY_PROMPT]] == ["count=1", "count=1"]


def test_a_different_reply_for_a_turn_already_stepped_is_refused() -> None:
    env = ChatEnv(PromptDataset([ROWS[0], ROWS[2]], shuffle=False), task=CountingTask(fail_once_on=4), batch_size=2)
    td = answer(env, env.reset())
    with pytest.raises(RewardError):
        env.step(td)
    with pytest.raises(RewardError, match="cannot be taken back: reset element"):
        env.step(answer(env, env.reset(TensorDict({keys.RESET: torch.tensor([[False], [True]])}, [2])), ["7", "1"]))


def test_reset_and_close_end_the_dialogs_of_a_stateful_task() -> None:
    task = CountingTask()
    env = counting_env(task, batch_size=2)
    env.reset()
    first = [env._states[i] for i in range(2)]
    env.reset(TensorDict({keys.RESET: torch.tensor([[True], [False]])}, [2]))
    assert task.ended == [first[0]]  # only the element reset was ended, before its next dialog started
    second = env._states[0]
    env.close()
    assert {id(s) for s in task.ended[1:]} == {id(second), id(first[1])} and len(task.ended) == 3


def test_a_restore_replays_a_stateful_dialog_and_it_goes_on_as_if_uninterrupted() -> None:
    env = counting_env(batch_size=3)
    td = env.step(answer(env, env.reset()))
    saved = env.state_dict()
    restored_task = CountingTask()
    restored = counting_env(restored_task, batch_size=3, seed=99)
    restored.load_state_dict(saved)
    assert restored_task.num_steps == 3  # each recorded assistant turn replayed once
    assert [restored._states[i].count for i in range(3)] == [env._states[i].count for i in range(3)]
    nxt = td["next"].exclude(keys.REWARD)
    want = env.step(answer(env, nxt.clone()))["next"]
    got = restored.step(answer(restored, nxt.clone()))["next"]
    assert list(got[keys.HISTORY_PROMPT]) == list(want[keys.HISTORY_PROMPT])
    assert torch.equal(got[keys.REWARD], want[keys.REWARD]) and torch.equal(got[keys.DONE], want[keys.DONE])


def test_a_restore_that_fails_to_replay_changes_nothing() -> None:
    env = counting_env(batch_size=3)
    env.step(answer(env, env.reset()))
    saved = env.state_dict()
    target = counting_env(CountingTask(fail_once_on=4), batch_size=3, seed=5)
    before = target.state_dict()
    with pytest.raises(RuntimeError, match="nothing was restored"):
        target.load_state_dict(saved)
    assert target.state_dict() == before


@pytest.mark.parametrize("kind", ["lockstep", "continuous"])
def test_a_stateful_opening_task_under_both_collectors_with_groups_is_token_exact(kind: str) -> None:
    turns = collect_turns(kind, lambda: counting_env(batch_size=4, repeats=2), counting_player, 24)
    assert check_prompts_extend_full_tokens(turns) >= 8
    for dialog in dialogs_of(turns):
        if bool(dialog[-1][keys.NEXT_DONE]):
            assert float(dialog[-1][keys.NEXT_REWARD]) == 1.0  # the player counts right: every finished dialog wins
    for members in groups_of(turns).values():
        openings = {non_tensor_values(t, keys.HISTORY_PROMPT)[0] for t in members if int(t[keys.STEP_COUNT]) == 0}
        assert len(openings) <= 1  # a group answers one opening


def test_the_environments_page_stateful_example_runs_and_restores() -> None:
    from tests.unit.test_readme import doc_block

    namespace: dict = {}
    exec(doc_block("class CountdownTask"), namespace)  # noqa: S102 - our own docs (docs/environments.md)
    env = namespace["env"]
    td = env.reset()
    assert [h.messages[-1].content for h in td[keys.HISTORY_PROMPT]] == ["Count down from 3. Say the next number."] * 2
    td = env.step(answer(env, td, ["2", "7"]))
    assert td["next", keys.REWARD].flatten().tolist() == [1.0, 0.0]
    assert [h.messages[-2].content for h in td["next", *keys.HISTORY_PROMPT]] == ["left=2", "left=3"]
    restored = ChatEnv([{"prompt": "", "start": 3}], task=namespace["CountdownTask"](), batch_size=2, repeats=2, max_turns=5)
    restored.load_state_dict(env.state_dict())
    assert [restored._states[i]["left"] for i in range(2)] == [2, 3]  # replayed to where the dialogs were
