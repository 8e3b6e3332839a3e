"""Continuous batching of our own over a ``transformers`` causal LM, behind :class:`EngineProtocol`."""

from __future__ import annotations

import contextlib
import inspect
import logging
import numbers
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from lmcollect.engines.base import EngineBase, FullWeights
from lmcollect.engines.hf.generate import generate_together
from lmcollect.engines.hf.kv_batch import LeftPaddedKVCache
from lmcollect.engines.hf.running_request import RunningRequest
from lmcollect.engines.kv_policy import KVPolicy, PushCost, PushCostMeter, check_kv_policy
from lmcollect.engines.protocol import (
    EngineCapabilities,
    EngineClosedError,
    EngineRequest,
    EngineResult,
    refuse_delta_base,
    refuse_long_prompt,
    refuse_stale_push,
)
from lmcollect.engines.sampling import eos_token_ids
from lmcollect.plumbing import forwarded
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.delta import WeightDelta, prepare_delta
from lmcollect.weights.kept_base import KeptBase
from lmcollect.weights.lora import LoraAdapter, check_adapter
from lmcollect.weights.tensors import (
    align_names,
    expected_metadata,
    raise_if_problems,
    tensor_metadata,
    unique_targets,
    weight_problems,
)
from lmcollect.weights.version import PushVersion, VersionCounter, version_index

if TYPE_CHECKING:  # transformers' model classes: the caller built the model
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["TransformersEngine"]

logger = logging.getLogger(__name__)

Outcome = tuple[RunningRequest, EngineResult | BaseException]


