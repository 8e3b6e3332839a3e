"""The Anthropic Messages API (``POST /v1/messages``) in and out: content blocks as a chat conversation, a reply as a message or its events (pure logic)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from lmcollect.agents.openai_format import (
    CallReply,
    ChatRequest,
    RequestError,
    chat_tools,
    check_messages,
    pieces,
    sampling_fields,
    sse,
    stop_strings,
    stream_flag,
    token_budget,
)

REFUSED = {
    "thinking": "extended thinking is not supported: call without 'thinking'",
    "top_k": "top_k is not supported: the collector's sampling applies (temperature / top_p with agent_sampling)",
    "container": "containers are not supported: run tools in the agent",
    "mcp_servers": "MCP servers are not supported: run tools in the agent",
}
"""Request fields the endpoint refuses, and what to do instead."""

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
"""The reply's finish reason as Anthropic's ``stop_reason`` (besides ``tool_use`` and ``stop_sequence``)."""


def parse_messages_request(body: Any) -> ChatRequest:
    """A :class:`ChatRequest` from a Messages API body, or :class:`RequestError` naming the field."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object with 'messages' and 'max_tokens'.")
    for name, advice in REFUSED.items():
        if body.get(name) is not None:
            raise RequestError(f"{name}: {advice}.")
    messages = _system_of(body.get("system"))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(
            "messages must be a non-empty list of {'role': 'user' | 'assistant', 'content': ...} objects."
        )
    for i, message in enumerate(raw):
        messages += _chat_messages(message, i)
    check_messages(messages)
    tools = chat_tools(_tools_of(body.get("tools")))
    choice = body.get("tool_choice")
    temperature, top_p = sampling_fields(body)
    return ChatRequest(
        messages=tuple(messages),
        tools=tools,
        parse_tool_calls=tools is not None and not (isinstance(choice, Mapping) and choice.get("type") == "none"),
        max_tokens=token_budget(body.get("max_tokens"), "max_tokens"),
        stop=stop_strings(body.get("stop_sequences")),
        stream=stream_flag(body),
        temperature=temperature,
        top_p=top_p,
    )


def _system_of(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    return [{"role": "system", "content": _text_blocks(system, "system")}]


def _text_blocks(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, Mapping) and b.get("type") == "text" for b in content):
        return "".join(str(block.get("text", "")) for block in content)
    raise RequestError(f"{where}: only text is supported (a string or a list of {{'type': 'text'}} blocks).")


def _chat_messages(message: Any, i: int) -> list[dict[str, Any]]:
    """One Messages API message as chat messages: an assistant's ``tool_use`` blocks as its ``tool_calls``,
    a user's ``tool_result`` blocks as ``tool`` messages (before the user's text, if any)."""
    role = message.get("role") if isinstance(message, Mapping) else None
    if role not in ("user", "assistant"):
        raise RequestError(
            f"messages[{i}] must be an object whose 'role' is 'user' or 'assistant', got {message!r:.200}."
        )
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise RequestError(f"messages[{i}].content must be a string or a list of content blocks.")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, Mapping) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call_of(block, where))
        elif kind == "tool_result" and role == "user":
            output = _text_blocks(block.get("content") or "", f"{where}.content")
            results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": output})
        else:
            raise RequestError(
                f"{where}: type {kind!r:.50} is not supported in a {role} message (text, tool_use, tool_result)."
            )
    if role == "assistant":
        text = "".join(texts) or (None if calls else "")  # an empty reply echoed back is still a reply
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _call_of(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), Mapping):
        raise RequestError(f"{where} (tool_use) needs a string 'name' and an object 'input'.")
    arguments = json.dumps(block.get("input", {}), ensure_ascii=False)  # as the parser wrote them: the echo matches
    return {
        "id": str(block.get("id", "")),
        "type": "function",
        "function": {"name": block["name"], "arguments": arguments},
    }


def _tools_of(tools: Any) -> list[dict[str, Any]] | None:
    """Messages API tools (``{"name", "description", "input_schema"}``) in chat form."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {'name': ..., 'input_schema': {...}} objects.")
    converted = []
    for k, tool in enumerate(tools):
        if (
            not isinstance(tool, Mapping)
            or not isinstance(tool.get("name"), str)
            or tool.get("type") not in (None, "custom")
        ):
            kind = tool.get("type") if isinstance(tool, Mapping) else tool
            raise RequestError(
                f"tools[{k}]: only custom tools with a name and input_schema are supported, got {kind!r:.50}."
            )
        function = {"name": tool["name"]}  # the key order of OpenAI's form: the template renders the same text
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema", {"type": "object"})
        converted.append({"type": "function", "function": function})
    return converted


# ---------------------------------------------------------------------- the reply
def content_blocks(answer: CallReply) -> list[dict[str, Any]]:
    """The reply's content: a ``text`` block (if any text, or no call: an empty reply has one), then a
    ``tool_use`` block per call."""
    reply = answer.reply
    blocks: list[dict[str, Any]] = (
        [{"type": "text", "text": reply.content or ""}] if reply.content or not reply.tool_calls else []
    )
    for call in answer.reply.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input_of(call.arguments)})
    return blocks


def _input_of(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic sends ({} if a custom parser wrote no JSON object)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):  # designed: a custom ToolParser may write anything
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(answer: CallReply) -> str:
    if answer.reply.tool_calls:
        return "tool_use"
    return "stop_sequence" if answer.stop is not None else STOP_REASONS[answer.finish_reason]


def message_json(answer: CallReply, *, message_id: str, model: str) -> dict[str, Any]:
    """A ``message`` object."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(answer),
        "stop_reason": stop_reason(answer),
        "stop_sequence": answer.stop,
        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens},
    }


def message_events(answer: CallReply, *, message_id: str, model: str) -> list[bytes]:
    """The reply as the Messages API streams it: message_start, each block (start, deltas, stop),
    message_delta (stop reason, usage), message_stop."""
    final = message_json(answer, message_id=message_id, model=model)
    opening = {**final, "content": [], "stop_reason": None, "stop_sequence": None}
    opening["usage"] = {"input_tokens": answer.prompt_tokens, "output_tokens": 0}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": opening}]
    for index, block in enumerate(final["content"]):
        if block["type"] == "text":
            start, deltas = {**block, "text": ""}, [{"type": "text_delta", "text": p} for p in pieces(block["text"])]
        else:
            arguments = json.dumps(block["input"], ensure_ascii=False)
            start, deltas = (
                {**block, "input": {}},
                [{"type": "input_json_delta", "partial_json": p} for p in pieces(arguments)],
            )
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events += [{"type": "content_block_delta", "index": index, "delta": delta} for delta in deltas]
        events.append({"type": "content_block_stop", "index": index})
    delta = {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]}
    events.append({"type": "message_delta", "delta": delta, "usage": {"output_tokens": answer.completion_tokens}})
    events.append({"type": "message_stop"})
    return [sse(event, event["type"]) for event in events]


class MessagesApi:
    """``POST /v1/messages`` (an :class:`~lmcollect.agents.openai_format.ApiFormat`); errors in Anthropic's form."""

    def parse(self, body: Any) -> ChatRequest:
        return parse_messages_request(body)

    def reply_json(self, answer: CallReply, request: ChatRequest, model: str) -> dict[str, Any]:
        return message_json(answer, message_id=f"msg_{uuid.uuid4().hex}", model=model)

    def reply_events(self, answer: CallReply, request: ChatRequest, model: str) -> list[bytes]:
        return message_events(answer, message_id=f"msg_{uuid.uuid4().hex}", model=model)

    def error_json(self, message: str, kind: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": kind, "message": message}}
