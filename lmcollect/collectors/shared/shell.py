"""What every collector shares around its scheduler: iteration, ``start()`` into a replay buffer,
``pause()``, shutdown, the context manager and attribute access.

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

from lmcollect.collectors.shared.config import CollectionConfig
from lmcollect.plumbing import ShutsDownOnExit

logger = logging.getLogger(__name__)


class CollectorShell(ShutsDownOnExit):
    """The lifecycle half of a collector (a mixin: the collector's ``__init__`` calls :meth:`_init_shell`)."""

    envs: list[Any]

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