class TransformersEngine(EngineBase):
    """Answers requests as they arrive, batching every running request into one decoding step.

    A background thread runs the loop. Each step (under the loop's lock):

    1. admit queued requests while fewer than ``max_batch_size`` run;
    2. decode the running batch: one forward pass over each row's last token, with the rows'
       keys/values left-padded in one cache (:class:`~lmcollect.engines.hf.kv_batch.LeftPaddedKVCache`),
       an attention mask and each row's own position ids;
    3. prefill each newcomer alone (no padding) and append its keys/values to the batch cache;
    4. pick every row's next token from its raw logits (:class:`~lmcollect.engines.hf.running_request.RunningRequest`:
       raw log-prob first, then sampling with the request's own generator);
    5. resolve the requests that ended (a stop token, a stop string or ``max_new_tokens``) and
       drop their rows from the cache.

    Log-probs are the raw model's (log-softmax at temperature 1) in float32: a plain forward pass
    over prompt + response reproduces them. :meth:`load_weights` writes in place between two steps
    (it takes the loop's lock). Under ``kv_policy="recompute"`` (the default) it marks the cache
    stale: the next step re-prefills every running request (prompt + tokens so far) under the new
    weights, so each token after a load is exactly what the new weights give that prefix, and
    ``token_versions`` switch at that token; :meth:`push_costs` counts and times that re-prefill.
    Under ``"keep"`` running requests go on over their keys/values (``kv_versions`` say how old).
    No prefix is cached across requests, so a later turn always prefills its whole prompt.

    Supported sampling: ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``min_new_tokens``,
    ``repetition_penalty``, ``ignore_eos`` (the model's eos is never drawn; the request's
    ``stop_token_ids`` still stop), ``stop_strings``, ``sampled_log_probs``. ``sampling.seed`` is
    not read: each request is seeded by :attr:`EngineRequest.seed` (None: a seed drawn from torch's
    global RNG at submit).

    Args:
        model: a causal LM whose cache is plain full attention (no sliding-window or recurrent
            layers); exposed as ``.model``.
        tokenizer: its tokenizer (eos id, stop strings).
        max_batch_size: most requests decoded together; the rest wait in the queue.
        version: the version of the weights the model holds now (-1: before any push).
        kv_policy: ``"recompute"`` or ``"keep"`` (see :mod:`lmcollect.engines.kv_policy`).

    Example::

        engine = TransformersEngine(model, tokenizer, max_batch_size=16)
        future = engine.submit(EngineRequest(prompt_ids=ids, sampling=SamplingConfig(temperature=0)))
        engine.pause(); engine.load_weights(trainer_model.state_dict().items(), version=1); engine.resume()
        result = future.result()  # result.token_versions: -1 before the load, 1 after
        engine.close()
    """

    capabilities = EngineCapabilities(
        loads_lora_adapters=True,  # merged into a kept copy of the adapted layers' base weights
        loads_weight_deltas=True,  # written in place
        sets_kv_policy=True,
        meters_push_costs=True,
        checkpoints_weights=True,
        has_version_counter=True,
    )
    """What it does beyond the core protocol (see :class:`~lmcollect.engines.protocol.EngineCapabilities`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 16,
        version: int = -1,
        kv_policy: KVPolicy = "recompute",
    ) -> None:
        _check_int("max_batch_size", max_batch_size, minimum=1, hint="the most requests decoded together")
        self._kv_policy = check_kv_policy(kv_policy)
        self._push_costs = PushCostMeter()
        _check_int("version", version, minimum=-1, hint="-1 before any push")
        self._continuous_refusal = _continuous_refusal(model)  # None: submit() can batch this model
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._counter = VersionCounter(start=version)
        self._eos_ids = eos_token_ids(model.generation_config.eos_token_id, tokenizer)
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self.max_context_tokens: int | None = getattr(model.config, "max_position_embeddings", None)
        """Prompt and response tokens the model takes at most (a longer prompt is refused at submit)."""
        self._device = next(model.parameters()).device
        self._step_lock = threading.Lock()  # held for one whole step; loads and pauses wait for it
        self._state = threading.Condition()  # guards the queue and the flags; the loop sleeps on it
        self._queue: deque[RunningRequest] = deque()
        self._rows: list[RunningRequest] = []  # the running batch (loop thread only, under the step lock)
        self._batch = LeftPaddedKVCache()
        self._paused = self._closed = self._weights_changed = False
        self._num_in_flight = 0
        self._kept_base = KeptBase()  # base weights of the layers LoRA adapters touch
        self._between_steps_waiting = 0  # loads and version changes waiting for the step lock
        self._outcomes: list[Outcome] = []  # the current step's ended requests (loop thread only)
        self._thread: threading.Thread | None = None  # the loop, started by the first submit()

    # ------------------------------------------------------------------ the protocol
    def submit(self, request: EngineRequest) -> Future[EngineResult]:
        """Queue ``request``; the future resolves with its :class:`EngineResult` when it ends."""
        self._check_request(request)
        running = RunningRequest(
            request,
            eos_token_ids=self._eos_ids,
            tokenizer=self.tokenizer,
            device=self._device,
            kv_policy=self._kv_policy,
        )
        with self._state:
            if self._closed:
                raise EngineClosedError("this TransformersEngine is closed; build a new engine to submit requests.")
            self._queue.append(running)
            self._num_in_flight += 1
            self._state.notify_all()
            if self._thread is None:  # lockstep-only use (generate_batch) never starts it
                self._thread = threading.Thread(target=self._run, name="TransformersEngine", daemon=True)
                self._thread.start()
        return running.future

    def generate_batch(
        self, requests: Sequence[EngineRequest], *, timeout_s: float | None = None
    ) -> list[EngineResult]:
        """Answer a lockstep batch together with one ``model.generate`` call (the lockstep policy's path).

        Faster than :meth:`submit` for a batch that starts and ends together: one padded prefill,
        ``generate``'s vectorized decoding. The rows share ``sampling`` and ``stop_token_ids`` (else a
        ValueError); seeded rows sample from their own generators, as in :meth:`submit`. It runs
        between two decoding steps of the continuous loop, waits while the engine is paused (at most
        ``timeout_s``, then ``TimeoutError``), and every token carries the version held meanwhile
        (no load lands inside it).
        """
        for request in requests:
            self._check_request(request, continuous=False)
        with self._state:
            if not self._state.wait_for(lambda: not self._paused or self._closed, timeout=timeout_s):
                raise TimeoutError(
                    f"TransformersEngine.generate_batch waited {timeout_s} s for the paused engine to resume "
                    "(timeout_s; a policy's timeout_s): resume() it, or raise the timeout."
                )
            self._num_in_flight += len(requests)
        try:
            with self._between_steps():
                if self._closed:
                    raise EngineClosedError("this TransformersEngine is closed; build a new engine to generate.")
                return generate_together(
                    self.model, self.tokenizer, requests, eos_token_ids=self._eos_ids, version=self._counter.index
                )
        finally:
            with self._state:
                self._num_in_flight -= len(requests)

    def pause(self) -> None:
        """Stop before the next step and return once the current one is done; requests keep their state."""
        with self._state:
            self._paused = True
        with self._step_lock:  # the step running now (if any) ends before this is acquired
            pass

    def resume(self) -> None:
        """Continue decoding every running and queued request."""
        with self._state:
            self._paused = False
            self._state.notify_all()

    full_load_options = frozenset({"convert_dtype"})

    def _load_full(self, weights: FullWeights, version: int | PushVersion, options: Mapping[str, Any]) -> None:
        """Check every tensor against the model, then copy them in place between two steps and take ``version``.

        All or nothing: a missing, unexpected, misshapen or wrongly typed tensor raises one
        ValueError naming each, before anything is written (``load_weights(..., convert_dtype=True)``
        casts floating tensors instead). Tied weights may come under either name. Names carrying
        one extra leading component (``model.`` of a policy wrapping the model) are accepted.
        Works paused or running; running requests continue under the new weights (their prefixes
        are re-prefilled). A sender's :class:`~lmcollect.weights.buckets.WeightBuckets` are copied
        into the model straight from views of their bytes (no other copy). A full push (whatever
        its values) becomes the base that LoRA adapters merge into.
        """
        named = weights.tensors().items() if isinstance(weights, WeightBuckets) else weights
        targets, writes = self._planned_writes(named, convert_dtype=bool(options.get("convert_dtype", False)))

        def write() -> None:
            self._kept_base.forget()
            for name, tensor in writes.items():
                targets[name].copy_(tensor)

        self._load_between_steps(version, write)

    def _load_adapter(self, adapter: LoraAdapter, version: int | PushVersion) -> None:
        """Merge ``adapter`` into a kept copy of the base weights of the layers it adapts
        (``base + scaling * B @ A``, see :class:`~lmcollect.weights.kept_base.KeptBase`): adapters
        replace each other. An adapter whose merge would not be finite is refused with nothing changed."""
        check_adapter(adapter, self.weight_metadata()[0], receiver="TransformersEngine's model")
        targets = unique_targets(self.model)[0]
        on_device = adapter.to(self._device)
        self._load_between_steps(
            version, lambda: self._kept_base.merge_into(on_device, targets, receiver="TransformersEngine's model")
        )

    def _load_delta(self, delta: WeightDelta, version: int | PushVersion) -> None:
        """Write ``delta`` in place into the model (no copy of the weights) between two steps: checked
        first (base version, names, dtypes, positions), its checksums verified after writing, and
        undone on a mismatch, so a refused delta (:class:`~lmcollect.weights.delta.DeltaRejectedError`)
        changes nothing."""
        targets, aliases = unique_targets(self.model)

        def write() -> None:
            refuse_delta_base(delta, self._counter.index, "TransformersEngine")
            # the base's index matched; its uuid is the owning collector's to check
            prepare_delta(delta, targets, held_version=delta.base_version, aliases=aliases).apply_()
            self._kept_base.forget()

        self._load_between_steps(version, write)

    def _load_between_steps(self, version: int | PushVersion, write: Callable[[], None]) -> None:
        """``write()`` between two decoding steps, then ``version`` taken: every load goes through
        here. A stale version is refused there (loads are ordered by the step lock)."""
        queued = time.perf_counter()
        with self._between_steps(), torch.no_grad():
            if self._closed:
                raise EngineClosedError("this TransformersEngine is closed; it cannot load weights.")
            refuse_stale_push(version_index(version), self._counter.index, "TransformersEngine")
            started = time.perf_counter()
            write()
            self._took(version, started, queued=queued)

    def _took(self, version: int | PushVersion, started: float, *, queued: float) -> None:
        """After a load that waited from ``queued`` for the step under way and ran from ``started``
        (under the step lock): the new version, the cache stale under ``"recompute"``."""
        self._counter.take(version)
        self._weights_changed = self._kv_policy == "recompute"
        call_s = time.perf_counter() - started
        self._push_costs.loaded(
            version=version_index(version), kv_policy=self._kv_policy, call_s=call_s,
            wait_s=started - queued, load_s=call_s,
        )  # fmt: skip

    def checkpoint_weights(self) -> tuple[dict[str, torch.Tensor], LoraAdapter | None]:
        """What a checkpoint restores this engine to: its base weights (the model's state, with the
        base of every layer a LoRA adapter is merged into in place of the merge) and that adapter
        (None: none). Loading the base as a full push, then the adapter, gives back these weights
        and the base the next adapter merges into. Taken between two steps; the other tensors are
        the model's own, as ``state_dict()`` gives them."""
        with self._between_steps():
            state = dict(self.model.state_dict())
            targets, aliases = unique_targets(self.model)
            held = self._kept_base.held(targets)
        if held is None:
            return state, None
        base, adapter = held
        state.update(base)
        state.update({alias: base[name] for alias, name in aliases.items() if name in base})
        return state, adapter

    def weight_metadata(self) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """The model's distinct tensors (name -> (dtype, shape)) and tied aliases."""
        return expected_metadata(self.model)

    def set_version(self, version: int) -> None:
        """Label tokens decoded from now on with ``version`` (between two decoding steps)."""
        _check_int("version", version, minimum=-1, hint="the loaded weights' version")
        with self._between_steps():
            self._counter.take(version)

    def reset_prefix_cache(self) -> None:
        """Nothing to forget: no prefix is cached across requests, and a load re-prefills running ones."""

    @property
    def kv_policy(self) -> KVPolicy:
        """What a load does to running requests' keys/values: ``"recompute"`` or ``"keep"``."""
        return self._kv_policy

    def set_kv_policy(self, kv_policy: KVPolicy) -> None:
        """Take ``kv_policy`` for the loads from now on (between two decoding steps)."""
        policy = check_kv_policy(kv_policy)
        with self._between_steps():
            self._kv_policy = policy

    def push_costs(self) -> list[PushCost]:
        """The recent loads' cost: the call, and the re-prefill each forced (tokens and seconds, measured)."""
        return self._push_costs.costs()

    version = forwarded("_counter.index", "The version of the weights loaded now (-1 before any push).")
    version_counter = forwarded(
        "_counter", "The counter of :attr:`version` (a collector driving this engine reads it)."
    )

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished (queued or running)."""
        with self._state:
            return self._num_in_flight

    def close(self) -> None:
        """Stop the loop and fail every unfinished request with :class:`EngineClosedError`."""
        with self._state:
            self._closed = True
            self._state.notify_all()
            thread = self._thread
        if thread is not None and threading.current_thread() is not thread:
            thread.join()  # the loop's exit fails what is left (see _run)

    def __reduce__(self) -> tuple:
        """Travels (pickle, Ray) as its model and settings; the copy starts with nothing in flight."""
        return (_rebuilt, (self.model, self.tokenizer, self.max_batch_size, self._counter.index, self._kv_policy))

    def __enter__(self) -> TransformersEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ checks
    def _check_request(self, request: EngineRequest, *, continuous: bool = True) -> None:
        if not isinstance(request, EngineRequest):
            raise TypeError(f"submit() takes an EngineRequest, got {type(request).__name__}.")
        if continuous and self._continuous_refusal:
            raise ValueError(self._continuous_refusal)
        ids = request.prompt_ids
        if len(ids) == 0:
            raise ValueError(
                f"request {request.request_id!r} has an empty prompt; prompt_ids needs at least one token."
            )
        refuse_long_prompt(request, self.max_context_tokens, "TransformersEngine")
        bad = [i for i in [*ids, *request.stop_token_ids] if not _is_token_id(i, self._vocab_size)]
        if bad:
            raise ValueError(
                f"request {request.request_id!r} has token ids outside the model's vocabulary "
                f"[0, {self._vocab_size}) in prompt_ids or stop_token_ids: {bad[:5]}."
            )

    def _planned_writes(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, convert_dtype: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The model's tensors and ``name -> tensor`` to copy into them, after checking every one."""
        weights: dict[str, torch.Tensor] = {}
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor; no weight was changed.")
            if name in weights:
                raise ValueError(f"weight {name!r} was given twice; no weight was changed.")
            weights[name] = tensor
        targets, aliases = unique_targets(self.model)
        weights = align_names(weights, set(targets) | set(aliases))
        problems = weight_problems(
            tensor_metadata(weights), tensor_metadata(targets), aliases=aliases, convert_dtype=convert_dtype
        )
        raise_if_problems(problems, where=" by TransformersEngine.load_weights")
        return targets, {aliases.get(name, name): tensor for name, tensor in weights.items()}

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """The step lock, taken before the loop's next step: the loop waits while anyone waits here.

        A plain lock is not fair: a loop that releases it and takes it again at once could keep a
        load out for as long as requests run.
        """
        with self._state:
            self._between_steps_waiting += 1
        try:
            with self._step_lock:
                yield
        finally:
            with self._state:
                self._between_steps_waiting -= 1
                self._state.notify_all()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                with self._step_lock:
                    outcomes = [] if self._is_paused() else self._step_or_fail()
                self._resolve(outcomes)  # outside the lock: callbacks may pause or load weights
        finally:
            self._fail_unfinished()

    def _fail_unfinished(self) -> None:
        """When the loop exits (closed, or an error outside any step): fail every request left."""
        with self._state:
            self._closed = True
            left, self._rows = [*self._rows, *self._queue], []
            self._queue.clear()
        self._batch.clear()
        self._resolve([(row, _closed_error(row)) for row in left])

    def _wait_for_work(self) -> bool:
        """Sleep while paused, idle or wanted between steps (see :meth:`_between_steps`); False once closed."""
        with self._state:
            while not self._closed and (self._paused or self._between_steps_waiting or not (self._rows or self._queue)):
                self._state.wait()
            return not self._closed

    def _is_paused(self) -> bool:
        with self._state:
            return self._paused or self._closed

    def _step_or_fail(self) -> list[Outcome]:
        """One step; the requests that ended in it (or all of the step's requests, failed, if it raised)."""
        self._outcomes = []
        try:
            with torch.inference_mode():
                self._step()
        except Exception as exc:  # designed: a failed step fails its requests; the engine goes on
            logger.exception("TransformersEngine: a decoding step failed; failing its %d request(s)", len(self._rows))
            self._outcomes += [(row, exc) for row in self._rows]
            self._rows = []
            self._batch.clear()
        return self._outcomes

    def _step(self) -> None:
        """One decoding step of every running request, newcomers included (ended ones go to ``_outcomes``)."""
        self._rows.extend(self._admit())
        stale = self._drop_stale_cache()
        cached = [row for row in self._rows if row.in_batch]
        logits = [self._decode(cached)] if cached else []
        fresh = []
        for row in self._rows:
            if not row.in_batch:
                try:
                    started = time.perf_counter()
                    logits.append(self._prefill(row))
                    fresh.append(row)
                    if id(row) in stale:  # a prefill the load forced: what the push cost afterwards
                        self._push_costs.recomputed(row.num_known, time.perf_counter() - started)
                except Exception as exc:  # designed: one prompt that fails (too long, ...) fails alone
                    self._outcomes.append((row, exc))
        self._rows = cached + fresh
        for row, row_logits in zip(self._rows, torch.cat(logits) if logits else [], strict=True):
            row.append_next(row_logits, version=self._counter.index)
        self._retire_finished()

    def _drop_stale_cache(self) -> set[int]:
        """After a load under ``"recompute"``: forget every row's keys/values; the ids of the rows that had them."""
        if not self._weights_changed:
            return set()
        self._weights_changed = False
        stale = {id(row) for row in self._rows if row.in_batch}
        self._batch.clear()
        for row in self._rows:
            row.in_batch = False
        return stale

    def _admit(self) -> list[RunningRequest]:
        """Queued requests that fit in the batch (cancelled ones are dropped)."""
        admitted: list[RunningRequest] = []
        with self._state:
            while self._queue and len(self._rows) + len(admitted) < self.max_batch_size:
                row = self._queue.popleft()
                if row.future.set_running_or_notify_cancel():
                    admitted.append(row)
                else:
                    self._num_in_flight -= 1
        return admitted

    def _decode(self, rows: list[RunningRequest]) -> torch.Tensor:
        """float32 ``[len(rows), vocab]``: next-token logits of the cached rows (their last token in, one step)."""
        input_ids = torch.tensor([[row.tokens[-1]] for row in rows], device=self._device)
        positions = torch.tensor([[row.num_known - 1] for row in rows], device=self._device)
        mask = self._batch.decode_mask()
        cache = self._batch.cache
        out = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        )
        self._batch.mask = mask
        return out.logits[:, -1].float()

    def _prefill(self, row: RunningRequest) -> torch.Tensor:
        """float32 ``[1, vocab]``: next-token logits after all of ``row``'s known tokens; its cache joins the batch."""
        cache = DynamicCache()
        input_ids = torch.tensor([row.known_ids], device=self._device)
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._batch.add_row(cache)
        row.in_batch = True
        return out.logits[:, -1].float()

    def _retire_finished(self) -> None:
        keep = [i for i, row in enumerate(self._rows) if row.finish_reason is None]
        self._outcomes += [(row, row.result()) for row in self._rows if row.finish_reason is not None]
        self._batch.keep_rows(keep)
        self._rows = [self._rows[i] for i in keep]

    def _resolve(self, outcomes: list[Outcome]) -> None:
        """Settle futures (their callbacks run here, in the loop thread, with no lock held)."""
        if not outcomes:
            return
        with self._state:
            self._num_in_flight -= len(outcomes)
        for row, outcome in outcomes:
            if row.future.cancelled():  # cancelled while queued
                continue
            if isinstance(outcome, BaseException):
                row.future.set_exception(outcome)
            else:
                row.future.set_result(outcome)


