"""The CLI's Ray session: start a local cluster or attach to one, and shut down only what we started."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import ModuleType

import ray

from lmcollect.distributed.ray_cluster import init_ray

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Ray is running inside the block: attached to ``address``, already running, or started here.

    A cluster started here is shut down on exit; one that was attached to or already running
    (e.g. a test session's) is left as it was.
    """
    started_here = not ray.is_initialized()
    init_ray({"address": address} if address else None)
    try:
        yield
    finally:
        if started_here:
            logger.info("shutting the local Ray session down")
            ray.shutdown()


def pickle_by_value(module: ModuleType) -> None:
    """Ship ``module``'s functions and classes to Ray workers by value (it is not importable there,
    e.g. a script loaded from a file path)."""
    ray.cloudpickle.register_pickle_by_value(module)


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
