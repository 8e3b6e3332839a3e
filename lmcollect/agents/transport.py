"""In-process ``httpx`` transports: an agent in the collector's process calls the endpoint's ASGI app without a socket.

The request goes through the same app as over HTTP (routing, key check, refusals, the same JSON
and server-sent events back), but as ASGI messages handed between coroutines: no connection, no
HTTP parsing. A response's body is handed over one message at a time (the app waits until the
reader took the previous one), so a reader that closes a streamed reply early is seen by the app
as a client that left: its next send raises ``OSError``, and its run records the stream as cut.

The ``openai`` and ``anthropic`` clients are built on ``httpx`` or on its fork ``httpx2`` (newer
releases), whose transports are distinct classes: :func:`transport_classes` builds the transports
for either module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

_END = ("end",)  # the app returned


class _Exchange:
    """One request through the ASGI app; ``messages`` holds its response's start and body parts, one at a time."""

    def __init__(self, app: Any, request: Any, body: bytes) -> None:
        self.app = app
        self.body = body
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", 0),
            "server": (request.url.host, request.url.port or 80),
        }
        self.messages: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue(maxsize=1)
        self.closed = asyncio.Event()
        self._body_sent = False

    async def run(self) -> None:
        """Call the app, then tell the reader it returned (unless the reader left: cancelled, or closed
        with its loop, when nothing may be awaited)."""
        try:
            await self.app(self.scope, self._receive, self._send)
        except Exception:  # designed: the app's error still ends the reader's wait (Starlette sent a 500)
            await self._end()
            raise
        await self._end()

    async def _end(self) -> None:
        if not self.closed.is_set():
            await self.messages.put(_END)

    async def start(self) -> tuple[asyncio.Task, tuple[int, list[tuple[bytes, bytes]], tuple[Any, ...]]]:
        """Run the app (a task on this loop) until the response's head: the task, and :meth:`head`'s answer."""
        task = asyncio.ensure_future(self.run())
        task.add_done_callback(_observe)
        try:
            return task, await self.head()
        except (asyncio.CancelledError, Exception):  # designed: the reader was cancelled (its agent ended)
            self.close()  # (not on GeneratorExit: a coroutine closed with its loop may not touch it)
            task.cancel()
            raise

    async def close_and_wait(self, task: asyncio.Task) -> None:
        """:meth:`close`, then wait for the app to end (it has recorded the client's leaving then)."""
        self.close()
        await asyncio.wait({task}, timeout=10)

    async def head(self) -> tuple[int, list[tuple[bytes, bytes]], tuple[Any, ...]]:
        """The response's status, headers and first body message (one hop for a whole JSON reply)."""
        start = await self.messages.get()
        if start[0] != "start":
            raise ConnectionError("the agent endpoint's app returned without a response")
        return start[1], start[2], await self.messages.get()

    def close(self) -> None:
        """The reader is done (on the app's loop): the app's next send raises, a waiting one is freed."""
        self.closed.set()
        while not self.messages.empty():
            self.messages.get_nowait()

    async def _receive(self) -> dict[str, Any]:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.closed.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if self.closed.is_set():
            raise OSError("the client closed the response")
        if message["type"] == "http.response.start":
            await self.messages.put(("start", message["status"], list(message.get("headers", []))))
        elif message["type"] == "http.response.body":
            await self.messages.put(("body", message.get("body", b""), message.get("more_body", False)))


def _observe(task: Any) -> None:
    """Read a finished app call's error (already answered as a 500, or a client that left): none is left unread."""
    if not task.cancelled():
        task.exception()


def _last(message: tuple[Any, ...]) -> bool:
    return message is _END or not message[2]


