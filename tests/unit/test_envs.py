"""Unit tests of lmcollect.envs: datasets, rewards, tasks, ChatEnv and AsyncEnvPool."""
from __future__ import annotations

import json
import random

import pytest
import torch
from tensordict import TensorDict, TensorDictBase

from lmcollect.data import History, keys
from lmcollect.envs import (
    PROMPT_ID,
    SAMPLE_INDEX,
    AsyncEnvPool,
    ChatEnv,
    ChatEnvConfig,
    EnvProtocol,
    ExactMatchReward,
    GuessingGameTask,
    MathAnswerReward,
    PromptDataset,
    RewardError,
    SingleTurnTask,
    Task,
    TaskReply,
    arithmetic_dataset,
    as_reward_fn,
    extract_math_answer,
    guessing_game_dataset,
    parse_math_answer,
)

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(10)]


def prompts(td: TensorDictBase, key: tuple[str, ...] = keys.HISTORY_PROMPT) -> list[History]:
    return list(td[key])


def act(td: TensorDictBase, answers: list[str]) -> TensorDictBase:
    """A hand-made policy output: full = prompt + one assistant message per element."""
    td[keys.HISTORY_FULL] = [p.append("assistant", a) for p, a in zip(prompts(td), answers)]
    return td


def next_obs(td: TensorDictBase) -> TensorDictBase:
    """The next turn's root td, as a collector would build it from "next"."""
    return td["next"].exclude(keys.REWARD)


def mask(*flags: bool) -> TensorDict:
    return TensorDict({keys.RESET: torch.tensor(flags).reshape(-1, 1)}, batch_size=[len(flags)])


def solve(history: History) -> str:
    a, op, b = history.last("user").content.removeprefix("What is ").rstrip("?").split()
    return str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])


# ---- datasets -------------------------------------------------------------------------------
def test_dataset_cycles_with_seeded_permutations():
    ds = PromptDataset(ROWS, seed=3)
    first = [ds.next_index() for _ in range(10)]
    second = [ds.next_index() for _ in range(10)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != list(range(10)) and first != second  # shuffled, new order each epoch
    again = PromptDataset(ROWS, seed=3)
    assert [again.next_index() for _ in range(20)] == first + second
    ds.set_seed(3)
    assert [ds.next_index() for _ in range(10)] == first
    assert [PromptDataset(ROWS, shuffle=False).next_index() for _ in range(1)] == [0]


def test_dataset_state_dict_resumes():
    ds = PromptDataset(ROWS, seed=1)
    for _ in range(13):
        ds.next_row()
    state = ds.state_dict()
    expected = [ds.next_row() for _ in range(12)]
    other = PromptDataset(ROWS, seed=99)
    other.load_state_dict(state)
    assert [other.next_row() for _ in range(12)] == expected
    it = iter(other)
    assert isinstance(next(it), dict)


def test_dataset_errors():
    with pytest.raises(ValueError, match="empty dataset"):
        PromptDataset([])
    with pytest.raises(ValueError, match="no 'prompt' key"):
        PromptDataset([{"question": "x"}])
    with pytest.raises(ValueError, match="'prompt' must be"):
        PromptDataset([{"prompt": 3}])
    with pytest.raises(TypeError, match="list of dicts"):
        PromptDataset("prompts.jsonl")


def test_dataset_jsonl_and_parquet(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS[:3]) + "\n\n")
    ds = PromptDataset.from_jsonl(path)
    assert len(ds) == 3 and ds[1] == ROWS[1]
    chat = [{"role": "user", "content": "hi"}]
    pd = pytest.importorskip("pandas")
    pq_path = tmp_path / "rows.parquet"
    pd.DataFrame({"prompt": [chat, chat], "answer": ["1", "2"]}).to_parquet(pq_path)
    ds = PromptDataset.from_parquet(pq_path)
    assert len(ds) == 2 and ds[0]["prompt"] == chat and ds[1]["answer"] == "2"
    both = PromptDataset.from_files([path, pq_path])
    assert len(both) == 5


