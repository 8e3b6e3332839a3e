"""How the demo keeps its collectors collecting into the buffer: in their actors, or driven from here."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from lmcollect.cli.vllm_backend import DriverSideCollection


class Collection(Protocol):
    """Background collection into the collectors' replay buffer."""

    def start(self) -> None: ...

    def is_running(self) -> bool:
        """True while some collector collects; re-raises the error that stopped one."""
        ...

    def stop(self) -> None: ...


class InActorCollection:
    """Each collector's actor collects in its own background thread (``start()``)."""

    def __init__(self, collectors: Sequence[Any]) -> None:
        self._collectors = list(collectors)

    def start(self) -> None:
        for collector in self._collectors:
            collector.start()

    def is_running(self) -> bool:
        return any(collector.is_running() for collector in self._collectors)

    def stop(self) -> None:
        """Nothing to do here: shutting a collector down stops its thread."""


def background_collection(collectors: Sequence[Any], backend: str) -> Collection:
    """vLLM engines take calls on one thread only: their collectors are driven from the driver."""
    return DriverSideCollection(collectors) if backend == "vllm" else InActorCollection(collectors)
