"""Agents written with the real ``openai`` client, collected through the real endpoint by a ContinuousLLMCollector.

Engines: the scripted engine (its log-probs reveal the pushed weights) and a TransformersEngine over
the tiny model. Every call is one turn with exact tokens, a push lands between two calls of one
dialog, GRPO groups, tool-call round trips, bad agents isolated, concurrent agents never mixed.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import defaultdict

import openai
import pytest
import torch

from lmcollect.agents import (
    AGENT_ERROR,
    AGENT_METADATA,
    TOOL_PARSE_ERROR,
    AgentEnv,
    AgentEnvConfig,
    AgentServer,
)
from lmcollect.agents.openai_format import parse_chat_request
from lmcollect.agents.runs import AgentRun
from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.data import History, keys
from lmcollect.data.codec import decode, encode
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.envs import ChatEnv, ChatEnvConfig, DialogFailed, PromptDataset, SingleTurnTask
from lmcollect.policies import EnginePolicy, SamplingConfig
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script
from tests.factories import run_in_thread

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                            "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]
SAMPLING = SamplingConfig(max_new_tokens=200)
RELEASE = threading.Event()  # hanging agents wait on it; set when the module's tests are done


@pytest.fixture(scope="module")
def server():
    """One endpoint for the module's envs (each run still gets its own key)."""
    with AgentServer() as shared:
        shared.start()
        yield shared
    RELEASE.set()


# ---------------------------------------------------------------------- the model and the agents
def player(history: History) -> str:
    """The scripted model: a well-formed add call for the row's numbers, then the answer with the row's marker."""
    opening = history.messages[0].content
    marker = re.search(r"marker=(\w+)", opening).group(1)
    last = history.messages[-1]
    if last.role == "tool":
        return f"ANSWER {last.content} marker={marker}"
    if "malformed" in opening:
        return '<tool_call>{"name": "add", "arguments": {</tool_call>'
    a, b = (int(x) for x in re.search(r"add (\d+) (\d+)", opening).groups())
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}, "marker": "{marker}"}}}}</tool_call>'


def scripted_engine(**kwargs) -> ScriptedEngine:
    return ScriptedEngine(script=chat_script(player), **kwargs)


def rows(behaviours: list[str]) -> PromptDataset:
    return PromptDataset(
        [{"prompt": f"marker=m{i} add {i} {i + 1} {b}", "answer": str(2 * i + 1), "behaviour": b} for i, b in enumerate(behaviours)],
        shuffle=False,
    )


REPLIES: dict[str, list] = defaultdict(list)  # api key -> the completions its run got
LATE: list[int] = []  # status codes of calls made after a dialog ended


FAILED_EARLY: set[str] = set()  # rows whose first run failed before calling the model


def calc_agent(ctx, row):
    """Calls the model, runs its add calls, calls again with the results; reward 1 for the right answer."""
    if row["behaviour"] == "early" and row["prompt"] not in FAILED_EARLY:
        FAILED_EARLY.add(row["prompt"])
        raise ConnectionError("the sandbox did not start")  # before any call: the group waits for one run fewer
    client = ctx.openai()
    messages = [{"role": "user", "content": row["prompt"]}]
    for number in range(4):
        completion = client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
        REPLIES[ctx.api_key].append(completion)
        message = completion.choices[0].message
        messages.append(message)
        misbehave(row["behaviour"], number, ctx, client, messages)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    if row["behaviour"] == "none":
        return None
    right = re.search(rf"ANSWER {row['answer']} marker=(\w+)", message.content or "")
    return {"reward": float(right is not None), "metadata": {"calls": number + 1}}


def misbehave(behaviour: str, number: int, ctx, client, messages) -> None:
    if behaviour == "raise" and number == 0:
        raise ValueError("the tool exploded")
    if behaviour == "hang" and number == 0:
        RELEASE.wait(60)
    if behaviour == "late" and number == 1:
        threading.Thread(target=late_call, args=(client, ctx.model, list(messages)), daemon=True).start()


def late_call(client, model, messages) -> None:
    time.sleep(0.3)  # after the agent returned and its dialog ended
    try:
        client.chat.completions.create(model=model, messages=messages)
    except openai.APIStatusError as exc:
        LATE.append(exc.status_code)