def test_dataset_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: malformed JSON"):
        PromptDataset.from_jsonl(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty dataset"):
        PromptDataset.from_jsonl(empty)
    with pytest.raises(ValueError, match="suffix"):
        PromptDataset.from_files(tmp_path / "rows.csv")


# ---- rewards --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "value", "formatted"),
    [
        ("so the answer is\n#### 42", 42.0, True),
        ("The answer is $\\boxed{42}$.", 42.0, True),
        ("\\boxed{\\frac{1}{2}}", 0.5, True),
        ("I get -3", -3.0, False),
        ("it is 3.0", 3.0, False),
        ("1 then 2, finally 1,234", 1234.0, False),
        ("#### 7 but later 9", 7.0, True),
        ("no idea", None, False),
        ("", None, False),
    ],
)
def test_math_answer_parser(text, value, formatted):
    assert extract_math_answer(text) == (value, formatted)
    assert parse_math_answer(text) == value


def test_math_answer_reward():
    h = History.from_text("q")
    reward = MathAnswerReward()
    assert reward(h.append("assistant", "#### 42"), {"answer": "42"}) == 1.0
    assert reward(h.append("assistant", "3.0"), {"answer": 3}) == 1.0
    assert reward(h.append("assistant", "41"), {"answer": "42"}) == 0.0
    assert reward(h.append("assistant", "none"), {"answer": "42"}) == 0.0
    assert reward(h.append("assistant", "x #### -3"), {"answer": "work... #### -3"}) == 1.0
    bonus = MathAnswerReward(format_bonus=0.1)
    assert bonus(h.append("assistant", "\\boxed{5}"), {"answer": "4"}) == pytest.approx(0.1)
    assert bonus(h.append("assistant", "5"), {"answer": "5"}) == 1.0
    with pytest.raises(KeyError, match="'answer'"):
        reward(h.append("assistant", "1"), {})


def test_exact_match_and_as_reward_fn():
    h = History.from_text("q").append("assistant", "  Paris \n")
    assert ExactMatchReward()(h, {"answer": "Paris"}) == 1.0
    assert ExactMatchReward()(h, {"answer": "paris"}) == 0.0
    assert ExactMatchReward(case_sensitive=False)(h, {"answer": "paris"}) == 1.0
    one = as_reward_fn(lambda history: float(len(history)))
    assert one(h, {}) == 2.0
    two = lambda history, sample: 5.0  # noqa: E731
    assert as_reward_fn(two) is two
    with pytest.raises(TypeError, match="callable"):
        as_reward_fn(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no positional"):
        as_reward_fn(lambda: 1.0)


# ---- tasks ----------------------------------------------------------------------------------
def test_arithmetic_dataset():
    rows = arithmetic_dataset(50, seed=0, max_operand=9, ops=("+", "-", "*", "/"))
    assert rows == arithmetic_dataset(50, seed=0, max_operand=9, ops=("+", "-", "*", "/"))
    for row in rows:
        a, op, b = row["prompt"].removeprefix("What is ").rstrip("?").split()
        assert 0 <= int(b) <= 9 and op in "+-*/"
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}.get(op)
        if op == "/":
            expected = int(a) // int(b)
            assert int(a) % int(b) == 0
        assert row["answer"] == str(expected)
    with pytest.raises(ValueError, match="ops"):
        arithmetic_dataset(3, seed=0, ops=("^",))
    with pytest.raises(ValueError, match="num_samples"):
        arithmetic_dataset(0, seed=0)


def test_guessing_task_replies():
    task = GuessingGameTask(low=1, high=10, max_turns=3)
    assert isinstance(task, Task)
    state = task.start({"prompt": "guess", "secret": 7}, random.Random(0))
    h = History.from_text("guess")
    assert task.respond(state, h.append("assistant", "5")) == TaskReply(reward=0.0, done=False, env_message="Higher.")
    h2 = h.append("assistant", "5").append("user", "Higher.")
    assert task.respond(state, h2.append("assistant", "I guess 9")).env_message == "Lower."
    bad = task.respond(state, h2.append("assistant", "hmm"))
    assert not bad.done and bad.reward == 0.0 and "number" in bad.env_message
    assert task.respond(state, h2.append("assistant", "7")) == TaskReply(reward=1.0, done=True)
    h3 = h2.append("assistant", "9").append("user", "Lower.").append("assistant", "8")
    out = task.respond(state, h3)
    assert out.done and out.reward == 0.0 and "7" in out.env_message
    secrets = {task.start({"prompt": "g"}, random.Random(s)).secret for s in range(50)}
    assert secrets <= set(range(1, 11)) and len(secrets) > 5
    rows = guessing_game_dataset(4, seed=0, high=10)
    assert len(rows) == 4 and all("10" in r["prompt"] and r["high"] == 10 for r in rows)
    with pytest.raises(ValueError, match="high"):
        GuessingGameTask(low=5, high=1)


