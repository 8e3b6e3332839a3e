"""The version a weight push carries (assigned by the trainer side, taken by every receiver)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PushVersion:
    """The version a weight push carries, assigned on the trainer side (one per push).

    Every collector that applies the push takes it, so collectors holding the same weights report
    the same version, and one that skipped pushes reports the older one.
    """

    index: int
    """Monotonic counter: 1 for the first push, then up (or what ``push_weights(version=N)`` set)."""
    uuid: str = field(default_factory=lambda: str(uuid.uuid4()))
    """What collectors with ``PolicyVersion("uuid")`` report for this push."""

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"a pushed version must be an int >= 0, got {self.index!r}.")
