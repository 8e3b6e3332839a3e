"""OpenEnv: an ``Environment`` in-process or behind its server (its client), and MCP-tool environments, as lmcollect tasks.

OpenEnv (``pip install 'lmcollect[openenv]'``) environments speak typed actions and observations:
``reset(seed=...)`` and ``step(action)`` give an ``Observation`` (``reward``, ``done`` and the env's
fields). :class:`OpenEnvTask` runs one OpenEnv session per dialog inside a
:class:`~lmcollect.envs.ChatEnv`:

* **the session** is made by ``make_session()``: an ``Environment`` object (in-process) or an
  ``EnvClient`` to a server (``MyEnvClient(base_url="http://127.0.0.1:8000")``, its WebSocket
  session; the adapter calls ``.sync()`` and ``connect()``);
* **text to action, observation to text** are your functions: ``action_of(reply_text)`` and
  ``text_of(observation)`` (the reset observation's text is the opening user message, each later
  observation's text the next user message);
* **MCP-tool environments** (``tools=True``; an ``MCPEnvironment`` or an ``MCPToolClient``): their
  tools (``ListToolsAction``) are offered to the model as function schemas, and each
  ``<tool_call>{"name", "arguments"}</tool_call>`` the model writes (the Hermes / Qwen format of
  :mod:`lmcollect.agents.tool_parsers`) is sent as a ``CallToolAction``; the results come back as
  ``tool`` messages. A reply without a tool call is the answer: ``action_of(text)`` is stepped if
  given, else the dialog ends;
* a session is stepped once per assistant turn and closed when its dialog ends (a
  :class:`~lmcollect.envs.tasks.base.StatefulTask`); the reset seed comes from the dialog's seed, so
  a restore replays it.

A server allows ``max_concurrent_envs`` WebSocket sessions (OpenEnv's ``create_app``); a ChatEnv
holds ``batch_size`` sessions at once: pass ``max_sessions=`` and the adapter warns when the server
would refuse some. lmcollect keeps the chat template, the tokens, the log-probs and the versions.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcollect.compat.extras import import_extra
from lmcollect.data.history import History, Message
from lmcollect.envs.chat_env import ChatEnv
from lmcollect.envs.datasets import PromptDataset
from lmcollect.envs.registry import register_ecosystem
from lmcollect.envs.tasks.base import TaskReply

if TYPE_CHECKING:  # the agents package (its endpoint's modules) loads when a tool call is read, not with the registry
    from lmcollect.agents.tool_parsers import ToolCall

logger = logging.getLogger(__name__)

ECOSYSTEM = "openenv"


def _openenv() -> Any:
    return import_extra("openenv.core.env_server.mcp_types", extra="openenv", who="OpenEnv envs")


def observation_text(observation: Any) -> str:
    """The default ``text_of``: an observation's own fields (not done/reward/metadata; a model's or a dict's) as text:
    a single field's value, else one ``key: value`` a line."""
    if isinstance(observation, Mapping):  # GenericEnvClient's observations are dicts
        fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
    else:
        fields = observation.model_dump(exclude={"done", "reward", "metadata"})
    if len(fields) == 1:
        return str(next(iter(fields.values())))
    return "\n".join(f"{key}: {value}" for key, value in fields.items())


@dataclass
class OpenEnvSession:
    """One dialog's OpenEnv session: an in-process ``Environment`` or a connected sync client."""

    handle: Any
    """The ``Environment``, or the ``SyncEnvClient``."""
    in_process: bool
    """True for an ``Environment`` (its ``step`` returns the observation itself)."""
    opening: Any = None
    """The reset observation."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """The MCP tools as OpenAI function schemas (empty without tools)."""

    def step(self, action: Any) -> tuple[Any, float, bool]:
        """``(observation, reward, done)`` of one action."""
        if self.in_process:
            obs = self.handle.step(action)
            return obs, float(obs.reward or 0.0), bool(obs.done)
        result = self.handle.step(action)
        return result.observation, float(result.reward or 0.0), bool(result.done)

    def reset(self, **kwargs: Any) -> Any:
        out = self.handle.reset(**kwargs)
        return out if self.in_process else out.observation

    def close(self) -> None:
        self.handle.close()


def open_session(made: Any) -> OpenEnvSession:
    """``make_session()``'s result as a session: an ``Environment`` as is, a client synced and connected."""
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.sync_client import SyncEnvClient

    if isinstance(made, Environment):
        return OpenEnvSession(made, in_process=True)
    if isinstance(made, EnvClient):
        made = made.sync()
    if isinstance(made, SyncEnvClient):
        try:
            made.connect()
        except Exception as exc:
            raise ConnectionError(
                f"OpenEnv: could not open a session on {made._async.base_url!r} ({type(exc).__name__}: {exc}); is the "
                "server up, and does its max_concurrent_envs allow one session per dialog (the env's batch_size)?"
            ) from exc
        return OpenEnvSession(made, in_process=False)
    raise TypeError(
        "OpenEnvTask: make_session() must return an openenv Environment or an EnvClient (e.g. "
        f"MyEnvClient(base_url='http://127.0.0.1:8000')), got {type(made).__name__}."
    )