# ---- ChatEnv --------------------------------------------------------------------------------
def test_reset_shapes_and_keys():
    env = ChatEnv(ROWS, batch_size=3, seed=0, system_prompt="Be brief.")
    assert isinstance(env, EnvProtocol) and env.batch_size == torch.Size([3])
    td = env.reset()
    assert td.batch_size == torch.Size([3])
    for key in (keys.DONE, keys.TERMINATED, keys.TRUNCATED):
        assert td[key].shape == (3, 1) and td[key].dtype == torch.bool and not td[key].any()
    hs = prompts(td)
    assert len(hs) == 3 and all(isinstance(h, History) for h in hs)
    assert [m.role for m in hs[0].messages] == ["system", "user"]
    assert td[PROMPT_ID].tolist() == [0, 1, 2]
    assert [env.current_samples[i] for i in range(3)] == [ROWS[i] for i in td[SAMPLE_INDEX].tolist()]


def test_single_turn_step_rewards_and_done():
    env = ChatEnv(ROWS, reward_fn=ExactMatchReward(), batch_size=4, seed=0)
    td = env.reset()
    answers = [env.current_samples[0]["answer"], "wrong", env.current_samples[2]["answer"], ""]
    out = env.step(act(td, answers))
    nxt = out["next"]
    assert nxt.batch_size == torch.Size([4])
    assert nxt[keys.REWARD].dtype == torch.float32 and nxt[keys.REWARD].shape == (4, 1)
    assert nxt[keys.REWARD].flatten().tolist() == [1.0, 0.0, 1.0, 0.0]
    assert nxt[keys.DONE].all() and nxt[keys.TERMINATED].all() and not nxt[keys.TRUNCATED].any()
    assert prompts(nxt) == prompts(td, keys.HISTORY_FULL)  # no env message in single-turn tasks
    with pytest.raises(RuntimeError, match="element 0 is done"):
        env.step(td)


def test_default_reward_is_zero_and_math_on_arithmetic():
    env = ChatEnv(ROWS, batch_size=2, seed=0)
    out = env.step(act(env.reset(), ["a", "b"]))
    assert out["next", keys.REWARD].abs().sum() == 0
    env = ChatEnv(arithmetic_dataset(20, seed=1), reward_fn=MathAnswerReward(), batch_size=4, seed=0)
    td = env.reset()
    out = env.step(act(td, [f"#### {solve(h)}" for h in prompts(td)]))
    assert out["next", keys.REWARD].flatten().tolist() == [1.0] * 4


def test_repeats_share_prompts_and_groups_stay_aligned():
    env = ChatEnv(ROWS, batch_size=6, repeats=3, seed=0)
    td = env.reset()
    hs, ids = prompts(td), td[PROMPT_ID].tolist()
    assert hs[0] == hs[1] == hs[2] != hs[3] == hs[4] == hs[5]
    assert ids == [0, 0, 0, 1, 1, 1]
    env.step(act(td, ["x"] * 6))
    # Element 0 restarts alone: its group draws a new prompt; element 1 later gets the same one.
    a = env.reset(mask(True, False, False, False, False, False))
    b = env.reset(mask(False, True, True, False, False, False))
    assert prompts(a)[0] == prompts(b)[1] == prompts(b)[2]
    assert a[PROMPT_ID][0] == b[PROMPT_ID][1] == b[PROMPT_ID][2] == 2


