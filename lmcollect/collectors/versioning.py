"""Policy versions: a counter (or uuid) bumped on every applied weight update."""

from __future__ import annotations

import threading
import uuid
from typing import Any, Literal

from lmcollect.weights.version import PushVersion


class PolicyVersion:
    """The version of the weights a policy generates with.

    ``version_type="int"`` counts 0, 1, 2, ...; ``"uuid"`` draws a fresh uuid4 string on every
    increment. Either way :attr:`index` counts increments, so versions can be compared.
    """

    def __init__(self, version_type: Literal["int", "uuid"] = "int") -> None:
        if version_type not in ("int", "uuid"):
            raise ValueError(f"version_type must be 'int' or 'uuid', got {version_type!r}.")
        self.version_type = version_type
        self._lock = threading.Lock()
        self.index = 0
        self._uuid = str(uuid.uuid4())
        self._pushed = False  # whether index and uuid are a push's (else drawn here)

    @property
    def version_uuid(self) -> str:
        """The uuid of the current version (what ``"uuid"`` collectors report)."""
        return self._uuid

    @property
    def version(self) -> int | str:
        return self.index if self.version_type == "int" else self._uuid

    def increment(self) -> int | str:
        with self._lock:
            self.index += 1
            self._uuid = str(uuid.uuid4())
            self._pushed = False
            return self.version

    def set(self, pushed: PushVersion) -> int | str:
        """Take the version of an applied push (never goes back: a lower one raises ValueError)."""
        with self._lock:
            self.check(pushed)
            self.index = pushed.index
            self._uuid = pushed.uuid
            self._pushed = True
            return self.version

    def adopt_index(self, index: int) -> None:
        """Count on from ``index`` (weights an engine already held, with no push's uuid to take)."""
        with self._lock:
            if index > self.index:
                self.index, self._uuid, self._pushed = index, str(uuid.uuid4()), False

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
        if pushed.index == self.index and self._pushed and pushed.uuid != self._uuid:
            raise ValueError(
                f"pushed version {pushed.index} has uuid {pushed.uuid!r}, but this collector already holds version "
                f"{self.index} of another push (uuid {self._uuid!r}); push with a higher version, or leave version=None."
            )

    def state_dict(self) -> dict:
        return {"version_type": self.version_type, "index": self.index, "uuid": self._uuid, "pushed": self._pushed}

    def load_state_dict(self, state: dict) -> None:
        self.version_type = state["version_type"]
        self.index = int(state["index"])
        self._uuid = state["uuid"]
        self._pushed = bool(state.get("pushed", False))

    def __repr__(self) -> str:
        return f"PolicyVersion(version_type={self.version_type!r}, version={self.version!r})"


def make_policy_version(track_policy_version: bool | PolicyVersion, *, engine: Any = None) -> PolicyVersion | None:
    """Resolve the collector's ``track_policy_version`` argument.

    ``engine``: the engine the collector generates with (lockstep or continuous), if any. When it
    already holds pushed weights (an earlier collector's), the version counts on from them, so turns
    and their tokens carry one consistent version and the next push is newer than what the engine holds.
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
    if version is not None and engine is not None and engine.version > version.index:
        version.adopt_index(engine.version)
    return version
