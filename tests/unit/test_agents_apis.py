"""Every API surface of the agent endpoint with its real client library, offline: chat completions
(streamed and not), the OpenAI Responses API and the Anthropic Messages API, sync and async, over
HTTP and in-process. The same dialogs (a tool call, its result, the answer) through every surface
must record the same tokens as plain chat completions; a client that leaves a stream ends its
dialog there, recorded as cut; what a surface does not support is refused naming the field.
"""
from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch

from lmcollect.agents import AgentEnv, AgentEnvConfig, AgentServer
from lmcollect.agents.element import AGENT_ERROR
from lmcollect.agents.runs import AgentContext, AgentRun
from lmcollect.data import keys
from lmcollect.testing.scripted_engine import ScriptedEngine, chat_script
from tests.unit.test_agents import TOOLS, collect, dialogs_of, player, rows, scripted_engine, text

RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "a + b", "parameters": TOOLS[0]["function"]["parameters"]}]
MESSAGES_TOOLS = [{"name": "add", "description": "a + b", "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def server():
    with AgentServer() as shared:
        shared.start()
        yield shared


def add(arguments: str | dict) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return str(args["a"] + args["b"])


# ---------------------------------------------------------------------- one model call per API, as agents write it
def chat_reply(completion_or_chunks, stream: bool) -> dict:
    """The assistant message, from a completion or accumulated from streamed chunks."""
    if not stream:
        return completion_or_chunks.choices[0].message.model_dump(exclude_none=True)
    content, calls, usage = "", {}, None
    for chunk in completion_or_chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = delta.id or call["id"]
                call["function"]["name"] += delta.function.name or ""
                call["function"]["arguments"] += delta.function.arguments or ""
    assert usage is not None and usage.completion_tokens > 0  # stream_options.include_usage
    return {"role": "assistant", "content": content, **({"tool_calls": list(calls.values())} if calls else {})}


def chat_step(client, ctx, messages, stream):
    kwargs = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    return client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, **kwargs)


def chat_turns(message: dict) -> tuple[list, str | None]:
    """What the agent appends (the reply, the tool results) and its final text (None: more calls)."""
    calls = message.get("tool_calls") or []
    results = [{"role": "tool", "tool_call_id": c["id"], "content": add(c["function"]["arguments"])} for c in calls]
    return [message, *results], None if calls else message.get("content")


def responses_output(response_or_events, stream: bool) -> list:
    if not stream:
        return response_or_events.output
    completed = [e for e in response_or_events if e.type == "response.completed"]
    assert len(completed) == 1
    return completed[0].response.output


def responses_turns(output: list) -> tuple[list, str | None]:
    items = [item.model_dump(exclude_none=True) for item in output]
    calls = [item for item in items if item["type"] == "function_call"]
    results = [{"type": "function_call_output", "call_id": c["call_id"], "output": add(c["arguments"])} for c in calls]
    texts = [part["text"] for item in items if item["type"] == "message" for part in item["content"]]
    return items + results, None if calls else "".join(texts)


def messages_turns(message) -> tuple[list, str | None]:
    blocks = [block.model_dump(exclude_none=True) for block in message.content]
    blocks = [{k: v for k, v in b.items() if k != "parsed_output"} for b in blocks]
    calls = [b for b in blocks if b["type"] == "tool_use"]
    results = [{"type": "tool_result", "tool_use_id": c["id"], "content": add(c["input"])} for c in calls]
    answer = None if calls else "".join(b["text"] for b in blocks if b["type"] == "text")
    return [{"role": "assistant", "content": blocks}, *([{"role": "user", "content": results}] if results else [])], answer


def sync_agent(api: str, stream: bool):
    def agent(ctx, row):
        history: list = [{"role": "user", "content": row["prompt"]}]
        for _ in range(3):
            if api == "chat":
                client = ctx.openai()
                turns, answer = chat_turns(chat_reply(chat_step(client, ctx, history, stream), stream))
            elif api == "responses":
                client = ctx.openai()
                reply = client.responses.create(model=ctx.model, input=history, tools=RESPONSES_TOOLS, stream=stream)
                turns, answer = responses_turns(responses_output(reply, stream))
            else:
                client = ctx.anthropic()
                kwargs = {"model": ctx.model, "max_tokens": 200, "messages": history, "tools": MESSAGES_TOOLS}
                if stream:
                    with client.messages.stream(**kwargs) as events:
                        message = events.get_final_message()
                else:
                    message = client.messages.create(**kwargs)
                turns, answer = messages_turns(message)
            history += turns
            if answer is not None:
                return float(answer.startswith(f"ANSWER {row['answer']} "))
        return 0.0

    return agent


def async_agent(api: str, stream: bool):
    async def agent(ctx, row):
        history: list = [{"role": "user", "content": row["prompt"]}]
        for _ in range(3):
            if api == "chat":
                client = ctx.async_openai()
                kwargs = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
                reply = await client.chat.completions.create(model=ctx.model, messages=history, tools=TOOLS, **kwargs)
                turns, answer = chat_turns(chat_reply([c async for c in reply] if stream else reply, stream))
            elif api == "responses":
                client = ctx.async_openai()
                reply = await client.responses.create(model=ctx.model, input=history, tools=RESPONSES_TOOLS, stream=stream)
                turns, answer = responses_turns(responses_output([e async for e in reply] if stream else reply, stream))
            else:
                client = ctx.async_anthropic()
                kwargs = {"model": ctx.model, "max_tokens": 200, "messages": history, "tools": MESSAGES_TOOLS}
                if stream:
                    async with client.messages.stream(**kwargs) as events:
                        message = await events.get_final_message()
                else:
                    message = await client.messages.create(**kwargs)
                turns, answer = messages_turns(message)
            history += turns
            if answer is not None:
                return float(answer.startswith(f"ANSWER {row['answer']} "))
        return 0.0

    return agent


def recorded(api: str, stream: bool, asynchronous: bool, transport: str, server) -> dict[str, list]:
    """Each row's dialog as recorded: the tokens of its turns, in order (two turns each)."""
    agent = (async_agent if asynchronous else sync_agent)(api, stream)
    env = AgentEnv(rows(["ok"] * 4), agent, batch_size=2, repeats=2, seed=0, server=server, transport=transport)
    engine = scripted_engine()
    turns = collect(env, engine, batches=1, dialog_turns_per_batch=8)  # 2 groups of 2 runs, one at a time
    engine.close()
    assert env.stats.runs_failed == 0 and env.stats.tool_parse_errors == 0
    dialogs = {}
    for steps in dialogs_of(turns).values():
        assert [float(t[keys.NEXT_REWARD]) for t in steps] == [0.0, 1.0]  # the tool round trip gave the right answer
        first, second = steps
        # token-exact: the second call's prompt is the first turn's tokens as generated, then the tool result
        assert torch.equal(second[keys.TOKENS_PROMPT][: first[keys.TOKENS_FULL].numel()], first[keys.TOKENS_FULL])
        dialogs[text(first, keys.TEXT_PROMPT)] = [t[keys.TOKENS_FULL].tolist() for t in steps]
    return dialogs


@pytest.fixture(scope="module")
def plain_chat(server) -> dict[str, list]:
    return recorded("chat", False, False, "http", server)


@pytest.mark.parametrize("transport", ["http", "in_process"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_every_surface_records_the_same_turns_as_plain_chat_completions(
    api, stream, asynchronous, transport, server, plain_chat
) -> None:
    assert len(plain_chat) >= 2
    theirs = recorded(api, stream, asynchronous, transport, server)
    common = set(theirs) & set(plain_chat)  # the rows whose runs were in both batches
    assert len(common) >= 2 and all(theirs[prompt] == plain_chat[prompt] for prompt in common)


# ---------------------------------------------------------------------- a client that leaves a stream
def leaving_agent(ctx, row):
    """Reads the first event of a streamed reply and closes it, then tries to go on (its dialog has ended)."""
    client = ctx.openai()
    messages = [{"role": "user", "content": row["prompt"]}]
    with client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS, stream=True) as chunks:
        first = next(iter(chunks))
    assert first.choices[0].delta.role == "assistant"
    with pytest.raises(openai.ConflictError, match="has ended"):
        client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
    return 1.0


async def async_leaving_agent(ctx, row):
    client = ctx.async_anthropic()
    kwargs = {"model": ctx.model, "max_tokens": 50, "messages": [{"role": "user", "content": row["prompt"]}]}
    events = await client.messages.create(stream=True, **kwargs)
    first = await events.__anext__()
    await events.close()
    assert first.type == "message_start"
    with pytest.raises(anthropic.ConflictError, match="has ended"):
        await client.messages.create(**kwargs)
    return 1.0


def assert_cut(env, turns) -> None:
    (turn,) = turns
    assert bool(turn["next", keys.DONE]) and bool(turn["next", keys.TRUNCATED]) and not bool(turn["next", keys.TERMINATED])
    assert "the client left" in text(turn, ("next", *AGENT_ERROR))
    assert turn[keys.TOKENS_RESPONSE].numel() > 0 and turn[keys.LOG_PROBS_RESPONSE].numel() == turn[keys.TOKENS_RESPONSE].numel()
    # (the next run in the slot may have been cut too before the collector closed)
    assert env.stats.streams_cut >= 1 and env.stats.runs_failed == 0 and env.stats.runs_finished == 0


@pytest.mark.parametrize("agent", [leaving_agent, async_leaving_agent], ids=["sync-openai", "async-anthropic"])
def test_a_client_that_leaves_mid_stream_ends_its_dialog_there_recorded_as_cut(agent, server) -> None:
    env = AgentEnv(rows(["ok"] * 2), agent, seed=0, server=server, transport="in_process")
    assert_cut(env, collect(env, scripted_engine(), batches=1, dialog_turns_per_batch=1))


def test_a_client_that_leaves_while_its_streamed_reply_is_generated_is_recorded_as_cut(server) -> None:
    """Over HTTP: the client gives up (a read timeout) before the first event; the endpoint sees it go."""

    def impatient_agent(ctx, row):
        client = ctx.openai(timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": row["prompt"]}],
                                           stream=True)
        return 1.0

    env = AgentEnv(rows(["ok"] * 2), impatient_agent, seed=0, server=server)
    slow = ScriptedEngine(script=chat_script(player), token_delay_s=0.02)  # ~1.5 s per reply
    assert_cut(env, collect(env, slow, batches=1, dialog_turns_per_batch=1))


# ---------------------------------------------------------------------- refusals, per API
@pytest.mark.parametrize("in_process", [False, True], ids=["http", "in_process"])
def test_every_api_refuses_keys_and_unsupported_fields_naming_them(server, in_process) -> None:
    run = AgentRun(key=f"refusals-{in_process}", dialog="agent run 98", prompt_id=0)
    server.register(run)
    ctx = AgentContext(run, server=server, model="m", in_process=in_process)
    chat, claude = ctx.openai(), ctx.anthropic()
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="previous_response_id: the endpoint stores no responses"):
        chat.responses.create(model="m", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]: only function tools"):
        chat.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match=r"input\[0\].type='reasoning' is not supported"):
        chat.responses.create(model="m", input=[{"type": "reasoning", "summary": []}])
    with pytest.raises(openai.BadRequestError, match="max_output_tokens must be an integer"):
        chat.responses.create(model="m", input="hi", max_output_tokens=0)
    with pytest.raises(anthropic.BadRequestError, match="thinking: extended thinking is not supported"):
        claude.messages.create(model="m", max_tokens=5, messages=user, thinking={"type": "enabled", "budget_tokens": 1024})
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\].content\[0\]: type 'image' is not supported"):
        claude.messages.create(model="m", max_tokens=5, messages=image)
    with pytest.raises(anthropic.BadRequestError, match="invalid_request_error"):  # Anthropic's error body
        claude.messages.create(model="m", max_tokens=5, messages=user, stop_sequences=["a"] * 5)
    wrong = AgentContext(AgentRun(key="nobody", dialog="x", prompt_id=0), server=server, model="m", in_process=in_process)
    with pytest.raises(anthropic.AuthenticationError, match="unknown API key"):
        wrong.anthropic().messages.create(model="m", max_tokens=5, messages=user)
    with pytest.raises(openai.AuthenticationError, match="unknown API key"):
        wrong.openai().responses.create(model="m", input="hi")
    server.retire(run)
    with pytest.raises(anthropic.ConflictError, match="agent run 98 has ended"):
        claude.messages.create(model="m", max_tokens=5, messages=user, stream=True)
    with pytest.raises(openai.ConflictError, match="agent run 98 has ended"):
        chat.responses.create(model="m", input="hi", stream=True)
    assert not run.next_event().done()  # nothing reached the run


