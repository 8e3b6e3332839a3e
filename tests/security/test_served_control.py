"""A served engine's control endpoints are closed by default: token guard, pause leases, bounded HTTP calls.

Part of the security suite (issue "Closed by default"). No vLLM process: the guard
(``lmcollect.engines.served.control.ControlEndpointGuard``) wraps a toy ASGI app that answers like
vLLM's routes, driven directly with asyncio or served by uvicorn (what ``vllm serve`` runs) on
loopback; ``request_json`` talks to a tiny ``http.server``. Each server is stopped by its fixture.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from lmcollect.engines import EngineRequest
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.served import launcher as vllm_launcher
from lmcollect.engines.served.control import (
    CONTROL_TOKEN_ENV,
    CONTROL_TOKEN_HEADER,
    GUARD_PATH,
    PAUSE_LEASE_ENV,
    RENEW_PAUSE_PATH,
    ControlEndpointGuard,
    ControlSettings,
    is_loopback_host,
)
from lmcollect.engines.served.http import MAX_ERROR_BODY_BYTES
from lmcollect.engines.served import (
    VLLMServer,
    VLLMServerEngine,
    VLLMServerError,
    request_json,
    serve_command,
)
from tests.security.served_toy import (  # the served_toy fixture comes from conftest
    TOKEN,
    WAIT_S,
    WRONG_TOKEN,
    ServedToy,
    ToyVLLM,
    call_asgi,
    guard_env,
    wait_until,
)

# ---------------------------------------------------------------------------------- the token guard
CONTROL_PATHS = ["/pause", "/resume", "/collective_rpc", "/reset_prefix_cache", "/server_info", "/is_paused",
                 "/sleep", "/no_such_path", "/V1/models", "/v1x", "/healthz", RENEW_PAUSE_PATH]  # fmt: skip


@pytest.mark.parametrize("path", CONTROL_PATHS)
@pytest.mark.parametrize(("token", "status"), [(None, 401), (WRONG_TOKEN, 403)], ids=["none", "wrong"])
def test_a_control_request_without_the_right_token_is_refused_and_never_reaches_the_app(
    path: str, token: str | None, status: int
) -> None:
    app = ToyVLLM()
    guard = ControlEndpointGuard(app, environ=guard_env())
    got, answer = asyncio.run(call_asgi(guard, "POST", path, token=token))
    assert got == status and app.seen == []
    assert "control_token" in answer["error"]["message"] and TOKEN not in json.dumps(answer)
    assert guard.lease.deadline is None  # a refused /pause holds nothing


def test_the_token_opens_the_control_endpoints_and_the_public_api_needs_none() -> None:
    app = ToyVLLM()
    guard = ControlEndpointGuard(app, environ=guard_env())

    async def scenario() -> None:
        assert await call_asgi(guard, "GET", "/is_paused", token=TOKEN) == (200, {"is_paused": False})
        for path in ["/v1/models", "/v1/completions", "/health", "/metrics"]:
            assert (await call_asgi(guard, "GET", path))[0] == 200, path

    asyncio.run(scenario())
    assert [path for _, path, _ in app.seen] == ["/is_paused", "/v1/models", "/v1/completions", "/health", "/metrics"]


@pytest.mark.parametrize(
    ("client", "status"), [(("127.0.0.1", 1), 200), (("::1", 1), 200), (("10.0.0.5", 1), 403), (None, 403)]
)
def test_without_a_token_only_loopback_peers_reach_the_control_endpoints(client: Any, status: int) -> None:
    app = ToyVLLM()
    guard = ControlEndpointGuard(app, environ=guard_env(token=None))
    assert asyncio.run(call_asgi(guard, "GET", "/is_paused", client=client))[0] == status
    assert len(app.seen) == (1 if status == 200 else 0)


def test_settings_travel_in_the_environment_and_never_show_the_token() -> None:
    settings = ControlSettings.from_environ({CONTROL_TOKEN_ENV: TOKEN, PAUSE_LEASE_ENV: "0.5"})
    assert (settings.token, settings.pause_lease_s) == (TOKEN, 0.5) and TOKEN not in repr(settings)
    assert ControlSettings.from_environ({CONTROL_TOKEN_ENV: ""}).token is None  # empty: no token
    with pytest.raises(ValueError, match=PAUSE_LEASE_ENV):
        ControlSettings.from_environ({PAUSE_LEASE_ENV: "soon"})
    with pytest.raises(ValueError, match="pause_lease_s must be a positive"):
        ControlSettings(pause_lease_s=0.0)
    assert all(map(is_loopback_host, ["127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"]))
    assert not any(map(is_loopback_host, ["0.0.0.0", "::", "10.0.0.1", "example.com", ""]))


# ---------------------------------------------------------------------------------- the pause lease
def test_an_unrenewed_pause_ends_with_the_guard_resuming_the_server() -> None:
    app = ToyVLLM()
    guard = ControlEndpointGuard(app, environ=guard_env(lease_s=0.3))

    async def scenario() -> None:
        assert (await call_asgi(guard, "POST", "/pause", token=TOKEN))[0] == 200
        assert app.is_paused and guard.lease.deadline is not None
        await wait_until(lambda: not app.is_paused, what="the guard's own resume")

    asyncio.run(scenario())
    assert app.seen == [("POST", "/pause", True), ("POST", "/resume", False)]  # the guard's resume carries no token
    assert guard.lease.num_expired == 1 and guard.lease.deadline is None


def test_renewals_hold_the_pause_and_a_resume_ends_the_lease() -> None:
    app = ToyVLLM()
    lease_s = 0.4
    guard = ControlEndpointGuard(app, environ=guard_env(lease_s=lease_s))

    async def scenario() -> None:
        assert (await call_asgi(guard, "POST", RENEW_PAUSE_PATH, token=TOKEN))[0] == 409  # nothing held yet
        await call_asgi(guard, "POST", "/pause", token=TOKEN)
        for _ in range(10):  # 1 s, two and a half leases
            assert await call_asgi(guard, "POST", RENEW_PAUSE_PATH, token=TOKEN) == (200, {"lease_s": lease_s})
            await asyncio.sleep(0.1)
        assert app.is_paused and guard.lease.num_expired == 0
        await call_asgi(guard, "POST", "/resume", token=TOKEN)
        assert guard.lease.deadline is None
        assert (await call_asgi(guard, "POST", RENEW_PAUSE_PATH, token=TOKEN))[0] == 409
        await asyncio.sleep(lease_s * 1.5)  # a lease's time: the ended lease must not resume again

    asyncio.run(scenario())
    assert [path for _, path, _ in app.seen] == ["/pause", "/resume"] and guard.lease.num_expired == 0


def test_a_failed_pause_holds_no_lease() -> None:
    guard = ControlEndpointGuard(ToyVLLM(), environ=guard_env(lease_s=0.3))
    assert asyncio.run(call_asgi(guard, "POST", "/fail_pause", token=TOKEN))[0] == 500
    assert guard.lease.deadline is None


# ---------------------------------------------------------------------------------- the launcher
@pytest.fixture
def no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"VLLMServer started a process: {args}")

    monkeypatch.setattr(vllm_launcher.subprocess, "Popen", refuse)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host": "0.0.0.0", "control_endpoints": True, "control_token": False}, "control_token=False on host="),
        ({"control_endpoints": True, "control_token": "short"}, "control_token must be at least 16"),
        ({"control_token": TOKEN}, "pass control_endpoints=True too"),
        ({"env": {"VLLM_SERVER_DEV_MODE": "1"}}, "env must not set"),
        ({"env": {CONTROL_TOKEN_ENV: TOKEN}}, "env must not set"),
        ({"pause_lease_s": -1.0}, "pause_lease_s must be a positive"),
    ],
)
def test_the_launcher_refuses_unsafe_or_contradictory_settings_before_starting_anything(
    tmp_path: Path, no_process: None, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        VLLMServer(tmp_path, log_path=tmp_path / "server.log", **kwargs)
    assert not (tmp_path / "server.log").exists()


def test_dev_mode_is_a_deprecated_name_for_control_endpoints(tmp_path: Path, no_process: None) -> None:
    with pytest.warns(DeprecationWarning, match="control_endpoints"), pytest.raises(ValueError, match="control_token"):
        VLLMServer(tmp_path, host="0.0.0.0", dev_mode=True, control_token=False)


def test_the_serve_command_installs_the_guard_and_carries_no_secret() -> None:
    command = serve_command("/m", host="127.0.0.1", port=1, serve_args=["--dtype", "bfloat16"])
    assert command[command.index("--middleware") + 1] == GUARD_PATH and command[-2:] == ["--dtype", "bfloat16"]


# ---------------------------------------------------------------------------------- client and guard over HTTP
def test_the_engine_sends_the_token_on_control_calls_only(served_toy: ServedToy) -> None:
    engine = VLLMServerEngine(served_toy.url, control_token=TOKEN)
    assert engine.collective_rpc("load_weights") == ["done"]
    assert engine.call("GET", "/is_paused") == {"is_paused": False}
    assert served_toy.toy.seen == [
        ("GET", "/v1/models", False), ("POST", "/pause", True), ("POST", "/collective_rpc", True),
        ("POST", "/reset_prefix_cache", True), ("POST", "/resume", True), ("GET", "/is_paused", True),
    ]  # fmt: skip
    engine.close()


def test_an_engine_without_the_token_is_told_to_pass_it_and_changes_nothing(served_toy: ServedToy) -> None:
    engine = VLLMServerEngine(served_toy.url)
    with pytest.raises(VLLMServerError, match="HTTP 401.*pass control_token") as refused:
        engine.collective_rpc("load_weights")
    assert refused.value.status == 401
    wrong = VLLMServerEngine(served_toy.url, control_token=WRONG_TOKEN)
    with pytest.raises(VLLMServerError, match="HTTP 403.*does not accept"):
        wrong.reset_prefix_cache()
    assert served_toy.toy.control_calls() == [] and not served_toy.toy.is_paused
    assert engine.server_config() is None  # shown to token holders only: the policy skips its check


@pytest.mark.parametrize("served_toy", [(60.0, False)], indirect=True, ids=["control_endpoints_off"])
def test_a_server_without_control_endpoints_says_how_to_turn_them_on(served_toy: ServedToy) -> None:
    engine = VLLMServerEngine(served_toy.url, control_token=TOKEN)
    with pytest.raises(VLLMServerError, match=r"HTTP 404.*control_endpoints=True.*VLLM_SERVER_DEV_MODE=1"):
        engine.collective_rpc("load_weights")


@pytest.mark.parametrize("served_toy", [(0.3, True)], indirect=True, ids=["lease_0.3s"])
def test_the_engine_renews_its_pause_and_a_client_that_vanishes_stalls_the_server_one_lease(
    served_toy: ServedToy,
) -> None:
    toy, guard = served_toy.toy, served_toy.guard
    engine = VLLMServerEngine(served_toy.url, control_token=TOKEN)
    with engine.paused():
        time.sleep(1.0)  # over three leases: only the renewals keep the pause
        assert toy.is_paused
    assert not toy.is_paused and guard.lease.num_expired == 0

    # a client that pauses and never comes back (killed between /pause and /resume)
    request_json("POST", served_toy.url + "/pause", timeout_s=WAIT_S, headers={CONTROL_TOKEN_HEADER: TOKEN})
    assert toy.is_paused
    asyncio.run(wait_until(lambda: not toy.is_paused, what="the resume after the lease ran out"))
    assert guard.lease.num_expired == 1


@pytest.mark.parametrize("served_toy", [(0.3, True)], indirect=True, ids=["lease_0.3s"])
def test_a_block_that_lost_its_pause_raises_at_its_end(served_toy: ServedToy) -> None:
    engine = VLLMServerEngine(served_toy.url, control_token=TOKEN)
    with pytest.raises(VLLMServerError, match=r"ended before resume\(\)"):
        with engine.paused():
            engine.call("POST", "/resume")  # someone else resumed: the next renewal finds no pause
            time.sleep(0.5)  # over one renewal interval (a third of the lease)


# ---------------------------------------------------------------------------------- request_json hygiene
class Toy:
    """What the HTTP handler below serves and records."""

    requested: list[str] = []


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        Toy.requested.append(self.path)
        route = {
            "/big": self.big, "/big_unsized": self.big_unsized, "/trickle": self.trickle,
            "/trickle_headers": self.trickle_headers, "/error": self.error, "/redirect": self.redirect,
        }.get(self.path, self.echo)  # fmt: skip
        try:
            route()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up: what the test wants
            pass

    def echo(self) -> None:
        self.answer(200, json.dumps({"path": self.path}).encode())

    def answer(self, status: int, body: bytes, *, sized: bool = True) -> None:
        self.send_response(status)
        if sized:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def big(self) -> None:
        self.answer(200, b'"' + b"x" * 4096 + b'"')

    def big_unsized(self) -> None:
        self.answer(200, b'"' + b"x" * 4096 + b'"', sized=False)  # HTTP/1.0: the body ends at close

    def error(self) -> None:
        self.answer(500, b"e" * (1 << 20))

    def redirect(self) -> None:
        self.send_response(307)
        self.send_header("Location", "/echo_after_redirect")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def trickle(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100")
        self.end_headers()
        for _ in range(100):  # a byte every 50 ms: each read is quick, the whole answer takes 5 s
            self.wfile.write(b" ")
            self.wfile.flush()
            time.sleep(0.05)

    def trickle_headers(self) -> None:
        self.wfile.write(b"HTTP/1.0 200 OK\r\n")
        for i in range(100):
            self.wfile.write(f"X-Slow-{i}: 1\r\n".encode())
            self.wfile.flush()
            time.sleep(0.05)


@pytest.fixture
def http_url() -> Iterator[str]:
    Toy.requested = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=WAIT_S)


def test_a_loopback_server_is_reached_without_the_proxy_and_others_through_it(
    http_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("no_proxy", "NO_PROXY", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    assert request_json("GET", http_url + "/echo", timeout_s=WAIT_S) == {"path": "/echo"}
    monkeypatch.setenv("http_proxy", http_url)  # now the toy server is the proxy of a remote address
    assert request_json("GET", "http://192.0.2.1:8000/x", timeout_s=WAIT_S) == {"path": "http://192.0.2.1:8000/x"}


@pytest.mark.parametrize("path", ["/big", "/big_unsized"])
def test_an_answer_over_the_cap_is_refused(http_url: str, path: str) -> None:
    with pytest.raises(VLLMServerError, match="more than max_response_bytes=1024 bytes"):
        request_json("GET", http_url + path, timeout_s=WAIT_S, max_response_bytes=1024)
    assert request_json("GET", http_url + path, timeout_s=WAIT_S, max_response_bytes=8192) == "x" * 4096


def test_an_error_body_is_read_only_up_to_its_cap(http_url: str) -> None:
    with pytest.raises(VLLMServerError, match="HTTP 500") as failed:
        request_json("GET", http_url + "/error", timeout_s=WAIT_S)
    assert len(str(failed.value)) < MAX_ERROR_BODY_BYTES + 200


def test_a_redirect_is_not_followed(http_url: str) -> None:
    with pytest.raises(VLLMServerError, match="HTTP 307") as redirected:
        request_json("GET", http_url + "/redirect", timeout_s=WAIT_S, headers={CONTROL_TOKEN_HEADER: TOKEN})
    assert redirected.value.status == 307 and Toy.requested == ["/redirect"]


@pytest.mark.parametrize("path", ["/trickle", "/trickle_headers"])
def test_a_trickling_server_is_cut_off_at_timeout_s(http_url: str, path: str) -> None:
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"did not complete within timeout_s=0\.5"):
        request_json("GET", http_url + path, timeout_s=0.5)
    assert time.monotonic() - started < 2.0  # the trickle would take 5 s


def test_only_http_is_spoken(tmp_path: Path) -> None:
    local = tmp_path / "local.json"
    local.write_text('{"read": "a local file"}', encoding="utf-8")
    with pytest.raises(VLLMServerError, match="unknown url type"):
        request_json("GET", local.as_uri(), timeout_s=WAIT_S)


def test_no_request_goes_out_while_the_engine_holds_a_pause_so_a_response_never_spans_a_push(served_toy: ServedToy) -> None:
    engine = VLLMServerEngine(served_toy.url, control_token=TOKEN)
    try:
        first = engine.submit(EngineRequest(prompt_ids=[1, 2], sampling=SamplingConfig(max_new_tokens=2)))
        assert first.result(timeout=30).token_versions.tolist() == [-1, -1]
        engine.pause()
        held = engine.submit(EngineRequest(prompt_ids=[1, 2], sampling=SamplingConfig(max_new_tokens=2)))
        time.sleep(0.3)
        assert not held.done() and engine.num_in_flight == 1
        engine.set_version(3)  # as a collector does after a push into the workers
        engine.resume()
        result = held.result(timeout=30)
        assert result.tokens.tolist() == [5, 6] and result.token_versions.tolist() == [3, 3]
        order = [path for _, path, _ in served_toy.toy.seen if path in ("/pause", "/resume", "/v1/completions")]
        assert order == ["/v1/completions", "/pause", "/resume", "/v1/completions"]
    finally:
        engine.close()
