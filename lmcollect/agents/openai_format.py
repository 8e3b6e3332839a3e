"""OpenAI chat-completions JSON in and out: requests checked and read, messages as a History, replies as JSON or server-sent events (pure logic).

Every API the endpoint serves (chat completions here, :mod:`~lmcollect.agents.responses_format`,
:mod:`~lmcollect.agents.anthropic_format`) reads its body into a :class:`ChatRequest` (one
conversation in chat-completions form: the one turn and token machinery) and writes a
:class:`CallReply` back in its own form (an :class:`ApiFormat`).
"""

from __future__ import annotations

import json
import math
import numbers
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lmcollect.agents.tool_parsers import ParsedReply, ToolCall, ToolParser
from lmcollect.data.history import History, Message, tools_of
from lmcollect.engines.sampling import MIN_TEMPERATURE

MAX_STOP_STRINGS = 4
"""Stop strings per call at most (OpenAI's limit): the engine loop every dialog shares checks each."""
MAX_STOP_CHARS = 1000
"""Characters per stop string at most."""

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
"""OpenAI message roles and the History role each becomes (``developer`` is OpenAI's newer ``system``)."""


class RequestError(ValueError):
    """A request the endpoint refuses: its HTTP status and OpenAI error type say why (nothing was recorded)."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


ReplyKey = tuple[str, tuple[tuple[str, str, str], ...]]
"""An assistant message as (text, ((call id, name, arguments), ...)): how a reply the agent echoes is recognised."""


@dataclass(frozen=True)
class ChatRequest:
    """One ``POST /v1/chat/completions`` body, checked."""

    messages: tuple[Mapping[str, Any], ...]
    """The conversation as the agent sent it."""
    tools: tuple[dict[str, Any], ...] | None
    """Function definitions offered to the model (None: none)."""
    parse_tool_calls: bool
    """Read tool calls out of the reply: tools were offered and ``tool_choice`` is not "none"."""
    max_tokens: int | None
    """``max_tokens`` / ``max_completion_tokens`` (None: the collector's budget)."""
    temperature: float | None
    top_p: float | None
    stop: tuple[str, ...]
    """Stop strings: the reply ends at the first one, which the returned text leaves out."""
    stream: bool = False
    """Answer with server-sent events (the reply is generated whole first, then sent as events)."""
    include_usage: bool = False
    """Chat completions' ``stream_options.include_usage``: a last event with the token counts."""

    def sampling_overrides(self, *, agent_sampling: bool) -> dict[str, Any]:
        """What this call asks of the sampling (``keys.SAMPLING_OVERRIDES``): its token budget and stop
        strings always, its temperature and top-p only with ``agent_sampling``."""
        overrides: dict[str, Any] = {}
        if self.max_tokens is not None:
            overrides["max_new_tokens"] = self.max_tokens
        if self.stop:
            overrides["stop_strings"] = list(self.stop)
        if agent_sampling:
            overrides.update(
                {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p)) if v is not None}
            )
        return overrides


def parse_chat_request(body: Any) -> ChatRequest:
    """A :class:`ChatRequest` from the JSON body, or :class:`RequestError` naming what is wrong."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object with 'messages'.")
    if body.get("n") not in (None, 1):
        raise RequestError(
            f"n={body.get('n')!r}: the endpoint answers one completion per call; to answer a row k times, "
            "run the agent k times (AgentEnv(repeats=k): a GRPO group)."
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {'role': ..., 'content': ...} objects.")
    check_messages(messages)
    tools = chat_tools(body.get("tools"))
    stream = stream_flag(body)
    options = body.get("stream_options")
    if options is not None and not (stream and isinstance(options, Mapping)):
        raise RequestError(
            "stream_options must be an object such as {'include_usage': true}, and only with stream=True."
        )
    temperature, top_p = sampling_fields(body)
    return ChatRequest(
        messages=tuple(messages),
        tools=tools,
        parse_tool_calls=tools is not None and body.get("tool_choice") != "none",
        max_tokens=_max_tokens(body),
        temperature=temperature,
        top_p=top_p,
        stop=stop_strings(body.get("stop")),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
    )


def stream_flag(body: Mapping[str, Any]) -> bool:
    """The body's ``stream`` (absent: False), or :class:`RequestError` if it is not a bool."""
    stream = body.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r:.50}.")
    return stream


def check_messages(messages: Sequence[Any]) -> None:
    """Each chat message well formed (a role, text content, readable tool calls), or :class:`RequestError`."""
    for i, message in enumerate(messages):
        _check_message(i, message)


