"""Policy versions: a counter (or uuid) bumped on every applied weight update."""

from __future__ import annotations

from typing import Any, Literal

from lmcollect.weights.version import PushVersion, VersionCounter


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


def make_policy_version(track_policy_version: bool | PolicyVersion, *, engine: Any = None) -> PolicyVersion | None:
    """Resolve the collector's ``track_policy_version`` argument.

    ``engine``: the engine the collector generates with (lockstep or continuous), if any. The
    version then reads the engine's counter (:meth:`PolicyVersion.share`): the engine's loads are
    the collector's versions, and one that already holds pushed weights (an earlier collector's)
    keeps them, so turns and their tokens carry one consistent version.
    """
    if isinstance(track_policy_version, PolicyVersion):
        version: PolicyVersion | None = track_policy_version
    elif isinstance(track_policy_version, bool):
        version = PolicyVersion() if track_policy_version else None
    else:
        raise TypeError(
            "track_policy_version must be a bool or a PolicyVersion instance, "
            f"got {type(track_policy_version).__name__}."
        )
    counter = getattr(engine, "version_counter", None)
    if version is not None and isinstance(counter, VersionCounter):
        version.share(counter)
    return version
