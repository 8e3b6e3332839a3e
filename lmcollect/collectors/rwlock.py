"""A small readers-writer lock: many policy calls at once, or one weight update alone."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class ReadWriteLock:
    """Policy calls take the read side; loading weights takes the write side.

    A waiting writer blocks new readers, so a weight update waits at most for the policy
    calls already under way (one turn), never for a whole batch.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextlib.contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
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
            while self._writing or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