async def async_calc_agent(ctx, row):
    """The same agent with AsyncOpenAI, checking that every reply names its own row's marker."""
    client = ctx.async_openai()
    marker = re.search(r"marker=(\w+)", row["prompt"]).group(1)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = (await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)).choices[0].message
    args = json.loads(first.tool_calls[0].function.arguments)
    messages += [first, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": str(args["a"] + args["b"])}]
    second = (await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)).choices[0].message
    return float(args["marker"] == marker and second.content.endswith(f"marker={marker}"))


def collect(env, engine, *, batches: int, **kwargs) -> list:
    kwargs.setdefault("dialog_turns_per_batch", 4)
    collector = ContinuousLLMCollector([env], engine=engine, tokenizer=ByteTokenizer(), sampling=SAMPLING, **kwargs)
    with collector:
        turns = [turn for _ in range(batches) for turn in flatten_turns(collector.next())]
    return turns


def text(turn, key) -> str:
    return non_tensor_values(turn.unsqueeze(0), key)[0]


def dialogs_of(turns) -> dict[int, list]:
    by_traj: dict[int, list] = defaultdict(list)
    for turn in turns:
        by_traj[int(turn[keys.TRAJ_IDS])].append(turn)
    return {t: sorted(ts, key=lambda turn: int(turn[keys.STEP_COUNT])) for t, ts in by_traj.items()}


# ---------------------------------------------------------------------- the tests
def test_every_call_is_one_turn_with_exact_tokens_groups_and_tool_round_trips(server) -> None:
    REPLIES.clear()
    env = AgentEnv(rows(["ok"] * 16), calc_agent, batch_size=4, repeats=2, seed=0, server=server)
    engine = scripted_engine()
    turns = collect(env, engine, batches=2, total_dialog_turns=16)  # 2 batches of 2 groups of 2 two-turn dialogs
    engine.close()
    dialogs = dialogs_of(turns)
    assert len(dialogs) == 8 and len(turns) == 16
    groups = defaultdict(set)
    for steps in dialogs.values():
        first, last = steps
        assert [int(t[keys.STEP_COUNT]) for t in steps] == [0, 1]
        # the second call extends the first: its prompt is the first turn's tokens as generated + the tool message
        assert torch.equal(last[keys.TOKENS_PROMPT][: first[keys.TOKENS_FULL].numel()], first[keys.TOKENS_FULL])
        assert "<|tool|>\n" in text(last, keys.TEXT_PROMPT) and text(first, keys.TEXT_RESPONSE).startswith("<tool_call>")
        assert [float(t[keys.NEXT_REWARD]) for t in steps] == [0.0, 1.0] and bool(last["next", keys.DONE])
        assert json.loads(text(last, ("next", *AGENT_METADATA))) == {"calls": 2}
        groups[int(first[keys.GROUP_ID])].add(text(first, keys.TEXT_PROMPT))
    assert len(groups) == 4 and all(len(prompts) == 1 for prompts in groups.values())  # 2 runs of one row each
    assert sorted(int(t[keys.GROUP_ID]) for t in turns).count(next(iter(groups))) == 4
    # every call the agents made came back as exactly one turn, the reply they got being its text
    recorded = sorted(text(t, keys.TEXT_RESPONSE) for t in turns)
    replies = [c.choices[0].message for key in REPLIES for c in REPLIES[key]]
    parsed_calls = [json.loads(m.tool_calls[0].function.arguments) for m in replies if m.tool_calls]
    assert env.stats.calls >= len(turns) and env.stats.tool_calls >= 8 and env.stats.tool_parse_errors == 0
    assert all(set(args) == {"a", "b", "marker"} for args in parsed_calls)
    assert sum(r in recorded for r in (m.content for m in replies if not m.tool_calls)) >= 8
    REPLIES.clear()


def test_concurrent_async_agents_are_never_mixed(server) -> None:
    env = AgentEnv(rows(["ok"] * 32), async_calc_agent, batch_size=8, seed=1, server=server)
    turns = collect(env, scripted_engine(token_delay_s=0.001), batches=4, dialog_turns_per_batch=8)
    for steps in dialogs_of(turns).values():
        markers = {m for t in steps for m in re.findall(r"marker=(\w+)", text(t, keys.TEXT_FULL))}
        assert len(markers) == 1, markers  # a dialog's prompts and replies are all its own row's
        if bool(steps[-1]["next", keys.DONE]):
            assert float(steps[-1][keys.NEXT_REWARD]) == 1.0  # and the agent saw only its own replies
    assert env.stats.runs_failed == 0


