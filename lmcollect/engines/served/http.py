"""JSON over HTTP with the standard library, closed by default: a call is bounded as a whole
(``timeout_s``, not per socket operation), answers are capped (:data:`MAX_RESPONSE_BYTES`),
loopback URLs never go through a proxy, and redirects are not followed (they could carry a token
to another host). What :class:`~lmcollect.engines.served.VLLMServerEngine` talks to a
vLLM server with.
"""

from __future__ import annotations

import functools
import http.client
import io
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from lmcollect.engines.served.control import is_loopback_host

MAX_RESPONSE_BYTES = 64 << 20
"""The largest answer :func:`request_json` accepts (a batch of completions is far smaller)."""
MAX_ERROR_BODY_BYTES = 64 << 10
READ_CHUNK_BYTES = 1 << 20


class VLLMServerError(RuntimeError):
    """A vLLM server could not be reached or refused a call; the message names the URL."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status the server answered with (None: no answer)."""


def _error_detail(exc: urllib.error.HTTPError) -> str:
    """The message of a vLLM error body (``{"error": {"message": ...}}`` or ``{"detail": ...}``), else the raw body.

    Reads at most :data:`MAX_ERROR_BODY_BYTES`; a body that cannot be read gives the status's reason.
    """
    try:
        raw = exc.read(MAX_ERROR_BODY_BYTES).decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException):  # the error body timed out or broke off: the status says enough
        return str(exc.reason)
    finally:
        exc.close()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        return raw.strip() or str(exc.reason)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(body.get("detail", raw)) if isinstance(body, dict) else raw


def request_json(
    method: str,
    url: str,
    body: Any = None,
    *,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
) -> Any:
    """One HTTP call with a JSON body and answer (None for an empty answer); failures raise :class:`VLLMServerError`.

    ``timeout_s`` bounds the whole call (connect, send, status, headers and body), not each socket
    operation; an answer over ``max_response_bytes`` is refused. Loopback URLs never go through a
    proxy (``http_proxy``/``https_proxy``), and redirects are not followed (they could carry the
    control token to another host).
    """
    deadline = time.monotonic() + timeout_s
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with _opener_for(url, deadline).open(request, timeout=timeout_s) as response:
            payload = _read_capped(response, limit=max_response_bytes, what=f"{method} {url}")
    except urllib.error.HTTPError as exc:  # the server answered with an error status
        detail = _error_detail(exc)
        raise VLLMServerError(f"{method} {url} failed with HTTP {exc.code}: {detail}", status=exc.code) from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # no (whole) answer
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError) or time.monotonic() >= deadline:
            raise VLLMServerError(
                f"{method} {url} did not complete within timeout_s={timeout_s} (connect, send and the whole answer)."
            ) from exc
        raise VLLMServerError(
            f"cannot reach the vLLM server at {url} ({reason}); is `vllm serve` running there and reachable from here?"
        ) from exc
    return json.loads(payload) if payload else None


def _read_capped(response: http.client.HTTPResponse, *, limit: int, what: str) -> bytes:
    """The response body, read in chunks (each within the call's deadline); over ``limit`` bytes raises."""
    too_big = f"{what} answered with more than max_response_bytes={limit} bytes; refused"
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise VLLMServerError(f"{too_big} (Content-Length {declared}).")
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read(min(READ_CHUNK_BYTES, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise VLLMServerError(f"{too_big}.")
    return b"".join(chunks)


def _opener_for(url: str, deadline: float) -> urllib.request.OpenerDirector:
    """An opener for http(s) only whose connections keep ``deadline``: no proxy for a loopback host,
    and no redirect handler (a 3xx answer raises HTTPError, like any other error status)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    proxies = urllib.request.ProxyHandler({}) if is_loopback_host(host) else urllib.request.ProxyHandler()
    opener = urllib.request.OpenerDirector()
    handlers = [
        proxies, _DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline), urllib.request.UnknownHandler(),
        urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor(),
    ]  # fmt: skip
    for handler in handlers:
        opener.add_handler(handler)
    return opener


class _DeadlineSocket:
    """A connected socket whose every send and receive gets the time left before the call's deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self._sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self.arm()
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        # http.client reads responses through makefile("rb"): the reader is binary and read-only
        if mode not in ("rb", "br"):
            raise ValueError(f"a deadline socket only makes binary readers (mode 'rb'), not mode {mode!r}.")
        return io.BufferedReader(_DeadlineReader(self, self._sock.makefile("rb", buffering=0)))

    def close(self) -> None:
        self._sock.close()  # the reader's own reference keeps the connection open until it is closed


class _DeadlineReader(io.RawIOBase):
    def __init__(self, owner: _DeadlineSocket, raw: Any) -> None:
        self._owner = owner
        self._raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._owner.arm()
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineConnectionMixin:
    """An ``http.client`` connection (``timeout`` bounds the connect) whose socket keeps ``deadline`` afterwards."""

    sock: Any

    def __init__(self, host: str, *, deadline: float, **kwargs: Any) -> None:
        super().__init__(host, **kwargs)  # type: ignore[call-arg]
        self.deadline = deadline

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _DeadlineHTTPConnection(_DeadlineConnectionMixin, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineConnectionMixin, http.client.HTTPSConnection):
    pass


class _DeadlineHandlerMixin:
    """A ``urllib`` handler that opens its connections with ``deadline`` (see ``_DeadlineConnectionMixin``)."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline


class _DeadlineHTTPHandler(_DeadlineHandlerMixin, urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_DeadlineHTTPConnection, deadline=self.deadline), req)


class _DeadlineHTTPSHandler(_DeadlineHandlerMixin, urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_DeadlineHTTPSConnection, deadline=self.deadline), req)
