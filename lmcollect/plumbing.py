"""Class plumbing every layer shares: read-only properties that pass an attribute on,
context-manager support for objects that end with ``close()`` or ``shutdown()``, a check that
refuses use after ``close()``, futures settled once, and an asyncio loop on a thread of its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import operator
import threading
from collections.abc import Coroutine
from concurrent.futures import Future, InvalidStateError
from typing import Any, ClassVar, Self, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


def forwarded(path: str, doc: str) -> Any:
    """A read-only property returning ``self.<path>``; ``path`` may be dotted (``"_flow.num_consumed"``).

    For an attribute that only passes on one the object holds, or one of its parts holds:
    ``turns_yielded = forwarded("_flow.num_consumed", "Turns that left in batches so far.")``.
    Setting or deleting it raises AttributeError, as for any property without a setter.
    Annotated ``Any`` (it is a ``property``): the value's type is that of the attribute ``path``
    names, which a type checker cannot follow through a string, so it must not read it as ``property``.
    """
    return property(operator.attrgetter(path), doc=doc)


class EntersAsSelf:
    """``with obj as x:`` binds ``x`` to ``obj`` itself; a subclass says in ``__exit__`` how it ends."""

    def __enter__(self) -> Self:
        return self


class ClosesOnExit(EntersAsSelf):
    """``with obj:`` calls ``obj.close()`` on the way out (after an error too)."""

    close: Any  # the host's own close()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RefusesWhenClosed:
    """``is_closed``, and ``_check_open()`` for the methods that need the object open: it raises
    ``RuntimeError(_closed_error)`` once the host's ``close()`` has set ``_closed``."""

    _closed: bool
    _closed_error: ClassVar[str]  # the host's message: what is closed and what to do instead

    @property
    def is_closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(self._closed_error)


class ShutsDownOnExit(EntersAsSelf):
    """``with obj:`` calls ``obj.shutdown()`` on the way out (after an error too): the collectors."""

    shutdown: Any  # the host's own shutdown()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> bool:
    """Set ``future``'s outcome (``error`` if given, else ``result``) unless it already has one.

    Returns False when it had one (or was cancelled): the first outcome stands, for a future that
    two parties may race to answer (a close and the request's end, a reply and a timeout).
    """
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


class LoopThread:
    """An asyncio event loop running on a daemon thread named ``name``.

    ``close()`` stops the loop and waits up to ``join_timeout_s`` for the thread; the loop is
    closed only if the thread ended (a coroutine that blocks its thread keeps it open).
    """

    def __init__(self, name: str, *, join_timeout_s: float = 30.0) -> None:
        self.loop = asyncio.new_event_loop()
        self._join_timeout_s = join_timeout_s
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its error is raised here)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancel the loop's pending tasks and let them end (bounded), then stop the loop. A task left
        pending on a closed loop is garbage whose finalizer runs whenever the collector next runs, in
        any thread (inside ``ast.parse`` it breaks CPython 3.11: "AST constructor recursion depth
        mismatch")."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            try:
                self.call(_end_pending_tasks(TASKS_END_TIMEOUT_S), timeout_s=TASKS_END_TIMEOUT_S + 1)
            except (concurrent.futures.TimeoutError, RuntimeError):  # designed: a stuck task must not stop the close
                logger.warning(
                    "tasks on the loop %s did not end after their cancellation; closing it.", self._thread.name
                )
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=self._join_timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


TASKS_END_TIMEOUT_S = 5.0
"""How long :meth:`LoopThread.close` lets cancelled tasks take to end."""


async def _end_pending_tasks(timeout_s: float) -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
