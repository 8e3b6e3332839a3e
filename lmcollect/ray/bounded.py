"""Ray calls that wait a bounded time: a hung actor raises an error naming the call and its knob."""

from __future__ import annotations

from typing import Any

DEFAULT_CALL_TIMEOUT_S = 300.0


class CallTimeoutError(TimeoutError):
    """A call into an actor got no answer within its bound (the actor may be hung or overloaded)."""


def get_within(refs: Any, *, timeout_s: float | None, call: str, knob: str) -> Any:
    """``ray.get(refs)`` for at most ``timeout_s`` seconds (None: no bound, for calls that must
    run as long as the work they start). Past it, :class:`CallTimeoutError` names ``call`` (what
    was asked, e.g. ``"RayReplayBuffer.sample"``) and ``knob`` (the setting that raises the bound)."""
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as exc:
        raise CallTimeoutError(
            f"{call} got no answer within {knob}={timeout_s} s: the actor may be hung or overloaded "
            f"(raise {knob} if it is only slow)."
        ) from exc
