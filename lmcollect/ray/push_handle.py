"""PushHandle and gather_refs: waiting on a push's calls into many collector actors, failing fast by worker."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from lmcollect.weight_sync.base import WeightPushError
from lmcollect.weights.delta import DeltaRejectedError

logger = logging.getLogger(__name__)


class PushHandle:
    """A push in flight (``push_weights(..., wait=False)``): :meth:`wait` returns once every
    targeted worker has applied the weights, and raises if one failed."""

    def __init__(
        self,
        refs: dict[int, Any],
        *,
        timeout_s: float | None,
        on_done: Callable[[], None] | None = None,
        repair: Callable[[list[int]], dict[int, Any]] | None = None,
        on_settled: Callable[[bool, list[int]], None] | None = None,
    ) -> None:
        self._refs = refs
        self._timeout_s = timeout_s
        self._on_done = on_done
        self._repair = repair  # a full push to the workers that refused a delta
        self._on_settled = on_settled  # (applied everywhere?, workers repaired)
        self._error: BaseException | None = None
        self._finished = not refs
        self._reported = False
        if self._finished:
            if on_settled is not None:
                on_settled(True, [])
            if on_done is not None:
                on_done()

    @property
    def worker_ids(self) -> list[int]:
        """The workers this push updates (skipped workers are not in it)."""
        return sorted(self._refs)

    def done(self) -> bool:
        """True when every targeted worker has answered (applied, or failed)."""
        if self._finished:
            return True
        refs = list(self._refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every targeted worker applied the push (None: the updater's timeout_s)."""
        self._reported = True
        self._wait(self._timeout_s if timeout_s is None else timeout_s)

    def settle(self) -> None:
        """Wait for the push; raise its error only if nobody has seen it yet."""
        try:
            self._wait(self._timeout_s)
        except Exception:
            if self._reported:
                logger.info("an earlier push failed (already reported); pushing the next one")
                return
            self._reported = True
            raise

    def _wait(self, timeout_s: float | None) -> None:
        if self._error is not None:
            raise self._error
        if self._finished:
            return
        repaired: list[int] = []
        try:
            tolerate = DeltaRejectedError if self._repair is not None else None
            results = gather_refs(self._refs, what="apply the weights", timeout_s=timeout_s, tolerate=tolerate)
            repaired = sorted(i for i, result in results.items() if isinstance(result, DeltaRejectedError))
            if repaired:
                assert self._repair is not None, "refusals are tolerated only by a push that can repair them"
                logger.info(
                    "worker(s) %s refused the delta push (%s); sending them a full push", repaired, results[repaired[0]]
                )
                gather_refs(
                    self._repair(repaired), what="apply a full push after refusing a delta", timeout_s=timeout_s
                )
        except Exception as exc:
            self._error = exc
            if self._on_settled is not None:
                self._on_settled(False, repaired)
            raise
        self._finished = True
        if self._on_settled is not None:
            self._on_settled(True, repaired)
        if self._on_done is not None:
            self._on_done()


def gather_refs(
    refs: dict[int, Any], *, what: str, timeout_s: float | None, tolerate: type[Exception] | None = None
) -> dict[int, Any]:
    """worker -> result of each ref; fails fast, naming the worker, if one died, raised or timed out.
    A worker raising ``tolerate`` gets that exception as its result instead."""
    worker_of = {ref: worker for worker, ref in refs.items()}
    results: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs.values())
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            late = sorted(worker_of[r] for r in pending)
            raise WeightPushError(
                f"worker(s) {late} did not {what} within timeout_s={timeout_s}; they may be hung "
                "or overloaded. Raise PushConfig(timeout_s=...) if they are only slow."
            )
        for ref in ready:
            results[worker_of[ref]] = _get(ref, worker_of[ref], what, tolerate)
    return results


def _get(ref: Any, worker: int, what: str, tolerate: type[Exception] | None = None) -> Any:
    try:
        return ray.get(ref)
    except RayActorError as exc:
        raise WeightPushError(f"worker {worker} died before it could {what}: {_first_line(exc)}") from exc
    except RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, Exception) else exc
        if tolerate is not None and isinstance(cause, tolerate):
            return cause
        if isinstance(cause, (ValueError, TypeError)):
            kind = ValueError if isinstance(cause, ValueError) else TypeError
            raise kind(f"worker {worker} rejected the push: {cause}") from exc
        raise WeightPushError(f"worker {worker} failed to {what}: {cause!r}") from exc


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__
