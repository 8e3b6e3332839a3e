"""The endpoint agent runs call: FastAPI on uvicorn, in a thread, one key per run; or the same app in-process.

``POST /v1/chat/completions`` (OpenAI chat completions), ``POST /v1/responses`` (the OpenAI
Responses API), ``POST /v1/messages`` (the Anthropic Messages API) and ``GET /v1/models``, on
loopback by default. Every request must carry a live run's key (``Authorization: Bearer <key>``
or Anthropic's ``x-api-key``): an unknown key gets HTTP 401, the key of a run whose dialog ended
gets 409, a malformed or unsupported request 400 naming the field. A call is handed to its run
(:class:`~lmcollect.agents.runs.AgentRun`) and the request waits, without holding a thread, until
the collector has generated its reply; a streamed call then gets the reply as server-sent events.
Agents in the collector's process may skip the socket: :meth:`AgentServer.transport` calls the
same app in-process (:mod:`~lmcollect.agents.transport`).
"""

# no ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations (``Request``,
# imported inside build_app) at definition time, and a string annotation there would not resolve
import asyncio
import ipaddress
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from lmcollect.agents.anthropic_format import MessagesApi
from lmcollect.agents.openai_format import ApiFormat, CallReply, ChatCompletionsApi, RequestError
from lmcollect.agents.responses_format import ResponsesApi
from lmcollect.agents.runs import AgentCall, AgentRun, DialogEndedError
from lmcollect.plumbing import ClosesOnExit, LoopThread

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "lmcollect-policy"
_MAX_ENDED_KEYS = 1 << 16  # ended runs remembered (their key gets 409, not 401)
APIS: dict[str, ApiFormat] = {
    "/v1/chat/completions": ChatCompletionsApi(),
    "/v1/responses": ResponsesApi(),
    "/v1/messages": MessagesApi(),
}
"""The model-call routes and the API each speaks."""