def test_a_push_between_two_calls_of_a_dialog_is_recorded_per_turn(server) -> None:
    proceed = threading.Event()

    def waiting_agent(ctx, row):
        client = ctx.openai()
        messages = [{"role": "user", "content": row["prompt"]}]
        first = client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS).choices[0].message
        assert proceed.wait(30), "the test never pushed"
        args = json.loads(first.tool_calls[0].function.arguments)
        messages += [first, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": str(args["a"] + args["b"])}]
        client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
        return 1.0

    env = AgentEnv(rows(["ok"] * 4), waiting_agent, seed=0, server=server)
    engine = scripted_engine()
    collector = ContinuousLLMCollector([env], engine=engine, tokenizer=ByteTokenizer(), sampling=SAMPLING,
                                       dialog_turns_per_batch=2, track_policy_version=True)

    def push_after_the_first_call():
        deadline = time.monotonic() + 30
        while env.stats.calls < 1:
            assert time.monotonic() < deadline, "the agent's first call never got its reply"
            time.sleep(0.01)
        collector.update_policy_weights_({"tag": torch.tensor([1.0])})
        proceed.set()

    join = run_in_thread(push_after_the_first_call)
    with collector:
        first, second = dialogs_of(flatten_turns(collector.next())).popitem()[1]
    join()
    engine.close()
    assert int(first[keys.POLICY_VERSION]) == 0 and set(first[keys.TOKEN_VERSIONS].tolist()) == {0}
    assert int(second[keys.POLICY_VERSION]) == 1 and set(second[keys.TOKEN_VERSIONS].tolist()) == {1}
    assert set(first[keys.LOG_PROBS_RESPONSE].tolist()) == {0.0} and set(second[keys.LOG_PROBS_RESPONSE].tolist()) == {-1.0}
    assert torch.equal(second[keys.TOKENS_PROMPT][: first[keys.TOKENS_FULL].numel()], first[keys.TOKENS_FULL])


def test_bad_agents_end_only_their_own_dialogs_named(server, caplog) -> None:
    behaviours = ["ok", "raise", "hang", "none", "malformed", "late", "early", "ok"]
    env = AgentEnv(rows(behaviours), calc_agent, batch_size=4, repeats=2, seed=0, server=server, agent_timeout_s=2.0)
    engine = scripted_engine()
    with caplog.at_level(logging.WARNING, logger="lmcollect"):
        collector = ContinuousLLMCollector([env], engine=engine, tokenizer=ByteTokenizer(), sampling=SAMPLING,
                                           dialog_turns_per_batch=4)  # 2 groups per batch
        turns, kept = [], set()
        with collector:
            while kept != {"ok", "malformed", "late", "early"}:  # every row that can succeed, each group whole
                assert len(turns) < 40, f"only {kept} came back"
                batch = run_in_thread(collector.next, timeout_s=120)()  # a stall fails here, named, not hangs
                turns += flatten_turns(batch)
                kept |= {re.search(r"add \d+ \d+ (\w+)", text(t, keys.TEXT_PROMPT)).group(1) for t in turns}
    engine.close()
    # 2 runs each of raise, hang, none, and the first of early, at least (rows come round again)
    assert collector.num_failed_dialogs == env.stats.runs_failed >= 7
    first_early = next(t for t in turns if "early" in text(t, keys.TEXT_PROMPT))
    group = [t for t in turns if int(t[keys.GROUP_ID]) == int(first_early[keys.GROUP_ID])]
    assert len(group) == 2 and len({int(t[keys.TRAJ_IDS]) for t in group}) == 1  # its group: one run fewer
    assert any("dataset row 6) failed before its first model call: ConnectionError" in m for m in caplog.messages)
    failures = [m for m in caplog.messages if "failed" in m]
    assert any(re.search(r"agent run \d+ \(env element \d, dataset row 1\) failed .*ValueError: the tool exploded", m) for m in failures)
    assert any("dataset row 2) failed" in m and "agent_timeout_s=2.0" in m for m in failures)
    assert any("dataset row 3) failed" in m and "not a reward" in m for m in failures)
    malformed = [t for t in turns if "malformed" in text(t, keys.TEXT_PROMPT)]
    assert malformed and all("not JSON" in text(t, ("next", *TOOL_PARSE_ERROR)) for t in malformed)
    assert env.stats.tool_parse_errors >= 2
    deadline = time.monotonic() + 10
    while len(LATE) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert LATE[:2] == [409, 409]  # calls after the dialog ended: refused, not recorded


def test_a_failed_run_is_kept_with_its_error_or_raised_to_the_consumer(server) -> None:
    engine = scripted_engine()
    env = AgentEnv(rows(["raise"] * 4), calc_agent, seed=0, server=server, on_agent_error="keep", failure_reward=-1.0)
    (turn,) = collect(env, engine, batches=1, dialog_turns_per_batch=1)
    assert float(turn[keys.NEXT_REWARD]) == -1.0 and bool(turn["next", keys.DONE])
    assert "ValueError: the tool exploded" in text(turn, ("next", *AGENT_ERROR))
    env = AgentEnv(rows(["raise"] * 4), calc_agent, seed=0, server=server, on_agent_error="raise")
    with ContinuousLLMCollector([env], engine=engine, tokenizer=ByteTokenizer(), sampling=SAMPLING,
                                dialog_turns_per_batch=1) as collector:
        with pytest.raises(DialogFailed, match=r"agent run \d+ \(env element 0, dataset row 0\) failed"):
            collector.next()
    # dropped one by one, until so many fail in a row that the agent itself must be broken
    env = AgentEnv(rows(["raise"] * 4), calc_agent, seed=0, server=server, max_failures_in_a_row=3)
    with ContinuousLLMCollector([env], engine=engine, tokenizer=ByteTokenizer(), sampling=SAMPLING,
                                dialog_turns_per_batch=1) as collector:
        with pytest.raises(DialogFailed, match="3 runs failed in a row"):
            collector.next()
        assert collector.num_failed_dialogs >= 3  # (a fourth run may fail before this line reads the count)
    engine.close()


def test_max_calls_truncates_and_per_turn_rewards_land_on_their_turns(server) -> None:
    def looping_agent(ctx, row):
        client = ctx.openai()
        while True:  # until the endpoint refuses the call past max_calls (HTTP 409)
            client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": row["prompt"]}])
            ctx.add_reward(0.5)

    env = AgentEnv(rows(["ok"] * 2), looping_agent, seed=0, server=server, max_calls=3)
    turns = collect(env, scripted_engine(), batches=1, dialog_turns_per_batch=3)
    assert [float(t[keys.NEXT_REWARD]) for t in turns] == [0.5, 0.5, 0.5]
    assert [bool(t["next", keys.TRUNCATED]) for t in turns] == [False, False, True]
    assert env.stats.runs_truncated == 1


def test_the_endpoint_refuses_unknown_keys_ended_dialogs_and_bad_stream_options(server) -> None:
    run = AgentRun(key="live-key", dialog="agent run 99", prompt_id=0)
    server.register(run)
    client = openai.OpenAI(base_url=server.base_url, api_key="live-key", max_retries=0)
    assert [m.id for m in client.models.list()] == [server.model_name]
    with pytest.raises(openai.BadRequestError, match="stream_options .* only with stream=True"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       stream_options={"include_usage": True})
    with pytest.raises(openai.AuthenticationError, match="unknown API key"):
        openai.OpenAI(base_url=server.base_url, api_key="guess", max_retries=0).models.list()
    server.retire(run)
    with pytest.raises(openai.ConflictError, match="agent run 99 has ended"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert not run.next_event().done()  # nothing reached the run
    assert parse_chat_request({"messages": [{"role": "user", "content": "hi"}]}).max_tokens is None


def test_token_exact_prompts_across_calls_with_the_tiny_model(server, tiny_model_and_tokenizer) -> None:
    from lmcollect.engines import TransformersEngine

    model, tokenizer = tiny_model_and_tokenizer

    def two_calls(ctx, row):
        client = ctx.openai()
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=6).choices[0].message
        messages += [reply, {"role": "tool", "tool_call_id": "t", "content": "42"}]
        client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=5)
        return 0.0

    env = AgentEnv([{"prompt": f"What is {i} + 1?"} for i in range(4)], two_calls, batch_size=2, seed=0, server=server)
    with TransformersEngine(model, tokenizer) as engine:
        collector = ContinuousLLMCollector([env], engine=engine, tokenizer=tokenizer, track_policy_version=True,
                                           sampling=SamplingConfig(max_new_tokens=16, temperature=1.0),
                                           dialog_turns_per_batch=4)
        with collector:
            turns = flatten_turns(collector.next())
            mismatches = collector.num_prefix_mismatches
    for first, second in (steps for steps in dialogs_of(turns).values() if len(steps) == 2):
        assert first[keys.TOKENS_RESPONSE].numel() <= 6 and second[keys.TOKENS_RESPONSE].numel() <= 5
        assert int(first[keys.SAMPLING_MAX_NEW_TOKENS]) == 6  # the call's max_tokens, under the collector's 16
        assert torch.equal(second[keys.TOKENS_PROMPT][: first[keys.TOKENS_FULL].numel()], first[keys.TOKENS_FULL])
        retokenized = tokenizer(text(second, keys.TEXT_PROMPT), add_special_tokens=False)["input_ids"]
        assert bool(second[keys.PREFIX_MISMATCH]) == (retokenized != second[keys.TOKENS_PROMPT].tolist())
        assert second[keys.LOG_PROBS_RESPONSE].numel() == second[keys.TOKENS_RESPONSE].numel()
    assert mismatches == sum(bool(t[keys.PREFIX_MISMATCH]) for t in turns)


