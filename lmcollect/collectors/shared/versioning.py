"""A collector's policy version: built from its ``track_policy_version`` argument, reading its engine's counter."""

from __future__ import annotations

from typing import Any

from lmcollect.engines.protocol import version_counter_of
from lmcollect.weights.version import PolicyVersion

__all__ = ["PolicyVersion", "make_policy_version"]


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
    counter = version_counter_of(engine)
    if version is not None and counter is not None:
        version.share(counter)
    return version
