"""A small readers-writer lock: many policy calls at once, or one weight update alone."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

DEFAULT_TIMEOUT_S = 600.0


class LockTimeoutError(TimeoutError):
    """A side of the policy lock waited longer than its bound (a turn or a weight load that never ends)."""


class ReadWriteLock:
    """Policy calls take the read side; loading weights takes the write side.

    A waiting writer blocks new readers, so a weight update waits at most for the policy
    calls already under way (one turn), never for a whole batch. Neither side waits longer than
    ``timeout_s``: a hung turn or load raises :class:`LockTimeoutError` naming ``knob`` (the
    setting of the lock's owner that raises the bound) instead of blocking forever.
    """

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, knob: str = "timeout_s") -> None:
        self.timeout_s = timeout_s
        self.knob = knob
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            self._wait_until(lambda: not (self._writing or self._writers_waiting), "a policy call", "a weight load")
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                self._wait_until(
                    lambda: not (self._writing or self._readers), "a weight load", "the policy calls under way"
                )
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # readers held back by this writer may go if it gave up
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()

    @property
    def num_writers_waiting(self) -> int:
        """Weight loads waiting for the policy calls under way."""
        return self._writers_waiting

    def _wait_until(self, ready, who: str, whom: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeoutError(
                    f"{who} waited over {self.knob}={self.timeout_s} s for {whom} (one that never ends?); "
                    f"raise {self.knob} if turns or loads really take that long."
                )
            self._cond.wait(left)
