"""One bad agent, model reply or request never stops the run (issue 50): each is refused or fails its own dialog.

Part of the security suite: an AgentEnv is collected by a ContinuousLLMCollector over the scripted
engine, through the real endpoint on loopback. Each test feeds one attack next to well-behaved
dialogs and asserts that the attack is refused (HTTP 400, or a clear error naming the setting) or
ends only its own dialog, while the others come back whole. Every wait is bounded.
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections import defaultdict

import openai
import pytest
import torch

from lmcollect.agents import TOOL_PARSE_ERROR, AgentEnv, AgentEnvConfig, AgentServer
from lmcollect.agents.openai_format import RequestError, parse_chat_request
from lmcollect.agents.runs import AgentResult
from lmcollect.agents.tool_parsers import HermesToolParser, ToolCall
from lmcollect.collectors import ContinuousLLMCollector
from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.envs import PromptDataset
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script
from tests.factories import run_in_thread

DEEP = 5_000  # brackets: far deeper than json's recursion allows (about 1,000)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
SEEN: dict[str, list] = defaultdict(list)  # row behaviour -> what its agent saw (replies, status codes)


@pytest.fixture(scope="module")
def server():
    with AgentServer() as shared:
        shared.start()
        yield shared


def player(history: History) -> str:
    """The scripted model: a tool call nested ``DEEP`` deep for the "deep_reply" rows, else a short answer."""
    if "deep_reply" in history.messages[0].content:
        return '<tool_call>{"name": "add", "arguments": {"x": ' + "[" * DEEP + "]" * DEEP + "}}</tool_call>"
    return "ANSWER 3"


def rows(behaviours: list[str]) -> PromptDataset:
    return PromptDataset([{"prompt": f"row {i} {b}", "behaviour": b} for i, b in enumerate(behaviours)], shuffle=False)


def probe_agent(ctx, row):
    """One call (its reply kept in SEEN), then the return its row's behaviour names."""
    behaviour, client = row["behaviour"], ctx.openai()
    messages = [{"role": "user", "content": row["prompt"]}]
    if behaviour == "deep_args":  # an assistant message the model never wrote, with arguments nested too deep
        arguments = '{"x": ' + "[" * DEEP + "]" * DEEP + "}"
        call = {"id": "c0", "type": "function", "function": {"name": "add", "arguments": arguments}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c0", "content": "3"}]
    options = {"max_tokens": 1} if behaviour == "short" else {}
    try:
        reply = client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, **options)
    except openai.APIStatusError as exc:
        SEEN[behaviour].append(exc.status_code)
        SEEN[behaviour].append(exc.message)
        raise
    SEEN[behaviour].append(reply.choices[0].message)
    return RETURNS.get(behaviour, lambda: 1.0)()


def cyclic() -> dict:
    metadata: dict = {}
    metadata["self"] = metadata
    return metadata


RETURNS = {
    "tuple_keys": lambda: {"reward": 1.0, "metadata": {(1, 2): "x"}},
    "cycle": lambda: {"reward": 1.0, "metadata": cyclic()},
    "list": lambda: {"reward": 1.0, "metadata": ["a", "b"]},
    "nan": lambda: AgentResult(reward=math.nan),
    "nan_dict": lambda: {"reward": math.nan},
}


def collect_until(env, done, *, sampling: SamplingConfig, max_batches: int = 12, **engine_kwargs) -> tuple[list, object]:
    """Batches of 2 turns until ``done(turns)``; each next() bounded (a stall fails here, named)."""
    engine = ScriptedEngine(script=chat_script(player), **engine_kwargs)
    collector = ContinuousLLMCollector([env], engine=engine, tokenizer=ByteTokenizer(), sampling=sampling,
                                       dialog_turns_per_batch=2)
    turns: list = []
    try:
        with collector:
            while not done(turns):
                assert len(turns) < 2 * max_batches, f"only {len(turns)} turns came back: {SEEN}"
                turns += flatten_turns(run_in_thread(collector.next, timeout_s=60)())
    finally:
        engine.close()
        env.close()
    return turns, collector


