"""Whom the served engine trusts, tried as an attacker would (issue 42, items 1-3).

1. A web page the user opens: its cross-site requests (a simple POST needs no preflight) and, after
   a DNS rebinding, its "same-origin" ones reach 127.0.0.1 too. The guard refuses both with 403 and
   the app never sees them; lmcollect's own client still gets through.
2. A process that answers on the launcher's port before vLLM binds it: the launcher asks it to
   prove the launch secret and, when it cannot, stops with a clear error, having sent it neither
   the control token nor a prompt.
3. A pause lease whose own resume fails once: the guard tries again, so the server does not stay
   paused.

No vLLM process: the guard wraps a toy app (tests/security/served_toy.py), in-process or behind
uvicorn on loopback; the impostor is a tiny ``http.server`` on loopback; the launched process is a
named fake (a Python that sleeps, as ``vllm serve`` does while it imports vLLM).
"""
from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from lmcollect.engines.served import control as vllm_control, launcher as vllm_launcher
from lmcollect.engines.served.control_checks import launch_proof
from lmcollect.engines.served.control import CONTROL_TOKEN_HEADER, IDENTITY_PATH, ControlEndpointGuard
from lmcollect.engines.served.launcher import launch_refusal
from lmcollect.engines.served import VLLMServer, VLLMServerEngine
from tests.security.served_toy import (  # the served_toy fixture comes from conftest
    LAUNCH_SECRET,
    TOKEN,
    WAIT_S,
    ServedToy,
    ToyVLLM,
    call_asgi,
    guard_env,
    wait_until,
)

NO_TOKEN = (60.0, True, None)  # served_toy: the default lease, control endpoints on, control_token=False
EVIL = "evil.example"


