"""The collector as it runs inside a Ray actor: the local collector plus RPC-friendly methods."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDictBase

from lmcollect.collectors.continuous.collector import ContinuousLLMCollector
from lmcollect.collectors.lockstep.collector import LLMCollector
from lmcollect.collectors.shared.versioning import PolicyVersion
from lmcollect.data.packed_turns import pack
from lmcollect.weight_sync.loader import LoadOptions, WeightLoader
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Received:
    """What a collector actor answers to ``receive_weights``."""

    version: PushVersion | None
    """The version now held (None when versions are not tracked)."""
    report: Any
    """The engine's report of the load (its workers' reports for a process-group push)."""


class CollectorRestartedError(RuntimeError):
    """A restarted collector actor was asked to collect before it was restored."""


if TYPE_CHECKING:

    class _CollectorHost:
        """What :class:`WorkerMethods` uses of the collector class it is mixed into (for the type checker only)."""

        _policy_version: PolicyVersion | None

        weight_loader: WeightLoader

        def set_worker_idx(self, worker_idx: int | None, restarts: int = 0) -> None: ...
        def set_seed(self, seed: int, static_seed: bool = False) -> int: ...
        def receive_weights(self, *args: Any, **kwargs: Any) -> Any: ...
        def start(self) -> None: ...
        def next(self) -> TensorDictBase | None: ...
        def rollout(self) -> Callable[[], Any]: ...
        def _finished(self) -> bool: ...

else:
    _CollectorHost = object


class WorkerMethods(_CollectorHost):
    """What a collector needs to be called through an actor handle (mixed into a collector class).

    It is a plain class (Ray is applied where the actor is created); env and policy (or engine)
    constructors are called here, inside the actor, so no model travels through the driver.

    ``restarted=True`` (the actor was reconstructed after a crash, see ``max_restarts``): it
    holds its initial weights, a fresh worker index and seed, so it refuses to collect until
    :meth:`restore_after_restart` gives it back its worker index, seed and last weights with
    their version (``RayLLMCollector`` does that by itself before its next call).
    """

    def __init__(self, *args: Any, torch_threads: int | None = None, restarted: bool = False, **kwargs: Any) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        super().__init__(*args, **kwargs)
        self._awaiting_restore = restarted

    def _check_restored(self) -> None:
        if self._awaiting_restore:
            raise CollectorRestartedError(
                "this collector's actor was restarted after a crash and still holds its initial weights, "
                "worker index and seed, so its turns would carry a version whose weights it does not hold. "
                "RayLLMCollector restores it before its next call; driving the actor yourself, call "
                "restore_after_restart(...) (or push weights) first."
            )

    def restore_after_restart(
        self,
        *,
        worker_idx: int | None,
        restarts: int,
        seed: tuple[int, bool] | None,
        weights: Any = None,
        version: Any = None,
        convert_dtype: bool = False,
    ) -> None:
        """Give a restarted actor back what it held: worker index (ids continue in a fresh
        sub-block of its range), seed, and the last weights pushed to it with their version."""
        if weights is not None:
            # what was pushed to it before: checked (or allowed) by that push
            self.weight_loader.load(
                weights, LoadOptions(version=version, convert_dtype=convert_dtype, allow_non_finite=True)
            )
        if worker_idx is not None:
            self.set_worker_idx(worker_idx, restarts=restarts)
        if seed is not None:
            self.set_seed(*seed)
        self._awaiting_restore = False

    def receive_weights(self, *args: Any, **kwargs: Any) -> Received:
        """:meth:`LLMCollector.receive_weights`; returns its report with the version now held, so
        the driver can re-send a push to a restarted actor."""
        report = super().receive_weights(*args, **kwargs)
        if self._policy_version is None:
            return Received(version=None, report=report)
        return Received(
            version=PushVersion(self._policy_version.index, self._policy_version.version_uuid), report=report
        )

    def start(self) -> None:
        self._check_restored()
        super().start()

    def ping(self) -> bool:
        return True

    def process_info(self) -> dict[str, Any]:
        """Where this collector runs: process id, host and (in a Ray actor) Ray node id, for
        placement checks and debugging."""
        return {"pid": os.getpid(), "hostname": socket.gethostname(), "node_id": self.node_id()}

    def node_id(self) -> str | None:
        """The Ray node this collector runs on (None here: the Ray actor bodies say)."""
        return None

    def get_attribute(self, name: str) -> Any:
        """Read a property (properties are not reachable through an actor handle)."""
        if name not in _READABLE:
            raise AttributeError(f"{name!r} is not a readable collector attribute; readable: {sorted(_READABLE)}.")
        return getattr(self, name)

    def collect_next(self) -> tuple[TensorDictBase | None, bool]:
        """(next batch or None, whether the collector is finished after it)."""
        self._check_restored()
        if self._finished():
            return None, True
        try:
            batch = self.next()
        except StopIteration:  # the budget ran out while waiting (a continuous collector's last turns)
            return None, True
        return pack(batch), self._finished()

    def rollout_once(self) -> TensorDictBase:
        self._check_restored()
        return pack(self.rollout())


class CollectorWorker(WorkerMethods, LLMCollector):
    """An :class:`LLMCollector` whose methods can all be called through an actor handle."""


class ContinuousCollectorWorker(WorkerMethods, ContinuousLLMCollector):
    """A :class:`ContinuousLLMCollector` whose methods can all be called through an actor handle."""


_READABLE = {
    "dialog_turns_per_batch",
    "total_dialog_turns",
    "turns_run",
    "turns_yielded",
    "turns_counted",
    "num_buffered_turns",
    "sampling_counts",
    "last_batch_counts",
    "policy_version",
    "worker_idx",
    "weight_updater",
    "replay_buffer",
}