class _InProcessTransport:
    """For ``httpx.Client`` (a plain agent in its own thread): the app runs on ``loop`` (another thread's)."""

    http: ModuleType  # httpx or httpx2 (set by transport_classes)
    body_class: type

    def __init__(self, app: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.app = app
        self.loop = loop

    def handle_request(self, request: Any) -> Any:
        exchange = _Exchange(self.app, request, request.read())
        task, (status, headers, first) = self._wait(exchange.start())  # one hop to the loop and back
        body = self.body_class(self, exchange, task, first)
        return self.http.Response(status, headers=headers, stream=body, request=request)

    def _wait(self, coro: Any) -> Any:
        """``coro``'s result from the app's loop; ConnectError once the endpoint was closed (its loop stopped)."""
        if self.loop.is_closed():
            coro.close()
            raise self.http.ConnectError("the agent endpoint was closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        while True:
            try:
                return future.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if not self.loop.is_running():
                    future.cancel()
                    raise self.http.ConnectError("the agent endpoint was closed") from None


class _SyncBody:
    def __init__(self, transport: _InProcessTransport, exchange: _Exchange, task: Any, first: tuple[Any, ...]) -> None:
        self.transport, self.exchange, self.task, self.first = transport, exchange, task, first
        self.read_all = False

    def __iter__(self) -> Iterator[bytes]:
        message = self.first
        while message is not _END:
            if message[1]:
                yield message[1]
            if _last(message):
                break
            message = self.transport._wait(self.exchange.messages.get())
        self.read_all = True

    def close(self) -> None:
        """Closed before the end (a reader that stopped early): the app sees a client that left, and
        has recorded it when this returns."""
        if self.read_all or self.transport.loop.is_closed():
            return
        self.transport._wait(self.exchange.close_and_wait(self.task))


class _AsyncInProcessTransport:
    """For ``httpx.AsyncClient`` (an ``async`` agent): the app runs on the caller's loop."""

    http: ModuleType  # httpx or httpx2 (set by transport_classes)
    body_class: type

    def __init__(self, app: Any) -> None:
        self.app = app

    async def handle_async_request(self, request: Any) -> Any:
        exchange = _Exchange(self.app, request, await request.aread())
        task, (status, headers, first) = await exchange.start()
        body = self.body_class(exchange, task, first)
        return self.http.Response(status, headers=headers, stream=body, request=request)


class _AsyncBody:
    def __init__(self, exchange: _Exchange, task: asyncio.Task, first: tuple[Any, ...]) -> None:
        self.exchange, self.task, self.first = exchange, task, first
        self.read_all = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        message = self.first
        while message is not _END:
            if message[1]:
                yield message[1]
            if _last(message):
                break
            message = await self.exchange.messages.get()
        self.read_all = True

    async def aclose(self) -> None:
        if self.read_all:
            return
        await self.exchange.close_and_wait(self.task)


@functools.cache
def transport_classes(http_module: str = "httpx") -> tuple[type, type]:
    """The in-process transports (sync, async) for clients of ``http_module`` (``"httpx"`` or
    ``"httpx2"``): ``InProcessTransport(app, loop)`` and ``AsyncInProcessTransport(app)``."""
    http = importlib.import_module(http_module)
    sync_body = type("InProcessBody", (_SyncBody, http.SyncByteStream), {})
    async_body = type("AsyncInProcessBody", (_AsyncBody, http.AsyncByteStream), {})
    sync = type(
        "InProcessTransport", (_InProcessTransport, http.BaseTransport), {"http": http, "body_class": sync_body}
    )
    asynchronous = type(
        "AsyncInProcessTransport",
        (_AsyncInProcessTransport, http.AsyncBaseTransport),
        {"http": http, "body_class": async_body},
    )
    return sync, asynchronous


def http_module_of(client_class: type) -> str:
    """The HTTP package an ``httpx``-style client class is built on (``"httpx"`` or ``"httpx2"``)."""
    base = next((c for c in client_class.__mro__ if c.__name__ in ("Client", "AsyncClient")), client_class)
    return base.__module__.partition(".")[0]
