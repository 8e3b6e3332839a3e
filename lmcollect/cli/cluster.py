"""The CLI's Ctrl-C handling (its Ray session helpers are in :mod:`lmcollect.ray.cluster`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def interrupt_on_sigint() -> Iterator[None]:
    """Inside the block, Ctrl-C (SIGINT) raises KeyboardInterrupt in the main thread.

    Python's own handler can be replaced below Python by a native library once it is up (Python
    still reports its default handler, yet a SIGINT during a run was lost and the demo trained on);
    a handler installed again after Ray and the loggers have started is the one that runs. Outside
    the main thread (where handlers cannot be set) the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
