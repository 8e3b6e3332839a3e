"""Version and batch-size accessors shared by the synchronous and the continuous collector."""

from __future__ import annotations

import logging

from lmcollect.collectors.shared.config import ConfiguredCollector
from lmcollect.collectors.shared.versioning import PolicyVersion

logger = logging.getLogger(__name__)


class CollectorVersionMixin(ConfiguredCollector):
    """The policy-version and turn-budget accessors of a collector.

    The host sets ``config``, ``_policy_version`` (a :class:`PolicyVersion` or None when versions
    are not tracked) and ``_shut_down``.
    """

    _policy_version: PolicyVersion | None
    _shut_down: bool

    def _version(self) -> tuple[int | str, int]:
        """(version, index) stamped on every turn; (-1, 0) when versions are not tracked."""
        if self._policy_version is None:
            return -1, 0
        return self._policy_version.version, self._policy_version.index

    @property
    def policy_version(self) -> int | str | None:
        """The current policy version, or None if version tracking is disabled."""
        return None if self._policy_version is None else self._policy_version.version

    def get_policy_version(self) -> int | str | None:
        """The current policy version (a method, for calls through a Ray actor)."""
        return self.policy_version

    def version_index(self) -> int:
        """The version as a counter (also for uuid versions; 0 when versions are not tracked)."""
        return 0 if self._policy_version is None else self._policy_version.index

    def increment_version(self) -> None:
        """Bump the policy version; turns collected from now on carry the new one.

        With ``track_policy_version=False`` nothing changes: turns stay "untracked" (-1).
        """
        if self._policy_version is None:
            logger.debug("increment_version(): versions are not tracked (track_policy_version=False)")
            return
        self._policy_version.increment()

    def is_initialized(self) -> bool:
        """True once the collector is built and not shut down."""
        return not self._shut_down