def text(turn, key) -> str:
    return non_tensor_values(turn.unsqueeze(0), key)[0]


def kinds(turns) -> set[str]:
    return {re.search(r"row \d+ (\w+)", text(t, keys.TEXT_PROMPT)).group(1) for t in turns}


# ---------------------------------------------------------------------- 1-3: deep JSON
def test_the_parser_never_raises_on_json_nested_too_deep_or_numbers_too_long() -> None:
    parser = HermesToolParser()
    deep = '<tool_call>{"name": "add", "arguments": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}</tool_call>"
    reply = parser.parse(deep, call_id=str)
    assert reply.tool_calls == () and reply.content == deep and "nested too deeply" in reply.error
    long_number = '<tool_call>{"name": "add", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>"
    assert "not readable JSON" in parser.parse(long_number, call_id=str).error
    # rendering an agent's own call never raises either: arguments it cannot rewrite stay a string
    arguments = "[" * 100_000 + "]" * 100_000
    rendered = parser.render(None, [ToolCall(id="c", name="add", arguments=arguments)])
    assert json.dumps(arguments) in rendered


def test_a_deeply_nested_model_reply_or_agent_message_fails_no_dialog(server) -> None:
    SEEN.clear()
    env = AgentEnv(rows(["deep_reply", "ok", "deep_args", "ok"]), probe_agent, batch_size=2, seed=0, server=server)
    turns, collector = collect_until(env, lambda ts: {"deep_reply", "deep_args", "ok"} <= kinds(ts),
                                     sampling=SamplingConfig(max_new_tokens=4 * DEEP))
    deep = [t for t in turns if "deep_reply" in text(t, keys.TEXT_PROMPT)]
    assert all(text(t, ("next", *TOOL_PARSE_ERROR)) for t in deep)  # recorded as text, with the reason
    (message,) = SEEN["deep_reply"][:1]
    assert message.tool_calls is None and message.content.startswith("<tool_call>")  # the agent got its reply
    (args_turn,) = [t for t in turns if "deep_args" in text(t, keys.TEXT_PROMPT)][:1]
    assert '"arguments": "{\\"x\\": [[[' in text(args_turn, keys.TEXT_PROMPT)  # kept as the string it was
    assert collector.num_failed_dialogs == 0 and env.stats.runs_finished >= 3


# ---------------------------------------------------------------------- 4: max_tokens < min_new_tokens
def test_a_call_below_min_new_tokens_gets_a_400_and_only_its_dialog_ends(server) -> None:
    SEEN.clear()
    env = AgentEnv(rows(["short", "ok"]), probe_agent, batch_size=2, seed=0, server=server)
    turns, collector = collect_until(env, lambda ts: len(ts) >= 4 and len(SEEN["short"]) >= 2,
                                     sampling=SamplingConfig(max_new_tokens=16, min_new_tokens=4))
    assert SEEN["short"][0] == 400 and "max_tokens=1, below the collector's min_new_tokens=4" in SEEN["short"][1]
    assert kinds(turns) == {"ok"} and collector.num_failed_dialogs >= 1  # the short call was never recorded
    assert env.stats.runs_finished >= 4


# ---------------------------------------------------------------------- 5, 6: what an agent returns
@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [("tuple_keys", "cannot be written as JSON"), ("cycle", "cannot be written as JSON"),
     ("list", "must be a dict"), ("nan", "not a reward"), ("nan_dict", "not a reward")],
)
def test_metadata_that_is_no_json_or_a_nan_reward_fails_only_its_run_at_once(server, caplog, behaviour, reason) -> None:
    SEEN.clear()
    env = AgentEnv(rows([behaviour, "ok"]), probe_agent, batch_size=2, seed=0, server=server, agent_timeout_s=30)
    with caplog.at_level(logging.WARNING, logger="lmcollect"):
        turns, collector = collect_until(env, lambda ts: len(ts) >= 4, sampling=SamplingConfig(max_new_tokens=16))
    assert kinds(turns) == {"ok"} and collector.num_failed_dialogs >= 1
    assert any(reason in m for m in caplog.messages), caplog.messages  # its own error, at once: no 30 s timeout
    assert all(math.isfinite(float(t[keys.NEXT_REWARD])) for t in turns)
    assert env.stats.runs_failed >= 1