class AgentServer(ClosesOnExit):
    """Serves agent runs' model calls over HTTP; :class:`~lmcollect.agents.AgentEnv` starts one for itself.

    Args:
        host: the address to listen on; loopback (the default) keeps other machines out. Any other
            address is logged as a warning: the keys are then the only guard.
        port: the port (0: a free one, see :attr:`base_url`).
        model_name: what ``/v1/models`` lists (requests may name any model: there is one).
        start_timeout_s: how long :meth:`start` waits for the server to listen.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model_name: str = DEFAULT_MODEL_NAME,
        start_timeout_s: float = 30.0,
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"port must be an int in [0, 65535] (0: any free port), got {port!r}.")
        self.host, self.model_name, self.start_timeout_s = host, model_name, start_timeout_s
        self.port = port
        self.num_calls = 0
        """Chat-completion requests accepted (handed to a run)."""
        self.num_refused = 0
        """Requests answered with an error (401, 409, 400)."""
        self._runs: dict[str, AgentRun] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # key -> dialog name
        self._lock = threading.Lock()
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()
        self._app: Any = None
        self._loop: LoopThread | None = None  # runs the app for in-process calls of plain (sync) agents

    @property
    def app(self) -> Any:
        """The ASGI app (FastAPI) that serves the routes, over HTTP and in-process alike."""
        with self._lock:
            if self._app is None:
                self._app = build_app(self)
            return self._app

    def transport(self, *, asynchronous: bool = False, http_module: str = "httpx") -> Any:
        """An ``httpx`` transport that calls :attr:`app` in this process, without a socket: pass it
        as ``httpx.Client(transport=...)`` (``asynchronous=True``: ``httpx.AsyncClient``;
        ``http_module="httpx2"`` for clients built on that fork, as newer ``openai`` releases are).
        The requests and responses are those of HTTP (status, headers, server-sent events)."""
        from lmcollect.agents.transport import transport_classes

        sync, async_transport = transport_classes(http_module)
        if asynchronous:
            return async_transport(self.app)
        with self._lock:
            if self._loop is None:
                self._loop = LoopThread("lmcollect-agent-calls", join_timeout_s=10)
            loop = self._loop
        return sync(self.app, loop.loop)

    @property
    def base_url(self) -> str:
        """``http://<host>:<port>/v1`` (after :meth:`start`)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    # ------------------------------------------------------------------ runs
    def register(self, run: AgentRun) -> None:
        """Serve ``run``'s key from now on."""
        with self._lock:
            self._runs[run.key] = run

    def retire(self, run: AgentRun) -> None:
        """``run``'s dialog ended: its key now gets HTTP 409."""
        with self._lock:
            self._runs.pop(run.key, None)
            self._ended[run.key] = run.dialog
            while len(self._ended) > _MAX_ENDED_KEYS:
                self._ended.popitem(last=False)

    def run_of(self, authorization: str | None) -> AgentRun:
        """The live run an ``Authorization`` header (or the bare key) names, or :class:`RequestError` (401 / 409)."""
        key = (authorization or "").removeprefix("Bearer ").strip()
        with self._lock:
            run, ended = self._runs.get(key), self._ended.get(key)
        if run is not None:
            return run
        if ended is not None:
            raise RequestError(
                f"{ended} has ended; its key takes no more calls (nothing was recorded).",
                status=409,
                kind="dialog_ended",
            )
        raise RequestError(
            "unknown API key: use the api_key of your agent run's AgentContext (each run has its own).",
            status=401,
            kind="authentication_error",
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Listen; returns once the server listens (later calls, from any thread, wait for the same)."""
        with self._lock:
            starting = self._thread is None
            if starting:
                import uvicorn

                _warn_if_exposed(self.host)
                config = uvicorn.Config(
                    self._app if self._app is not None else self._build_app(),
                    host=self.host,
                    port=self.port,
                    log_level="warning",
                    access_log=False,
                    lifespan="off",
                )
                self._uvicorn = uvicorn.Server(config)
                self._thread = threading.Thread(target=self._uvicorn.run, name="lmcollect-agent-server", daemon=True)
                self._thread.start()
        if starting:
            self._wait_listening()
            self._listening.set()
        elif not self._listening.wait(self.start_timeout_s):
            raise TimeoutError(f"the agent endpoint did not listen within start_timeout_s={self.start_timeout_s}.")

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self._uvicorn.started:
            if self._thread is None or not self._thread.is_alive():
                raise RuntimeError(
                    f"the agent endpoint could not listen on {self.host}:{self.port}; see the log above."
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent endpoint did not listen within start_timeout_s={self.start_timeout_s}.")
            time.sleep(0.01)
        self.port = int(self._uvicorn.servers[0].sockets[0].getsockname()[1])

    def _build_app(self) -> Any:
        self._app = build_app(self)  # under the lock
        return self._app

    def close(self) -> None:
        """Stop listening (requests still waiting were answered by their runs' ends first)."""
        with self._lock:
            thread, server, self._thread = self._thread, self._uvicorn, None
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()
        if thread is None:
            return
        server.should_exit = True
        thread.join(timeout=10)
        if thread.is_alive():
            logger.warning("the agent endpoint's thread did not stop within 10 s; it is left as a daemon thread.")


def _warn_if_exposed(host: str) -> None:
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        logger.warning(
            "the agent endpoint listens on %s, not loopback: other machines can reach it and only the runs' "
            "keys keep them out.",
            host,
        )


def key_of(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: ``Authorization: Bearer <key>`` (OpenAI) or ``x-api-key`` (Anthropic)."""
    return headers.get("authorization") or headers.get("x-api-key")


def build_app(server: AgentServer) -> Any:
    """The FastAPI app of ``server``: the model-call routes of :data:`APIS` and ``/v1/models``, errors
    in each API's JSON form."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="lmcollect agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        server.num_refused += 1
        api = APIS.get(request.url.path, APIS["/v1/chat/completions"])
        return JSONResponse(api.error_json(str(exc), exc.kind), status_code=exc.status)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.run_of(key_of(request.headers))
        model = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "lmcollect"}
        return JSONResponse({"object": "list", "data": [model]})

    for path, api in APIS.items():
        app.add_api_route(path, _route(server, api), methods=["POST"])
    return app


def _route(server: AgentServer, api: ApiFormat) -> Any:
    """The handler of one model-call route (a closure: FastAPI reads its ``Request`` annotation)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    from lmcollect.agents.event_stream import event_stream

    async def model_call(request: Request) -> Response:
        run = server.run_of(key_of(request.headers))
        try:
            body = await request.json()
        except (ValueError, RecursionError) as exc:  # malformed, or nested deeper than the parser recurses
            raise RequestError(f"the request body is not readable JSON: {type(exc).__name__}: {exc!s:.200}") from None
        parsed = api.parse(body)
        try:
            call = run.post_call(parsed)
        except DialogEndedError as exc:
            raise RequestError(str(exc), status=409, kind="dialog_ended") from exc
        server.num_calls += 1
        answer = await _answer_of(request, run, call)
        if answer is None:  # the client left while its streamed reply was generated (recorded as cut)
            return Response(status_code=499)
        if not parsed.stream:
            return JSONResponse(api.reply_json(answer, parsed, server.model_name))
        return event_stream(api.reply_events(answer, parsed, server.model_name), run, call)

    return model_call


async def _answer_of(request: Any, run: AgentRun, call: AgentCall) -> CallReply | None:
    """The call's reply; for a streamed call, None if the client left before it came (the run is told)."""
    future = asyncio.wrap_future(call.reply)
    try:
        if not call.request.stream:
            return await future
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left = gone.done() and not gone.cancelled() and gone.exception() is None
            gone.cancel()
        if left:
            run.cut_stream(call, "the client left before its streamed reply began")
            future.add_done_callback(_read_outcome)  # its reply (or refusal) comes to nobody now
            return None
        return await future
    except DialogEndedError as exc:
        raise RequestError(str(exc), status=409, kind="dialog_ended") from exc


def _read_outcome(future: asyncio.Future) -> None:
    """Read a reply nobody waits for any more (no "exception was never retrieved" at exit)."""
    if not future.cancelled():
        future.exception()


async def _client_gone(request: Any) -> None:
    """Returns when the client disconnects (the body was read: the server has nothing else to say)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