def test_partial_reset_only_changes_masked_elements():
    env = ChatEnv(ROWS, batch_size=4, seed=0, max_turns=3, task=GuessingGameTask(max_turns=3))
    td = env.reset()
    out = env.step(act(td, ["1", "2", "3", "4"]))
    before = prompts(out["next"])
    again = env.reset(mask(False, True, False, True))
    after = prompts(again)
    assert after[0] == before[0] and after[2] == before[2]
    assert len(after[1]) == 1 and len(after[3]) == 1  # fresh dialogs
    assert again[PROMPT_ID].tolist() == [0, 4, 2, 5]
    # Unmasked rows hold their current prompt, so the reset output can serve as the next root:
    # stepping continues the unmasked dialogs (turn 2) and restarts the masked ones (turn 1).
    out = env.step(act(again, ["5"] * 4))
    assert [len(h) for h in prompts(out, keys.HISTORY_FULL)] == [4, 2, 4, 2]
    with pytest.raises(ValueError, match="_reset"):
        env.reset(TensorDict({keys.RESET: torch.ones(3, 1, dtype=torch.bool)}, batch_size=[3]))


def test_max_turns_truncation():
    task = GuessingGameTask(low=1, high=10, max_turns=None)
    env = ChatEnv([{"prompt": "guess", "secret": 5}], task=task, batch_size=1, max_turns=2, seed=0)
    td = env.reset()
    out = env.step(act(td, ["1"]))
    assert not out["next", keys.DONE].any()
    out = env.step(act(next_obs(out), ["2"]))
    assert out["next", keys.DONE].all() and out["next", keys.TRUNCATED].all()
    assert not out["next", keys.TERMINATED].any()


def test_guessing_game_multi_turn():
    rows = [{"prompt": "guess", "secret": 7}]
    env = ChatEnv(rows, task=GuessingGameTask(low=1, high=10, max_turns=5), batch_size=2, max_turns=5, seed=0)
    td = env.reset()
    out = env.step(act(td, ["3", "9"]))
    nxt = out["next"]
    assert [h.messages[-1].content for h in prompts(nxt)] == ["Higher.", "Lower."]
    assert [h.messages[-1].role for h in prompts(nxt)] == ["user", "user"]
    assert nxt[keys.REWARD].flatten().tolist() == [0.0, 0.0] and not nxt[keys.DONE].any()
    out = env.step(act(next_obs(out), ["7", "no clue"]))
    nxt = out["next"]
    assert nxt[keys.REWARD].flatten().tolist() == [1.0, 0.0]
    assert nxt[keys.DONE].flatten().tolist() == [True, False]
    assert nxt[keys.TERMINATED].flatten().tolist() == [True, False]
    assert "number" in prompts(nxt)[1].messages[-1].content
    assert [m.role for m in prompts(nxt)[1].messages] == ["user", "assistant", "user", "assistant", "user"]


def test_guessing_secret_is_shared_in_group_and_seeded():
    def secrets(seed: int) -> list[int]:
        env = ChatEnv(guessing_game_dataset(5, seed=0), task=GuessingGameTask(high=1000), batch_size=8,
                      repeats=2, max_turns=5, seed=seed)
        env.reset()
        return [s.secret for s in env._states]

    s = secrets(0)
    assert s[0::2] == s[1::2] and len(set(s[0::2])) > 1
    assert secrets(0) == s and secrets(1) != s


def test_reward_error_names_element_and_dialog():
    def reward(history: History) -> float:
        if "boom" in history.last("assistant").content:
            raise ZeroDivisionError("bad reward")
        return 1.0

    env = ChatEnv(ROWS, reward_fn=reward, batch_size=3, seed=0)
    td = env.reset()
    with pytest.raises(RewardError, match=r"(?s)element 2 .*ZeroDivisionError.*boom") as info:
        env.step(act(td, ["ok", "ok", "boom"]))
    assert isinstance(info.value, RuntimeError) and isinstance(info.value.__cause__, ZeroDivisionError)
    assert info.value.index == 2
    # Nothing was committed: the same turn can be retried.
    out = env.step(act(td, ["ok", "ok", "fine"]))
    assert out["next", keys.REWARD].flatten().tolist() == [1.0, 1.0, 1.0]


