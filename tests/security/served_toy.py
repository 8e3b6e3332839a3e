"""The served-engine toys the security tests share: a ToyVLLM app behind the control guard, driven
in-process (:func:`call_asgi`) or served by uvicorn on loopback (the ``served_toy`` fixture)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmcollect.engines.served.control import CONTROL_TOKEN_HEADER, ControlEndpointGuard, ControlSettings, is_public_path

TOKEN = "t0ken-for-tests-0123456789abcdef"
WRONG_TOKEN = "wrong-token-0123456789abcdef"
HEADER = CONTROL_TOKEN_HEADER.lower().encode()
WAIT_S = 5.0  # the longest any awaited event may take here


LAUNCH_SECRET = "launch-secret-for-tests-0123456789"


def guard_env(token: str | None = TOKEN, lease_s: float = 60.0) -> dict[str, str]:
    return ControlSettings(token=token, pause_lease_s=lease_s, launch_secret=LAUNCH_SECRET).environ()


class ToyVLLM:
    """An ASGI app answering like vLLM's routes that the engine uses; records each request it sees."""

    def __init__(self, *, control_endpoints: bool = True) -> None:
        self.control_endpoints = control_endpoints
        self.is_paused = False
        self.seen: list[tuple[str, str, bool]] = []
        """(method, path, whether it carried the control token header), in order."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http", scope["type"]
        method, path = scope["method"], scope["path"]
        self.seen.append((method, path, any(name == HEADER for name, _ in scope["headers"])))
        while (await receive()).get("more_body"):  # the request body, whatever it is
            pass
        status, content = self.answer(method, path)
        body = json.dumps(content).encode()
        headers = [(b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def answer(self, method: str, path: str) -> tuple[int, dict[str, Any]]:
        if (method, path) == ("GET", "/v1/models"):
            return 200, {"data": [{"id": "toy", "root": "/toy"}]}
        if (method, path) == ("POST", "/v1/completions"):  # two tokens, whatever the prompt
            return 200, {"choices": [{"finish_reason": "length", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -0.25]}}]}
        if path in ("/health", "/metrics") or path.startswith("/v1/"):
            return 200, {}
        if not self.control_endpoints:
            return 404, {"detail": "Not Found"}
        if path in ("/pause", "/resume"):
            self.is_paused = path == "/pause"
            return 200, {"status": path[1:] + "d"}
        if path == "/fail_pause":
            return 500, {"error": "no"}
        answers = {"/is_paused": {"is_paused": self.is_paused}, "/reset_prefix_cache": {"success": True}}
        return 200, answers.get(path, {"results": ["done"]})

    def control_calls(self) -> list[str]:
        return [path for _, path, _ in self.seen if not is_public_path(path)]


async def call_asgi(
    app: Any,
    method: str,
    path: str,
    *,
    token: str | None = None,
    client: tuple[str, int] | None = ("127.0.0.1", 5000),
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One request to an ASGI app served on 127.0.0.1:8000 (Host says so unless ``headers`` do); its status and JSON answer."""
    fields = {"host": "127.0.0.1:8000", **(headers or {})}
    raw = [(name.encode(), value.encode()) for name, value in fields.items()]
    raw += [] if token is None else [(HEADER, token.encode())]
    path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "method": method,
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query.encode(), "headers": raw,
        "client": client, "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    answer: dict[str, Any] = {}
    body = bytearray()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        else:
            body.extend(message.get("body", b""))

    await app(scope, receive, send)
    return answer["status"], json.loads(body) if body else {}


async def wait_until(condition: Callable[[], bool], *, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(0.01)

class ServedToy:
    def __init__(self, toy: ToyVLLM, guard: ControlEndpointGuard, url: str) -> None:
        self.toy, self.guard, self.url = toy, guard, url


@pytest.fixture
def served_toy(request: pytest.FixtureRequest) -> Iterator[ServedToy]:
    """The guard in front of a ToyVLLM, served by uvicorn on a free loopback port; the test's param:
    (lease, control endpoints on) or (lease, control endpoints on, token)."""
    uvicorn = pytest.importorskip("uvicorn")
    lease_s, control_endpoints, token = (*getattr(request, "param", (60.0, True)), TOKEN)[:3]
    toy = ToyVLLM(control_endpoints=control_endpoints)
    guard = ControlEndpointGuard(toy, environ=guard_env(token=token, lease_s=lease_s))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(guard, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield ServedToy(toy, guard, f"http://127.0.0.1:{sock.getsockname()[1]}")
    server.should_exit = True
    thread.join(timeout=WAIT_S)
    sock.close()
    assert not thread.is_alive()
