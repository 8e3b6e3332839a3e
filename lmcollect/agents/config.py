"""AgentEnvConfig: batch, groups, bounds, failure handling and endpoint settings of an AgentEnv."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal

from lmcollect.agents.server import DEFAULT_MODEL_NAME
from lmcollect.agents.tool_parsers import ToolParser, get_tool_parser

OnAgentError = Literal["drop", "keep", "raise"]
Transport = Literal["http", "in_process"]

MAX_AGENT_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest ``agent_timeout_s`` (far below what a thread's wait accepts, ``threading.TIMEOUT_MAX``)."""


@dataclass(kw_only=True)
class AgentEnvConfig:
    """Options of :class:`~lmcollect.agents.AgentEnv`."""

    batch_size: int = 1
    """Agent runs side by side (the env's elements; the continuous collector gives each a slot)."""
    repeats: int = 1
    """GRPO group size: ``repeats`` consecutive elements run the agent on the same rows, sharing a group id."""
    seed: int | None = None
    """Seed of the row order (None: one from the OS, so a shuffled dataset differs run to run)."""
    agent_timeout_s: float = 300.0
    """Longest wait for a run's next model call or its end, from its start or its latest reply (the
    agent's own work: tools, parsing). Past it the run fails with a TimeoutError naming its dialog."""
    max_calls: int = 64
    """Model calls per run at most: a call past it gets HTTP 409 and the dialog ends (truncated) at
    the previous call's turn."""
    on_agent_error: OnAgentError = "drop"
    """What a run that fails (raises, times out, returns no reward) does to its dialog: ``"drop"``
    ends it without stopping collection (the turn under way is dropped, and where the collector
    still holds them, in GRPO groups or trajectory modes, its earlier turns too; see
    ``DialogFailed``); ``"keep"`` ends it at the turn under way with reward ``failure_reward`` and
    the error in ``("agent", "error")``; ``"raise"`` also drops it and the consumer's next
    ``next()`` raises the error. A run that fails before its first call has no turn: it is dropped
    (``"raise"``: raised)."""
    failure_reward: float = 0.0
    """The last turn's reward of a failed run with ``on_agent_error="keep"``."""
    max_failures_in_a_row: int = 16
    """Runs failing one after the other (none returning a reward in between) past which the failure is
    raised to the consumer whatever ``on_agent_error`` says: the agent itself is broken, not a dialog."""
    tool_parser: str | ToolParser = "hermes"
    """How tool calls are read from the model's text: ``"hermes"`` (``<tool_call>{json}</tool_call>``,
    Qwen's format too) or an object implementing :class:`~lmcollect.agents.ToolParser`."""
    agent_sampling: bool = False
    """Use the ``temperature`` / ``top_p`` an agent's call asks for (False: the collector's, as RL
    usually wants). A call's ``max_tokens`` (capped at the collector's budget) and ``stop`` always apply."""
    transport: Transport = "http"
    """How the clients of ``AgentContext`` (``openai()``, ``async_openai()``, ``anthropic()``,
    ``http_client()``, ...) reach the endpoint: ``"http"`` over loopback HTTP, or ``"in_process"``:
    their ``httpx`` transport calls the endpoint's app in this process (the same requests, replies
    and refusals, no socket: faster). Agents that build their own clients from ``context.base_url``
    (or run in another process) use HTTP either way (the listener starts when ``base_url`` is read)."""
    host: str = "127.0.0.1"
    """Where the endpoint listens (loopback: only this machine)."""
    port: int = 0
    """The endpoint's port (0: a free one)."""
    model_name: str = DEFAULT_MODEL_NAME
    """The model name ``/v1/models`` lists."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "repeats", "max_calls", "max_failures_in_a_row"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AgentEnvConfig.{name} must be an int >= 1, got {value!r}.")
        if self.batch_size % self.repeats:
            raise ValueError(
                f"AgentEnvConfig.batch_size ({self.batch_size}) must be a multiple of repeats ({self.repeats}); "
                f"use e.g. batch_size={self.repeats * max(1, self.batch_size // self.repeats)}."
            )
        if not _positive(self.agent_timeout_s) or self.agent_timeout_s > MAX_AGENT_TIMEOUT_S:
            raise ValueError(
                f"AgentEnvConfig.agent_timeout_s must be a positive number of seconds up to {MAX_AGENT_TIMEOUT_S:.0f} "
                f"(a week), got {self.agent_timeout_s!r}; e.g. agent_timeout_s=3600 for agents with slow tools."
            )
        if self.on_agent_error not in ("drop", "keep", "raise"):
            raise ValueError(
                f"AgentEnvConfig.on_agent_error must be 'drop', 'keep' or 'raise', got {self.on_agent_error!r}."
            )
        if self.transport not in ("http", "in_process"):
            raise ValueError(f"AgentEnvConfig.transport must be 'http' or 'in_process', got {self.transport!r}.")
        if not _finite(self.failure_reward):
            raise ValueError(f"AgentEnvConfig.failure_reward must be a finite number, got {self.failure_reward!r}.")
        get_tool_parser(self.tool_parser)  # a clear error now, not at the first call
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"AgentEnvConfig.seed must be an int or None, got {self.seed!r}.")

    @property
    def num_groups(self) -> int:
        return self.batch_size // self.repeats


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def _positive(value: object) -> bool:
    return _finite(value) and float(value) > 0  # type: ignore[arg-type]
