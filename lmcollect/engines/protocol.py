"""The one engine interface the collectors and the weight updaters talk to.

An engine answers requests one at a time as they arrive (continuous batching): ``submit`` returns
at once with a future; the engine joins the request into its running batch between decoding steps
and resolves the future when the response ends. Pausing keeps in-flight requests (they continue
after ``resume``), so weights can be loaded between two decoding steps; every generated token
records the version of the weights that produced it.

Implementations: :class:`~lmcollect.engines.hf.engine.TransformersEngine` (our own
continuous batching over a ``transformers`` causal LM), :class:`~lmcollect.engines.vllm.engine.VLLMEngine`
(vLLM's ``LLMEngine`` stepped by our decoding thread, engine core in this process),
:class:`~lmcollect.engines.served.VLLMServerEngine` (a vLLM server),
:class:`~lmcollect.ray.engine.RayEngine` (any of them in a Ray actor) and
:class:`~lmcollect.engines.router.EngineRouter` (replicas behind one engine).

Engines whose weights live in worker processes (vLLM's) also implement :class:`WorkerRpcEngine`:
that is how a :class:`~lmcollect.weight_sync.vLLMUpdater` broadcasts weights straight into the
workers, whether the engine is a lockstep ``VLLMPolicy``'s or a continuous collector's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.weight_group import GroupPush
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.delta import DeltaRejectedError, WeightDelta
from lmcollect.weights.lora import LoraAdapter
from lmcollect.weights.version import PushVersion, VersionCounter

__all__ = [
    "CORE_ONLY", "BatchGenerating", "DeclaresCapabilities", "EngineCapabilities", "EngineClosedError", "EngineProtocol",
    "EngineRequest", "EngineResult", "PayloadKind", "StalePushError", "WorkerRpcEngine", "capabilities_of",
    "check_engine_loads", "check_version", "engine_of", "load_refusal", "payload_kind", "refuse_delta_base",
    "refuse_stale_push", "version_counter_of", "worker_rpc_engine_of",
]  # fmt: skip


class EngineClosedError(RuntimeError):
    """The engine was closed before the request finished (its tokens are lost; resubmit it elsewhere)."""


class EngineDiedError(EngineClosedError):
    """A process the engine runs in died (killed, out of memory): the request failed with it, and the
    engine takes no more. Close it and build a new one (then push the trainer's weights, or restore the
    last checkpoint)."""


class StalePushError(ValueError):
    """A weight load older than the weights the engine holds: refused, nothing changed."""


def check_version(version: object) -> None:
    """``TypeError`` unless ``version`` is an int (bools refused) or a push's
    :class:`~lmcollect.weights.version.PushVersion`: the argument of ``load_weights`` / ``set_version``."""
    if isinstance(version, PushVersion):
        return
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an int (the weights' version), got {version!r}.")


class PromptTooLongError(ValueError):
    """A request whose prompt leaves no room in the model's context (see :func:`refuse_long_prompt`);
    its own type so that a caller can tell it from other errors when it comes back through a future
    (an engine in another process, e.g. a Ray actor, refuses it in its own ``submit``)."""


def refuse_long_prompt(request: EngineRequest, max_context_tokens: int | None, engine: str) -> None:
    """Raise ValueError at submit if ``request``'s prompt leaves no room in the model's context for
    one generated token (None: the engine knows no bound). Every engine refuses it the same way,
    before any prefill: a collector then fails that dialog alone (an agent's call gets HTTP 400)."""
    num_tokens = len(request.prompt_ids)
    if max_context_tokens is not None and num_tokens >= max_context_tokens:
        raise PromptTooLongError(
            f"request {request.request_id!r}: the prompt has {num_tokens} tokens, but {engine}'s model has a "
            f"context of {max_context_tokens} tokens (max context), which must also hold the response; "
            "shorten the dialog (fewer or shorter messages, e.g. ChatEnvConfig.max_turns) or serve a model "
            "with a longer context (vLLM: max_model_len)."
        )


def refuse_stale_push(version: int, held: int, engine: str) -> None:
    """Raise :class:`StalePushError` when a load of ``version`` would overwrite the newer ``held`` one.

    Engines call it where the load takes effect (between two decoding steps, under the lock that
    orders loads), so two overlapping pushes that arrive in the wrong order leave the newer weights
    in place under their own version: no weight was changed by the older one."""
    if version < held:
        raise StalePushError(
            f"{engine}.load_weights(version={version}) refused: the engine holds version {held}, which is newer; "
            "no weight was changed (a push older than the weights held never overwrites them)."
        )


def refuse_delta_base(delta: WeightDelta, held: int, engine: str) -> None:
    """Raise :class:`~lmcollect.weights.delta.DeltaRejectedError` unless the engine holds the version
    ``delta`` was computed against (its ``base_version.index``); the sender then pushes in full.

    The collector that owns the engine also checks the base's uuid (it holds the push's
    :class:`~lmcollect.weights.version.PushVersion`); an engine knows only the version index."""
    if delta.base_version.index != held:
        raise DeltaRejectedError(
            f"{engine} holds version {held}; the delta applies to version {delta.base_version.index}: "
            "nothing was changed (push the full weights)."
        )


PayloadKind = Literal["full", "group_push", "lora_adapter", "weight_delta"]
"""What ``load_weights`` was given: full weights (named tensors or a sender's
:class:`~lmcollect.weights.buckets.WeightBuckets`), a process-group push, a LoRA adapter or a weight delta."""


def payload_kind(source: object) -> PayloadKind:
    """The :data:`PayloadKind` of a ``load_weights`` source (anything not a push, an adapter or a delta is full weights)."""
    if isinstance(source, GroupPush):
        return "group_push"
    if isinstance(source, LoraAdapter):
        return "lora_adapter"
    if isinstance(source, WeightDelta):
        return "weight_delta"
    return "full"


@dataclass(frozen=True, kw_only=True)
class EngineCapabilities:
    """What an engine does beyond the core of :class:`EngineProtocol`: its ``capabilities``, read
    with :func:`capabilities_of` (an engine that declares none implements the core alone).

    One source of truth: an engine refuses a payload kind whose field is False, naming the fix
    (:func:`check_engine_loads`), and callers read these fields instead of probing for methods.
    """

    loads_full_weights: bool = True
    """``load_weights`` takes full weights (named tensors, a sender's WeightBuckets): the core of
    the protocol. False for a vLLM server, whose workers only receive a process-group push."""
    loads_group_pushes: bool = False
    """``load_weights`` takes a :class:`~lmcollect.engines.weight_group.GroupPush`: its worker
    processes receive a trainer's broadcast (a :class:`WorkerRpcEngine`: the vLLM engines)."""
    loads_lora_adapters: bool = False
    """``load_weights`` takes a :class:`~lmcollect.weights.lora.LoraAdapter`, merged into a kept
    copy of the adapted layers' base weights (adapters replace each other)."""
    loads_weight_deltas: bool = False
    """``load_weights`` takes a :class:`~lmcollect.weights.delta.WeightDelta` of the weights it holds."""
    checks_finite_in_copy: bool = False
    """``load_weights(full weights, check_finite=True)`` refuses NaN/Inf while it copies (one pass
    per buffer), so a sender need not check them first."""
    sets_kv_policy: bool = False
    """It has ``kv_policy`` and ``set_kv_policy(policy)`` and can keep keys/values across a load
    (``"keep"``, see :mod:`lmcollect.engines.kv_policy`); without it, an engine recomputes."""
    meters_push_costs: bool = False
    """It has ``push_costs()``: the recent loads' :class:`~lmcollect.engines.kv_policy.PushCost`."""
    checkpoints_weights: bool = False
    """It has ``checkpoint_weights()``: the base weights it holds and the LoRA adapter merged on
    them (what a checkpoint restores it to)."""
    has_version_counter: bool = False
    """It has ``version_counter``: the :class:`~lmcollect.weights.version.VersionCounter` behind
    ``version``, which a collector driving the engine reads as its policy version."""

    def loads(self, kind: PayloadKind) -> bool:
        """Whether ``load_weights`` takes a payload of ``kind``."""
        return {
            "full": self.loads_full_weights,
            "group_push": self.loads_group_pushes,
            "lora_adapter": self.loads_lora_adapters,
            "weight_delta": self.loads_weight_deltas,
        }[kind]


CORE_ONLY = EngineCapabilities()
"""The capabilities of an engine that declares none: it loads full weights, nothing more."""


@runtime_checkable
class DeclaresCapabilities(Protocol):
    """An engine that declares its :class:`EngineCapabilities` (every engine of lmcollect does)."""

    @property
    def capabilities(self) -> EngineCapabilities:
        """What the engine does beyond the core protocol."""
        ...


def capabilities_of(engine: object) -> EngineCapabilities:
    """``engine.capabilities``, or :data:`CORE_ONLY` for an engine that declares none (a user's
    engine implementing only :class:`EngineProtocol`)."""
    if isinstance(engine, DeclaresCapabilities):
        declared = engine.capabilities
        if not isinstance(declared, EngineCapabilities):
            raise TypeError(
                f"{type(engine).__name__}.capabilities is a {type(declared).__name__}; declare an EngineCapabilities."
            )
        return declared
    return CORE_ONLY


def version_counter_of(engine: object) -> VersionCounter | None:
    """The engine's :class:`~lmcollect.weights.version.VersionCounter` where it has one
    (``has_version_counter``), else None."""
    if engine is None or not capabilities_of(engine).has_version_counter:
        return None
    counter = engine.version_counter  # type: ignore[attr-defined]  # declared by has_version_counter
    return counter if isinstance(counter, VersionCounter) else None


_REFUSALS: dict[PayloadKind, str] = {
    "full": (
        "{name} cannot load weights sent as tensors (a vLLM server's weights do not travel through its HTTP "
        "endpoints); give the collector weight_updater=vLLMUpdater() (a process-group broadcast into the "
        "server's workers) and push through it."
    ),
    "group_push": (
        "{name} has no worker processes to receive a process-group push (vLLMUpdater); collect with a vLLM "
        "engine (VLLMEngine, a vLLM server), or push with RayRemoteWeightUpdater instead."
    ),
    "lora_adapter": (
        "{name} does not load LoRA adapters (TransformersEngine, VLLMEngine and the engines routing to them "
        "do): collect with one of those, or push the merged model (model.merge_and_unload()) as full weights."
    ),
    "weight_delta": (
        "{name} does not load weight deltas (TransformersEngine and VLLMEngine do): push full weights "
        "(PushConfig(delta=False))."
    ),
}


def load_refusal(engine: object, kind: PayloadKind) -> TypeError:
    """The error of ``engine`` refusing a payload of ``kind``, naming the fix."""
    return TypeError(_REFUSALS[kind].format(name=type(engine).__name__))


def check_engine_loads(engine: object, source: object) -> PayloadKind:
    """The payload kind of ``source``; ``TypeError`` naming the fix if ``engine``'s
    :class:`EngineCapabilities` say it does not load that kind. Changes nothing."""
    kind = payload_kind(source)
    if not capabilities_of(engine).loads(kind):
        raise load_refusal(engine, kind)
    return kind


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    """One generation request: a prompt's token ids and how to sample its response."""

    prompt_ids: list[int]
    """The prompt, already tokenized (token-exact multi-turn: the previous turn's ids + the env reply)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Temperature, top-p/top-k, ``max_new_tokens``, stop strings; ``stop_token_ids`` below add to it."""
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end the response (included as its last token), in addition to the model's eos."""
    seed: int | None = None
    """Seeds this request's sampling (same seed, same weights, same prompt: same tokens)."""
    request_id: str = ""
    """Caller's id (for logs and errors); the engine does not require it to be unique."""
    affinity: str | None = None
    """Requests with the same affinity (e.g. one dialog's turns) go to the same replica, to reuse its
    prefix cache."""
    context_kv_version: int | None = None
    """Under ``kv_policy="keep"``: the oldest weight version that computed a key/value cached for this
    request's dialog (its earlier turns), which its prompt may reuse; None for a dialog's first turn.
    Engines with a prefix cache salt it by this version (the version now when None), and a prompt
    that hit that cache has it as the floor of its :attr:`EngineResult.kv_versions`."""


@dataclass(frozen=True, kw_only=True)
class EngineResult:
    """The response to one :class:`EngineRequest`."""

    tokens: torch.Tensor
    """int64 ``[n]``: generated ids, ending with the stop token if the response stopped on one."""
    log_probs: torch.Tensor
    """float32 ``[n]``: raw log-probs of each generated token (softmax at temperature 1)."""
    token_versions: torch.Tensor
    """int64 ``[n]``: the weight version that generated each token (differs within a response that spanned a push)."""
    finish_reason: str
    """``"stop"`` (a stop token or string) or ``"length"`` (``max_new_tokens`` reached)."""
    sampled_log_probs: torch.Tensor | None = None
    """float32 ``[n]``: log-probs under the distribution actually sampled (after temperature / top-k /
    top-p; 0 for greedy), with ``SamplingConfig(sampled_log_probs=True)`` on engines that support it; else None."""
    kv_versions: torch.Tensor | None = None
    """int64 ``[n]``: the oldest weight version that computed a key/value each token attended to
    (:func:`~lmcollect.engines.kv_policy.kv_versions_of`): ``token_versions`` under
    ``kv_policy="recompute"``, possibly older under ``"keep"``; None from engines that do not report it
    (then it equals ``token_versions``)."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens whose keys/values came from the engine's prefix cache (not computed for this request)."""


@runtime_checkable
class EngineProtocol(Protocol):
    """What the collectors and the updaters need from an inference engine."""

    def submit(self, request: EngineRequest) -> Future[EngineResult]:
        """Queue ``request``; the future resolves when its response ends (or with the engine's error)."""
        ...

    def pause(self) -> None:
        """Stop decoding after the current step; in-flight requests keep their state. Returns once stopped."""
        ...

    def resume(self) -> None:
        """Continue decoding every in-flight and queued request."""
        ...

    def load_weights(
        self,
        source: Iterable[tuple[str, torch.Tensor]] | WeightBuckets | LoraAdapter | WeightDelta,
        *,
        version: int | PushVersion,
    ) -> list[Any] | None:
        """Load weights (all names and shapes checked before any is written) and take ``version``.

        ``version``: an index, or a push's :class:`~lmcollect.weights.version.PushVersion` (index and
        uuid): the engine's version counter (``version_counter``, which a collector driving the
        engine reads as its own version) takes it with the weights, under the same lock.

        A successful load also forgets the cached prefixes (computed with the old weights): callers
        need not call :meth:`reset_prefix_cache` after it.

        Every engine also takes a sender's :class:`~lmcollect.weights.buckets.WeightBuckets` (a
        layout and its byte buffers) and reads them as they are, through views: a push is packed
        once, by its sender (an engine with worker processes hands the buffers on to them).

        Returns None (a :class:`WorkerRpcEngine` returns its workers' reports for a ``GroupPush``).

        An engine whose ``capabilities.loads_lora_adapters`` is True also takes a
        :class:`~lmcollect.weights.lora.LoraAdapter`: it merges the adapter into its kept copy of
        the adapted layers' base weights (adapters replace each other; a full push is a new base).

        An engine whose ``capabilities.loads_weight_deltas`` is True also takes a
        :class:`~lmcollect.weights.delta.WeightDelta`: the changed elements of the weights it holds
        (its version must be the delta's base, see :func:`refuse_delta_base`). It checks names,
        dtypes and positions, writes, verifies the checksums, and on any failure raises
        :class:`~lmcollect.weights.delta.DeltaRejectedError` with nothing changed.

        A ``version`` older than :attr:`version` is refused with :class:`StalePushError` where the
        load would take effect (see :func:`refuse_stale_push`), so an out-of-order push changes nothing.

        Allowed while paused (in-flight tokens from then on carry the new version) or while running
        (the engine waits for the current decoding step).
        """
        ...

    def weight_metadata(self) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """What :meth:`load_weights` accepts: name -> (dtype, shape), and tied aliases (alias -> name)."""
        ...

    def set_version(self, version: int) -> None:
        """Label tokens decoded from now on with ``version``: weights were loaded by other means
        than :meth:`load_weights` (a process-group broadcast into the workers). Call while paused."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt prefixes (after a weight load, they were computed with old weights)."""
        ...

    # Optional, declared in ``capabilities`` (:class:`EngineCapabilities`, read with
    # :func:`capabilities_of`): ``kv_policy`` / ``set_kv_policy`` (``sets_kv_policy``),
    # ``push_costs()`` (``meters_push_costs``), ``checkpoint_weights()`` (``checkpoints_weights``),
    # ``version_counter`` (``has_version_counter``), and the payload kinds ``load_weights`` takes.

    @property
    def version(self) -> int:
        """The version of the weights loaded now (-1 before any push)."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished (the load a router balances)."""
        ...

    def close(self) -> None:
        """Fail pending futures with a clear error and free the engine."""
        ...


@runtime_checkable
class BatchGenerating(Protocol):
    """An engine that answers a whole lockstep batch faster in one call than request by request
    (``TransformersEngine``: one ``model.generate``). :class:`~lmcollect.policies.EnginePolicy`
    hands such an engine each batch whole; rows share ``sampling`` and ``stop_token_ids``."""

    def generate_batch(
        self, requests: Sequence[EngineRequest], *, timeout_s: float | None = None
    ) -> list[EngineResult]:
        """Every request's result, in order, generated together (no weight load lands inside);
        ``timeout_s`` bounds the wait for a paused engine to resume (``TimeoutError``)."""
        ...


@runtime_checkable
class WorkerRpcEngine(Protocol):
    """An engine whose weights live in worker processes that a trainer can join in a process group.

    Implemented by the vLLM engines (``VLLMEngine``, a vLLM server), also in a ``RayEngine``
    actor and behind an ``EngineRouter`` (``VLLMReplicas``). A push into the workers is the
    engine's own ``load_weights(GroupPush(...), version=)`` after
    :func:`~lmcollect.engines.weight_group.join_weight_group` (what ``vLLMUpdater`` calls): only
    the engines and :mod:`lmcollect.engines.weight_group` name the workers' methods.
    ``collective_rpc_each`` is how they fan out, and a hook for tests and benchmarks.
    """

    @property
    def num_replicas(self) -> int:
        """Engine replicas (each a tensor-parallel group of workers)."""
        ...

    def collective_rpc_each(
        self, method: str, args_per_replica: list[tuple], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``method`` on every worker of every replica, replica ``i`` with ``args_per_replica[i]``;
        returns every worker's answer (replica by replica)."""
        ...

    def load_weights(
        self, source: Iterable[tuple[str, torch.Tensor]] | GroupPush | LoraAdapter, *, version: int | PushVersion
    ) -> list[Any] | None:
        """:meth:`EngineProtocol.load_weights`, or, for a :class:`~lmcollect.engines.weight_group.GroupPush`,
        the workers receive the trainer's broadcast inside the load; returns their reports (replica by replica)."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt prefixes (after the workers' weights changed)."""
        ...


def engine_of(policy: Any) -> EngineProtocol | None:
    """The :class:`EngineProtocol` engine behind ``policy``: the policy itself (a continuous
    collector's engine) or its ``engine`` (an :class:`~lmcollect.policies.EnginePolicy`); else None."""
    for candidate in (policy, getattr(policy, "engine", None)):
        if isinstance(candidate, EngineProtocol):
            return candidate
    return None


def worker_rpc_engine_of(policy: Any) -> WorkerRpcEngine | None:
    """The :class:`WorkerRpcEngine` behind ``policy``: the policy itself (a continuous collector's
    engine) or its ``engine`` (a ``VLLMPolicy``); None when there is none."""
    for candidate in (policy, getattr(policy, "engine", None)):
        if isinstance(candidate, WorkerRpcEngine):
            return candidate
    return None
