"""The agent of ``lmcollect demo --task agent``: asks "which is larger", offers a compare tool, runs the model's call, scores the answer.

An ordinary ``openai``-client program: it sends the question with one tool, ``compare()`` (which
compares the question's two numbers and returns the larger), runs the tool calls the model makes,
sends the results back and takes the model's next reply as its answer (a reply without a call is
the answer at once). Reward 1.0 for exactly the larger number, else 0.0.

The demo's model is tiny and starts from random weights, so it writes its calls in a short form,
``call: compare``, that :class:`CompactCallParser` reads (a pluggable parser; a real model writes
Hermes' ``<tool_call>{json}</tool_call>``, the default). :func:`warmup_rows` teaches it the format
only: the call, then either number of the question at random (right half of the time), so RL has
to learn to answer with what the tool said.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmcollect.agents.runs import AgentContext
from lmcollect.agents.tool_parsers import ParsedReply, ToolCall
from lmcollect.envs.tasks.comparison import comparison_dataset, either_number

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "compare",
            "description": "Compare the two numbers of the question; returns the larger one.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]
"""The one tool the agent offers."""

MAX_CALL_TOKENS = 8
"""Token budget of a reply (``call: compare`` is 5 tokens of the tiny tokenizer, an answer 1 and the end)."""

_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class CompactCallParser:
    """Reads a reply ``call: <name>`` (optionally followed by a JSON object of arguments) as one tool call.

    The short call form of the demo's tiny model: 5 tokens where Hermes' JSON takes about 40 of its
    tokenizer, so a warm-up of a minute teaches it. Any other reply is plain text; a call whose
    arguments are not a JSON object is plain text with the error.
    """

    prefix: str = "call:"
    """What opens a call."""

    def parse(self, text: str, *, call_id: Callable[[int], str]) -> ParsedReply:
        stripped = text.strip()
        if not stripped.startswith(self.prefix):
            return ParsedReply(content=text)
        name, _, rest = stripped[len(self.prefix) :].strip().partition(" ")
        try:
            arguments = json.loads(rest) if rest.strip() else {}
        except json.JSONDecodeError as exc:
            return ParsedReply(content=text, error=f"arguments are not JSON ({exc.msg})")
        if not name or not isinstance(arguments, dict):
            return ParsedReply(content=text, error=f"expected '{self.prefix} <name> [{{json arguments}}]'")
        return ParsedReply(
            content=None, tool_calls=(ToolCall(id=call_id(0), name=name, arguments=json.dumps(arguments)),)
        )

    def render(self, content: str | None, tool_calls: Sequence[ToolCall]) -> str:
        lines = [content] if content else []
        for call in tool_calls:
            arguments = "" if call.arguments.strip() in ("", "{}") else f" {call.arguments}"
            lines.append(f"{self.prefix} {call.name}{arguments}")
        return "\n".join(lines)


def compare(question: str) -> str:
    """The tool: the larger of the question's two numbers."""
    numbers = [int(n) for n in _NUMBER.findall(question)]
    return str(max(numbers)) if numbers else "error: the question has no numbers"


def compare_agent(context: AgentContext, row: Mapping[str, Any]) -> float:
    """Ask the row's question with the compare tool, answer its calls once, score the final reply."""
    client = context.openai()
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    ask = {"model": context.model, "tools": TOOLS, "max_tokens": MAX_CALL_TOKENS}
    reply = client.chat.completions.create(messages=messages, **ask).choices[0].message
    if reply.tool_calls:
        messages.append(reply)
        for call in reply.tool_calls:
            result = compare(row["prompt"]) if call.function.name == "compare" else "error: no such tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        reply = client.chat.completions.create(messages=messages, tool_choice="none", **ask).choices[0].message
    return 1.0 if (reply.content or "").strip() == str(row["answer"]) else 0.0


def compare_rows(num_samples: int, *, seed: int) -> list[dict[str, str]]:
    """``{"prompt": "Which is larger, 3 or 7?", "answer": "7"}`` rows (the comparison task's)."""
    return comparison_dataset(num_samples, seed=seed)


def warmup_rows(rows: list[dict[str, str]], *, seed: int, prefix: str = "call:") -> list[dict[str, Any]]:
    """Supervised examples of both calls of each row: the call, then either number of the question at
    random (the format, not the rule: RL has to learn to answer with the tool's result)."""
    rng = random.Random(seed)
    examples: list[dict[str, Any]] = []
    for row in rows:
        call = f"{prefix} compare"
        question = {"role": "user", "content": row["prompt"]}
        examples.append({"prompt": [question], "answer": call})
        after = [question, {"role": "assistant", "content": call}, {"role": "tool", "content": compare(row["prompt"])}]
        examples.append({"prompt": after, "answer": either_number(row, rng)})
    return examples
