"""PushSender: one mechanism's trainer side of a push (the updater's loop calls it); the in-process senders."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from lmcollect.weight_sync.loader import LoadOptions
from lmcollect.weight_sync.target import WeightTarget
from lmcollect.weights.delta import PushStats, distinct_nbytes
from lmcollect.weights.lora import LoraAdapter, check_adapter
from lmcollect.weights.push_config import PushConfig
from lmcollect.weights.tensors import (
    Metadata,
    WeightDict,
    narrowest_held_dtypes,
    non_finite_problems,
    raise_if_problems,
)
from lmcollect.weights.version import PushVersion

W = TypeVar("W")
Payload = WeightDict | LoraAdapter
"""What a push carries: full weights (named tensors) or a LoRA adapter."""


class PushSender(abc.ABC, Generic[W]):
    """How one mechanism moves a push to its workers. The one loop, written once in
    :meth:`~lmcollect.weight_sync.base.WeightUpdaterBase.push_weights`, calls in order:

    :meth:`before_push`, :meth:`prepare` (full weights), then, after the push took its version,
    :meth:`check` (names, shapes, dtypes, NaN/Inf: the one check on this side), :meth:`plan`
    (nothing changes yet: a refused plan leaves every worker as it was), :meth:`send`,
    :meth:`wait`. :attr:`last_push_stats` is what the push moved.
    """

    last_push_stats: PushStats | None = None

    def before_push(self) -> None:
        """Run first (e.g. wait for a push still in flight)."""

    def prepare(self, weights: WeightDict) -> WeightDict:
        """The weights as they will be checked and sent (e.g. names aligned to the workers')."""
        return weights

    @abc.abstractmethod
    def check(self, payload: Payload, worker_ids: list[W]) -> None:
        """Raise ValueError if ``payload`` does not fit every worker of ``worker_ids``; changes nothing."""

    def plan(self, payload: Payload, targets: list[W]) -> Any:
        """Decide how the push travels (e.g. a delta's encoding); nothing changes yet. None here."""
        return None

    @abc.abstractmethod
    def send(self, payload: Payload, targets: list[W], pushed: PushVersion, plan: Any) -> Any:
        """Start the push to every target; sets :attr:`last_push_stats`. Returns what :meth:`wait` waits for."""

    def wait(
        self, sent: Any, targets: list[W], pushed: PushVersion, *, wait: bool, on_done: Callable[[], None]
    ) -> object:
        """Wait for ``sent`` (or, ``wait=False``, hand back a handle of it), then ``on_done()``.
        Returns what ``push_weights`` returns (None here: :meth:`send` waited)."""
        on_done()
        return None

    def close(self) -> None:
        """Release what the sender holds (connections, buffers)."""


class EachWorkerSender(PushSender[W]):
    """A push as an updater's spec hooks make it: :meth:`_validate`, then one
    ``_sync_weights_with_worker`` per worker (a LoRA adapter is checked against each worker's
    ``_adapter_metadata`` first). What an updater that defines only those hooks pushes through."""

    def __init__(
        self,
        *,
        sync: Callable[..., Any],
        validate: Callable[[WeightDict, list[W]], None],
        adapter_metadata: Callable[[W], Metadata | None],
    ) -> None:
        self._sync = sync
        self._validate = validate
        self._adapter_metadata = adapter_metadata

    def check(self, payload: Payload, worker_ids: list[W]) -> None:
        if not isinstance(payload, LoraAdapter):
            self._validate(payload, worker_ids)
            return
        for worker_id in worker_ids:  # an adapter that does not fit changes nothing anywhere
            metadata = self._adapter_metadata(worker_id)
            if metadata is not None:
                check_adapter(payload, metadata, receiver=f"worker {worker_id}'s model")

    def send(self, payload: Payload, targets: list[W], pushed: PushVersion, plan: Any) -> None:
        for worker_id in targets:
            self._sync(worker_id=worker_id, server_weights=payload, version=pushed)
        self.last_push_stats = stats_of(payload, len(targets))


class InProcessSender(PushSender[int]):
    """A push into a loader in this process (``LocalWeightUpdater``): checked here for NaN/Inf (as
    the model will hold the values, with ``convert_dtype``), then one load, which checks names,
    shapes and dtypes as it copies in place, under the collector's policy lock."""

    def __init__(self, target: Callable[[], WeightTarget], config: PushConfig) -> None:
        self._target = target  # called per push: the updater refuses one whose collector is gone
        self.config = config

    def check(self, payload: Payload, worker_ids: list[int]) -> None:
        if isinstance(payload, LoraAdapter):
            check_adapter(payload, self._target().metadata()[0], receiver="the collector's model")
            return
        if self.config.allow_non_finite:
            return
        held = narrowest_held_dtypes(payload, [self._target().metadata()]) if self.config.convert_dtype else None
        raise_if_problems(non_finite_problems(payload, dtypes=held))

    def send(self, payload: Payload, targets: list[int], pushed: PushVersion, plan: Any) -> None:
        for _ in targets:
            self.load(payload, pushed)
        self.last_push_stats = stats_of(payload, len(targets))

    def load(self, payload: Any, pushed: PushVersion) -> None:
        """One load of ``payload`` as ``pushed`` (NaN/Inf: refused, or allowed, by :meth:`check`)."""
        options = LoadOptions(version=pushed, convert_dtype=self.config.convert_dtype, allow_non_finite=True)
        self._target().load(payload, options)


def stats_of(payload: Payload, num_targets: int) -> PushStats:
    """What a push of ``payload`` sent whole to ``num_targets`` workers moved."""
    if isinstance(payload, LoraAdapter):
        return PushStats.lora(payload.nbytes, num_receivers=num_targets)
    return PushStats.full(distinct_nbytes(payload), num_full=num_targets)
