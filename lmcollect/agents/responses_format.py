"""The OpenAI Responses API (``POST /v1/responses``) in and out: input items as a chat conversation, a reply as a response or its events (pure logic)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from lmcollect.agents.openai_format import (
    CallReply,
    ChatRequest,
    RequestError,
    chat_tools,
    check_messages,
    error_json,
    pieces,
    sampling_fields,
    sse,
    stream_flag,
    token_budget,
)

REFUSED = {
    "previous_response_id": "the endpoint stores no responses: send the whole conversation in 'input'",
    "conversation": "the endpoint stores no conversations: send the whole conversation in 'input'",
    "background": "background responses are not supported: call without background",
    "prompt": "stored prompts are not supported: send 'instructions' and 'input'",
}
"""Request fields the endpoint refuses, and what to do instead."""

_TEXT_PARTS = ("input_text", "output_text", "text")


def parse_responses_request(body: Any) -> ChatRequest:
    """A :class:`ChatRequest` from a Responses API body, or :class:`RequestError` naming the field."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object with 'input'.")
    for name, advice in REFUSED.items():
        if body.get(name) not in (None, False):
            raise RequestError(f"{name}: {advice}.")
    text_format = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if text_format is not None and (not isinstance(text_format, Mapping) or text_format.get("type") != "text"):
        raise RequestError("text.format: only {'type': 'text'} is supported (no structured outputs).")
    messages = _messages_of(body.get("input"), body.get("instructions"))
    check_messages(messages)
    tools = chat_tools(_tools_of(body.get("tools")))
    temperature, top_p = sampling_fields(body)
    return ChatRequest(
        messages=tuple(messages),
        tools=tools,
        parse_tool_calls=tools is not None and body.get("tool_choice") != "none",
        max_tokens=token_budget(body.get("max_output_tokens"), "max_output_tokens"),
        stop=(),
        stream=stream_flag(body),
        temperature=temperature,
        top_p=top_p,
    )


def _messages_of(items: Any, instructions: Any) -> list[dict[str, Any]]:
    """The input items as chat messages: ``function_call`` items join the assistant message before
    them (as its ``tool_calls``), ``function_call_output`` items become ``tool`` messages."""
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string.")
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty list of items (messages, function calls, outputs).")
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            _add_call(messages, item, i)
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output})
        else:
            raise RequestError(
                f"input[{i}].type={kind!r} is not supported: use messages, 'function_call' and 'function_call_output' items."
            )
    return messages


def _add_call(messages: list[dict[str, Any]], item: Mapping[str, Any], i: int) -> None:
    if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
        raise RequestError(f"input[{i}] (function_call) needs a string 'name' and 'arguments'.")
    call = {
        "id": str(item.get("call_id", "")),
        "type": "function",
        "function": {"name": item["name"], "arguments": item.get("arguments", "")},
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": None}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _text(content: Any, where: str) -> str:
    """A content's text: a string, or a list of text parts (``input_text`` / ``output_text``) joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") in _TEXT_PARTS for p in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise RequestError(f"{where}: only text is supported (a string or a list of 'input_text' / 'output_text' parts).")


def _tools_of(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "parameters"}``) in chat form."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {'type': 'function', 'name': ..., 'parameters': {...}} objects.")
    converted = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, Mapping) else tool
            raise RequestError(f"tools[{k}]: only function tools are supported, got type {kind!r:.50}.")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        converted.append({"type": "function", "function": function})
    return converted


# ---------------------------------------------------------------------- the reply
def output_items(answer: CallReply, response_id: str) -> list[dict[str, Any]]:
    """The reply's output items: a ``message`` with its text (if any, or no call), then a ``function_call`` per call."""
    items: list[dict[str, Any]] = []
    if answer.reply.content or not answer.reply.tool_calls:  # an empty reply is an empty message
        part = {"type": "output_text", "text": answer.reply.content or "", "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{response_id}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for k, call in enumerate(answer.reply.tool_calls):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{response_id}_{k}",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    return items


def response_json(answer: CallReply, request: ChatRequest, *, response_id: str, model: str) -> dict[str, Any]:
    """A ``response`` object (``status`` "incomplete" when the token budget ran out)."""
    cut = answer.finish_reason == "length" and not answer.reply.tool_calls
    usage = {
        "input_tokens": answer.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": answer.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }
    return {
        "id": f"resp_{response_id}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output_items(answer, response_id),
        "error": None,
        "instructions": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_tokens,
        "usage": usage,
    }


def response_events(answer: CallReply, request: ChatRequest, *, response_id: str, model: str) -> list[bytes]:
    """The reply as the Responses API streams it: created, each output item (added, its deltas, done), completed."""
    final = response_json(answer, request, response_id=response_id, model=model)
    events: list[dict[str, Any]] = []
    opening = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events += [{"type": "response.created", "response": opening}, {"type": "response.in_progress", "response": opening}]
    for index, item in enumerate(final["output"]):
        events += _item_events(item, index)
    events.append({"type": f"response.{final['status']}", "response": final})
    return [sse({**event, "sequence_number": n}, event["type"]) for n, event in enumerate(events)]


def _item_events(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    where = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        added = {**item, "arguments": "", "status": "in_progress"}
        deltas = [
            {"type": "response.function_call_arguments.delta", **where, "delta": p} for p in pieces(item["arguments"])
        ]
        done = {
            "type": "response.function_call_arguments.done",
            **where,
            "name": item["name"],
            "arguments": item["arguments"],
        }
        middle = [*deltas, done]
    else:
        added = {**item, "content": [], "status": "in_progress"}
        part = item["content"][0]
        text, at = part["text"], {**where, "content_index": 0}
        middle = [
            {"type": "response.content_part.added", **at, "part": {**part, "text": ""}},
            *({"type": "response.output_text.delta", **at, "delta": p, "logprobs": []} for p in pieces(text)),
            {"type": "response.output_text.done", **at, "text": text, "logprobs": []},
            {"type": "response.content_part.done", **at, "part": part},
        ]
    return [
        {"type": "response.output_item.added", "output_index": index, "item": added},
        *middle,
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]


class ResponsesApi:
    """``POST /v1/responses`` (an :class:`~lmcollect.agents.openai_format.ApiFormat`)."""

    def parse(self, body: Any) -> ChatRequest:
        return parse_responses_request(body)

    def reply_json(self, answer: CallReply, request: ChatRequest, model: str) -> dict[str, Any]:
        return response_json(answer, request, response_id=uuid.uuid4().hex, model=model)

    def reply_events(self, answer: CallReply, request: ChatRequest, model: str) -> list[bytes]:
        return response_events(answer, request, response_id=uuid.uuid4().hex, model=model)

    def error_json(self, message: str, kind: str) -> dict[str, Any]:
        return error_json(message, kind)