def test_agent_result_refuses_a_nan_reward_and_metadata_that_is_no_json() -> None:
    with pytest.raises(TypeError, match="not a reward"):
        AgentResult(reward=math.nan)
    with pytest.raises(TypeError, match="AgentResult.metadata cannot be written as JSON"):
        AgentResult(reward=1.0, metadata={(1, 2): "x"})
    with pytest.raises(TypeError, match="AgentResult.metadata must be a dict"):
        AgentResult(reward=1.0, metadata=["a", "b"])  # type: ignore[arg-type]
    assert json.loads(AgentResult(reward=1.0, metadata={"t": torch.tensor(1)}).metadata_text) == {"t": "tensor(1)"}


# ---------------------------------------------------------------------- 8: timeouts
def test_an_agent_timeout_past_what_a_wait_accepts_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"agent_timeout_s must be a positive number of seconds up to 604800"):
        AgentEnvConfig(agent_timeout_s=1e10)
    assert AgentEnvConfig(agent_timeout_s=3600).agent_timeout_s == 3600


# ---------------------------------------------------------------------- 9, 11: what a call may ask
def request(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stop": [f"s{i}" for i in range(500_000)]}, "at most 4 strings"),
        ({"stop": ["x" * 100_000]}, "of at most 1000 characters"),
        ({"temperature": 1e-300}, r"temperature must be a number 0 \(greedy\) or >= 0.01"),
    ],
    ids=["many_stops", "long_stop", "tiny_temperature"],
)
def test_unbounded_stops_and_a_vanishing_temperature_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message) as refused:
        parse_chat_request(request(**fields))
    assert refused.value.status == 400
    assert parse_chat_request(request(stop=["a", "b", "c", "d"], temperature=0.0)).stop == ("a", "b", "c", "d")


def test_sampling_refuses_a_temperature_that_overflows_the_logits() -> None:
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or >= 0.01"):
        SamplingConfig(temperature=1e-300)
    assert SamplingConfig(temperature=0).greedy and SamplingConfig(temperature=0.01).temperature == 0.01


def test_a_body_nested_too_deep_is_a_400(server) -> None:
    env = AgentEnv(rows(["ok"]), probe_agent, seed=0, server=server)
    run = env.start_run(0, env.draw_for(0))
    import httpx

    body = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    try:
        answer = httpx.post(f"{server.base_url}/chat/completions", content=body, timeout=30,
                            headers={"Authorization": f"Bearer {run.key}", "Content-Type": "application/json"})
    finally:
        env.close()
    assert answer.status_code == 400 and "not readable JSON" in answer.json()["error"]["message"]



# ---------------------------------------------------------------------- 10: a prompt longer than the context
CONTEXT = 200
LONG = "x" * 300  # one message of 300 byte tokens: past the scripted model's 200-token context


def long_prompt_agent(ctx, row):
    """Sends a prompt past the model's context for the "long" rows (its refusal kept in SEEN)."""
    content = f"{row['prompt']} {LONG if row['behaviour'] == 'long' else ''}"
    try:
        ctx.openai().chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": content}])
    except openai.BadRequestError as exc:
        SEEN[row["behaviour"]].append(exc.message)
        raise
    return 1.0


