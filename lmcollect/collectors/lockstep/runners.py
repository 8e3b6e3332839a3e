"""Drives env runners: in lockstep in the caller's thread, or one thread per env (async_envs)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from lmcollect.collectors.lockstep.env_runner import EnvRunner
from lmcollect.collectors.shared.batcher import CollectedTurn


class SyncRunners:
    """One env, stepped in the caller's thread."""

    def __init__(self, runners: list[EnvRunner]) -> None:
        self.runners = runners

    def next_turns(self) -> list[CollectedTurn]:
        return [turn for runner in self.runners for turn in runner.step()]

    def take_pending(self) -> list[CollectedTurn]:
        """Nothing runs ahead in lockstep mode."""
        return []

    def start_stepping(self) -> None:
        """Nothing runs ahead in lockstep mode."""

    def stop_stepping(self) -> None:
        """Nothing runs ahead in lockstep mode."""

    def close(self) -> None:
        """No threads to stop."""


class AsyncRunners:
    """Each env steps in its own thread while stepping is on; turns arrive in completion order.

    A step already under way when stepping is turned off finishes, and its turns are kept for
    :meth:`take_pending`, so nothing is lost. ``may_step(i, steps_started)`` is asked before env
    ``i`` starts a step (``steps_started`` counts its steps so far): it keeps a thread from running
    ahead of what the collector will yield.
    """

    def __init__(self, runners: list[EnvRunner], may_step: Callable[[int, int], bool] | None = None) -> None:
        self.runners = runners
        self.may_step = may_step or (lambda i, started: True)
        self.steps_started = [0] * len(runners)
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
            if not self.may_step(i, self.steps_started[i]):
                self._closed.wait(0.005)  # until the collector takes a batch, or stops stepping
                continue
            self._idle[i].clear()
            try:
                if self._go.is_set() and not self._closed.is_set():
                    self.steps_started[i] += 1
                    self._turns.put(self.runners[i].step())
            except BaseException as exc:  # designed: hand the error to the collector's thread
                self._go.clear()
                self._turns.put(exc)
            finally:
                self._idle[i].set()

    def next_turns(self) -> list[CollectedTurn]:
        self.start_stepping()
        while True:
            try:
                item = self._turns.get(timeout=0.5)
                break
            except queue.Empty:
                if self._stuck():
                    raise RuntimeError(
                        "no env may take another step and no turn is under way (lmcollect bug: the collector "
                        "asked for a turn its budget does not allow); please report it."
                    ) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _stuck(self) -> bool:
        idle = all(event.is_set() for event in self._idle)
        blocked = not any(self.may_step(i, n) for i, n in enumerate(self.steps_started))
        return idle and blocked and self._turns.empty()

    def take_pending(self) -> list[CollectedTurn]:
        """The turns of steps that finished after the last :meth:`next_turns` (call after stop_stepping)."""
        turns: list[CollectedTurn] = []
        while True:
            try:
                item = self._turns.get_nowait()
            except queue.Empty:
                return turns
            if isinstance(item, BaseException):
                raise item
            turns.extend(item)

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
