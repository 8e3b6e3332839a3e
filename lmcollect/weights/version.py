"""The version a weight push carries (assigned by the trainer side, taken by every receiver)."""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal


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


class VersionCounter:
    """The version of the weights held: an index that only goes up, the uuid of that version, and
    whether both are a push's. One counter is shared by an engine and the collector that drives it,
    so the version the engine labels its tokens with is the one the collector reports.

    ``index`` starts at ``start`` (engines: -1 before any load; collectors: 0, the starting weights).
    """

    def __init__(self, start: int = -1) -> None:
        self._lock = threading.Lock()
        self.index = start
        self.uuid = str(uuid.uuid4())
        self.pushed = False  # whether index and uuid are a push's (else drawn here)

    def __getstate__(self) -> dict[str, Any]:  # a copy gets a lock of its own
        return {"index": self.index, "uuid": self.uuid, "pushed": self.pushed}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self.index, self.uuid, self.pushed = int(state["index"]), str(state["uuid"]), bool(state["pushed"])

    def increment(self) -> int:
        """One version more, under a fresh uuid (weights changed with no push's label)."""
        with self._lock:
            self.index, self.uuid, self.pushed = self.index + 1, str(uuid.uuid4()), False
            return self.index

    def set(self, pushed: PushVersion) -> None:
        """Take the version of an applied push (never goes back: a lower one raises ValueError)."""
        with self._lock:
            self.check(pushed)
            self.index, self.uuid, self.pushed = pushed.index, pushed.uuid, True

    def take(self, version: int | PushVersion) -> None:
        """Take a loaded version: a push's (index and uuid) or a bare index (a fresh uuid unless it is
        the index held). Engines call it under the lock that orders their loads, after refusing stale ones."""
        if isinstance(version, PushVersion):
            with self._lock:
                self.index, self.uuid, self.pushed = version.index, version.uuid, True
            return
        with self._lock:
            if version != self.index:
                self.index, self.uuid, self.pushed = version, str(uuid.uuid4()), False

    def adopt(self, other: VersionCounter) -> None:
        """Take ``other``'s state (index, uuid, pushed)."""
        with self._lock:
            self.index, self.uuid, self.pushed = other.index, other.uuid, other.pushed

    def check(self, pushed: PushVersion) -> None:
        """Raise the ValueError :meth:`set` would, without changing anything.

        Versions only go up. The same push again (same index and uuid) is taken; another push
        under the index of a push already held is refused: two pushes cannot share a label. A
        version drawn here (the starting weights, ``increment``) may be relabelled by a push.
        """
        if pushed.index < self.index:
            raise ValueError(
                f"pushed version {pushed.index} is older than this collector's version {self.index}; "
                "versions only go up (push with a higher version, or leave version=None)."
            )
        if pushed.index == self.index and self.pushed and pushed.uuid != self.uuid:
            raise ValueError(
                f"pushed version {pushed.index} has uuid {pushed.uuid!r}, but this collector already holds version "
                f"{self.index} of another push (uuid {self.uuid!r}); push with a higher version, or leave version=None."
            )


def version_index(version: int | PushVersion) -> int:
    """The index of a version given to ``load_weights`` (a bare index or a push's version)."""
    return version.index if isinstance(version, PushVersion) else version


class PolicyVersion:
    """The version of the weights a policy generates with.

    ``version_type="int"`` counts 0, 1, 2, ...; ``"uuid"`` draws a fresh uuid4 string on every
    increment. Either way :attr:`index` counts increments, so versions can be compared.

    It reads a :class:`~lmcollect.weights.version.VersionCounter`: its own, or the one of the engine
    the collector generates with (:func:`make_policy_version`), so the engine's loads are the
    collector's versions with no copying between the two.
    """

    def __init__(self, version_type: Literal["int", "uuid"] = "int") -> None:
        if version_type not in ("int", "uuid"):
            raise ValueError(f"version_type must be 'int' or 'uuid', got {version_type!r}.")
        self.version_type = version_type
        self.counter = VersionCounter(start=0)

    @property
    def index(self) -> int:
        """The version as a counter (also for uuid versions)."""
        return self.counter.index

    @property
    def version_uuid(self) -> str:
        """The uuid of the current version (what ``"uuid"`` collectors report)."""
        return self.counter.uuid

    @property
    def version(self) -> int | str:
        return self.counter.index if self.version_type == "int" else self.counter.uuid

    def increment(self) -> int | str:
        self.counter.increment()
        return self.version

    def set(self, pushed: PushVersion) -> int | str:
        """Take the version of an applied push (never goes back: a lower one raises ValueError)."""
        self.counter.set(pushed)
        return self.version

    def check(self, pushed: PushVersion) -> None:
        """Raise the ValueError :meth:`set` would, without changing anything (see :meth:`VersionCounter.check`)."""
        self.counter.check(pushed)

    def share(self, counter: VersionCounter) -> None:
        """Read ``counter`` from now on (an engine's). The newer of the two versions is kept: an
        engine that loaded weights before keeps them; one that loaded none (or older) takes this
        version; an engine's ``-1`` (nothing loaded) becomes this collector's starting 0."""
        if self.counter.index > counter.index:
            counter.adopt(self.counter)
        self.counter = counter

    def shares(self, counter: VersionCounter | None) -> bool:
        """Whether this version reads ``counter``."""
        return counter is not None and self.counter is counter

    def state_dict(self) -> dict:
        counter = self.counter
        return {
            "version_type": self.version_type,
            "index": counter.index,
            "uuid": counter.uuid,
            "pushed": counter.pushed,
        }

    def load_state_dict(self, state: dict) -> None:
        self.version_type = state["version_type"]
        self.counter.__setstate__(
            {"index": state["index"], "uuid": state["uuid"], "pushed": state.get("pushed", False)}
        )

    def __repr__(self) -> str:
        return f"PolicyVersion(version_type={self.version_type!r}, version={self.version!r})"
