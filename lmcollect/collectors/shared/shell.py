"""What every collector shares around its scheduler: iteration, ``start()`` into a replay buffer,
``pause()``, shutdown, the context manager, attribute access, the policy-version accessors and
dynamic sampling's counts (one base class, so a collector names two or three bases, not five).

A collector (lockstep :class:`~lmcollect.collectors.LLMCollector` or continuous
:class:`~lmcollect.collectors.ContinuousLLMCollector`) supplies the scheduler: ``next()``, the
background loop ``_run_in_background()``, ``pause_begin``/``pause_end`` and ``_stop_scheduler``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from tensordict import TensorDictBase

from lmcollect.collectors.shared.config import CollectionConfig, ConfiguredCollector
from lmcollect.collectors.shared.group_filter import GroupTally, SamplingCounts
from lmcollect.collectors.shared.versioning import PolicyVersion
from lmcollect.plumbing import ShutsDownOnExit

logger = logging.getLogger(__name__)


class CollectorShell(ConfiguredCollector, ShutsDownOnExit):
    """The lifecycle half of a collector (a base: the collector's ``__init__`` calls :meth:`_init_shell`).

    The collector sets ``_policy_version`` (a :class:`PolicyVersion`, or None when versions are not
    tracked) and says where its dynamic sampling tally is (:meth:`_sampling_tally`).
    """

    envs: list[Any]
    _policy_version: PolicyVersion | None

    def _init_shell(self, config: CollectionConfig, *, thread_name: str) -> None:
        self.config = config
        self.postproc = config.postproc
        self.replay_buffer = config.replay_buffer
        self.verbose = config.verbose
        self._shut_down = False
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        self._thread_name = thread_name

    # ------------------------------------------------------------------ iteration
    def next(self) -> TensorDictBase | None:
        raise NotImplementedError

    def iterator(self) -> Iterator[TensorDictBase | None]:
        """Yields batches until total_dialog_turns have run."""
        while True:
            try:
                yield self.next()
            except StopIteration:
                return

    def __iter__(self) -> Iterator[TensorDictBase | None]:
        return self.iterator()

    def _raise_if_unusable(self) -> None:
        if self._shut_down:
            raise RuntimeError("this collector was shut down; build a new one to collect again.")
        if self._background is not None and self._background.is_alive():
            raise RuntimeError(
                "the collector is collecting into its replay buffer in the background (start()); call shutdown() first."
            )

    # ------------------------------------------------------------------ background collection
    def start(self) -> None:
        """Collect into the replay buffer from a background thread until total_dialog_turns."""
        if self.replay_buffer is None:
            raise ValueError("start() writes into a replay buffer: pass replay_buffer=... to the collector.")
        self._raise_if_unusable()
        self._before_start()
        self._background = threading.Thread(target=self._guarded_background, name=self._thread_name, daemon=True)
        self._background.start()

    def _before_start(self) -> None:
        """Reset what the background loop reads (a collector restarted after shutdown() cannot start)."""

    def _run_in_background(self) -> None:
        raise NotImplementedError

    def _write_to_buffer(self, batch: TensorDictBase) -> None:
        """``replay_buffer.extend(batch)``, from the background loop (start() checked there is a buffer)."""
        assert self.replay_buffer is not None, "start() checks that there is a replay buffer"
        self.replay_buffer.extend(batch)

    def _guarded_background(self) -> None:
        try:
            self._run_in_background()
        except BaseException as exc:  # designed: surfaced by is_running() / pause() / shutdown()
            logger.exception("background collection failed")
            self._background_error = exc

    def is_running(self) -> bool:
        """True while start()'s thread collects; re-raises the error that stopped it, if any."""
        self._raise_background_error()
        return self._background is not None and self._background.is_alive()

    def _raise_background_error(self) -> None:
        if self._background_error is not None:
            error, self._background_error = self._background_error, None
            raise RuntimeError(f"background collection failed: {error!r}") from error

    # ------------------------------------------------------------------ pause
    @contextlib.contextmanager
    def pause(self, timeout_s: float = 600.0) -> Iterator[None]:
        """Context manager: no turn starts inside it; the turns under way finish first and are kept."""
        try:
            self.pause_begin(timeout_s)
            yield
        finally:
            self.pause_end()

    def pause_begin(self, timeout_s: float = 600.0) -> None:
        raise NotImplementedError

    def pause_end(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Stop collecting (the turns under way finish, up to ``timeout`` s), keep every finished
        turn, and close the envs. Safe to call twice."""
        if self._shut_down:
            return
        self._stop_scheduler(timeout)
        for env in self.envs:
            close = getattr(env, "close", None)
            if callable(close):
                close()
        self._shut_down = True
        if self._background_error is not None:
            logger.warning("background collection had failed: %r", self._background_error)

    def _stop_scheduler(self, timeout: float | None) -> None:
        """Stop the background thread and the scheduler; keep what finished."""
        raise NotImplementedError

    def _join_background(self, timeout: float | None) -> None:
        if self._background is not None:
            self._background.join(timeout)

    def async_shutdown(self, timeout: float | None = None) -> None:
        """Shut down; waits at most ``timeout`` seconds for the background thread."""
        self.shutdown(timeout=timeout)

    # ------------------------------------------------------------------ attribute access
    def getattr_rb(self, attr: str) -> Any:
        if self.replay_buffer is None:
            raise AttributeError("this collector has no replay_buffer; pass replay_buffer=... to use getattr_rb.")
        return getattr(self.replay_buffer, attr)

    # ------------------------------------------------------------------ policy version
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

    # ------------------------------------------------------------------ dynamic sampling
    def _sampling_tally(self) -> GroupTally | None:
        raise NotImplementedError

    @property
    def sampling_counts(self) -> SamplingCounts | None:
        """Dynamic sampling's counts since the collector began (None without ``dynamic_sampling``):
        groups generated, kept and dropped by reason, tokens generated and delivered. A state from
        :meth:`state_dict` carries them; ``.as_metrics()`` gives logger keys."""
        tally = self._sampling_tally()
        return None if tally is None else tally.total

    @property
    def last_batch_counts(self) -> SamplingCounts | None:
        """The same counts for the last batch released: what happened between the batch before it and it."""
        tally = self._sampling_tally()
        return None if tally is None else tally.last_batch
