"""What a weight push does to the keys/values engines hold, and what each push costs afterwards.

Two KV policies (``kv_policy=`` of the collectors and engines):

- ``"recompute"`` (the default, exact): a load drops every key/value computed with the old
  weights (the running requests' and the prefix cache), so each token after the push is a forward
  pass of the new weights over its whole context, as a trainer computes it. The price: every
  running dialog's context is prefilled again, and a dialog's next turn cannot reuse its cached
  prefix.
- ``"keep"`` (NeMo-RL's and prime-rl's choice): running requests go on over the keys/values they
  have, and a dialog's later turns may reuse the prefix cached for it under older weights (engines
  with a prefix cache salt it by the oldest version that computed the prefix, so a request reuses
  only keys/values whose version it records, and a GRPO group's siblings, first turns of one
  version, share their prompt's). A token after
  the push is then the new weights' answer over a context partly computed by old ones: each
  token records the oldest version that computed any key/value it attended to
  (``EngineResult.kv_versions``, the turn key ``("collector", "kv_versions")``), so a trainer can
  mask or correct those tokens.

:class:`PushCost` is one push's whole cost as an engine sees it: the call (pause, check, load,
resume) and the recompute it forced afterwards; :class:`PushCostMeter` keeps the recent ones.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

import torch

from lmcollect.engines.protocol import capabilities_of

logger = logging.getLogger(__name__)

__all__ = [
    "KV_POLICIES", "KVPolicy", "PushCost", "PushCostMeter", "check_kv_policy", "configure_kv_policy", "kv_versions_of",
    "push_costs_of",
]  # fmt: skip

KVPolicy = Literal["recompute", "keep"]
KV_POLICIES: tuple[KVPolicy, ...] = ("recompute", "keep")


def check_kv_policy(kv_policy: object, *, supported: tuple[str, ...] = KV_POLICIES, engine: str = "") -> KVPolicy:
    """``kv_policy`` if it is one of ``supported``; else a ``ValueError`` naming the argument and the choices."""
    if kv_policy not in KV_POLICIES:
        raise ValueError(f"kv_policy must be one of {list(KV_POLICIES)}, got {kv_policy!r}.")
    if kv_policy not in supported:
        raise ValueError(
            f"kv_policy={kv_policy!r}: {engine or 'this engine'} cannot keep keys/values across a weight load "
            f"(it supports {list(supported)}); use kv_policy='recompute', or collect with TransformersEngine "
            "or VLLMEngine, which keep."
        )
    return kv_policy


def configure_kv_policy(engine: object, kv_policy: object) -> KVPolicy:
    """Give ``engine`` the collector's ``kv_policy`` (``engine.set_kv_policy``); an engine whose
    capabilities lack ``sets_kv_policy`` recomputes, so it takes ``"recompute"`` and refuses
    ``"keep"`` naming the fix."""
    policy = check_kv_policy(kv_policy)
    if not capabilities_of(engine).sets_kv_policy:
        return check_kv_policy(kv_policy, supported=("recompute",), engine=type(engine).__name__)
    engine.set_kv_policy(policy)  # type: ignore[attr-defined]  # declared by sets_kv_policy
    return policy


def push_costs_of(engine: object) -> list[PushCost]:
    """``engine.push_costs()`` where the engine meters its loads (``meters_push_costs``), else an empty list."""
    if not capabilities_of(engine).meters_push_costs:
        return []
    return list(engine.push_costs())  # type: ignore[attr-defined]  # declared by meters_push_costs


def kv_versions_of(
    token_versions: torch.Tensor, *, kv_policy: KVPolicy, context_kv_version: int | None = None
) -> torch.Tensor:
    """int64 ``[n]``: for each generated token, the oldest weight version that computed a key/value it attended to.

    Under ``"recompute"`` a load drops every older key/value, so it is the token's own version.
    Under ``"keep"`` nothing is dropped: every token attends to the prompt's keys/values, computed
    when the request first ran (the first token's version) or, where the prompt reused a cached
    prefix, by that prefix's version (``context_kv_version``; None when nothing was reused), so the
    floor is the same for all the request's tokens.
    """
    versions = token_versions.to(torch.int64)
    if kv_policy == "recompute" or versions.numel() == 0:
        return versions.clone()
    floor = int(versions[0])
    if context_kv_version is not None:
        floor = min(floor, int(context_kv_version))
    return torch.full_like(versions, floor)


@dataclass(frozen=True, kw_only=True)
class PushCost:
    """One weight load as the engine saw it: the call, and the keys/values it made the engine compute again."""

    version: int
    """The version the load took."""
    kv_policy: str
    """The engine's KV policy then (``"keep"``: nothing is recomputed)."""
    call_s: float
    """Seconds of the load between two decoding steps (checks, copy, reload, cache reset)."""
    recomputed_tokens: int = 0
    """Tokens whose keys/values were computed again because this load dropped them (the running
    requests' prompts and tokens so far; with a prefix cache, also dialogs' later prompts that lost
    their cached prefix), counted as the engine computes them."""
    recompute_s: float = 0.0
    """Seconds of that recompute: the re-prefills timed (TransformersEngine), or the extra time of the
    first decoding step after the load over the median ordinary step (VLLMEngine)."""
    recompute_timed: bool = True
    """False where the engine cannot time its steps (vLLM's engine core in a process of its own):
    ``recompute_s`` is then 0 and only the tokens are counted."""
    # the timeline of the push, in order (0.0 where an engine has no such stage)
    copy_s: float = 0.0
    """Packing the weights into the engine's buffers, with the NaN/Inf check riding on the copy
    (one pass over each buffer right after it); before the wait: decoding goes on meanwhile."""
    wait_s: float = 0.0
    """Waiting for the decoding step under way to end (the step boundary the load lands on)."""
    load_s: float = 0.0
    """The load itself, decoding stopped: the workers read the buffers into the model."""
    reset_s: float = 0.0
    """Taking the version and, under ``"recompute"``, dropping the keys/values held (decoding stopped)."""
    first_step_s: float = 0.0
    """The first decoding step after the load (it prefills again what the load dropped), where
    requests were running; with vLLM's engine core in a process of its own, the wait for its outputs."""

    @property
    def stall_s(self) -> float:
        """Seconds no token was decoded because of this push: the load and the reset (``call_s``)."""
        return self.call_s

    @property
    def total_s(self) -> float:
        """The engine's part of the push from the caller's side: copy, wait, load and reset."""
        return self.copy_s + self.wait_s + self.call_s

    def as_metrics(self, prefix: str = "push") -> dict[str, float]:
        """Flat metric keys (``push/call_s`` ...), for loggers and tables."""
        return {
            f"{prefix}/call_s": self.call_s,
            f"{prefix}/copy_s": self.copy_s,
            f"{prefix}/wait_s": self.wait_s,
            f"{prefix}/load_s": self.load_s,
            f"{prefix}/reset_s": self.reset_s,
            f"{prefix}/first_step_s": self.first_step_s,
            f"{prefix}/recomputed_tokens": float(self.recomputed_tokens),
            f"{prefix}/recompute_s": self.recompute_s,
        }

    def timeline(self) -> str:
        """One line: each stage's milliseconds, in order, and the recompute it forced."""
        return (
            f"copy {self.copy_s * 1e3:.0f} ms, wait {self.wait_s * 1e3:.0f} ms, load {self.load_s * 1e3:.0f} ms, "
            f"reset {self.reset_s * 1e3:.0f} ms, first step {self.first_step_s * 1e3:.0f} ms, "
            f"{self.recomputed_tokens} tokens prefilled again in {self.recompute_s:.3f} s"
        )


class PushCostMeter:
    """The last ``keep`` pushes' :class:`PushCost`, the recompute added as the engine does it (thread-safe)."""

    def __init__(self, keep: int = 64) -> None:
        self._costs: deque[PushCost] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def loaded(
        self,
        *,
        version: int,
        kv_policy: str,
        call_s: float,
        timed: bool = True,
        copy_s: float = 0.0,
        wait_s: float = 0.0,
        load_s: float = 0.0,
        reset_s: float = 0.0,
    ) -> None:
        """A load took ``version`` in ``call_s`` seconds, its stages as :class:`PushCost` names them.
        The previous load's whole cost is logged (its recompute is done)."""
        cost = PushCost(
            version=version, kv_policy=kv_policy, call_s=call_s, recompute_timed=timed,
            copy_s=copy_s, wait_s=wait_s, load_s=load_s, reset_s=reset_s,
        )  # fmt: skip
        with self._lock:
            previous = self._costs[-1] if self._costs else None
            self._costs.append(cost)
        if previous is not None:
            logger.info(
                "push of version %d (kv_policy=%s): %s", previous.version, previous.kv_policy, previous.timeline()
            )

    def first_step(self, seconds: float, *, version: int) -> None:
        """The first decoding step after the load of ``version`` took ``seconds``."""
        with self._lock:
            for i in range(len(self._costs) - 1, -1, -1):
                if self._costs[i].version == version:
                    self._costs[i] = replace(self._costs[i], first_step_s=float(seconds))
                    return

    def recomputed(self, tokens: int, seconds: float, *, version: int | None = None) -> None:
        """``tokens`` computed again (in ``seconds``) because of the load of ``version`` (None: the latest)."""
        if tokens <= 0 and seconds <= 0:
            return
        with self._lock:
            for i in range(len(self._costs) - 1, -1, -1):
                cost = self._costs[i]
                if version is None or cost.version == version:
                    self._costs[i] = replace(
                        cost,
                        recomputed_tokens=cost.recomputed_tokens + int(tokens),
                        recompute_s=cost.recompute_s + max(0.0, float(seconds)),
                    )
                    return

    def costs(self) -> list[PushCost]:
        """The recent pushes, oldest first (the last one's recompute may still grow)."""
        with self._lock:
            return list(self._costs)

    @property
    def last(self) -> PushCost | None:
        with self._lock:
            return self._costs[-1] if self._costs else None