def test_the_lockstep_collector_runs_a_batch_of_agents(server) -> None:
    env = AgentEnv(rows(["ok"] * 8), calc_agent, batch_size=2, seed=0, server=server)
    engine = scripted_engine()
    policy = EnginePolicy(engine, tokenizer=ByteTokenizer(), sampling=SAMPLING)
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=4, flatten_data=True)
    turns = flatten_turns(collector.next())
    collector.shutdown()
    engine.close()
    dialogs = dialogs_of(turns)
    assert len(dialogs) == 2 and all([float(t[keys.NEXT_REWARD]) for t in d] == [0.0, 1.0] for d in dialogs.values())
    REPLIES.clear()


def test_histories_with_tools_survive_a_checkpoint_round_trip() -> None:
    history = History.from_dicts([{"role": "user", "content": "q"}], tools=TOOLS)
    data, tensors = encode({"h": history})
    assert decode(json.loads(json.dumps(data)), tensors)["h"] == history


ENV_ROWS = [{"prompt": "What is 1 + 1?"}]


def test_env_config_and_closed_errors_name_the_env():
    """ChatEnv and AgentEnv share the config merge and the closed check; each keeps its own words."""
    with pytest.raises(TypeError, match=r"^config must be a ChatEnvConfig, got AgentEnvConfig\.$"):
        ChatEnv(ENV_ROWS, task=SingleTurnTask(), config=AgentEnvConfig())
    with pytest.raises(TypeError, match=r"^config must be an AgentEnvConfig, got ChatEnvConfig\.$"):
        AgentEnv(ENV_ROWS, lambda context, row: 1.0, config=ChatEnvConfig())
    with pytest.raises(TypeError, match=r"^AgentEnv got unknown keyword argument\(s\) \['bogus'\]; valid config fields"):
        AgentEnv(ENV_ROWS, lambda context, row: 1.0, bogus=1)
    with pytest.raises(TypeError, match=r"^ChatEnv got unknown keyword argument\(s\) \['bogus'\]; valid config fields"):
        ChatEnv(ENV_ROWS, task=SingleTurnTask(), bogus=1)
    chat, agents = ChatEnv(ENV_ROWS, task=SingleTurnTask(), batch_size=2), AgentEnv(ENV_ROWS, lambda context, row: 1.0)
    assert chat.config.batch_size == 2 and not chat.is_closed and not agents.is_closed
    chat.close()
    agents.close()
    assert chat.is_closed and agents.is_closed
    with pytest.raises(RuntimeError, match=r"^ChatEnv is closed; create a new env\.$"):
        chat.reset()
    with pytest.raises(RuntimeError, match=r"^this AgentEnv is closed; build a new one\.$"):
        agents.reset()


def test_an_event_that_comes_as_a_wait_times_out_is_taken_never_lost() -> None:
    """A call posted just as the element's wait ended must reach the element (else its HTTP request
    waits for a reply forever); one posted after is queued for the next read."""
    from lmcollect.agents.element import _taken
    from lmcollect.agents.openai_format import ChatCompletionsApi
    from lmcollect.agents.runs import AgentCall, AgentRun, RunEnded

    request = ChatCompletionsApi().parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    run = AgentRun(key="k", dialog="agent run 0", prompt_id=0)
    waiting = run.next_event()
    call = run.post_call(request)  # lands in the future the wait gave up on
    assert _taken(waiting, 2.0, run.dialog) is call
    late = run.next_event()
    timed_out = _taken(late, 2.0, run.dialog)  # nothing came: the run's failure, the future cancelled
    assert isinstance(timed_out, RunEnded) and "agent_timeout_s=2.0" in str(timed_out.error)
    second = run.post_call(request)
    assert isinstance(second, AgentCall) and run.next_event().result(timeout=1) is second  # queued, not lost