def test_the_in_process_transport_needs_no_listener_and_is_checked() -> None:
    with pytest.raises(ValueError, match="transport must be 'http' or 'in_process'"):
        AgentEnvConfig(transport="socket")

    async def agent(ctx, row):
        reply = await ctx.async_http_client().post("/chat/completions", json={"messages": [{"role": "user", "content": row["prompt"]}]})
        assert reply.status_code == 200 and reply.json()["object"] == "chat.completion"
        return 1.0

    env = AgentEnv(rows(["ok"] * 2), agent, seed=0, transport="in_process")
    turns = collect(env, scripted_engine(), batches=1, dialog_turns_per_batch=1)
    assert len(turns) == 1 and env._endpoint().port == 0  # it never listened (the port is set once it does)
    env.close()


def test_async_agents_share_the_loop_with_in_process_calls() -> None:
    """Many async agents at once, in-process: each gets its own replies (nothing mixed, nothing lost)."""
    env = AgentEnv(rows(["ok"] * 8), async_agent("chat", True), batch_size=8, seed=1, transport="in_process")
    turns = collect(env, scripted_engine(token_delay_s=0.001), batches=2, dialog_turns_per_batch=8)
    env.close()
    assert env.stats.runs_failed == 0 and all(float(t[keys.NEXT_REWARD]) in (0.0, 1.0) for t in turns)
    assert sum(float(t[keys.NEXT_REWARD]) for t in turns) >= 4