def _check_message(i: int, message: Any) -> None:
    if not isinstance(message, Mapping) or message.get("role") not in ROLES:
        raise RequestError(
            f"messages[{i}] must be an object whose 'role' is one of {sorted(ROLES)}, got {message!r:.200}."
        )
    content = message.get("content")
    if content is None and not (message["role"] == "assistant" and message.get("tool_calls")):
        raise RequestError(f"messages[{i}] ({message['role']}) has no 'content'.")
    text_of(content, where=f"messages[{i}].content")
    if message["role"] == "assistant":
        calls_of(message.get("tool_calls"), where=f"messages[{i}].tool_calls")


def text_of(content: Any, *, where: str = "content") -> str:
    """A message's text: a string, a list of text parts joined, or "" for None."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise RequestError(f"{where}: only text is supported (a string or a list of {{'type': 'text'}} parts).")


def calls_of(tool_calls: Any, *, where: str = "tool_calls") -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` as :class:`ToolCall` s."""
    if tool_calls is None:
        return ()
    calls = []
    for k, call in enumerate(tool_calls if isinstance(tool_calls, list) else [None]):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(
                f"{where}[{k}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}."
            )
        arguments = function.get("arguments", "{}")
        calls.append(ToolCall(id=str(call.get("id", "")), name=function["name"], arguments=str(arguments)))
    return tuple(calls)


