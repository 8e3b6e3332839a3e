"""WeightUpdaterBase: the trainer-side object that pushes weights into collectors' inference engines."""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeAlias, TypeVar

import torch

from lmcollect.weight_sync.sender import EachWorkerSender, PushSender
from lmcollect.weight_sync.target import WeightTarget
from lmcollect.weights.delta import PushStats
from lmcollect.weights.lora import LoraAdapter, is_lora_source, lora_adapter
from lmcollect.weights.tensors import Metadata, WeightDict, expected_metadata, to_weight_dict
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)

WorkerIds: TypeAlias = int | torch.device | Sequence[int] | Sequence[torch.device] | None
WorkerId = TypeVar("WorkerId", bound=Hashable)
"""How an updater names its workers (the updaters here number them: ``int``)."""


class WeightPushError(RuntimeError):
    """A worker died, or did not apply a push within the updater's timeout."""


class WeightUpdaterBase(abc.ABC, Generic[WorkerId]):
    """Pushes a trainer's weights to the inference workers behind a collector.

    One push, in order (one loop for every mechanism, :meth:`_push`; each stage is the
    :attr:`push_sender`'s, a :class:`~lmcollect.weight_sync.sender.PushSender`):

    1. resolve the weights: the argument (an ``nn.Module``, a TensorDict module, a TensorDict, a
       dict) or, when it is None, :meth:`_get_server_weights`; then :meth:`_maybe_map_weights`
       and the sender's ``prepare``;
    2. assign the push its version (:meth:`next_version`): one more than the last push, or
       ``push_weights(..., version=N)``; versions only go up, a lower or equal one is refused;
    3. check ``worker_ids`` against :meth:`all_worker_ids` and the weights against every worker
       (the sender's ``check``, once), so a bad push is rejected before any worker changes anything;
    4. leave out the workers :meth:`_skip_update` skips; the sender's ``plan`` (e.g. a delta);
    5. send and wait: each targeted worker's loader (its :class:`~lmcollect.weight_sync.target.WeightTarget`,
       learnt when the collector registered) holds its policy (no turn runs), loads the weights
       in place, resets its prefix cache, takes the push's version, resumes;
    6. record :attr:`last_push_stats`, run the :attr:`post_hooks` (only when some worker was updated).

    An updater that defines only :meth:`all_worker_ids` and :meth:`_sync_weights_with_worker`
    (and optionally :meth:`_validate`, :meth:`_adapter_metadata`) pushes through an
    :class:`~lmcollect.weight_sync.sender.EachWorkerSender`, which calls those hooks.

    The version belongs to the push, not to each receiver: collectors holding the same weights
    report the same version, and one that skipped pushes reports the one it holds.

    Example::

        updater = LocalWeightUpdater()
        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=64, weight_updater=updater)
        for batch in collector:
            train_step(trainer_model, batch)
            collector.update_policy_weights_(trainer_model)  # same as updater(trainer_model)
    """

    def __init__(self) -> None:
        self._collector_ref: weakref.ref | None = None
        self._weight_target: WeightTarget | None = None  # learnt once, when the collector registers
        self._push_sender: PushSender[WorkerId] | None = None
        self._post_hooks: list[Callable[[], None]] = []
        self._pushed_version = 0
        self._caught_up = False  # the counter starts from the workers' version at the first push

    def __getstate__(self) -> dict[str, Any]:
        # the collector link is a weak reference, which cannot travel; register again after unpickling
        state = self.__dict__.copy()
        state.update(_collector_ref=None, _weight_target=None, _push_sender=None)
        return state

    # ------------------------------------------------------------------ registration
    def register_collector(self, collector: Any) -> None:
        """Register the collector this updater serves (once: a second call raises)."""
        if self._collector_ref is not None:
            raise RuntimeError(
                f"this {type(self).__name__} is already registered with a collector; an updater serves "
                "one collector. Build a new updater for another collector."
            )
        self._collector_ref = weakref.ref(collector)
        self._weight_target = collector.weight_target()

    @property
    def collector(self) -> Any:
        """The registered collector, or None if there is none or it was garbage-collected."""
        return None if self._collector_ref is None else self._collector_ref()

    def init(self, *args: Any, **kwargs: Any) -> None:
        """Prepare the transport (no-op here; a vLLM updater opens its process group)."""

    @classmethod
    def from_policy(cls, policy: Any) -> WeightUpdaterBase | None:
        """An updater built from ``policy``, or None when this class cannot build one from it."""
        return None

    @classmethod
    def get_model_metadata(cls, model: Any) -> dict[str, tuple[torch.dtype, torch.Size]]:
        """name -> (dtype, shape) of the distinct tensors of ``model`` (or of ``policy.model``)."""
        module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"get_model_metadata needs an nn.Module or a policy with a .model, got {type(model).__name__}."
            )
        return expected_metadata(module)[0]

    # ------------------------------------------------------------------ hooks and versions
    @property
    def post_hooks(self) -> list[Callable[[], None]]:
        """Callables run after each push that updated at least one worker."""
        return self._post_hooks

    def register_post_hook(self, hook: Callable[[], None]) -> None:
        if not callable(hook):
            raise TypeError(f"a post hook must be callable with no arguments, got {type(hook).__name__}.")
        self._post_hooks.append(hook)

    def _run_post_hooks(self) -> None:
        for hook in self._post_hooks:
            hook()

    @property
    def version(self) -> int:
        """The version of the last push (0 before any)."""
        return self._pushed_version

    def next_version(self, version: int | None = None) -> PushVersion:
        """The version of the push about to go out (checked; recorded by :meth:`_commit_version`).

        A new updater first catches up with the highest version its workers hold, so a trainer
        that restarts (or builds a second updater) keeps counting up instead of going back.
        """
        if not self._caught_up:
            self._pushed_version = max(self._pushed_version, self._workers_version())
            self._caught_up = True
        if version is None:
            return PushVersion(self._pushed_version + 1)
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"version must be an int, got {type(version).__name__}.")
        if version <= self._pushed_version:
            raise ValueError(
                f"version={version} is not above the last pushed version {self._pushed_version}: versions "
                "only go up. Pass a larger one, or leave version=None to count up from the last push."
            )
        return PushVersion(version)

    def _workers_version(self) -> int:
        """The highest version index the workers hold (the target's here; 0 without one)."""
        target = self._weight_target
        return 0 if target is None else target.version_index()

    def _commit_version(self, pushed: PushVersion) -> None:
        self._pushed_version = pushed.index

    def increment_version(self) -> None:
        """Bump the registered collector's policy version (for receivers that cannot do it)."""
        self._target().increment_version()

    def _target(self) -> WeightTarget:
        """What pushes go into: the registered collector's target (learnt when it registered)."""
        target = self._weight_target
        if target is None or (self._collector_ref is not None and self.collector is None):
            raise RuntimeError(
                f"this {type(self).__name__} has no live collector: pass it as weight_updater=... to a "
                "collector (or set collector.weight_updater) before pushing."
            )
        return target

    # ------------------------------------------------------------------ what subclasses define
    @abc.abstractmethod
    def all_worker_ids(self) -> list[WorkerId]:
        """Every worker this updater can push to."""

    def _get_server_weights(self) -> Any:
        """The weights to push when ``push_weights`` gets none (None: there are none)."""
        return None

    def _maybe_map_weights(self, server_weights: WeightDict) -> WeightDict:
        """Rename or convert the weights for the receivers (identity here)."""
        return server_weights

    def _skip_update(self, worker_id: WorkerId) -> bool:
        """True to leave ``worker_id`` out of this push (every worker is updated here)."""
        return False

    @abc.abstractmethod
    def _sync_weights_with_worker(self, *, worker_id: WorkerId, server_weights: Any, version: PushVersion) -> Any:
        """Send ``server_weights`` to one worker, which takes ``version`` when it applies them
        (what it returns is the subclass's business)."""

    # ------------------------------------------------------------------ pushing
    @property
    def push_sender(self) -> PushSender[WorkerId]:
        """The mechanism this updater pushes through (built on first use by :meth:`_make_sender`)."""
        if self._push_sender is None:
            self._push_sender = self._make_sender()
        return self._push_sender

    def _make_sender(self) -> PushSender[WorkerId]:
        """The updater's sender; here the spec hooks' (:class:`~lmcollect.weight_sync.sender.EachWorkerSender`)."""
        return EachWorkerSender(
            sync=self._sync_weights_with_worker, validate=self._validate, adapter_metadata=self._adapter_metadata
        )

    @property
    def last_push_stats(self) -> PushStats | None:
        """What the last push moved (None before any): ``kind`` ("full", "delta" or "lora"), bytes
        sent once to all receivers, how many receivers got what, and the call's seconds."""
        return None if self._push_sender is None else self._push_sender.last_push_stats

    def push_weights(
        self, policy_or_weights: Any = None, worker_ids: WorkerIds = None, *, version: int | None = None
    ) -> object:
        """Push weights (see the class docstring for the steps) to ``worker_ids`` (default: all),
        as ``version`` (default: one more than the last push). Returns None here; a subclass may
        return a handle of the push (``RayRemoteWeightUpdater(...).push_weights(wait=False)``)."""
        return self._push(policy_or_weights, worker_ids, version=version, wait=True)

    def _push(self, policy_or_weights: Any, worker_ids: WorkerIds, *, version: int | None, wait: bool) -> object:
        """The one loop of every updater and mechanism: check -> version -> plan -> send -> wait ->
        record, each stage the :attr:`push_sender`'s. A push is full weights or a LoRA adapter (a
        peft model or a :class:`~lmcollect.weights.lora.LoraAdapter`: only its tensors are sent, each
        worker's engine merges it into its kept base weights). Everything is checked before the
        version is committed, so a refused push changes nothing anywhere."""
        sender = self.push_sender
        sender.before_push()
        started = time.perf_counter()
        payload: WeightDict | LoraAdapter
        if is_lora_source(policy_or_weights):
            payload = lora_adapter(policy_or_weights)
        else:
            payload = sender.prepare(self._resolve_weights(policy_or_weights))
        ids = self._resolve_worker_ids(worker_ids)
        pushed = self.next_version(version)  # the version, once
        sender.check(payload, ids)  # names, shapes, dtypes, NaN/Inf: once, on this side
        targets = [i for i in ids if not self._skip_update(i)]
        plan = sender.plan(payload, targets)  # nothing changes yet: a refused plan leaves all as it was
        self._commit_version(pushed)  # from here some worker may hold it: never hand it out twice
        sent = sender.send(payload, targets, pushed, plan)
        on_done = self._run_post_hooks if targets else _nothing
        result = sender.wait(sent, targets, pushed, wait=wait, on_done=on_done)
        stats = sender.last_push_stats
        if stats is not None:  # the call's seconds (None: not waited for)
            seconds = time.perf_counter() - started if wait else None
            sender.last_push_stats = dataclasses.replace(stats, call_s=seconds)
        return result

    # ------------------------------------------------------------------ the hooks of EachWorkerSender
    def _validate(self, weights: WeightDict, worker_ids: list[WorkerId]) -> None:
        """Raise ValueError before anything is sent if the weights do not fit (receivers check too).

        A no-op here (accept everything); updaters that can check before sending override it.
        """

    def _adapter_metadata(self, worker_id: WorkerId) -> Metadata | None:
        """name -> (dtype, shape) of worker ``worker_id``'s model (here: the registered collector's
        target's); None: not known here (the worker's engine checks the adapter before loading it)."""
        return self._target().metadata()[0]

    def __call__(self, policy_or_weights: Any = None, worker_ids: WorkerIds = None, **kwargs: Any) -> Any:
        return self.push_weights(policy_or_weights, worker_ids, **kwargs)

    def _resolve_weights(self, policy_or_weights: Any) -> WeightDict:
        source = policy_or_weights if policy_or_weights is not None else self._get_server_weights()
        if source is None:
            raise ValueError(
                f"{type(self).__name__} has no weights to push: pass them (push_weights(model_or_weights)) "
                "or give the updater policy_weights when you build it."
            )
        return self._maybe_map_weights(to_weight_dict(source))

    def _resolve_worker_ids(self, worker_ids: WorkerIds) -> list[WorkerId]:
        """``worker_ids`` as a list without repeats, each one checked against all_worker_ids()."""
        known = self.all_worker_ids()
        if worker_ids is None:
            return list(known)
        ids = list(worker_ids) if isinstance(worker_ids, (list, tuple, range)) else [worker_ids]
        bad = [i for i in ids if isinstance(i, bool) or i not in known]
        if bad:
            raise ValueError(
                f"worker_ids={worker_ids!r} names unknown worker(s) {bad}; this {type(self).__name__} has "
                f"workers {known} (see all_worker_ids())."
            )
        # each id as all_worker_ids() names it (found by equality, as the check above)
        return [next(k for k in known if k == i) for i in dict.fromkeys(ids)]


def _nothing() -> None:
    """No post-hooks: no worker was updated."""


def resolve_updater(updater: Any, policy: Any = None) -> WeightUpdaterBase | None:
    """An updater given as an instance or as a constructor (a class or factory) -> the instance.

    A class is first asked ``from_policy(policy)`` (when there is a policy); its plain
    constructor is the fallback when that returns None.
    """
    from_policy = getattr(updater, "from_policy", None) if isinstance(updater, type) else None
    if policy is not None and callable(from_policy):
        built = from_policy(policy)
        if built is not None:
            return resolve_updater(built)
    if (
        updater is not None
        and (isinstance(updater, type) or not hasattr(updater, "push_weights"))
        and callable(updater)
    ):
        updater = updater()
    if updater is not None and not hasattr(updater, "push_weights"):
        raise TypeError(
            f"weight_updater must be a WeightUpdaterBase or a callable returning one, got {type(updater).__name__}."
        )
    return updater
