"""The agent endpoint's pure parts: Hermes tool calls in and out, OpenAI requests checked, messages as a History."""
from __future__ import annotations

import json

import pytest

from lmcollect.agents import HermesToolParser, RequestError, ToolCall, get_tool_parser
from lmcollect.agents.openai_format import cut_at_stops, history_of, parse_chat_request, reply_key
from lmcollect.data import History

PARSER = HermesToolParser()
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def ids(k: int) -> str:
    return f"call_{k}"


def test_hermes_calls_are_read_with_the_text_around_them() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>'
    reply = PARSER.parse(text, call_id=ids)
    assert reply.error == "" and reply.content == "Let me add."
    assert reply.tool_calls == (ToolCall("call_0", "add", '{"a": 1, "b": 2}'), ToolCall("call_1", "add", '{"a": 3}'))
    assert PARSER.parse("no call here", call_id=ids).tool_calls == ()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "not JSON"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "not closed"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "arguments must be a JSON object"),
    ],
)
def test_a_malformed_call_leaves_the_reply_as_plain_text_with_the_error(text: str, error: str) -> None:
    reply = PARSER.parse(text, call_id=ids)
    assert reply.content == text and reply.tool_calls == () and error in reply.error


def test_rendered_calls_parse_back_to_themselves() -> None:
    calls = (ToolCall("c0", "add", '{"a": 1}'), ToolCall("c1", "mul", '{"x": [2, 3]}'))
    text = PARSER.render("thinking", calls)
    reply = PARSER.parse(text, call_id=lambda k: calls[k].id)
    assert reply.content == "thinking" and reply.tool_calls == calls
    with pytest.raises(ValueError, match="not a shipped format"):
        get_tool_parser("nope")


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream must be true or false"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "repeats=k"),
        ({"messages": []}, 400, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "'role' is one of"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "only text"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "'tools'"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(body: dict, status: int, words: str) -> None:
    with pytest.raises(RequestError, match=words) as caught:
        parse_chat_request(body)
    assert caught.value.status == status


def test_a_request_reads_its_sampling_and_tools() -> None:
    request = parse_chat_request({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                     {"role": "user", "content": "hi"}],
        "tools": TOOLS, "max_completion_tokens": 7, "stop": "END", "temperature": 0.5, "tool_choice": "auto",
    })
    assert request.parse_tool_calls and request.tools == tuple(TOOLS)
    assert request.sampling_overrides(agent_sampling=False) == {"max_new_tokens": 7, "stop_strings": ["END"]}
    assert request.sampling_overrides(agent_sampling=True)["temperature"] == 0.5
    assert not parse_chat_request({"messages": list(request.messages), "tools": TOOLS, "tool_choice": "none"}).parse_tool_calls
    history = history_of(request, {}, PARSER)
    assert [(m.role, m.content) for m in history.messages] == [("system", "be brief"), ("user", "hi")]
    assert history.tools == tuple(TOOLS)


def test_an_echoed_reply_becomes_the_models_own_text_and_other_assistant_messages_are_rendered() -> None:
    written = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    echoed = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}
    replies = {reply_key(None, (ToolCall("c0", "add", '{"a": 1}'),)): written}
    messages = [{"role": "user", "content": "q"}, echoed, {"role": "tool", "tool_call_id": "c0", "content": "1"}]
    history = history_of(parse_chat_request({"messages": messages}), replies, PARSER)
    assert history.messages[1].content == written and history.messages[2].role == "tool"
    # an assistant message the model never wrote in this dialog: rendered as the model would write it
    other = history_of(parse_chat_request({"messages": messages}), {}, PARSER).messages[1].content
    assert json.loads(other.split("\n")[1]) == {"name": "add", "arguments": {"a": 1}}


def test_stop_strings_cut_the_returned_text() -> None:
    assert cut_at_stops("answer END more", ("END", "more")) == ("answer ", True)
    assert cut_at_stops("answer", ("END",)) == ("answer", False)


def test_histories_keep_their_tools_when_they_grow() -> None:
    history = History.from_dicts([{"role": "user", "content": "q"}], tools=TOOLS)
    grown = history.append("assistant", "a").append("tool", "1")
    assert grown.tools == tuple(TOOLS) and grown[:1].tools == tuple(TOOLS)


def test_tools_reach_a_chat_template_that_renders_them() -> None:
    class ShowsTools:
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, tools=None):
            return json.dumps({"messages": messages, "tools": tools})

    rendered = json.loads(History.from_dicts([{"role": "user", "content": "q"}], tools=TOOLS).apply_chat_template(ShowsTools()))
    assert rendered["tools"] == TOOLS


def test_the_demos_compact_calls_parse_render_and_warm_up() -> None:
    from lmcollect.agents.compare_agent import CompactCallParser, compare, compare_rows, warmup_rows

    parser = CompactCallParser()
    (call,) = parser.parse("call: compare", call_id=ids).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("compare", {})
    assert parser.parse("call: add {\"a\": 1}", call_id=ids).tool_calls[0].arguments == '{"a": 1}'
    assert "not JSON" in parser.parse("call: add {oops", call_id=ids).error
    assert parser.parse("7", call_id=ids) == parser.parse("7", call_id=ids) and not parser.parse("7", call_id=ids).tool_calls
    assert parser.render(None, [call]) == "call: compare"
    row = compare_rows(1, seed=0)[0]
    assert compare(row["prompt"]) == row["answer"]
    first, second = warmup_rows([row], seed=0)
    assert first["answer"] == "call: compare" and second["prompt"][-1] == {"role": "tool", "content": row["answer"]}
    assert second["answer"] in row["prompt"]


def test_an_observation_sets_its_turns_sampling_within_the_collectors() -> None:
    from tensordict import TensorDict

    from lmcollect.collectors.continuous.engine_turns import sampling_of
    from lmcollect.data import keys
    from lmcollect.policies import SamplingConfig

    base = SamplingConfig(max_new_tokens=16, temperature=1.0, stop_strings=("END",))
    obs = TensorDict({}, [])
    assert sampling_of(obs, base) is base
    obs.set(keys.SAMPLING_OVERRIDES, json.dumps({"max_new_tokens": 99, "stop_strings": ["STOP"], "temperature": 0.0}))
    turn = sampling_of(obs, base)
    assert (turn.max_new_tokens, turn.stop_strings, turn.temperature) == (16, ("END", "STOP"), 0.0)  # capped, added
    obs.set(keys.SAMPLING_OVERRIDES, json.dumps({"top_k": 3}))
    with pytest.raises(ValueError, match="keys among"):
        sampling_of(obs, base)