def test_step_input_errors():
    env = ChatEnv(ROWS, batch_size=2, seed=0)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(TensorDict({}, batch_size=[2]))
    td = env.reset()
    with pytest.raises(KeyError, match="policy must write"):
        env.step(td)
    td[keys.HISTORY_FULL] = prompts(td)
    with pytest.raises(ValueError, match="assistant message"):
        env.step(td)
    env.close()
    with pytest.raises(RuntimeError, match="closed"):
        env.reset()


def test_bad_config_errors():
    with pytest.raises(ValueError, match=r"batch_size \(5\).*repeats \(2\)"):
        ChatEnvConfig(batch_size=5, repeats=2)
    with pytest.raises(ValueError, match="batch_size"):
        ChatEnv(ROWS, batch_size=3, repeats=2)
    with pytest.raises(ValueError, match="max_turns"):
        ChatEnvConfig(max_turns=0)
    with pytest.raises(TypeError, match="batch_size"):
        ChatEnvConfig(batch_size=2.0)
    with pytest.raises(ValueError, match="empty dataset"):
        ChatEnv([])
    with pytest.raises(ValueError, match="both task and reward_fn"):
        ChatEnv(ROWS, task=SingleTurnTask(), reward_fn=ExactMatchReward())
    with pytest.raises(TypeError, match="batchsize"):
        ChatEnv(ROWS, batchsize=2)
    with pytest.raises(RuntimeError, match="element 0 on dataset row 0"):
        ChatEnv([{"prompt": "g", "low": 5, "high": 1}], task=GuessingGameTask(), max_turns=5).reset()
    cfg = ChatEnvConfig(batch_size=4, repeats=2)
    assert ChatEnv(ROWS, config=cfg, max_turns=3).config.max_turns == 3


def test_seeding_and_state_dict():
    def run(env: ChatEnv) -> list[History]:
        hs = []
        for _ in range(3):
            td = env.reset()
            hs += prompts(td)
            env.step(act(td, ["x"] * 2))
        return hs

    a, b = ChatEnv(ROWS, batch_size=2, seed=5), ChatEnv(ROWS, batch_size=2, seed=6)
    assert run(a) != run(b)
    assert b.set_seed(5) == 6 and b.set_seed(5, static_seed=True) == 5
    a.set_seed(5)
    assert run(a) == run(b)
    state = a.state_dict()
    expected = run(a)
    fresh = ChatEnv(ROWS, batch_size=2, seed=123)
    fresh.load_state_dict(state)
    assert run(fresh) == expected
    ds = PromptDataset(ROWS, seed=5)
    shared = ChatEnv(ds, batch_size=2, seed=5)
    run(shared)
    assert ds.state_dict()["index"] == 0  # the env iterates a fork of the dataset


# ---- pool -----------------------------------------------------------------------------------
def test_async_env_pool():
    built = ChatEnv(ROWS, batch_size=1, seed=0)
    pool = AsyncEnvPool([lambda: ChatEnv(ROWS, batch_size=2), built])
    assert pool.num_envs == 2 and pool.envs[1] is built and len(pool) == 2
    assert pool.set_seed(10) == 12
    assert prompts(pool.envs[0].reset())[0] == prompts(ChatEnv(ROWS, batch_size=2, seed=10).reset())[0]
    assert prompts(built.reset())[0] == prompts(ChatEnv(ROWS, batch_size=1, seed=11).reset())[0]
    pool.close()
    pool.close()
    assert all(env.is_closed for env in pool.envs)
    with pytest.raises(ValueError, match="non-empty"):
        AsyncEnvPool([])
    with pytest.raises(TypeError, match=r"env_makers\[0\]"):
        AsyncEnvPool([lambda: object()])


def test_message_list_prompts_system_prompt_and_mask_shapes():
    rows = [{"prompt": [{"role": "user", "content": "hi"}]},
            {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}]}]
    env = ChatEnv(rows, batch_size=2, seed=0, system_prompt="sys", max_turns=2,
                  task=GuessingGameTask(max_turns=None))
    td = env.reset()
    by_user = {h.last("user").content: h for h in prompts(td)}
    assert [m.content for m in by_user["hi"].messages] == ["sys", "hi"]
    assert [m.content for m in by_user["yo"].messages] == ["own", "yo"]
    out = env.step(act(td, ["1", "2"]))
    flat = TensorDict({keys.RESET: torch.tensor([False, False])}, batch_size=[2])
    same = env.reset(flat)  # (B,) masks are accepted; all-False resets nothing
    assert prompts(same) == prompts(out["next"])