# ---------------------------------------------------------------------- each API's form, without a server
def test_responses_input_items_become_one_chat_conversation() -> None:
    from lmcollect.agents.responses_format import parse_responses_request

    request = parse_responses_request({
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "add 1 2"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "on it"}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
        ],
        "tools": RESPONSES_TOOLS, "max_output_tokens": 7, "tool_choice": "none", "stream": True,
    })
    assert [dict(m) for m in request.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 1 2"},
        {"role": "assistant", "content": "on it",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    assert request.tools == tuple(TOOLS) and request.max_tokens == 7 and request.stream
    assert not request.parse_tool_calls  # tool_choice="none"


def test_messages_blocks_become_one_chat_conversation() -> None:
    from lmcollect.agents.anthropic_format import parse_messages_request

    request = parse_messages_request({
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [
            {"role": "user", "content": "add 1 2"},
            {"role": "assistant", "content": [{"type": "text", "text": "on it"},
                                              {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [{"type": "text", "text": "3"}]},
                                         {"type": "text", "text": "and now?"}]},
        ],
        "tools": MESSAGES_TOOLS, "max_tokens": 9, "stop_sequences": ["END"], "tool_choice": {"type": "none"},
    })
    assert [dict(m) for m in request.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 1 2"},
        {"role": "assistant", "content": "on it",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "user", "content": "and now?"},
    ]
    assert request.tools == tuple(TOOLS) and request.max_tokens == 9 and request.stop == ("END",)
    assert not request.parse_tool_calls and not request.stream


def test_one_reply_in_every_form() -> None:
    from lmcollect.agents.anthropic_format import message_events, message_json
    from lmcollect.agents.openai_format import CallReply, completion_chunks, completion_json, parse_chat_request
    from lmcollect.agents.responses_format import response_events, response_json
    from lmcollect.agents.tool_parsers import ParsedReply, ToolCall

    stopped = CallReply(reply=ParsedReply(content="x" * 100), finish_reason="stop", stop="END", prompt_tokens=3,
                        completion_tokens=5)
    message = message_json(stopped, message_id="m", model="p")
    assert (message["stop_reason"], message["stop_sequence"], message["usage"]) == ("stop_sequence", "END",
                                                                                   {"input_tokens": 3, "output_tokens": 5})
    cut = CallReply(reply=ParsedReply(content="abc"), finish_reason="length", stop=None, prompt_tokens=3, completion_tokens=5)
    request = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                  "stream_options": {"include_usage": True}})
    assert completion_json(cut, completion_id="c", model="p")["choices"][0]["finish_reason"] == "length"
    assert message_json(cut, message_id="m", model="p")["stop_reason"] == "max_tokens"
    response = response_json(cut, request, response_id="r", model="p")
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    calls = CallReply(reply=ParsedReply(content=None, tool_calls=(ToolCall("c1", "add", '{"a": 1}'),)),
                      finish_reason="stop", stop=None, prompt_tokens=3, completion_tokens=5)
    chunks = [json.loads(e.decode().removeprefix("data: ")) for e in completion_chunks(calls, request, completion_id="c", model="p")[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1]["usage"]["total_tokens"] == 8
    text_chunks = completion_chunks(stopped, request, completion_id="c", model="p")
    text = "".join(json.loads(e.decode()[6:])["choices"][0]["delta"].get("content", "")
                   for e in text_chunks[:-2])
    assert text == "x" * 100 and len(text_chunks) == 6  # role, 64 + 36 characters, finish, usage, [DONE]
    events = [e.decode().split("\n") for e in response_events(calls, request, response_id="r", model="p")]
    assert [json.loads(lines[1][6:])["sequence_number"] for lines in events] == list(range(len(events)))
    assert events[-1][0] == "event: response.completed" and "function_call_arguments.done" in events[-3][0]
    names = [e.decode().split("\n")[0] for e in message_events(calls, message_id="m", model="p")]
    assert names == ["event: message_start", "event: content_block_start", "event: content_block_delta",
                     "event: content_block_stop", "event: message_delta", "event: message_stop"]


# ---------------------------------------------------------------------- a real chat template: the tiny model
def two_calls(api: str):
    """Two calls through ``api``, the first reply echoed back as the client returned it, then a user message."""

    def agent(ctx, row):
        history: list = [{"role": "user", "content": row["prompt"]}]
        for budget in (6, 5):
            if api == "chat-stream":
                chunks = ctx.openai().chat.completions.create(model=ctx.model, messages=history, max_tokens=budget,
                                                              stream=True, stream_options={"include_usage": True})
                history.append(chat_reply(chunks, True))
            elif api == "responses":
                response = ctx.openai().responses.create(model=ctx.model, input=history, max_output_tokens=budget)
                history += [item.model_dump(exclude_none=True) for item in response.output]
            else:
                with ctx.anthropic().messages.stream(model=ctx.model, max_tokens=budget, messages=history) as events:
                    history += messages_turns(events.get_final_message())[0]
            history.append({"role": "user", "content": "and then?"})
        return 0.0

    return agent


@pytest.mark.parametrize(("api", "transport"), [("chat-stream", "http"), ("responses", "in_process"),
                                                ("messages-stream", "in_process")])
def test_token_exact_prompts_across_calls_with_the_tiny_model_on_every_api(
    api, transport, server, tiny_model_and_tokenizer
) -> None:
    from lmcollect.collectors import ContinuousLLMCollector
    from lmcollect.data.turns import flatten_turns
    from lmcollect.engines import TransformersEngine
    from lmcollect.policies import SamplingConfig

    model, tokenizer = tiny_model_and_tokenizer
    rows_ = [{"prompt": f"What is {i} + 1?"} for i in range(4)]
    env = AgentEnv(rows_, two_calls(api), batch_size=2, seed=0, server=server, transport=transport)
    with TransformersEngine(model, tokenizer) as engine:
        collector = ContinuousLLMCollector([env], engine=engine, tokenizer=tokenizer, track_policy_version=True,
                                           sampling=SamplingConfig(max_new_tokens=16, temperature=1.0),
                                           dialog_turns_per_batch=4, total_dialog_turns=4)  # none in flight after
        with collector:
            turns = flatten_turns(collector.next())
            mismatches = collector.num_prefix_mismatches  # counted as turns start: all of them are in the batch
    pairs = [steps for steps in dialogs_of(turns).values() if len(steps) == 2]
    assert pairs and env.stats.runs_failed == 0
    for first, second in pairs:
        assert int(first[keys.SAMPLING_MAX_NEW_TOKENS]) == 6 and second[keys.TOKENS_RESPONSE].numel() <= 5
        assert torch.equal(second[keys.TOKENS_PROMPT][: first[keys.TOKENS_FULL].numel()], first[keys.TOKENS_FULL])
        retokenized = tokenizer(text(second, keys.TEXT_PROMPT), add_special_tokens=False)["input_ids"]
        assert bool(second[keys.PREFIX_MISMATCH]) == (retokenized != second[keys.TOKENS_PROMPT].tolist())
        assert second[keys.LOG_PROBS_RESPONSE].numel() == second[keys.TOKENS_RESPONSE].numel()
    assert mismatches == sum(bool(t[keys.PREFIX_MISMATCH]) for t in turns)


# ---------------------------------------------------------------------- echoed replies as frameworks send them back
def test_an_echoed_call_is_recognised_whatever_its_json_spacing_and_a_rewrite_is_counted(server) -> None:
    """The second call echoes the first reply's tool call with compact arguments (as pydantic-ai does): the
    prompt extends the recorded tokens. The third rewrites that reply's text: rendered whole, counted."""
    from lmcollect.agents.openai_format import reply_key
    from lmcollect.agents.tool_parsers import ToolCall

    assert reply_key(None, [ToolCall("c", "add", '{"a": 1, "b": 2}')]) == reply_key("", [ToolCall("c", "add", '{"b":2,"a":1}')])
    assert reply_key("", [ToolCall("c", "add", "{not json")]) != reply_key("", [ToolCall("c", "add", "{not  json")])

    def agent(ctx, row):
        client, messages = ctx.openai(), [{"role": "user", "content": row["prompt"]}]
        call = client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS).choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        compact = {"id": call.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(args, separators=(",", ":"))}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [compact]},
                     {"role": "tool", "tool_call_id": call.id, "content": add(args)}]
        answer = client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS).choices[0].message
        messages += [{"role": "assistant", "content": answer.content + " (edited)"}, {"role": "user", "content": "sure?"}]
        client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
        return 1.0

    env = AgentEnv(rows(["ok"] * 2), agent, seed=0, server=server)
    first, second, third = dialogs_of(collect(env, scripted_engine(), batches=1, dialog_turns_per_batch=3)).popitem()[1]
    assert torch.equal(second[keys.TOKENS_PROMPT][: first[keys.TOKENS_FULL].numel()], first[keys.TOKENS_FULL])
    assert not torch.equal(third[keys.TOKENS_PROMPT][: second[keys.TOKENS_FULL].numel()], second[keys.TOKENS_FULL])
    assert "(edited)" in text(third, keys.TEXT_PROMPT) and env.stats.calls_rewritten >= 1  # (a next run may have too)
