"""Drives env runners: in lockstep in the caller's thread, or one thread per env (async_envs)."""
from __future__ import annotations

import queue
import threading

from lmcollect.collectors.batcher import CollectedTurn
from lmcollect.collectors.env_runner import EnvRunner


class SyncRunners:
    """One env, stepped in the caller's thread."""

    def __init__(self, runners: list[EnvRunner]) -> None:
        self.runners = runners

    def next_turns(self) -> list[CollectedTurn]:
        return [turn for runner in self.runners for turn in runner.step()]

    def start_stepping(self) -> None:
        """Nothing runs ahead in lockstep mode."""

    def stop_stepping(self) -> None:
        """Nothing runs ahead in lockstep mode."""

    def close(self) -> None:
        """No threads to stop."""


class AsyncRunners:
    """Each env steps in its own thread while stepping is on; turns arrive in completion order.

    A step already under way when stepping is turned off finishes, and its turns are kept for
    the next call, so nothing is lost.
    """

    def __init__(self, runners: list[EnvRunner]) -> None:
        self.runners = runners
        self._turns: queue.Queue[list[CollectedTurn] | BaseException] = queue.Queue()
        self._go = threading.Event()
        self._closed = threading.Event()
        self._idle = [threading.Event() for _ in runners]
        for event in self._idle:
            event.set()
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"lmcollect-env-{i}", daemon=True)
            for i in range(len(runners))
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, i: int) -> None:
        while not self._closed.is_set():
            if not self._go.wait(timeout=0.1):
                continue
            self._idle[i].clear()
            try:
                if self._go.is_set() and not self._closed.is_set():
                    self._turns.put(self.runners[i].step())
            except BaseException as exc:  # designed: hand the error to the collector's thread
                self._go.clear()
                self._turns.put(exc)
            finally:
                self._idle[i].set()

    def next_turns(self) -> list[CollectedTurn]:
        self.start_stepping()
        item = self._turns.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def start_stepping(self) -> None:
        self._go.set()

    def stop_stepping(self) -> None:
        """Stop starting new steps and wait for those under way (at most one turn each)."""
        self._go.clear()
        for event in self._idle:
            event.wait()

    def close(self) -> None:
        self._go.clear()
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=60)
