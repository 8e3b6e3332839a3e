"""How the demo keeps its collectors collecting into the buffer: each in its own actor (``start()``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


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
    """Collection in the collectors' actors, for every ``backend``: a vLLM engine runs its calls
    on its own thread, so it collects from ``start()``'s thread like a transformers model."""
    return InActorCollection(collectors)