def _rebuilt(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_batch_size: int, version: int, kv_policy: KVPolicy
) -> TransformersEngine:
    return TransformersEngine(model, tokenizer, max_batch_size=max_batch_size, version=version, kv_policy=kv_policy)


def _closed_error(row: RunningRequest) -> EngineClosedError:
    return EngineClosedError(
        f"the TransformersEngine was closed before request {row.request.request_id!r} finished; resubmit it elsewhere."
    )


def _is_token_id(value: object, vocab_size: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= int(value) < vocab_size


def _check_int(name: str, value: object, *, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} ({hint}), got {value!r}.")


def _continuous_refusal(model: PreTrainedModel) -> str | None:
    """Why :meth:`TransformersEngine.submit` cannot batch ``model`` (its cache cannot be left-padded
    and merged), or None; :meth:`TransformersEngine.generate_batch` (``model.generate``) serves it anyway."""
    config = model.config.get_text_config(decoder=True)
    other = sorted({t for t in getattr(config, "layer_types", None) or [] if t != "full_attention"})
    if other:
        return (
            f"TransformersEngine.submit batches full-attention caches only; this model has {other} layers. "
            "Use TransformersPolicy (lockstep batches through model.generate) or a vLLM engine for it."
        )
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return (
            f"{type(model).__name__}.forward takes no logits_to_keep; TransformersEngine.submit needs a recent "
            "causal LM class (TransformersPolicy's lockstep batches through model.generate still work)."
        )
    return None