def chat_tools(tools: Any) -> tuple[dict[str, Any], ...] | None:
    if tools is None:
        return None
    ok = isinstance(tools, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("function"), Mapping) and isinstance(t["function"].get("name"), str)
        for t in tools
    )
    if not ok:
        raise RequestError("'tools' must be a list of {'type': 'function', 'function': {'name': ..., ...}} objects.")
    return tools_of(tools)


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    return token_budget(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens")


def token_budget(value: Any, name: str) -> int | None:
    """A call's token budget (``name`` in errors): None, or an int >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{name} must be an integer >= 1, got {value!r}.")
    return value


def sampling_fields(body: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """The body's ``temperature`` and ``top_p``, checked (every API names them alike)."""
    temperature = number_field(
        body, "temperature", lambda v: v == 0 or v >= MIN_TEMPERATURE, f"0 (greedy) or >= {MIN_TEMPERATURE}"
    )
    return temperature, number_field(body, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")


def number_field(body: Mapping[str, Any], name: str, ok: Any, rule: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise RequestError(f"{name} must be a number {rule}, got {value!r}.")
    return float(value)


def stop_strings(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {stop!r:.200}.")
    if len(stops) > MAX_STOP_STRINGS or max(map(len, stops), default=0) > MAX_STOP_CHARS:
        raise RequestError(
            f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each (OpenAI's "
            f"limit; every step of the engine checks them), got {len(stops)} of up to {max(map(len, stops))}."
        )
    return tuple(stops)


# ---------------------------------------------------------------------- messages -> History
def reply_key(content: Any, tool_calls: Sequence[ToolCall]) -> ReplyKey:
    """How an echoed reply is recognised: its text and its calls' ids, names and arguments (as JSON
    values: frameworks re-serialise the arguments they parsed, e.g. pydantic-ai without spaces)."""
    return text_of(content), tuple((c.id, c.name, canonical_arguments(c.arguments)) for c in tool_calls)


def canonical_arguments(arguments: str) -> str:
    """``arguments`` as compact JSON with sorted keys, or as they are if they are not JSON."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):  # designed: a malformed call's arguments are compared as text
        return arguments
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def history_of(request: ChatRequest, replies: Mapping[ReplyKey, str], parser: ToolParser) -> History:
    """The conversation as the model sees it.

    An assistant message that is one of the replies this dialog got (``replies``: its key -> the
    text the model wrote, exactly) becomes that text, so the conversation extends the recorded
    tokens; any other assistant message is rendered by ``parser`` (text, then its tool calls). A
    ``tool`` message keeps its text (templates that need the call's id are not supported).
    """
    messages = []
    for message in request.messages:
        role, content = ROLES[message["role"]], text_of(message.get("content"))
        if role == "assistant":
            calls = calls_of(message.get("tool_calls"))
            written = replies.get(reply_key(message.get("content"), calls))
            content = written if written is not None else (parser.render(content, calls) if calls else content)
        messages.append(Message(role, content))
    return History(tuple(messages), request.tools)


# ---------------------------------------------------------------------- the reply
def cut_at_stops(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to its first stop string (left out, as OpenAI does), and whether one was found."""
    cut, stop = cut_at_stop(text, stops)
    return cut, stop is not None


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to its first stop string, and that stop string (None: none found)."""
    cuts = sorted((i, k) for k, i in enumerate(text.find(s) for s in stops) if i >= 0)
    return (text[: cuts[0][0]], stops[cuts[0][1]]) if cuts else (text, None)


@dataclass(frozen=True, kw_only=True)
class CallReply:
    """The reply to one call, in no API's form yet: what every :class:`ApiFormat` writes from."""

    reply: ParsedReply
    """The reply's text and tool calls."""
    finish_reason: str
    """``"stop"`` (the model ended, or a stop string did) or ``"length"`` (the token budget ran out)."""
    stop: str | None
    """The stop string that ended the reply (None: none did)."""
    prompt_tokens: int
    completion_tokens: int


class ApiFormat(Protocol):
    """One API the endpoint serves: its request body read into a :class:`ChatRequest`, a
    :class:`CallReply` written as its JSON reply or its server-sent events, its errors' body."""

    def parse(self, body: Any) -> ChatRequest: ...

    def reply_json(self, answer: CallReply, request: ChatRequest, model: str) -> dict[str, Any]: ...

    def reply_events(self, answer: CallReply, request: ChatRequest, model: str) -> list[bytes]: ...

    def error_json(self, message: str, kind: str) -> dict[str, Any]: ...


def sse(data: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event: ``event: <event>`` (if given) and ``data: <json>``."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {text}\n\n".encode()


def completion_json(answer: CallReply, *, completion_id: str, model: str) -> dict[str, Any]:
    """A ``chat.completion`` object (``finish_reason`` "tool_calls" when the reply holds calls)."""
    reply = answer.reply
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
    choice = {"index": 0, "message": message, "finish_reason": _finish(answer), "logprobs": None}
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(answer),
    }


def _finish(answer: CallReply) -> str:
    return "tool_calls" if answer.reply.tool_calls else answer.finish_reason


def _usage(answer: CallReply) -> dict[str, int]:
    total = answer.prompt_tokens + answer.completion_tokens
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens, "total_tokens": total}


STREAM_CHUNK_CHARS = 64
"""Characters of text per streamed event at most (the reply exists whole: fewer events, less work)."""


def pieces(text: str) -> list[str]:
    """``text`` in pieces of at most :data:`STREAM_CHUNK_CHARS` characters (none for "")."""
    return [text[i : i + STREAM_CHUNK_CHARS] for i in range(0, len(text), STREAM_CHUNK_CHARS)]


def completion_chunks(answer: CallReply, request: ChatRequest, *, completion_id: str, model: str) -> list[bytes]:
    """The reply as ``chat.completion.chunk`` events, as OpenAI streams them: the role, the text, each
    tool call (its id and name, then its arguments), the finish reason, the usage if asked, ``[DONE]``."""
    head = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
    if request.include_usage:
        head["usage"] = None

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in pieces(answer.reply.content or "")]
    for k, call in enumerate(answer.reply.tool_calls):
        function = {"name": call.name, "arguments": ""}
        events.append(chunk({"tool_calls": [{"index": k, "id": call.id, "type": "function", "function": function}]}))
        events += [chunk({"tool_calls": [{"index": k, "function": {"arguments": p}}]}) for p in pieces(call.arguments)]
    events.append(chunk({}, _finish(answer)))
    if request.include_usage:
        events.append(sse({**head, "choices": [], "usage": _usage(answer)}))
    return [*events, sse("[DONE]")]


class ChatCompletionsApi:
    """``POST /v1/chat/completions`` (an :class:`ApiFormat`)."""

    def parse(self, body: Any) -> ChatRequest:
        return parse_chat_request(body)

    def reply_json(self, answer: CallReply, request: ChatRequest, model: str) -> dict[str, Any]:
        return completion_json(answer, completion_id=f"chatcmpl-{uuid.uuid4().hex}", model=model)

    def reply_events(self, answer: CallReply, request: ChatRequest, model: str) -> list[bytes]:
        return completion_chunks(answer, request, completion_id=f"chatcmpl-{uuid.uuid4().hex}", model=model)

    def error_json(self, message: str, kind: str) -> dict[str, Any]:
        return error_json(message, kind)


def error_json(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body (the ``openai`` client raises it with this message)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