def send_raw(url: str, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """One request as a browser sends it: any Host, Origin and Sec-Fetch-Site, and a JSON body sent as
    text/plain (a "simple" request: no CORS preflight). Its status and JSON answer."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=WAIT_S)
    body = json.dumps({"method": "join_weight_group", "args": ["198.51.100.7", 29500]}).encode()
    try:
        connection.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for name, value in {**headers, "Content-Type": "text/plain", "Content-Length": str(len(body))}.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        connection.close()


# ---------------------------------------------------------------------------------- 1. browsers
BROWSER_ATTACKS = {
    "cross_site_post": {"Origin": f"http://{EVIL}", "Sec-Fetch-Site": "cross-site"},
    "origin_only": {"Origin": f"https://{EVIL}"},  # a browser without Sec-Fetch-* headers
    "fetch_site_only": {"Sec-Fetch-Site": "same-site"},  # a page on another port of this host
    "sandboxed_frame": {"Origin": "null", "Sec-Fetch-Site": "cross-site"},
    # DNS rebinding: the page's own name now resolves to 127.0.0.1, so to the browser it is same-origin
    "rebound_page": {"Host": f"{EVIL}:{{port}}", "Origin": f"http://{EVIL}:{{port}}", "Sec-Fetch-Site": "same-origin"},
    "rebound_no_marks": {"Host": f"{EVIL}:{{port}}"},
    "other_port": {"Host": "127.0.0.1:1"},
}


@pytest.mark.parametrize("served_toy", [NO_TOKEN], indirect=True, ids=["no_token"])
@pytest.mark.parametrize("path", ["/pause", "/collective_rpc"])
@pytest.mark.parametrize("attack", list(BROWSER_ATTACKS))
def test_a_web_page_cannot_reach_the_control_endpoints_of_a_tokenless_loopback_server(
    served_toy: ServedToy, path: str, attack: str
) -> None:
    port = str(urlsplit(served_toy.url).port)
    headers = {name: value.replace("{port}", port) for name, value in BROWSER_ATTACKS[attack].items()}
    status, answer = send_raw(served_toy.url, "POST", path, headers)
    assert status == 403, (status, answer)
    assert "control request refused" in answer["error"]["message"]
    assert served_toy.toy.seen == [] and not served_toy.toy.is_paused  # the app never saw it
    assert served_toy.guard.lease.deadline is None


@pytest.mark.parametrize("served_toy", [NO_TOKEN], indirect=True, ids=["no_token"])
def test_lmcollects_client_and_the_users_own_tools_still_reach_a_tokenless_loopback_server(
    served_toy: ServedToy,
) -> None:
    port = urlsplit(served_toy.url).port
    engine = VLLMServerEngine(served_toy.url)
    try:
        assert engine.collective_rpc("load_weights") == ["done"]
    finally:
        engine.close()
    allowed = [
        {"Host": f"localhost:{port}"},
        {"Host": f"127.0.0.1:{port}", "Sec-Fetch-Site": "none"},  # typed into the address bar
        {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port}", "Sec-Fetch-Site": "same-origin"},
    ]
    for headers in allowed:
        assert send_raw(served_toy.url, "GET", "/is_paused", headers)[0] == 200, headers


@pytest.mark.parametrize("attack", ["cross_site_post", "origin_only", "fetch_site_only", "sandboxed_frame"])
def test_a_cross_site_request_is_refused_even_with_the_token(attack: str) -> None:
    app = ToyVLLM()
    guard = ControlEndpointGuard(app, environ=guard_env())
    status, answer = asyncio.run(call_asgi(guard, "POST", "/pause", token=TOKEN, headers=BROWSER_ATTACKS[attack]))
    assert status == 403 and "control request refused" in answer["error"]["message"]
    assert app.seen == [] and guard.lease.deadline is None
    # with a token, a rebound page gets nowhere without it, and the Host may be any name of the server
    named = {"host": "gpu-node-3.cluster:8000"}
    assert asyncio.run(call_asgi(guard, "GET", "/is_paused", token=TOKEN, headers=named))[0] == 200


# ---------------------------------------------------------------------------------- 2. the process on the port
def test_the_guard_proves_the_launch_secret_to_anyone_and_reveals_nothing_else() -> None:
    guard = ControlEndpointGuard(ToyVLLM(), environ=guard_env())
    challenge = "ab" * 32
    browser = {"Origin": f"http://{EVIL}"}  # the proof is no secret: anyone may ask
    status, answer = asyncio.run(call_asgi(guard, "GET", f"{IDENTITY_PATH}?challenge={challenge}", headers=browser))
    assert status == 200 and answer == {"proof": launch_proof(LAUNCH_SECRET, challenge)}
    assert LAUNCH_SECRET not in json.dumps(answer) and TOKEN not in json.dumps(answer)
    assert asyncio.run(call_asgi(guard, "GET", f"{IDENTITY_PATH}?challenge=short"))[0] == 400
    hand_started = ControlEndpointGuard(ToyVLLM(), environ={})  # no launch secret: it proves nothing
    assert asyncio.run(call_asgi(hand_started, "GET", f"{IDENTITY_PATH}?challenge={challenge}"))[0] == 404


def test_the_launcher_accepts_the_server_that_holds_its_secret_only(served_toy: ServedToy) -> None:
    assert launch_refusal(served_toy.url, LAUNCH_SECRET) is None
    why = launch_refusal(served_toy.url, "another-launch-secret-0123456789")
    assert why is not None and "not the launched server's proof" in why


class Impostor(BaseHTTPRequestHandler):
    """A process that took the port first: healthy at once, and eager to read what the launcher sends."""

    seen: list[bytes] = []
    answers_identity = "forged"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.record()
        if self.path.startswith(IDENTITY_PATH) and self.answers_identity == "forged":
            self.answer(200, {"proof": "0" * 64})
        elif self.path.startswith(IDENTITY_PATH) and self.answers_identity == "echo":
            self.answer(200, {"proof": self.path.rpartition("=")[2]})
        elif self.path.startswith(IDENTITY_PATH):
            self.answer(404, {"detail": "Not Found"})
        else:
            self.answer(200, {})

    def do_POST(self) -> None:
        self.record()
        self.answer(200, {"choices": []})

    def record(self) -> None:
        length = int(self.headers.get("Content-Length", "0") or 0)
        Impostor.seen.append(f"{self.command} {self.path}\n{self.headers}".encode() + self.rfile.read(length))

    def answer(self, status: int, content: dict[str, Any]) -> None:
        body = json.dumps(content).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def impostor(request: pytest.FixtureRequest) -> Iterator[int]:
    """An impostor listening on a loopback port (its identity answer: the test's param); the port."""
    Impostor.seen, Impostor.answers_identity = [], request.param
    server = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join(timeout=WAIT_S)


def fake_serve_command(model_path: object, *, host: str, port: int, serve_args: object = ()) -> list[str]:
    """A fake ``vllm serve``: a Python that sleeps, as the real one does for 30-80 s while it imports vLLM."""
    return [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.mark.parametrize("impostor", ["forged", "echo", "none"], indirect=True)
def test_the_launcher_never_trusts_a_process_that_took_its_port(
    impostor: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_launcher, "serve_command", fake_serve_command)
    server = VLLMServer(tmp_path, port=impostor, control_endpoints=True, wait=False, log_path=tmp_path / "serve.log")
    assert server.running and server.control_token is not None
    with pytest.raises(RuntimeError, match=f"not the vllm serve this VLLMServer started.*port {impostor}"):
        server.wait_ready(timeout_s=30.0)
    assert not server.running  # the launched process was stopped with the refusal
    seen = b"\n".join(Impostor.seen)
    assert [request.split(b"\n", 1)[0].split(b"?")[0] for request in Impostor.seen] == [
        b"GET /health",
        b"GET " + IDENTITY_PATH.encode(),
    ]  # fmt: skip
    assert server.control_token.encode() not in seen and CONTROL_TOKEN_HEADER.lower().encode() not in seen.lower()


# ---------------------------------------------------------------------------------- 3. the lease's own resume
class FlakyResume(ToyVLLM):
    """A ToyVLLM whose first ``num_failures`` resumes fail (``how``: an HTTP 500 or an exception)."""

    def __init__(self, num_failures: int, how: str) -> None:
        super().__init__()
        self.failures_left, self.how = num_failures, how

    def answer(self, method: str, path: str) -> tuple[int, dict[str, Any]]:
        if path == "/resume" and self.failures_left > 0:
            self.failures_left -= 1
            if self.how == "exception":
                raise RuntimeError("the engine core is busy")
            return 500, {"error": "the engine core is busy"}
        return super().answer(method, path)


@pytest.mark.parametrize("how", ["http_500", "exception"])
def test_a_lease_whose_own_resume_fails_once_still_ends_the_pause(how: str) -> None:
    app = FlakyResume(num_failures=1, how=how)
    guard = ControlEndpointGuard(app, environ=guard_env(lease_s=0.2))

    async def scenario() -> None:
        assert (await call_asgi(guard, "POST", "/pause", token=TOKEN))[0] == 200
        await wait_until(lambda: not app.is_paused, what="the guard's second resume after a failed one")

    asyncio.run(scenario())
    assert [path for _, path, _ in app.seen] == ["/pause", "/resume", "/resume"]
    assert guard.lease.num_expired == 1 and guard.lease.num_resume_failures == 1


def test_a_resume_that_keeps_failing_is_tried_a_bounded_number_of_times_and_the_next_lease_still_works() -> None:
    app = FlakyResume(num_failures=1000, how="http_500")
    guard = ControlEndpointGuard(app, environ=guard_env(lease_s=0.2))

    async def scenario() -> None:
        await call_asgi(guard, "POST", "/pause", token=TOKEN)
        await wait_until(lambda: guard.lease.num_resume_failures >= vllm_control.MIN_RESUME_TRIES, what="retries")
        await asyncio.sleep(1.0)  # over the retry window (one more lease): no more tries
        tries = guard.lease.num_resume_failures
        assert tries < 10 and app.is_paused, tries
        app.failures_left = 0  # the engine core recovers; the next pause's lease ends it
        await call_asgi(guard, "POST", "/pause", token=TOKEN)
        await wait_until(lambda: not app.is_paused, what="the next lease's resume")

    asyncio.run(scenario())
    assert guard.lease.num_expired == 2