def test_every_engine_refuses_a_prompt_longer_than_its_context_at_submit(tiny_model_and_tokenizer) -> None:
    from lmcollect.engines import EngineRequest, TransformersEngine

    model, tokenizer = tiny_model_and_tokenizer
    context = model.config.max_position_embeddings
    with TransformersEngine(model, tokenizer) as engine:
        with pytest.raises(ValueError, match=rf"the prompt has {context} tokens, but TransformersEngine's model has a context of {context} tokens"):
            engine.submit(EngineRequest(prompt_ids=[1] * context, request_id="long"))
        assert engine.num_in_flight == 0  # nothing was queued
    scripted = ScriptedEngine(max_context_tokens=CONTEXT)
    with pytest.raises(ValueError, match=rf"the prompt has 300 tokens, .* context of {CONTEXT} tokens"):
        scripted.submit(EngineRequest(prompt_ids=[1] * 300))
    assert scripted.submit(EngineRequest(prompt_ids=[1] * (CONTEXT - 1))).result(timeout=30).tokens.numel() >= 1
    scripted.close()
    # VLLMEngine: tests/integration/test_vllm_engine.py::test_one_in_process_engine_with_worker_rpcs (a real engine)


def test_an_agent_prompt_past_the_context_gets_a_400_and_only_its_dialog_ends(server) -> None:
    SEEN.clear()
    env = AgentEnv(rows(["long", "ok"]), long_prompt_agent, batch_size=2, seed=0, server=server)
    turns, collector = collect_until(env, lambda ts: len(ts) >= 4 and SEEN["long"],
                                     sampling=SamplingConfig(max_new_tokens=16), max_context_tokens=CONTEXT)
    assert re.search(rf"the prompt has 3\d\d tokens, but ScriptedEngine's model has a context of {CONTEXT}", SEEN["long"][0])
    assert kinds(turns) == {"ok"} and collector.num_failed_dialogs >= 1  # nothing of it was generated or kept


def test_a_chat_dialog_past_the_context_is_refused_naming_the_dialog() -> None:
    from lmcollect.envs import ChatEnv, SingleTurnTask

    env = ChatEnv([{"prompt": LONG}], task=SingleTurnTask(), batch_size=1, seed=0)
    engine = ScriptedEngine(max_context_tokens=CONTEXT)
    collector = ContinuousLLMCollector([env], engine=engine, tokenizer=ByteTokenizer(),
                                       sampling=SamplingConfig(max_new_tokens=4), dialog_turns_per_batch=1)
    try:
        with collector, pytest.raises(ValueError, match=rf"context of {CONTEXT} tokens") as refused:
            run_in_thread(collector.next, timeout_s=60)()
    finally:
        engine.close()
    assert any("dialog slot 0 (trajectory" in note for note in refused.value.__notes__)
    assert engine.num_steps == 0  # refused before any prefill


# ---------------------------------------------------------------------- 7: proxies
def test_agent_clients_never_send_the_run_key_through_a_proxy(server, monkeypatch) -> None:
    import asyncio
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from lmcollect.agents.runs import AgentContext, AgentRun

    seen: list[str] = []

    class Proxy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append(str(self.headers.get("Authorization")))
            self.send_error(502)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args) -> None:
            pass

    proxy = HTTPServer(("127.0.0.1", 0), Proxy)
    proxy.timeout = 5
    serving = threading.Thread(target=proxy.serve_forever, daemon=True)
    serving.start()
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.server_port}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    run = AgentRun(key="proxy-test-key", dialog="agent run 98", prompt_id=0)
    server.register(run)
    context = AgentContext(run, base_url=server.base_url, model=server.model_name)
    try:
        assert [m.id for m in context.openai(timeout=10).models.list()] == [server.model_name]
        listed = asyncio.run(asyncio.wait_for(context.async_openai(timeout=10).models.list(), 20))
        assert [m.id for m in listed.data] == [server.model_name]
    finally:
        server.retire(run)
        proxy.shutdown()
        proxy.server_close()
        serving.join(10)
    assert seen == []  # the proxy never saw the key


