"""A guard for a served vLLM's control endpoints: a token on every request outside the public API, and pause leases.

``vllm serve --middleware lmcollect.engines.served.control.ControlEndpointGuard`` wraps the server's
ASGI app in :class:`ControlEndpointGuard` (vLLM builds it as ``ControlEndpointGuard(app)``):

- Public paths (:data:`PUBLIC_PREFIXES`, :data:`PUBLIC_PATHS`: the OpenAI API under ``/v1``,
  ``/health``, ``/metrics``, ...) pass untouched; vLLM's ``--api-key`` guards ``/v1`` as before.
- Every other path is a control path (``/pause``, ``/resume``, ``/collective_rpc``,
  ``/reset_prefix_cache``, ``/server_info``, ``/is_paused``, unknown paths too). With a token, a
  control request must carry it in the ``X-Lmcollect-Control-Token`` header (401 without it, 403 for
  a wrong one; the app never sees the request). Without a token, only loopback peers may call them.
- A pause is a lease: once ``/pause`` succeeds the guard waits ``pause_lease_s``; unless
  ``/resume`` succeeds or a client renews the lease (``POST /lmcollect/renew_pause``, token-checked,
  answered by the guard itself) in time, the guard resumes the server itself, so a client that dies
  while it holds a pause stalls the server for at most one lease (a resume that fails is tried
  again, with back-off, for up to one more lease).
- A control request that a browser marked as cross-site (``Origin`` of another site,
  ``Sec-Fetch-Site`` other than ``same-origin``/``none``) is refused with 403, token or not; without
  a token its ``Host`` must also name the server's bound address and port (a page's own name after
  a DNS rebinding is refused). See :mod:`lmcollect.engines.served.control_checks`.
- ``GET /lmcollect/identity?challenge=<hex>`` answers ``{"proof": HMAC(launch secret, challenge)}``
  (:func:`~lmcollect.engines.served.control_checks.launch_proof`) when the launcher gave the server a
  launch secret: the launcher asks it before it sends the token or a prompt, so a process that
  took the port first is never trusted. Anyone may ask (the proof reveals neither secret).

The guard reads its settings from environment variables (:class:`ControlSettings`): the launcher
puts the token there, never on the command line, which other users can read in ``ps``. This module
is plain ASGI: it imports neither vLLM nor Starlette, and unit tests drive it with a toy app.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from lmcollect.engines.served.control_checks import (
    browser_refusal,
    check_challenge,
    header_value,
    host_refusal,
    is_loopback_host,
    launch_proof,
)

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GUARD_PATH = "lmcollect.engines.served.control.ControlEndpointGuard"
"""What ``vllm serve --middleware`` takes to install the guard."""
CONTROL_TOKEN_ENV = "LMCOLLECT_CONTROL_TOKEN"
PAUSE_LEASE_ENV = "LMCOLLECT_PAUSE_LEASE_S"
LAUNCH_SECRET_ENV = "LMCOLLECT_LAUNCH_SECRET"
CONTROL_TOKEN_HEADER = "X-Lmcollect-Control-Token"
RENEW_PAUSE_PATH = "/lmcollect/renew_pause"
IDENTITY_PATH = "/lmcollect/identity"
DEFAULT_PAUSE_LEASE_S = 60.0
# The guard's own resume after a lease ran out: a failed try waits 0.05 s, doubling up to 2 s, and
# is tried again for up to one more lease, at least three tries in all.
RESUME_RETRY_FIRST_S = 0.05
RESUME_RETRY_MAX_S = 2.0
MIN_RESUME_TRIES = 3
MIN_TOKEN_CHARS = 16
# The served API: generation (OpenAI API under /v1) and read-only status. Everything else is control.
PUBLIC_PREFIXES = ("/v1", "/metrics")
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version", "/load", "/tokenize", "/detokenize"})
_HEADER = CONTROL_TOKEN_HEADER.lower().encode("latin-1")  # ASGI header names are lower-case bytes


def is_public_path(path: str) -> bool:
    """Whether ``path`` (from the server's root; a query is ignored) is served API rather than control."""
    path = path.split("?", 1)[0]
    return path in PUBLIC_PATHS or any(path == prefix or path.startswith(prefix + "/") for prefix in PUBLIC_PREFIXES)


def check_control_token(token: str) -> str:
    """``token`` if it can be a control token (long enough, one header-safe word), else ValueError."""
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token:
        raise ValueError(
            f"control_token must be at least {MIN_TOKEN_CHARS} printable ASCII characters without spaces "
            f"(got {len(token)} characters); pass control_token=True to generate one, or secrets.token_urlsafe(32)."
        )
    return token


@dataclass(frozen=True, kw_only=True)
class ControlSettings:
    """What the guard enforces; it travels from the launcher to the server in environment variables."""

    token: str | None = field(default=None, repr=False)
    """The control token (None: control requests from loopback peers only)."""
    pause_lease_s: float = DEFAULT_PAUSE_LEASE_S
    """How long a pause holds without a renewal before the guard resumes the server itself."""
    launch_secret: str | None = field(default=None, repr=False)
    """The per-launch secret the server proves it holds at :data:`IDENTITY_PATH` (None: it proves nothing)."""

    def __post_init__(self) -> None:
        lease = self.pause_lease_s
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not math.isfinite(lease) or lease <= 0:
            raise ValueError(f"pause_lease_s must be a positive number of seconds, got {lease!r}; e.g. 60.0.")
        if self.token is not None:
            check_control_token(self.token)
        if self.launch_secret is not None and len(self.launch_secret) < MIN_TOKEN_CHARS:
            raise ValueError(f"launch_secret must be at least {MIN_TOKEN_CHARS} characters; use secrets.token_hex(32).")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ControlSettings:
        """The settings in ``environ`` (unset or empty token: none; unset lease: the default)."""
        raw_lease = environ.get(PAUSE_LEASE_ENV, "").strip()
        try:
            lease = float(raw_lease) if raw_lease else DEFAULT_PAUSE_LEASE_S
        except ValueError:
            raise ValueError(f"{PAUSE_LEASE_ENV} must be a number of seconds, got {raw_lease!r}.") from None
        token, secret = environ.get(CONTROL_TOKEN_ENV) or None, environ.get(LAUNCH_SECRET_ENV) or None
        return cls(token=token, pause_lease_s=lease, launch_secret=secret)

    def environ(self) -> dict[str, str]:
        """The environment variables that carry these settings (an empty variable: none)."""
        return {
            CONTROL_TOKEN_ENV: self.token or "",
            PAUSE_LEASE_ENV: repr(float(self.pause_lease_s)),
            LAUNCH_SECRET_ENV: self.launch_secret or "",
        }


# ------------------------------------------------------------------------------------------ ASGI helpers
def route_path(scope: Scope) -> str:
    """The request's path as the app routes it: without the app's root path (Starlette's rule)."""
    path, root = str(scope["path"]), str(scope.get("root_path", "") or "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path


async def send_json(scope: Scope, send: Send, status: int, content: dict[str, Any]) -> None:
    """Answer an HTTP request with ``content``; a websocket is closed before it opens (the client sees a 403)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps(content).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode("ascii"))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in vLLM's shape, so clients show ``message``."""
    return {"error": {"message": message, "type": "ControlEndpointRefused", "code": status}}


def on_success(send: Send, action: Callable[[], None]) -> Send:
    """``send``, running ``action`` when the app starts a 2xx answer (before the client can see it)."""

    async def watched(message: Message) -> None:
        if message["type"] == "http.response.start" and 200 <= int(message["status"]) < 300:
            action()
        await send(message)

    return watched


async def post_locally(app: ASGIApp, scope: Scope) -> int | None:
    """Run ``app`` on a synthetic request ``scope`` (empty body); its answer's status (None: it sent none)."""
    finished = asyncio.Event()
    status: int | None = None
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await finished.wait()  # nobody disconnects before the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            finished.set()

    await app(scope, receive, send)
    finished.set()
    return status


def resume_scope_for(pause_scope: Scope) -> Scope:
    """A ``POST /resume`` request like the ``/pause`` one (same app, root path, server), without its headers."""
    path = str(pause_scope["path"]).removesuffix("/pause") + "/resume"
    scope = {**pause_scope, "method": "POST", "path": path, "raw_path": path.encode("utf-8")}
    scope.update(query_string=b"", headers=[(b"content-length", b"0")])
    if "state" in pause_scope:
        scope["state"] = dict(pause_scope["state"])
    return scope


# ------------------------------------------------------------------------------------------ the pause lease
class PauseLease:
    """The server's current pause: it ends at ``/resume`` or, without a renewal in time, by the guard's own resume."""

    def __init__(self, app: ASGIApp, *, lease_s: float) -> None:
        self.app = app
        self.lease_s = lease_s
        self.deadline: float | None = None
        """When the guard resumes the server (time.monotonic); None: no pause is held."""
        self.num_expired = 0
        """Leases that ran out (the guard resumed the server)."""
        self.num_resume_failures = 0
        """The guard's own resumes that failed (each one tried again, see :meth:`_resume`)."""
        self._resume_scope: Scope | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._epoch = 0  # changes at every pause and resume that succeeds: a retried resume stops then

    def start(self, resume_scope: Scope) -> None:
        """A pause succeeded: hold it for one lease (a second pause starts the lease again)."""
        self._resume_scope = resume_scope
        self.deadline = time.monotonic() + self.lease_s
        self._epoch += 1
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def renew(self) -> bool:
        """Extend a held pause by one lease from now; False when none is held."""
        if self.deadline is None:
            return False
        self.deadline = time.monotonic() + self.lease_s
        return True

    def end(self) -> None:
        """A resume succeeded: nothing is held any more."""
        self.deadline = None
        self._epoch += 1

    async def _watch(self) -> None:
        while self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left > 0:
                await asyncio.sleep(left)
                continue
            self.deadline = None
            self.num_expired += 1
            logger.warning(
                "the server was paused and nobody renewed the pause within %.1f s (%s); resuming it "
                "(the client that paused it died, hung, or lost its connection)",
                self.lease_s,
                PAUSE_LEASE_ENV,
            )
            await self._resume()

    async def _resume(self) -> None:
        """Resume the server; a failed try is retried with back-off for up to one more lease (at least
        :data:`MIN_RESUME_TRIES` tries), and stops once a client paused or resumed the server meanwhile."""
        assert self._resume_scope is not None  # start() came first
        epoch, give_up = self._epoch, time.monotonic() + self.lease_s
        wait_s = RESUME_RETRY_FIRST_S
        for attempt in itertools.count(1):
            failure = await self._try_resume()
            if failure is None:
                return
            self.num_resume_failures += 1
            if attempt >= MIN_RESUME_TRIES and time.monotonic() + wait_s > give_up:
                logger.error(
                    "resuming the server after its pause lease ran out failed %d times (%s); giving up: the "
                    "server stays paused until a client calls /resume",
                    attempt,
                    failure,
                )
                return
            logger.warning("resuming the server after its pause lease ran out failed (%s); trying again", failure)
            await asyncio.sleep(wait_s)
            wait_s = min(wait_s * 2, RESUME_RETRY_MAX_S)
            if self._epoch != epoch:  # a client paused (a new lease) or resumed the server meanwhile
                return

    async def _try_resume(self) -> str | None:
        """One ``POST /resume`` into the app; why it failed, or None when it succeeded."""
        assert self._resume_scope is not None
        try:  # a failed resume must not end the watcher
            status = await post_locally(self.app, self._resume_scope)
        except Exception as exc:  # designed: any failure of the app is retried, then logged
            return f"{type(exc).__name__}: {exc}"
        if status is None or not 200 <= status < 300:
            return f"HTTP {status}"
        return None


# ------------------------------------------------------------------------------------------ the guard
class ControlEndpointGuard:
    """ASGI middleware: control paths need the token (or a loopback peer without one); pauses are leases.

    Args:
        app: the wrapped ASGI app (vLLM's).
        environ: where the settings come from (:class:`ControlSettings`); None: ``os.environ``.
    """

    def __init__(self, app: ASGIApp, *, environ: Mapping[str, str] | None = None) -> None:
        self.app = app
        self.settings = ControlSettings.from_environ(os.environ if environ is None else environ)
        self._token = None if self.settings.token is None else self.settings.token.encode("ascii")
        self.lease = PauseLease(app, lease_s=self.settings.pause_lease_s)
        _log_to_server_output()
        logger.info(
            "control endpoints: %s; pause lease %.1f s",
            f"{CONTROL_TOKEN_HEADER} required" if self._token else "loopback peers only (no token)",
            self.settings.pause_lease_s,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: start-up and shutdown
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if is_public_path(path):
            await self.app(scope, receive, send)
            return
        if path == IDENTITY_PATH:  # answered to anyone: a proof reveals neither the token nor the secret
            await self.identify(scope, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            status, message = refusal
            method = scope.get("method", "WEBSOCKET")
            logger.warning("refused %s %s from %s: HTTP %d", method, path, _peer(scope), status)
            await send_json(scope, send, status, error_body(status, message))
            return
        method = scope.get("method")
        if path == RENEW_PAUSE_PATH:
            await self.renew(scope, send)
        elif path == "/pause" and method == "POST":
            resume_scope = resume_scope_for(scope)  # copied now: the app adds routing keys to the scope
            await self.app(scope, receive, on_success(send, lambda: self.lease.start(resume_scope)))
        elif path == "/resume" and method == "POST":
            await self.app(scope, receive, on_success(send, self.lease.end))
        else:
            await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """Why a control request may not pass (HTTP status, message), or None when it may; a
        browser's cross-site request is refused first, token or not."""
        browser = self.browser_refusal(scope)
        if browser is not None:
            return 403, browser
        if self._token is None:
            if is_loopback_host(_peer(scope)):
                return None
            return 403, (
                "this server has no control token, so its control endpoints answer loopback clients only; "
                "start it with VLLMServer(control_endpoints=True, control_token=True) to reach them from elsewhere."
            )
        given = header_value(scope.get("headers", ()), _HEADER)
        if given is None:
            return 401, (
                f"control endpoints need the {CONTROL_TOKEN_HEADER} header: pass control_token=<the server's "
                "control_token> to VLLMServerEngine/VLLMServerPolicy."
            )
        if not hmac.compare_digest(given, self._token):
            return 403, f"wrong {CONTROL_TOKEN_HEADER}: pass the server's control_token (VLLMServer.control_token)."
        return None

    def browser_refusal(self, scope: Scope) -> str | None:
        """Why a browser sent this request for another site (see :mod:`lmcollect.engines.served.control_checks`), or None.

        Without a token, the ``Host`` must also name the address and port the server is bound to:
        then a DNS-rebound page, whose requests are same-origin to the browser, is refused too. With
        a token a rebound page gets nowhere without it, and the Host may be any name of the server."""
        headers = list(scope.get("headers", ()))
        scheme = str(scope.get("scheme", "http"))
        why = browser_refusal(headers, scheme)
        if why is None and self._token is None:
            why = host_refusal(header_value(headers, b"host"), _server(scope), scheme)
        if why is None:
            return None
        return (
            f"control request refused: {why}. Control endpoints take no requests from web pages; lmcollect's "
            "client (VLLMServerEngine) sends no Origin or Sec-Fetch-Site and names the server by its address."
        )

    async def identify(self, scope: Scope, send: Send) -> None:
        """``GET /lmcollect/identity?challenge=<hex>``: the launch proof of this server (404: it has no launch secret)."""
        secret = self.settings.launch_secret
        if secret is None:
            message = "this server was given no launch secret (it was not started by VLLMServer); it proves nothing."
            await send_json(scope, send, 404, error_body(404, message))
            return
        if scope.get("method") != "GET":
            await send_json(scope, send, 405, error_body(405, f"{IDENTITY_PATH} takes GET."))
            return
        query = parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
        try:
            proof = launch_proof(secret, check_challenge(query.get("challenge", [""])[0]))
        except ValueError as exc:
            await send_json(scope, send, 400, error_body(400, str(exc)))
            return
        await send_json(scope, send, 200, {"proof": proof})

    async def renew(self, scope: Scope, send: Send) -> None:
        """``POST /lmcollect/renew_pause``: one more lease for the held pause (409: none is held)."""
        if scope.get("method") != "POST":
            await send_json(scope, send, 405, error_body(405, f"{RENEW_PAUSE_PATH} takes POST."))
        elif self.lease.renew():
            await send_json(scope, send, 200, {"lease_s": self.lease.lease_s})
        else:
            message = "no pause is held: the server was resumed (by a client, or by this guard when the lease ran out)."
            await send_json(scope, send, 409, error_body(409, message))


def _log_to_server_output() -> None:
    """Let refusals and expired leases reach the server's log: vLLM's API server leaves the root
    logger at ERROR with no handler, which would drop this module's warnings."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [lmcollect control guard] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _server(scope: Scope) -> tuple[str, int] | None:
    """The address and port the request came in on (None: not a TCP socket, e.g. a Unix socket)."""
    server = scope.get("server")
    if not server or server[1] is None:
        return None
    return str(server[0]), int(server[1])


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else ""
