"""The KV policy's bookkeeping for :class:`~lmcollect.engines.vllm.engine.VLLMEngine` (pure Python, no vLLM).

vLLM holds the keys/values; this keeps what the engine needs to say about them: each request's
cache salt (under ``"keep"``, the oldest version that may have computed the prefix it reuses: its
dialog's ``context_kv_version``, or the version now for a first turn, so a GRPO group's siblings
share their prompt's keys/values and a prefix is reused only by requests that record its version),
the ``kv_versions`` of its result, and each push's recompute (:class:`~lmcollect.engines.kv_policy.PushCost`):
the running requests' contexts prefilled again after a ``"recompute"`` load (counted from each
finished request's token versions, timed as the extra time of the first step after the load over
the median of the steps before it; with the engine core in a process of its own, ``step()`` only
collects outputs and this time is a lower bound),
and the prefixes a dialog's next turn could no longer reuse.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

import torch

from lmcollect.engines.kv_policy import KVPolicy, PushCost, PushCostMeter, kv_versions_of
from lmcollect.engines.protocol import EngineRequest, EngineResult

__all__ = ["RequestKV", "VLLMKVBook"]

_MAX_DIALOGS = 4096  # dialogs whose last context length is remembered (for the prefix each push costs)
_RECENT_STEPS = 16  # ordinary steps whose median time is the baseline of the first step after a load


@dataclass(frozen=True)
class RequestKV:
    """What the book keeps of one running request."""

    kv_policy: KVPolicy
    prompt_len: int
    dialog: str | None
    salt_version: int | None  # the version its cache salt names (None: no salt, under "recompute")
    added_version: int


class VLLMKVBook:
    """Cache salts, ``kv_versions`` and push costs of one vLLM engine (decoding thread only, but ``costs()``)."""

    def __init__(self, kv_policy: KVPolicy, *, timed_steps: bool = True) -> None:
        self.kv_policy = kv_policy
        self.timed_steps = timed_steps  # False: step() only collects the outputs of another process's steps
        self.meter = PushCostMeter()
        self._requests: dict[str, RequestKV] = {}
        self._dialog_context: OrderedDict[str, tuple[int, int]] = OrderedDict()  # dialog -> (version, tokens)
        self._recent_steps: deque[float] = deque(maxlen=_RECENT_STEPS)  # seconds of the last ordinary steps
        self._timed_load: int | None = None  # the load whose first step's extra time is its recompute
        self._first_step_of: int | None = None  # the load whose first step is timed next

    # ------------------------------------------------------------------ requests
    def added(self, request_id: str, request: EngineRequest, *, version: int) -> str | None:
        """Remember a request vLLM just took; its cache salt (None: share the prefix cache).

        Under ``"keep"`` the salt is a version ``s``: the oldest that computed the request's context
        (its dialog's ``context_kv_version``; the version now for a first turn). Every block cached
        under ``s`` was computed by a request added at version ``s`` or later, so a request that
        reuses one records ``s`` as the floor of its ``kv_versions``: KV of another version is never
        reused unrecorded, and requests of one version (a group's siblings) share their prompt."""
        salt_version = None
        if self.kv_policy == "keep":
            context = request.context_kv_version
            salt_version = version if context is None else min(context, version)
        self._requests[request_id] = RequestKV(
            kv_policy=self.kv_policy,
            prompt_len=len(request.prompt_ids),
            dialog=request.affinity,
            salt_version=salt_version,
            added_version=version,
        )
        # "recompute": the cache holds only the current version's prefixes (a load empties it)
        return None if salt_version is None else f"kv-version:{salt_version}"

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def finished(self, request_id: str, result: EngineResult, *, num_cached: int) -> EngineResult:
        """``result`` with its ``kv_versions`` and cached prompt tokens; what a push made it recompute is counted."""
        info = self._requests.pop(request_id, None)
        if info is None:
            return result
        context = info.salt_version if num_cached > 0 else None
        kv = kv_versions_of(result.token_versions, kv_policy=info.kv_policy, context_kv_version=context)
        if info.kv_policy == "recompute":
            self._count_recompute(info, result.token_versions, num_cached)
        self._remember_context(info, result)
        return replace(result, kv_versions=kv, num_cached_prompt_tokens=int(num_cached))

    def _count_recompute(self, info: RequestKV, versions: torch.Tensor, num_cached: int) -> None:
        """The contexts the loads inside this request dropped, and the prefix its dialog lost to a load."""
        changes = (versions[1:] != versions[:-1]).nonzero().flatten().tolist()
        for index in changes:  # a load before token index + 1: prompt and tokens so far computed again
            self.meter.recomputed(info.prompt_len + index + 1, 0.0, version=int(versions[index + 1]))
        previous = self._dialog_context.get(info.dialog) if info.dialog is not None else None
        if previous is not None and previous[0] < info.added_version:
            lost = max(0, min(previous[1], info.prompt_len) - num_cached)
            self.meter.recomputed(lost, lost * self._seconds_per_token(info.added_version), version=info.added_version)

    def _remember_context(self, info: RequestKV, result: EngineResult) -> None:
        if info.dialog is None:
            return
        last_version = int(result.token_versions[-1]) if result.token_versions.numel() else info.added_version
        self._dialog_context[info.dialog] = (last_version, info.prompt_len + result.tokens.numel())
        self._dialog_context.move_to_end(info.dialog)
        while len(self._dialog_context) > _MAX_DIALOGS:
            self._dialog_context.popitem(last=False)

    def _seconds_per_token(self, version: int) -> float:
        """The rate of the recompute measured after the load of ``version`` (0 when none was measured)."""
        for cost in reversed(self.meter.costs()):
            if cost.version == version:
                return cost.recompute_s / cost.recomputed_tokens if cost.recomputed_tokens else 0.0
        return 0.0

    # ------------------------------------------------------------------ loads and steps
    def loaded(self, *, version: int, call_s: float, running: int, **timeline: float) -> None:
        """A load took ``version`` (``timeline``: its stages, see :class:`PushCost`); with requests
        running the next step is the push's first step, and under ``"recompute"`` its extra time is
        the recompute."""
        self.meter.loaded(version=version, kv_policy=self.kv_policy, call_s=call_s, timed=self.timed_steps, **timeline)
        self._timed_load = version if self.kv_policy == "recompute" and running and self.timed_steps else None
        self._first_step_of = version if running else None

    def step_started(self) -> float:
        return time.perf_counter()

    def step_ended(self, started: float, *, admitted: bool) -> None:
        """One decoding step's time: the first after a load counts its extra time over the median of the
        recent ordinary steps (it re-prefills every running request); a step that ``admitted`` new
        requests prefills them too and is no baseline."""
        seconds = time.perf_counter() - started
        if self._first_step_of is not None:
            self.meter.first_step(seconds, version=self._first_step_of)
            self._first_step_of = None
        if self._timed_load is not None:
            baseline = statistics.median(self._recent_steps) if self._recent_steps else 0.0
            self.meter.recomputed(0, seconds - baseline, version=self._timed_load)
            self._timed_load = None
            return
        if not admitted:
            self._recent_steps.append(seconds)

    def costs(self) -> list[PushCost]:
        return self.meter.costs()