# ---------------------------------------------------------------------- closing while a reset starts a run
@pytest.mark.filterwarnings("ignore:coroutine 'AgentRun._run_async' was never awaited")  # cancelled before it ran
def test_closing_while_a_reset_starts_an_async_agent_ends_its_wait_at_once(server, monkeypatch) -> None:
    import asyncio
    import time

    from lmcollect.agents.runs import AgentRun
    from lmcollect.envs import DialogFailed

    async def waiting_agent(ctx, row):
        await asyncio.sleep(120)  # never calls before the env closes
        return 1.0

    started, closed = threading.Event(), threading.Event()
    real_start = AgentRun.start

    def start_then_hold(self, *args):
        real_start(self, *args)  # the agent is scheduled on the env's loop
        started.set()
        assert closed.wait(30), "the test never closed the env"

    monkeypatch.setattr(AgentRun, "start", start_then_hold)
    env = AgentEnv(rows(["ok"]), waiting_agent, seed=0, server=server)  # agent_timeout_s: 300 s
    join = run_in_thread(env.reset, timeout_s=30)
    assert started.wait(30), "the reset never started its run"
    env.close()  # the run is not its element's yet: close must still end it
    closed.set()
    begin = time.monotonic()
    with pytest.raises((DialogFailed, RuntimeError), match="closed|ended"):
        join()
    assert time.monotonic() - begin < 10  # not agent_timeout_s


def test_the_served_engine_refuses_a_prompt_past_the_listed_max_model_len(served_toy) -> None:
    from lmcollect.engines import EngineRequest
    from lmcollect.engines.served import VLLMServerEngine

    plain = served_toy.toy.answer

    def with_context(method: str, path: str):
        if (method, path) == ("GET", "/v1/models"):  # as vLLM lists it
            return 200, {"data": [{"id": "toy", "root": "/toy", "max_model_len": CONTEXT}]}
        return plain(method, path)

    served_toy.toy.answer = with_context
    engine = VLLMServerEngine(served_toy.url)
    try:
        assert engine.max_context_tokens == CONTEXT
        with pytest.raises(ValueError, match=rf"the prompt has {CONTEXT} tokens, but VLLMServerEngine's model has a context of {CONTEXT}"):
            engine.submit(EngineRequest(prompt_ids=[1] * CONTEXT))
        assert ("POST", "/v1/completions", False) not in served_toy.toy.seen  # refused before it was sent
        assert engine.submit(EngineRequest(prompt_ids=[1] * 8)).result(timeout=30).tokens.tolist() == [5, 6]
    finally:
        engine.close()


class RefusesInItsFuture:
    """An engine in another process as the collector sees it (a Ray actor's): its own submit's refusal
    comes back through the future, not raised by submit."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self.engine = engine

    def submit(self, request):
        from concurrent.futures import Future

        try:
            return self.engine.submit(request)
        except ValueError as exc:
            future: Future = Future()
            future.set_exception(exc)
            return future

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def test_a_prompt_refused_by_an_engine_elsewhere_fails_only_its_agent_dialog(server) -> None:
    SEEN.clear()
    env = AgentEnv(rows(["long", "ok"]), long_prompt_agent, batch_size=2, seed=0, server=server)
    engine = ScriptedEngine(script=chat_script(player), max_context_tokens=CONTEXT)
    collector = ContinuousLLMCollector([env], engine=RefusesInItsFuture(engine), tokenizer=ByteTokenizer(),
                                       sampling=SamplingConfig(max_new_tokens=16), dialog_turns_per_batch=2)
    turns: list = []
    try:
        with collector:
            while len(turns) < 4 or not SEEN["long"]:
                assert len(turns) < 24, f"only {len(turns)} turns came back"
                turns += flatten_turns(run_in_thread(collector.next, timeout_s=60)())
    finally:
        engine.close()
        env.close()
    assert f"context of {CONTEXT} tokens" in SEEN["long"][0] and kinds(turns) == {"ok"}