def test_turn_limit_warning_and_pickle(caplog):
    import pickle

    with caplog.at_level("WARNING", logger="lmcollect.envs.chat_env"):
        ChatEnv(ROWS, task=GuessingGameTask(max_turns=5), max_turns=1)
    assert "max_turns" in caplog.text
    env = ChatEnv(ROWS, reward_fn=MathAnswerReward(), batch_size=2, seed=4)
    clone = pickle.loads(pickle.dumps(env))
    assert prompts(clone.reset()) == prompts(env.reset())


def test_the_env_registry_builds_shipped_tasks_by_name_and_lists_the_names_when_one_is_unknown() -> None:
    from lmcollect.envs import ChatEnv, as_env, make_env, register_env, registered_envs

    names = registered_envs()
    assert {"lmcollect:arithmetic", "lmcollect:comparison", "lmcollect:guessing", "torchrl:*"} <= set(names)
    env = make_env("lmcollect:guessing", batch_size=2, repeats=2, num_samples=4, seed=1)
    assert isinstance(env, ChatEnv) and tuple(env.batch_size) == (2,) and env.config.max_turns == 5
    assert isinstance(as_env("lmcollect:comparison"), ChatEnv)  # a collector's env= takes the name too
    with pytest.raises(ValueError, match=r"unknown env 'lmcollect:nope'; registered: lmcollect:addition.*register_env"):
        make_env("lmcollect:nope")
    with pytest.raises(ValueError, match=r"an env name is 'ecosystem:name'.*got 'arithmetic'"):
        make_env("arithmetic")
    with pytest.raises(ValueError, match="registered already; pass replace=True"):
        register_env("lmcollect:arithmetic", ChatEnv)
    with pytest.raises(TypeError, match="env must follow lmcollect.envs.EnvProtocol .* or name a registered env"):
        as_env(object())


def test_an_outside_library_registers_its_names_and_its_env_objects_through_one_door() -> None:
    from lmcollect.envs import as_env, make_env, register_ecosystem, register_env, registered_envs
    from lmcollect.envs.registry import _ECOSYSTEMS, _FACTORIES

    class ForeignEnv:  # an env of another library: no lmcollect protocol
        def __init__(self, name: str = "x") -> None:
            self.name = name

    class Adapter:
        def __init__(self, env: ForeignEnv) -> None:
            self.env, self.batch_size = env, torch.Size([1])

        def reset(self, td=None):  # noqa: ANN001, ANN202 (the protocol's shape)
            raise NotImplementedError

        def step(self, td):  # noqa: ANN001, ANN202
            raise NotImplementedError

    try:
        register_ecosystem("foreign", recognizes=lambda e: isinstance(e, ForeignEnv), wrap=Adapter,
                           build=lambda name, **kw: Adapter(ForeignEnv(name)))  # fmt: skip
        register_env("foreign:fixed", lambda **kw: Adapter(ForeignEnv("fixed")))
        assert {"foreign:*", "foreign:fixed"} <= set(registered_envs())
        assert make_env("foreign:fixed").env.name == "fixed"  # a registered name first
        assert make_env("foreign:any_other").env.name == "any_other"  # then the ecosystem's builder
        wrapped = as_env(ForeignEnv("obj"))  # an object the adapter recognizes
        assert isinstance(wrapped, Adapter) and wrapped.env.name == "obj"
        assert isinstance(as_env(lambda: ForeignEnv("made")), Adapter)  # a constructor, then wrapped
    finally:
        _ECOSYSTEMS.pop("foreign", None)
        _FACTORIES.pop("foreign:fixed", None)
    with pytest.raises(ValueError, match="unknown env 'foreign:fixed'"):
        make_env("foreign:fixed")
    with pytest.raises(TypeError, match="pass recognizes and wrap together"):
        register_ecosystem("half", recognizes=lambda e: True)
