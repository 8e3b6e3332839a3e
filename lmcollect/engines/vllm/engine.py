"""vLLM's ``LLMEngine`` stepped by a decoding thread of ours: continuous batching in this process.

:class:`VLLMEngine` is lmcollect's vLLM generator behind :class:`~lmcollect.engines.protocol.EngineProtocol`.
One thread owns the engine: it adds the requests submitted since its last step, runs one decoding
step, settles the futures of the requests that finished, and between two steps runs the control
calls other threads queued (pause, a weight load, a worker RPC). So requests join the running batch
as they come, and weights change only between two steps. Unlike vLLM's ``AsyncLLM``, whose engine
core is always a process of its own, the engine core runs here by default (``multiprocess=False``):
one Python per engine, which starts in seconds (or, with ``multiprocess=True``, in vLLM's own
process, which overlaps scheduling with this process's output handling on a GPU).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from lmcollect.engines.base import EngineBase, FullWeights
from lmcollect.engines.kv_policy import KVPolicy, PushCost, check_kv_policy
from lmcollect.engines.loop_queue import QueuedAndRunning
from lmcollect.engines.protocol import (
    EngineCapabilities,
    EngineClosedError,
    EngineDiedError,
    EngineRequest,
    EngineResult,
    check_version,
    refuse_delta_base,
    refuse_long_prompt,
    refuse_stale_push,
)
from lmcollect.engines.vllm.common import (
    INITIAL_VERSION,
    engine_config,
    engine_eos_token_ids,
    engine_kwargs_for,
    import_vllm,
    request_sampling_params,
    result_of,
)
from lmcollect.engines.vllm.core_watch import CALL_DEATH_WAIT_S, CoreWatch
from lmcollect.engines.vllm.kv import VLLMKVBook
from lmcollect.engines.vllm.reaper import Reaper
from lmcollect.engines.vllm.shm_payload import SharedPackSets, shared_memory_available
from lmcollect.engines.vllm.worker_ext import (
    COMMIT_STAGED_WEIGHTS,
    DROP_STAGED_WEIGHTS,
    HELD_BASE_WEIGHTS,
    LOAD_LORA_ADAPTER,
    LOAD_SHARED_WEIGHTS,
    STAGE_WEIGHT_DELTA,
    checkpoint_metadata,
    held_base_of,
)
from lmcollect.engines.weight_group import RECEIVE_METHOD, GroupPush
from lmcollect.plumbing import forwarded, settle
from lmcollect.weights.buckets import (
    LOAD_PACKED_WEIGHTS,
    PackTarget,
    WeightBuckets,
    bucket_problems,
    byte_views,
    layout_to_json,
    packed_weights,
    plan_layout,
)
from lmcollect.weights.delta import DeltaRejectedError, WeightDelta
from lmcollect.weights.lora import LoraAdapter, check_adapter
from lmcollect.weights.tensors import check_weights, non_finite_problems, raise_if_problems, weight_problems
from lmcollect.weights.version import PushVersion, VersionCounter, version_index

if TYPE_CHECKING:  # vllm is an optional extra and slow to import; the engine imports it when built
    from vllm import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

__all__ = ["VLLMEngine"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# a request waiting for the decoding thread: its future, vLLM id, the request, vLLM's sampling parameters
Queued = tuple[Future[EngineResult], str, EngineRequest, "SamplingParams"]


class VLLMEngine(QueuedAndRunning, EngineBase):
    """vLLM (continuous batching) in this process, behind the engine protocol; any thread may call it.

    A weight push (what ``load_weights`` does by itself, or an updater around a process-group
    receive)::

        engine.pause()                            # the decoding thread stops after its current step
        engine.load_weights(weights, version=v)   # checked here, reloaded in every worker, label v
        engine.resume()                           # in-flight requests go on under version v

    What a token's version means: vLLM labels the outputs of every decoding step with the engine's
    weight version, which changes only between two steps, together with the weights. Under
    ``kv_policy="recompute"`` (the default) a load also drops the KV cache of every running request
    (``reset_prefix_cache(reset_running_requests=True)``), so its next step recomputes the prompt and
    the earlier tokens under the new weights: a new-version token's log-prob is a forward pass of
    the new weights over the whole sequence, as a trainer computes it. Under ``"keep"`` nothing is
    dropped: running requests go on over their KV, and each dialog (``EngineRequest.affinity``) has a
    prefix cache of its own (vLLM's ``cache_salt``), which its later turns reuse across loads;
    ``EngineResult.kv_versions`` say how old each token's context is (:mod:`lmcollect.engines.kv_policy`).

    On CPU, vLLM's default KV cache does not fit: pass ``engine_kwargs={"kv_cache_memory_bytes":
    1 << 30, "enforce_eager": True}``. vLLM keeps parallel state in module globals: keep one
    in-process engine per process (replicas: ``lmcollect.ray.VLLMReplicas``, one engine per actor).

    Args:
        model_path: a local Hugging Face model folder (its safetensors names are what
            ``load_weights`` accepts).
        engine_kwargs: more ``vllm.EngineArgs``, e.g. ``enforce_eager``, ``seed``,
            ``worker_extension_cls``; our defaults come from :func:`~lmcollect.engines.vllm.common.engine_kwargs_for`.
        multiprocess: run vLLM's engine core in a process of its own (vLLM's default layout) instead
            of in this one. If that process dies (or its worker, which ends it), every request and
            call fails at once with :class:`~lmcollect.engines.EngineDiedError` (see
            :mod:`~lmcollect.engines.vllm.core_watch`); if this process dies without ``close()``, a
            reaper ends the engine core (see :mod:`~lmcollect.engines.vllm.reaper`).
        timeout_s: how long start-up and each control call (``pause``, ``load_weights``, a worker
            RPC) may take before a ``TimeoutError``.
        kv_policy: ``"recompute"`` or ``"keep"``: what a load does to the KV held (see above).

    Example::

        engine = VLLMEngine(path, engine_kwargs={"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True})
        result = engine.submit(EngineRequest(prompt_ids=ids, sampling=SamplingConfig(temperature=0.0))).result()
        engine.close()
    """

    capabilities = EngineCapabilities(
        loads_group_pushes=True,  # its workers receive a trainer's broadcast inside the load
        loads_lora_adapters=True,  # merged in the workers
        loads_weight_deltas=True,  # applied in the workers
        checks_finite_in_copy=True,
        sets_kv_policy=True,
        meters_push_costs=True,
        checkpoints_weights=True,
        has_version_counter=True,
    )
    """What it does beyond the core protocol (see :class:`~lmcollect.engines.protocol.EngineCapabilities`)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        engine_kwargs: dict[str, Any] | None = None,
        multiprocess: bool = False,
        timeout_s: float = 600.0,
        kv_policy: KVPolicy = "recompute",
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (seconds for start-up and control calls), got {timeout_s}.")
        import_vllm()  # a clear ImportError before any thread starts
        self.model_path = str(model_path)
        self.timeout_s = timeout_s
        self._counter = VersionCounter(start=INITIAL_VERSION)
        self._kv = VLLMKVBook(check_kv_policy(kv_policy))
        self._paused = False
        self._closed = False
        self._queued: list[Queued] = []
        self._calls: list[tuple[Future, Callable[[], Any]]] = []
        self._running: dict[str, Future[EngineResult]] = {}  # vLLM request id -> caller's future
        self._request_ids = itertools.count()
        self._wake = threading.Condition()  # guards the lists above, _paused and _closed
        self._thread = threading.Thread(target=self._decode_loop, name="lmcollect-vllm-engine", daemon=True)
        self._llm: LLMEngine = self._start(_engine_kwargs(model_path, engine_kwargs), multiprocess)
        # multiprocess: a core process that dies fails what waits on it (vLLM's own client would wait forever)
        self._core_watch = CoreWatch(self._llm, is_open=lambda: not self._closed, on_death=self._core_died)
        config = self._llm.model_config
        self._max_model_len = int(config.max_model_len)  # what submit refuses past (kept after close)
        self._eos_token_ids = engine_eos_token_ids(self._llm)  # what ignore_eos bans (see sampling_params_kwargs)
        tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        # vLLM's engine core in a process of its own, or workers in processes of their own (tensor
        # parallel): collective_rpc serialises its arguments, so a push's bytes go through shared memory
        self._workers_elsewhere = multiprocess or _world_size(self._llm) > 1
        self._kv.timed_steps = not multiprocess  # else step() only collects the engine core process's outputs
        self._core_elsewhere = multiprocess
        self._loaded = False  # whether any load changed the weights the engine was built with
        self._adapter: LoraAdapter | None = None  # the adapter merged on the workers' base now (a CPU copy)
        self._full_load = threading.Lock()  # one full load packs and sends at a time
        self._pack_sets: list[PackTarget | None] = [None, None]  # each set's views, made once (see _packed)
        # workers elsewhere: the two sets live in shared memory, which they map once (see _packed)
        self._shared_sets = SharedPackSets() if self._workers_elsewhere and shared_memory_available() else None
        self._spare = 0  # the set the next full push packs into (see _packed)
        # what load_weights accepts: the worker's own check, made here before anything is sent
        self._metadata, self._aliases = checkpoint_metadata(
            self.model_path, dtype=config.dtype, tie_word_embeddings=tied
        )

    def _start(self, kwargs: dict[str, Any], multiprocess: bool) -> LLMEngine:
        """Build vLLM's engine on the decoding thread (vLLM's CPU kernels bind to it) and start that thread;
        with ``multiprocess``, a reaper first: it ends the engine core (and removes its socket files) if
        this process dies without ``close()``."""
        self._reaper = Reaper() if multiprocess else None
        started: Future[LLMEngine] = Future()
        self._calls.append((started, lambda: _build(self.model_path, kwargs, self._reaper)))
        logger.info("starting vllm LLMEngine(model=%s, %s)", self.model_path, kwargs)
        self._thread.start()
        try:
            llm = started.result(timeout=self.timeout_s)
        except BaseException:
            self._stop_thread()
            if self._reaper is not None:  # whatever vLLM started of a core that failed to start
                self._reaper.reap()
            raise
        if self._reaper is not None:
            self._reaper.built()
        return llm

    # ------------------------------------------------------------------ the protocol
    def submit(self, request: EngineRequest) -> Future[EngineResult]:
        """Queue ``request``; it joins the running batch at the next step. Settings vLLM cannot
        honour (e.g. ``stop_strings``) raise ``ValueError`` here, at once."""
        refuse_long_prompt(request, self._max_model_len, "VLLMEngine")
        params = request_sampling_params(request, eos_token_ids=self._eos_token_ids)
        future: Future[EngineResult] = Future()
        with self._wake:
            if self._core_watch.error is not None:  # its engine core died: refused at once
                raise EngineDiedError(str(self._core_watch.error))
            if self._closed:
                raise EngineClosedError("this VLLMEngine is closed; build a new engine to submit requests.")
            request_id = f"{request.request_id or 'request'}-{next(self._request_ids)}"
            self._queued.append((future, request_id, request, params))
            self._wake.notify_all()
        return future

    def pause(self) -> None:
        """Stop decoding after the current step (in-flight requests keep their state). Returns once stopped."""
        self._between_steps(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        """Continue every in-flight request and the ones submitted while paused."""
        self._between_steps(lambda: setattr(self, "_paused", False))

    full_load_options = frozenset({"check_finite"})

    def _load_full(self, weights: FullWeights, version: int | PushVersion, options: Mapping[str, Any]) -> None:
        """Check every name, shape and dtype, then reload the weights in every worker and take ``version``.

        ``load_weights(..., check_finite=True)``: refuse full weights holding NaN or Inf, checked in
        the pack buffers right after the copy into them (one pass per buffer; the tensors are named
        only when one fails).

        Names are the checkpoint's (Hugging Face) names; a tied output embedding may be sent or
        left out. A refused load raises ``ValueError`` and changes nothing. The load runs between
        two decoding steps, paused or not; running requests are recomputed under the new weights.

        A sender's :class:`~lmcollect.weights.buckets.WeightBuckets` (e.g. a Ray push's object):
        its layout is checked, then an in-process worker reloads straight from its buffers, which it
        keeps as its base (do not write into them afterwards); workers in other processes get them
        copied as they are into the shared pack set. Not packed again.
        """
        check_finite = bool(options.get("check_finite", False))
        if isinstance(weights, WeightBuckets):
            problems = bucket_problems(weights) or weight_problems(
                weights.layout.metadata(), self._metadata, aliases=self._aliases
            )
            raise_if_problems(problems, where=" by VLLMEngine.load_weights")  # before anything is sent or written
            with self._full_load:
                started = time.perf_counter()
                method, payload = self._passed_on(weights, check_finite=check_finite)
                self._reload_workers(method, payload, version, into_spare=method == LOAD_SHARED_WEIGHTS,
                                     copy_s=time.perf_counter() - started)  # fmt: skip
            return
        tensors = dict(weights)
        check_weights(tensors, self._metadata, aliases=self._aliases)  # before anything is sent or written
        with self._full_load:
            started = time.perf_counter()
            method, payload = self._packed(tensors, check_finite=check_finite)
            self._reload_workers(method, payload, version, into_spare=True, copy_s=time.perf_counter() - started)

    def _load_group_push(self, push: GroupPush, version: int | PushVersion) -> list[Any]:
        """The workers receive the weights from the trainer's process group (joined before) and
        reload them, inside the same step boundary; each worker's report (what arrived, checksums
        with ``verify``)."""
        return self._timed_load(
            version, lambda: self._took_base(self._llm.collective_rpc(RECEIVE_METHOD, args=push.worker_args()))
        )

    def _reload_workers(
        self, method: str, payload: tuple[str, Any], version: int | PushVersion, *, into_spare: bool, copy_s: float
    ) -> None:
        """Every worker reloads ``payload`` with ``method`` between two steps (under ``_full_load``).
        ``into_spare``: the payload is in the spare pack set, which becomes the workers' base."""
        self._timed_load(
            version, lambda: self._took_base(self._llm.collective_rpc(method, args=payload)), copy_s=copy_s
        )
        if into_spare:
            self._spare ^= 1  # the worker's base is now this set: the next push packs into the other

    def _timed_load(self, version: int | PushVersion, load: Callable[[], T], *, copy_s: float = 0.0) -> T:
        """``load()`` between two decoding steps, then the version taken; every load goes through here.
        A stale version is refused at the step boundary (loads run one at a time there). Its
        timeline (copy, wait for the step under way, load, reset) goes to :meth:`push_costs`."""
        queued = time.perf_counter()

        def run() -> T:
            refuse_stale_push(version_index(version), self._counter.index, "VLLMEngine")
            with self._core_paused():
                started = time.perf_counter()
                result = load()
                loaded = time.perf_counter()
                self._take_version(version, started, copy_s=copy_s, wait_s=started - queued, load_s=loaded - started)
            return result

        return self._between_steps(run)

    @contextlib.contextmanager
    def _core_paused(self) -> Iterator[None]:
        """vLLM's engine core in a process of its own runs its steps on its own: each call to it (the
        load, the version label, the cache reset) would wait for the step under way there. Its
        scheduler is paused first, keeping every request (``pause_scheduler("keep")``: one wait for
        that step), so the calls inside land back to back between the same two steps. In this
        process the core steps only when the decoding thread says so: nothing to pause."""
        if not self._core_elsewhere:
            yield
            return
        client = self._llm.engine_core
        client.call_utility("pause_scheduler", "keep", False)
        try:
            yield
        finally:
            client.call_utility("resume_scheduler")

    def _packed(self, weights: dict[str, torch.Tensor], *, check_finite: bool) -> tuple[str, tuple[str, Any]]:
        """``weights`` packed into the spare one of two sets of buffers, kept from push to push, and
        the worker call that reloads them. Kept, because a fresh 0.3 GB allocation costs several
        times the copy itself (page faults; 0.15 vs 0.03 s for the medium model here). Two sets,
        because the worker keeps the last push's buffers as its base (for LoRA adapters and
        deltas): the next push must not overwrite them, and a refused push must leave them as
        they were. Workers in other processes get the sets in shared memory, which they map once:
        a push sends only which file and where its buffers start (see :mod:`~lmcollect.engines.vllm.shm_payload`);
        an in-process worker gets the buffers themselves."""
        layout = plan_layout(weights)
        target = self._pack_sets[self._spare]
        if self._shared_sets is not None:
            out, where = self._shared_sets.buffers(self._spare, layout.buffer_nbytes)
            if target is None or target.layout != layout or target.buffers[0].data_ptr() != out[0].data_ptr():
                target = self._pack_sets[self._spare] = PackTarget(layout, out)
            target.pack(weights, check_finite=check_finite)
            return LOAD_SHARED_WEIGHTS, (layout_to_json(layout), where.as_args())
        if target is None or target.layout != layout:
            target = self._pack_sets[self._spare] = PackTarget.allocate(layout)
        buckets = target.pack(weights, check_finite=check_finite)
        return LOAD_PACKED_WEIGHTS, (layout_to_json(layout), [buffer.numpy().data for buffer in buckets.buffers])

    def _passed_on(self, buckets: WeightBuckets, *, check_finite: bool) -> tuple[str, tuple[str, Any]]:
        """The worker call that reloads a sender's ``buckets`` (checked) as they are: an in-process
        worker reads their buffers themselves; workers in other processes read a copy of each buffer,
        byte for byte, in the spare shared pack set (the RPC would serialise the bytes; see :meth:`_packed`).
        ``check_finite``: NaN/Inf refused, read through views of the bytes (buffer by buffer after its copy)."""
        layout_json = layout_to_json(buckets.layout)
        if self._shared_sets is None:
            if check_finite:
                raise_if_problems(non_finite_problems(buckets.tensors()), where=" by VLLMEngine.load_weights")
            return LOAD_PACKED_WEIGHTS, (layout_json, byte_views(buckets))
        out, where = self._shared_sets.buffers(self._spare, buckets.layout.buffer_nbytes)
        for target, buffer in zip(out, byte_views(buckets), strict=True):
            target.numpy()[:] = np.frombuffer(buffer, dtype=np.uint8, count=target.numel())
        if check_finite:
            copied = WeightBuckets(buckets.layout, out)
            raise_if_problems(non_finite_problems(copied.tensors()), where=" by VLLMEngine.load_weights")
        return LOAD_SHARED_WEIGHTS, (layout_json, where.as_args())

    def _load_adapter(self, adapter: LoraAdapter, version: int | PushVersion) -> list[Any]:
        """A LoRA adapter: checked here, sent to every worker in the call (a few MB), merged there into
        the kept base weights of the adapted layers, which alone are reloaded (see the worker's
        ``load_lora_adapter``)."""
        check_adapter(adapter, self._metadata, receiver="VLLMEngine's model")
        tensors, scalings = adapter.cpu_flat()
        layout_json, buffers = packed_weights(tensors)
        args = (layout_json, [buffer.data for buffer in buffers], scalings, adapter.rank)

        kept = adapter.cloned(device="cpu")  # what a checkpoint saves (the trainer's tensors train on)

        def load() -> list[Any]:
            reports = self._llm.collective_rpc(LOAD_LORA_ADAPTER, args=args)
            self._loaded, self._adapter = True, kept
            return reports

        return self._timed_load(version, load)

    def _core_died(self, error: EngineDiedError) -> None:
        """(The core watch's thread.) Fail every queued and running request with ``error`` (later calls are
        refused with the watch's error)."""
        with self._wake:
            pending = [future for future, *_ in self._queued] + list(self._running.values())
            self._queued.clear()
            self._running.clear()
            self._wake.notify_all()
        for future in pending:
            settle(future, error=error)

    def _took_base(self, reports: T) -> T:
        """The workers reloaded full weights (their ``reports``): their new LoRA base, no adapter
        merged (the base rule)."""
        self._loaded, self._adapter = True, None
        return reports

    def checkpoint_weights(self) -> tuple[dict[str, torch.Tensor], LoraAdapter | None] | None:
        """What a checkpoint restores this engine to: the workers' base weights (their last full
        push, or the checkpoint files before any; checkpoint names, CPU copies) and the LoRA adapter
        merged on top (None: none). Loading the base as a full push, then the adapter, gives back
        these weights and the base the next adapter merges into. None when no load changed the
        weights the engine was built with (an engine built the same way holds them)."""

        def read() -> tuple[dict[str, torch.Tensor], LoraAdapter | None] | None:
            if not self._loaded:
                return None
            # every worker holds it whole: one sends it, packed when it is in another process
            reports = self._llm.collective_rpc(HELD_BASE_WEIGHTS, args=(0, self._workers_elsewhere))
            return held_base_of(reports), self._adapter

        return self._between_steps(read)

    def _load_delta(self, delta: WeightDelta, version: int | PushVersion) -> list[Any]:
        """A delta push (e.g. a ``RayRemoteWeightUpdater(delta=True)`` push into a continuous
        collector): sent to every worker in the call, applied there to a copy of the tensors it
        changes (from the worker's last full push), and reloaded only once every worker accepted
        it; a refusal anywhere raises ``DeltaRejectedError`` with no worker changed."""
        arrays = delta.arrays.to_numpy()
        args = (delta.header(), layout_to_json(arrays.layout), [buffer.data for buffer in arrays.buffers])

        def load() -> list[Any]:
            refuse_delta_base(delta, self._counter.index, "VLLMEngine")
            staged = self._llm.collective_rpc(STAGE_WEIGHT_DELTA, args=args)
            refused = [report["refused"] for report in staged if "refused" in report]
            if refused:
                self._llm.collective_rpc(DROP_STAGED_WEIGHTS)
                raise DeltaRejectedError(f"VLLMEngine's workers refused the delta ({refused[0]}); nothing was changed.")
            return self._took_base(self._llm.collective_rpc(COMMIT_STAGED_WEIGHTS))

        return self._timed_load(version, load)

    def weight_metadata(self) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """The checkpoint's names, dtypes and shapes (what ``load_weights`` accepts), and tied aliases."""
        return dict(self._metadata), dict(self._aliases)

    def set_version(self, version: int) -> None:
        """Label the steps from now on with ``version``; running requests are recomputed under the
        weights loaded now."""
        check_version(version)
        self._between_steps(lambda: self._take_version(version, time.perf_counter()))

    @property
    def num_replicas(self) -> int:
        """One engine (its tensor-parallel workers are one replica)."""
        return 1

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` on every worker (through our worker extension), between two steps; one
        replica, so one tuple of arguments (a hook for tests and benchmarks; weight pushes go
        through :meth:`load_weights`)."""
        if len(args_per_replica) != 1:
            raise ValueError(f"VLLMEngine is one replica; got arguments for {len(args_per_replica)}.")
        args = tuple(args_per_replica[0])
        return self._between_steps(lambda: self._llm.collective_rpc(method, args=args, kwargs=kwargs))

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (running requests, if any, are recomputed from their tokens)."""
        self._between_steps(self._reset_caches)

    def run_on_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(llm)`` with vLLM's ``LLMEngine`` on the decoding thread, between two steps (nothing
        else touches the engine meanwhile); e.g. a benchmark's plain vLLM loop as its baseline."""
        return self._between_steps(lambda: fn(self._llm))

    version = forwarded("_counter.index", "The version of the weights loaded now (-1 before any load).")
    version_counter = forwarded(
        "_counter", "The counter of :attr:`version` (a collector driving this engine reads it)."
    )

    @property
    def kv_policy(self) -> KVPolicy:
        """What a load does to the KV held: ``"recompute"`` or ``"keep"``."""
        return self._kv.kv_policy

    def set_kv_policy(self, kv_policy: KVPolicy) -> None:
        """Take ``kv_policy`` for the requests and loads from now on (between two decoding steps)."""
        policy = check_kv_policy(kv_policy)
        self._between_steps(lambda: setattr(self._kv, "kv_policy", policy))

    def push_costs(self) -> list[PushCost]:
        """The recent loads' cost: the call, and the recompute each forced (see :mod:`lmcollect.engines.vllm.kv`)."""
        return self._kv.costs()

    @property
    def paused(self) -> bool:
        """Whether ``pause()`` was called without a ``resume()`` since."""
        return self._paused

    def close(self) -> None:
        """Fail pending futures with :class:`EngineClosedError`, abort their requests, free the engine. Idempotent."""
        with self._wake:
            if self._closed:
                return
            self._closed = True
            pending = [future for future, *_ in self._queued] + list(self._running.values())
            self._queued.clear()
            self._wake.notify_all()
        for future in pending:
            settle(
                future,
                error=EngineClosedError(
                    "VLLMEngine was closed before this request finished; resubmit it to another engine."
                ),
            )
        self._stop_thread()
        if self._shared_sets is not None:  # after the engine core stopped: no worker maps them any more
            self._shared_sets.close()
        if self._reaper is not None:  # the engine core stopped: nothing to reap
            self._reaper.close()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ on the decoding thread
    def _decode_loop(self) -> None:
        while True:
            with self._wake:
                while not (self._calls or self._closed or self._has_work()):
                    self._wake.wait()
                calls, self._calls = self._calls, []
                closed = self._closed
                added = [] if self._paused or closed else self._take_queued()
            for future, call in calls:  # control calls: between two steps
                _run_into(future, call)
            if closed:
                self._shut_down()
                return
            self._add(added)
            if not self._paused and self._running:
                self._step(admitted=bool(added))

    def _has_work(self) -> bool:
        return not self._paused and bool(self._queued or self._running)

    def _take_queued(self) -> list[Queued]:
        queued, self._queued = self._queued, []
        for future, request_id, _, _ in queued:
            self._running[request_id] = future
        return queued

    def _add(self, queued: list[Queued]) -> None:
        from vllm.inputs import TokensPrompt

        for _future, request_id, request, params in queued:
            salt = self._kv.added(request_id, request, version=self._counter.index)
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
            if salt is not None:
                prompt["cache_salt"] = salt
            try:
                self._llm.add_request(request_id, prompt, params)
            except Exception as error:  # designed: a request vLLM refuses fails its own future only
                self._finish(request_id, error=error)

    def _step(self, *, admitted: bool) -> None:
        started = self._kv.step_started()
        try:
            outputs = self._llm.step()
            self._kv.step_ended(started, admitted=admitted)
        except Exception as error:  # the engine broke: every running request fails with its error
            for request_id in list(self._running):
                self._finish(request_id, error=self._core_watch.check(error) or error)
            return
        if not outputs and not self._llm.has_unfinished_requests():  # never spin on requests vLLM lost
            for request_id in list(self._running):
                self._finish(request_id, error=RuntimeError(f"vLLM dropped request {request_id!r} without an output."))
        for output in outputs:
            if output.finished:
                try:
                    result = self._kv.finished(
                        output.request_id, result_of(output), num_cached=output.num_cached_tokens or 0
                    )
                    self._finish(output.request_id, result=result)
                except Exception as error:  # designed: a malformed output fails its own request
                    self._finish(output.request_id, error=error)

    def _finish(
        self, request_id: str, *, result: EngineResult | None = None, error: BaseException | None = None
    ) -> None:
        with self._wake:
            future = self._running.pop(request_id, None)
        self._kv.forget(request_id)
        if future is not None:
            settle(future, result=result, error=error)

    def _take_version(self, version: int | PushVersion, started: float | None = None, **timeline: float) -> None:
        """The new version label (after a load that began at ``started``, its stages in ``timeline``);
        under ``"recompute"`` the KV is dropped."""
        reset_started = time.perf_counter()
        index = version_index(version)
        self._llm.set_weight_version(str(index))
        self._counter.take(version)
        if self._kv.kv_policy == "recompute":
            self._reset_caches()
        if started is not None:
            ended = time.perf_counter()
            self._kv.loaded(version=index, call_s=ended - started, running=len(self._running),
                            reset_s=ended - reset_started, **timeline)  # fmt: skip

    def _reset_caches(self) -> None:
        if not self._llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset its prefix cache (a KV transfer in progress?).")

    def _shut_down(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        with self._wake:
            running = list(self._running)
            self._running.clear()
        if running:
            llm.abort_request(running)
        llm.engine_core.shutdown()
        del self._llm

    # ------------------------------------------------------------------ plumbing
    def _between_steps(self, call: Callable[[], T]) -> T:
        """Run ``call`` on the decoding thread between two steps and wait for it (at most ``timeout_s``)."""
        assert threading.current_thread() is not self._thread, "a blocking engine call from the engine's own thread"
        future: Future[T] = Future()
        with self._wake:
            if self._core_watch.error is not None:  # its engine core died: refused at once
                raise EngineDiedError(str(self._core_watch.error))
            if self._closed:
                raise EngineClosedError("this VLLMEngine is closed; build a new engine.")
            self._calls.append((future, call))
            self._wake.notify_all()
        try:
            return future.result(timeout=self.timeout_s)
        except Exception as error:  # a call that met the dead core on its way: said as the death it is
            # vLLM's plain Exception: a call that failed in the core (a worker that died under it?)
            died = self._core_watch.check(error, wait_s=CALL_DEATH_WAIT_S if type(error) is Exception else 0.0)
            if died is not None and not isinstance(error, EngineDiedError):
                raise EngineDiedError(str(died)) from error
            raise

    def _stop_thread(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=self.timeout_s)


def _world_size(llm: LLMEngine) -> int:
    parallel = getattr(getattr(llm, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "world_size", 1) or 1)


def _build(model_path: str, kwargs: dict[str, Any], reaper: Reaper | None) -> LLMEngine:
    """The engine (on the decoding thread), its version label -1; with a ``reaper``, the engine core in a
    process of its own, its socket files in the reaper's folder."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    config = engine_config(EngineArgs(model=model_path, **kwargs))
    with reaper.starting() if reaper is not None else contextlib.nullcontext():
        llm = LLMEngine(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_stats=not kwargs["disable_log_stats"],
            multiprocess_mode=reaper is not None,
        )
    llm.set_weight_version(str(INITIAL_VERSION))
    return llm


def _engine_kwargs(model_path: str | Path, engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``EngineArgs`` keywords: ours (checkpoint dtype, raw log-probs, weight extension), no stats log."""
    kwargs = engine_kwargs_for(model_path, engine_kwargs)
    kwargs.setdefault("disable_log_stats", True)  # vllm.LLM's default too; else a stats line every 10 s
    if kwargs["worker_extension_cls"] is None:
        raise ValueError(
            "engine_kwargs worker_extension_cls=None: VLLMEngine loads weights through "
            "lmcollect's worker extension; drop the setting."
        )
    return kwargs


def _run_into(future: Future, call: Callable[[], Any]) -> None:
    try:
        future.set_result(call())
    except BaseException as error:  # designed: the caller's future carries the call's error
        future.set_exception(error)
