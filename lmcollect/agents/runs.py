"""One run of an agent program on one dataset row: its key, the calls it makes and how it ended, handed between threads.

The agent runs in a thread of its own (a plain function) or on the env's agent loop (an ``async``
one). Its HTTP calls arrive on the server's loop; the env element that owns the run takes them one
at a time from the collector's side. :class:`AgentRun` is the meeting point: a queue of events
(a call, the run's end) guarded by a lock, read through futures, so no side blocks another.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import numbers
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcollect.agents.openai_format import CallReply, ChatRequest, ReplyKey
from lmcollect.plumbing import settle

if TYPE_CHECKING:  # the openai package is the agent's dependency, imported only when a run asks for a client
    import openai as openai_package  # (its own name is AgentContext's method)

    from lmcollect.agents.server import AgentServer  # the server imports this module

logger = logging.getLogger(__name__)


class DialogEndedError(RuntimeError):
    """A call reached a run whose dialog had ended (HTTP 409)."""


@dataclass(frozen=True, eq=False)  # compared (and hashed) as itself: a run remembers which of its calls were cut
class AgentCall:
    """One model call of a run, waiting for its reply (a :class:`CallReply`, or an error)."""

    request: ChatRequest
    reply: Future = field(default_factory=Future)


@dataclass(frozen=True, kw_only=True)
class AgentResult:
    """What an agent returns: its reward (on the dialog's last turn) and anything to keep beside it."""

    reward: float
    """The dialog's reward, added to its last turn's."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """JSON-able details stored with the last turn (``("agent", "metadata")``, as JSON text): a
    mapping with string keys (values that are no JSON are written as their ``str``)."""

    def __post_init__(self) -> None:
        _reward(self.reward, "this run")
        metadata_json(self.metadata)

    @property
    def metadata_text(self) -> str:
        """:attr:`metadata` as JSON text (what the last turn stores)."""
        return metadata_json(self.metadata)


def metadata_json(metadata: Any) -> str:
    """``metadata`` as JSON text, or a TypeError saying what an agent's metadata must be (checked
    when the agent returns, so a bad one fails its own run, not the collection)."""
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"AgentResult.metadata must be a dict with string keys, got {type(metadata).__name__}; "
            "e.g. {'reward': 1.0, 'metadata': {'steps': 3}}."
        )
    try:
        return json.dumps(dict(metadata), default=str)
    except (TypeError, ValueError, RecursionError) as exc:  # keys that are no strings, a cycle, too deep
        raise TypeError(
            f"AgentResult.metadata cannot be written as JSON ({type(exc).__name__}: {exc}); use a dict with "
            "string keys, no cycles and plain values."
        ) from None


@dataclass(frozen=True)
class RunEnded:
    """The run returned (``result``) or raised (``error``)."""

    result: AgentResult | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class StreamCut:
    """The client of a streamed reply went away before its last event: the dialog ends at that turn, cut
    (an event, so that a reader waiting for the run's next one wakes up)."""

    reason: str


Event = AgentCall | RunEnded | StreamCut


def result_of(value: Any, dialog: str) -> AgentResult:
    """An agent's return value as an :class:`AgentResult`: a number, a dict with ``"reward"``, or one already."""
    if isinstance(value, AgentResult):
        return value
    if isinstance(value, Mapping) and "reward" in value:
        metadata = value.get("metadata", {k: v for k, v in value.items() if k != "reward"})
        return AgentResult(reward=_reward(value["reward"], dialog), metadata=metadata)
    return AgentResult(reward=_reward(value, dialog))


def _reward(value: Any, dialog: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(
            f"the agent of {dialog} returned {value!r:.100}, not a reward: return a finite number, "
            "{'reward': number, 'metadata': {...}} or AgentResult(reward=...)."
        )
    return float(value)


class AgentRun:
    """One agent run: its key, its events (calls, its end) and the rewards it added along the way."""

    def __init__(self, *, key: str, dialog: str, prompt_id: int) -> None:
        self.key = key
        self.dialog = dialog
        """Names the run in errors and logs: ``"agent run 12 (env element 3, dataset row 5)"``."""
        self.prompt_id = prompt_id
        self.replies: dict[ReplyKey, str] = {}
        """The replies this run got: their key -> the text the model wrote (see ``history_of``)."""
        self.num_calls = 0
        self._lock = threading.Lock()
        self._events: deque[Event] = deque()
        self._waiter: Future | None = None
        self._ended: str | None = None  # why the dialog ended (then calls are refused)
        self._reward = 0.0
        self._task: Future | None = None  # the async agent's task (cancelled if the dialog gives up on it)
        self._cuts: dict[AgentCall, str] = {}  # calls whose client left their streamed reply -> how

    # ------------------------------------------------------------------ the agent's side (any thread)
    def post_call(self, request: ChatRequest) -> AgentCall:
        """Queue a call; its ``reply`` future resolves with the reply (or :class:`DialogEndedError`)."""
        call = AgentCall(request)
        call.reply.set_running_or_notify_cancel()  # nobody may cancel it: the env or end() answers it
        with self._lock:
            if self._ended is not None:
                raise DialogEndedError(f"{self.dialog} has ended ({self._ended}); this call was not recorded.")
            self._post(call)
        return call

    def add_reward(self, value: float) -> None:
        """Add to the reward of the turn of the latest reply (before any reply: of the first turn)."""
        reward = _reward(value, self.dialog)
        with self._lock:
            self._reward += reward

    def finish(self, result: AgentResult | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            if self._ended is None:  # after the dialog's end (e.g. an agent cancelled by a close) it means nothing
                self._post(RunEnded(result, error))

    def cut_stream(self, call: AgentCall, reason: str) -> None:
        """The client of ``call``'s streamed reply left before its last event (the endpoint saw it go)."""
        with self._lock:
            if self._ended is None:
                self._cuts[call] = reason
                self._post(StreamCut(reason))

    def cut_reason(self, call: AgentCall | None) -> str | None:
        """Why ``call``'s client left its streamed reply (None: it did not, as far as the endpoint saw)."""
        with self._lock:
            return None if call is None else self._cuts.get(call)

    # ------------------------------------------------------------------ the env's side
    def next_event(self) -> Future:
        """A future of the run's next event (already resolved if one is waiting, or if the run has
        ended: a reader never waits on a run nobody will post to)."""
        future: Future = Future()
        with self._lock:
            if self._events:
                future.set_result(self._events.popleft())
            elif self._ended is not None:
                future.set_result(RunEnded(error=DialogEndedError(f"{self.dialog} has ended ({self._ended})")))
            else:
                self._waiter = future
        return future

    def take_reward(self) -> float:
        """The rewards added since the last call, reset to 0."""
        with self._lock:
            reward, self._reward = self._reward, 0.0
        return reward

    def end(self, reason: str) -> None:
        """The dialog is over: refuse later calls, fail the calls still queued, cancel an async agent,
        and wake a reader still waiting for an event (the env closing under a waiting reset)."""
        with self._lock:
            if self._ended is not None:
                return
            self._ended = reason
            queued = [e for e in self._events if isinstance(e, AgentCall)]
            self._events.clear()
            task = self._task
            if self._waiter is not None:
                self._post(RunEnded(error=DialogEndedError(f"{self.dialog} has ended ({reason})")))
        for call in queued:
            _answer(
                call.reply, error=DialogEndedError(f"{self.dialog} has ended ({reason}); this call was not recorded.")
            )
        if task is not None:
            task.cancel()

    @property
    def ended(self) -> bool:
        return self._ended is not None

    def _post(self, event: Event) -> None:
        """Hand ``event`` to a waiting reader, else queue it (under the lock)."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and settle(waiter, result=event):
            return  # else the reader gave up waiting (a timeout cancelled its future)
        self._events.append(event)

    # ------------------------------------------------------------------ running the agent
    def start(self, agent: Callable[..., Any], context: AgentContext, row: Mapping[str, Any], loop: Any) -> None:
        """Run ``agent(context, row)``: on ``loop`` (a :class:`~lmcollect.plumbing.LoopThread`) if it is async, else in a thread."""
        if is_async_agent(agent):
            self._task = asyncio.run_coroutine_threadsafe(self._run_async(agent, context, row), loop.loop)
            return
        name = f"lmcollect-agent-{self.key[:6]}"
        threading.Thread(target=self._run_sync, args=(agent, context, row), name=name, daemon=True).start()

    def _run_sync(self, agent: Callable[..., Any], context: AgentContext, row: Mapping[str, Any]) -> None:
        try:
            value = agent(context, row)
        except BaseException as exc:  # designed: the agent's failure ends its dialog, as the env's config says
            self.finish(error=exc)
            return
        self._finish_with(value)

    async def _run_async(self, agent: Callable[..., Any], context: AgentContext, row: Mapping[str, Any]) -> None:
        try:
            value = await agent(context, row)
        except asyncio.CancelledError:
            self.finish(error=TimeoutError(f"the agent of {self.dialog} was cancelled"))
            raise
        except Exception as exc:  # designed: the agent's failure ends its dialog, as the env's config says
            self.finish(error=exc)
            return
        self._finish_with(value)

    def _finish_with(self, value: Any) -> None:
        try:
            result = result_of(value, self.dialog)
        except (TypeError, ValueError) as exc:  # designed: a reward or metadata we cannot keep fails the run
            self.finish(error=exc)
            return
        self.finish(result=result)


def _answer(reply: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    if not settle(reply, result=result, error=error):
        logger.debug("a call's reply was already answered")


def answer_call(call: AgentCall, reply: CallReply) -> None:
    """Hand ``reply`` to the waiting HTTP request (which writes it in its API's form)."""
    _answer(call.reply, result=reply)


def refuse_call(call: AgentCall, error: BaseException) -> None:
    _answer(call.reply, error=error)


def is_async_agent(agent: Callable[..., Any]) -> bool:
    """An ``async def`` function (or an object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__)


IN_PROCESS_BASE_URL = "http://lmcollect.in-process/v1"
"""The base URL of in-process clients (no socket: the host is never looked up)."""


class AgentContext:
    """What an agent run gets besides its row: where to send its model calls, and a way to add rewards.

    ``base_url`` and ``api_key`` are those of the endpoint (OpenAI chat completions and Responses,
    Anthropic Messages); the key is this run's own (a call with it after the dialog ended gets HTTP
    409). :meth:`openai` / :meth:`async_openai` / :meth:`anthropic` / :meth:`async_anthropic` build
    clients for them, :meth:`http_client` / :meth:`async_http_client` plain ``httpx`` ones. With
    ``in_process=True`` (``AgentEnvConfig(transport="in_process")``) those clients call the endpoint's
    app in this process, without a socket; ``base_url`` still works for anything else (reading it
    starts the HTTP listener).
    """

    def __init__(
        self,
        run: AgentRun,
        *,
        model: str,
        base_url: str | None = None,
        server: AgentServer | None = None,
        in_process: bool = False,
    ) -> None:
        if base_url is None and server is None:
            raise TypeError("AgentContext needs base_url or server (the endpoint the run calls).")
        if in_process and server is None:
            raise TypeError("AgentContext(in_process=True) needs the server whose app its clients call.")
        self._run = run
        self._base_url = base_url
        self._server = server
        self.in_process = in_process
        """The clients built here call the endpoint in-process (no socket)."""
        self.api_key = run.key
        """This run's key (send it as ``Authorization: Bearer <key>`` or ``x-api-key: <key>``)."""
        self.model = model
        """The model name the endpoint serves (any name is accepted)."""
        self.dialog = run.dialog
        """This run's name in errors and logs."""

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1`` (read in-process: the endpoint starts listening now)."""
        if self._base_url is None:
            assert self._server is not None, "checked in __init__"
            self._server.start()
            self._base_url = self._server.base_url
        return self._base_url

    @property
    def client_base_url(self) -> str:
        """The base URL of the clients built here: :attr:`base_url`, or in-process one no socket serves
        (its calls reach the endpoint only through :meth:`openai_http_client` and the like)."""
        return IN_PROCESS_BASE_URL if self.in_process else self.base_url

    def openai_http_client(self, *, asynchronous: bool = False) -> Any:
        """The HTTP client :meth:`openai` (``asynchronous``: :meth:`async_openai`) is built on, for a
        framework that builds its own ``openai`` client from a base URL, a key and an ``http_client``
        (langchain-openai's ``ChatOpenAI``, smolagents' ``OpenAIServerModel``): pass it with
        :attr:`client_base_url` and :attr:`api_key`, and in-process the calls need no socket."""
        import openai

        http_client = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
        return http_client(**self._transport_options(asynchronous, http_client))

    def openai(self, **kwargs: Any) -> openai_package.OpenAI:
        """An ``openai.OpenAI`` client for this run (``max_retries=0`` unless given: a refused call stays
        refused; no proxy unless ``http_client`` is given: see :meth:`_client_options`)."""
        import openai

        return openai.OpenAI(**self._client_options(kwargs, openai.DefaultHttpxClient, "/v1", asynchronous=False))

    def async_openai(self, **kwargs: Any) -> openai_package.AsyncOpenAI:
        """An ``openai.AsyncOpenAI`` client for this run (for ``async`` agents)."""
        import openai

        return openai.AsyncOpenAI(
            **self._client_options(kwargs, openai.DefaultAsyncHttpxClient, "/v1", asynchronous=True)
        )

    def anthropic(self, **kwargs: Any) -> Any:
        """An ``anthropic.Anthropic`` client for this run (in the ``agents`` extra): its
        ``messages.create`` reaches ``/v1/messages``."""
        import anthropic

        return anthropic.Anthropic(**self._client_options(kwargs, anthropic.DefaultHttpxClient, "", asynchronous=False))

    def async_anthropic(self, **kwargs: Any) -> Any:
        """An ``anthropic.AsyncAnthropic`` client for this run (for ``async`` agents)."""
        import anthropic

        options = self._client_options(kwargs, anthropic.DefaultAsyncHttpxClient, "", asynchronous=True)
        return anthropic.AsyncAnthropic(**options)

    def http_client(self, **kwargs: Any) -> Any:
        """An ``httpx.Client`` whose base URL is the endpoint's ``/v1`` and which sends this run's key."""
        import httpx

        return httpx.Client(**self._httpx_options(kwargs, asynchronous=False))

    def async_http_client(self, **kwargs: Any) -> Any:
        """An ``httpx.AsyncClient`` as :meth:`http_client` (for ``async`` agents)."""
        import httpx

        return httpx.AsyncClient(**self._httpx_options(kwargs, asynchronous=True))

    def _client_options(
        self, kwargs: dict[str, Any], http_client: type, suffix: str, *, asynchronous: bool
    ) -> dict[str, Any]:
        """The client's arguments: this run's endpoint (its URL ending in ``suffix``) and key, and an
        HTTP client that ignores ``HTTP_PROXY`` and the like (the endpoint is in this process: a
        proxy would see the run's key and prompts, and one that cannot reach this machine fails
        every call), or in-process, one whose transport calls the endpoint's app."""
        root = self.client_base_url
        options = {"base_url": root.removesuffix("/v1") + suffix, "api_key": self.api_key, "max_retries": 0, **kwargs}
        if "http_client" not in options:
            options["http_client"] = http_client(**self._transport_options(asynchronous, http_client))
        return options

    def _httpx_options(self, kwargs: dict[str, Any], *, asynchronous: bool) -> dict[str, Any]:
        root = self.client_base_url
        options: dict[str, Any] = {"base_url": root, "headers": {"Authorization": f"Bearer {self.api_key}"}}
        options.update(self._transport_options(asynchronous, None))
        return {**options, **kwargs}

    def _transport_options(self, asynchronous: bool, http_client: type | None) -> dict[str, Any]:
        """No proxy over HTTP; in-process, a transport of the HTTP package ``http_client`` is built on."""
        if not self.in_process:
            return {"trust_env": False}
        from lmcollect.agents.transport import http_module_of

        assert self._server is not None, "checked in __init__"
        module = "httpx" if http_client is None else http_module_of(http_client)
        return {"transport": self._server.transport(asynchronous=asynchronous, http_module=module)}

    def add_reward(self, value: float) -> None:
        """Add ``value`` to the reward of the turn of the latest reply (a per-turn reward; before any
        reply, of the first turn). The number the agent returns goes on the last turn."""
        self._run.add_reward(value)
