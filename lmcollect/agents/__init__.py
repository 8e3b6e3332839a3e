"""Agents as collection sources: agent programs calling an OpenAI- or Anthropic-style endpoint, each call one recorded turn.

:class:`AgentEnv` runs an agent function per dialog (see its docstring); :class:`AgentServer` is
the endpoint (FastAPI on uvicorn, or the same app in-process: :mod:`~lmcollect.agents.transport`)
its runs call: chat completions (:mod:`~lmcollect.agents.openai_format`), the Responses API
(:mod:`~lmcollect.agents.responses_format`) and Anthropic Messages
(:mod:`~lmcollect.agents.anthropic_format`), streamed or not; :mod:`~lmcollect.agents.tool_parsers`
reads tool calls out of the model's text. Needs ``pip install 'lmcollect[agents]'`` (fastapi,
uvicorn, openai, anthropic).
"""

from lmcollect.agents.config import AgentEnvConfig
from lmcollect.agents.element import AGENT_ERROR, AGENT_METADATA, TOOL_PARSE_ERROR, AgentEnvElement
from lmcollect.agents.env import Agent, AgentEnv, AgentStats
from lmcollect.agents.openai_format import RequestError
from lmcollect.agents.runs import AgentContext, AgentResult, DialogEndedError
from lmcollect.agents.server import AgentServer
from lmcollect.agents.tool_parsers import HermesToolParser, ParsedReply, ToolCall, ToolParser, get_tool_parser

__all__ = [
    "AGENT_ERROR",
    "AGENT_METADATA",
    "TOOL_PARSE_ERROR",
    "Agent",
    "AgentContext",
    "AgentEnv",
    "AgentEnvConfig",
    "AgentEnvElement",
    "AgentResult",
    "AgentServer",
    "AgentStats",
    "DialogEndedError",
    "HermesToolParser",
    "ParsedReply",
    "RequestError",
    "ToolCall",
    "ToolParser",
    "get_tool_parser",
]