def tool_schema(tool: Any) -> dict[str, Any]:
    """An OpenEnv (MCP) ``Tool`` as an OpenAI function definition (what chat templates render)."""
    schema = dict(tool.input_schema or {"type": "object", "properties": {}})
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": schema}}


def tool_result_text(observation: Any) -> str:
    """A ``CallToolObservation`` as the tool message's text: the error, or the result (MCP text content, else JSON)."""
    if observation.error is not None:
        return f"error: {observation.error.message}"
    result = observation.result
    content = getattr(result, "content", None)
    if isinstance(result, Mapping):
        content = result.get("content", content)
        if content is None and "data" in result:
            return str(result["data"])
    if isinstance(content, list) and content:
        texts = [
            getattr(part, "text", None) or (part.get("text") if isinstance(part, Mapping) else None) for part in content
        ]
        if all(isinstance(t, str) for t in texts):
            return "\n".join(texts)  # type: ignore[arg-type]  # every part is text
    data = getattr(result, "data", None)
    if data is not None:
        return str(data)
    return result if isinstance(result, str) else json.dumps(result, default=str)


def _call_id(k: int) -> str:
    return f"call_{k}"


@dataclass(frozen=True)
class OpenEnvTask:
    """One OpenEnv session per dialog: ``make_session()``, ``reset(seed=...)``, a step per assistant turn.

    Picklable when ``make_session``, ``action_of`` and ``text_of`` are (module-level functions or
    classes), so it goes to collector actors with the env; openenv is imported where it runs.
    """

    make_session: Callable[[], Any]
    """``() -> Environment | EnvClient``: a new session (an env object, or a client to a server)."""
    action_of: Callable[[str], Any] | None = None
    """``reply_text -> Action``: the env's action for a reply (None: only tool calls; a reply without one ends the dialog)."""
    text_of: Callable[[Any], str] = observation_text
    """``observation -> str``: an observation as the next user message (default: its fields)."""
    tools: bool = False
    """True for an MCP-tool env: its tools are offered to the model and its tool calls are routed to them."""
    max_turns: int = 1
    """Assistant turns per dialog at most."""
    reset_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of every ``reset`` (the seed is the dialog's own)."""

    def __post_init__(self) -> None:
        if not callable(self.make_session):
            raise TypeError(
                f"OpenEnvTask: make_session must be callable (() -> Environment or EnvClient), got {self.make_session!r}."
            )
        if self.action_of is None and not self.tools:
            raise ValueError(
                "OpenEnvTask: pass action_of=lambda text: MyAction(...) (text to action), or tools=True for an MCP env."
            )
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {self.max_turns!r}.")

    def start(self, sample: Mapping[str, Any], rng: random.Random) -> OpenEnvSession:
        session = open_session(self.make_session())
        try:
            kwargs = {**self.reset_kwargs, **dict(sample.get("reset_kwargs") or {})}
            session.opening = session.reset(seed=rng.getrandbits(31), **kwargs)
            if self.tools:
                listed, _, _ = session.step(_openenv().ListToolsAction())
                session.tools = [tool_schema(tool) for tool in listed.tools]
        except BaseException as exc:
            session.close()
            if not session.in_process and "CAPACITY_REACHED" in str(exc):
                raise ConnectionError(
                    f"OpenEnv: the server refused another session ({exc}); a ChatEnv holds batch_size sessions at "
                    "once: raise the server's max_concurrent_envs (create_app) or lower batch_size."
                ) from exc
            raise
        return session

    def opening_prompt(self, state: OpenEnvSession, sample: Mapping[str, Any]) -> History:
        messages = [Message("user", self.text_of(state.opening))]
        prompt = sample.get("prompt")
        if isinstance(prompt, str) and prompt:
            messages.insert(0, Message("system", prompt))  # the row's instructions, if any
        return History(tuple(messages), tuple(state.tools) or None)

    def respond(self, state: OpenEnvSession, history: History) -> TaskReply:
        reply = history.last("assistant")
        text = "" if reply is None else reply.content
        if self.tools:
            from lmcollect.agents.tool_parsers import HermesToolParser

            parsed = HermesToolParser().parse(text, call_id=_call_id)
            if parsed.tool_calls:
                return self._call_tools(state, parsed.tool_calls)
        if self.action_of is None:
            return TaskReply(reward=0.0, done=True)
        obs, reward, done = state.step(self.action_of(text))
        return TaskReply(reward=reward, done=done, messages=[] if done else [("user", self.text_of(obs))])

    def _call_tools(self, state: OpenEnvSession, calls: Sequence[ToolCall]) -> TaskReply:
        action_type = _openenv().CallToolAction
        messages, reward, done = [], 0.0, False
        for call in calls:
            obs, step_reward, done = state.step(action_type(tool_name=call.name, arguments=json.loads(call.arguments)))
            messages.append(("tool", tool_result_text(obs)))
            reward += step_reward
            if done:
                break
        return TaskReply(reward=reward, done=done, messages=messages)

    def end(self, state: OpenEnvSession) -> None:
        state.close()


def openenv_env(
    make_session: Callable[[], Any],
    *,
    action_of: Callable[[str], Any] | None = None,
    text_of: Callable[[Any], str] = observation_text,
    tools: bool = False,
    rows: PromptDataset | Sequence[Mapping[str, Any]] | None = None,
    num_samples: int = 256,
    batch_size: int = 1,
    repeats: int = 1,
    max_turns: int = 1,
    max_sessions: int | None = None,
    seed: int = 0,
) -> ChatEnv:
    """A :class:`ChatEnv` of OpenEnv sessions (see :class:`OpenEnvTask`); ``repeats`` dialogs per reset seed make the groups.

    ``rows``: one per episode to draw (a ``"reset_kwargs"`` mapping each, and an optional
    ``"prompt"`` str put first as a system message); default ``num_samples`` empty rows (the env's
    reset draws the episode from the dialog's seed). ``max_sessions``: the server's
    ``max_concurrent_envs``; a ``batch_size`` above it is warned about (those dialogs would be refused).
    """
    if max_sessions is not None and batch_size > max_sessions:
        logger.warning(
            "OpenEnv: the server allows %d sessions but this env keeps %d dialogs in flight (batch_size); the "
            "rest will be refused: raise the server's max_concurrent_envs or lower batch_size.",
            max_sessions,
            batch_size,
        )
    if rows is None:
        rows = [{"prompt": "", "episode": k} for k in range(num_samples)]
    task = OpenEnvTask(make_session, action_of, text_of, tools, max_turns)
    return ChatEnv(rows, task=task, batch_size=batch_size, repeats=repeats, max_turns=max_turns, seed=seed)


def _build(name: str, **kwargs: Any) -> ChatEnv:
    """``make_env("openenv:<url>", ...)``: the server at ``http://<url>`` (e.g. ``openenv:127.0.0.1:8000``) through ``client=``."""
    client = kwargs.pop("client", None)
    if client is None:
        raise ValueError(
            f"make_env('openenv:{name}'): pass client=MyEnvClient (the env's EnvClient class; GenericEnvClient or "
            "MCPToolClient work for any server) and action_of=... (or tools=True)."
        )
    return openenv_env(_ClientMaker(client, name if "://" in name else f"http://{name}"), **kwargs)


@dataclass(frozen=True)
class _ClientMaker:
    """``make_session()``: a new client of ``client_cls`` to ``base_url`` (picklable)."""

    client_cls: Any
    base_url: str

    def __call__(self) -> Any:
        return self.client_cls(base_url=self.base_url)


register_ecosystem(ECOSYSTEM, build=_build)
