"""RayRemoteWeightUpdater: one object-store copy per push, loaded in place by every collector actor."""

from __future__ import annotations

from typing import Any, ClassVar

from ray.actor import ActorHandle

from lmcollect.collectors.shared.weights import HoldsWeightUpdater
from lmcollect.ray.loader_proxy import ActorWeightLoader
from lmcollect.ray.object_store import ObjectStorePushSender
from lmcollect.ray.push_handle import PushHandle, gather_refs
from lmcollect.weight_sync.base import WeightUpdaterBase, WorkerIds
from lmcollect.weights.push_config import PushConfig, push_config_or_default
from lmcollect.weights.tensors import WeightDict, to_weight_dict
from lmcollect.weights.version import PushVersion

__all__ = ["PushHandle", "RayPushConfig", "RayRemoteWeightUpdater", "RayWeightUpdater", "gather_refs"]


RayPushConfig = PushConfig
"""Deprecated: the former name of :class:`~lmcollect.weights.push_config.PushConfig` (the same class), kept
so code that names it keeps working; new code imports ``PushConfig`` from ``lmcollect.weight_sync``."""


class RayRemoteWeightUpdater(WeightUpdaterBase[int]):
    """Pushes weights to collectors running as Ray actors (``RayLLMCollector`` s or actor handles).

    It pushes through an :class:`~lmcollect.ray.object_store.ObjectStorePushSender` (the loop is
    :class:`~lmcollect.weight_sync.base.WeightUpdaterBase`'s). One push, in order: (1) check the weights on the driver against the metadata every worker
    reported once (names, shapes, dtypes; no NaN/Inf unless ``allow_non_finite``): a bad push
    raises one ValueError and no worker changes anything; (2) ``ray.put`` the weights once (a layout plus byte buffers), shared by
    every worker; (3) each targeted worker maps the object zero-copy, checks it again, pauses its
    policy (write lock), copies into its parameters in place, resets its prefix cache, takes the
    push's version (the updater's counter, or ``push_weights(version=N)``) and resumes; (4) ``push_weights`` returns when all have applied (or, with
    ``wait=False``, at once with a :class:`PushHandle`). At most one push is in flight: a new
    push first waits for the previous one, so workers apply pushes in order.

    With ``PushConfig(delta=True)``, step (2) puts only the elements that changed since the
    last push (compared bit for bit with the driver's copy of it) for the workers that hold that
    push; each checks the delta's base version, writes it and verifies per-tensor checksums,
    or refuses with its weights untouched. Workers that did not hold the base, or refused, get
    the full weights within the same push (``last_push_stats`` says who got what).

    Args:
        policy_weights: what ``push_weights()`` pushes when given nothing (a module, TensorDict
            or dict, read at push time).
        remote_collectors: ``RayLLMCollector`` objects or collector actor handles; worker ``i``
            is ``remote_collectors[i]``. None: the collector this updater gets registered with.
        max_interval: a worker is skipped until it has missed ``max_interval`` pushes in a row
            (0: every push reaches every worker).
        config: timeout, dtype conversion, packing, delta, zero copy (see
            :class:`~lmcollect.weights.push_config.PushConfig`; its process-group options are refused).

    Example::

        collectors = [RayLLMCollector(make_env, policy_factory=make_policy, dialog_turns_per_batch=64)
                      for _ in range(2)]
        updater = RayRemoteWeightUpdater(trainer_model, collectors)
        for step in range(num_steps):
            batch = collectors[step % 2].next()
            train_step(trainer_model, batch)
            updater.push_weights()  # every collector now generates with the new weights
    """

    sender_class: ClassVar[type[ObjectStorePushSender]] = ObjectStorePushSender
    """The mechanism's class (a subclass may change how it plans or sends)."""

    def __init__(
        self,
        policy_weights: Any = None,
        remote_collectors: list[Any] | None = None,
        max_interval: int = 0,
        *,
        config: PushConfig | None = None,
    ) -> None:
        super().__init__()
        if isinstance(max_interval, bool) or not isinstance(max_interval, int) or max_interval < 0:
            raise ValueError(f"max_interval must be an int >= 0 (0: update every push), got {max_interval!r}.")
        self._policy_weights = policy_weights
        self.config = push_config_or_default(config, updater="RayRemoteWeightUpdater")
        self.config.check_for("ray", updater="RayRemoteWeightUpdater")
        # each worker's target: a proxy of its actor's loader (a RayLLMCollector's remembers pushes for restarts)
        loaders = [_loader_of(c, i) for i, c in enumerate(remote_collectors or [])]
        self._push_sender = self.sender_class(loaders, self.config, max_interval=max_interval)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_push_sender"] = self._push_sender  # actor handles and the delta base travel
        return state

    def _make_sender(self) -> ObjectStorePushSender:
        raise AssertionError("built by __init__")

    @property
    def _store(self) -> ObjectStorePushSender:
        sender = self.push_sender
        assert isinstance(sender, ObjectStorePushSender), "built by __init__"
        return sender

    @property
    def max_interval(self) -> int:
        """A worker is skipped until it has missed this many pushes in a row (0: never)."""
        return self._store.max_interval

    def register_collector(self, collector: Any) -> None:
        """Register the collector; with no ``remote_collectors`` it becomes worker 0."""
        super().register_collector(collector)
        if not self._store.loaders:
            self._store.add_worker(_loader_of(collector, 0))

    def init(self, *args: Any, **kwargs: Any) -> None:
        """Fetch every worker's weight metadata now, so the first push does not wait for it."""
        self._store.metadata()

    def all_worker_ids(self) -> list[int]:
        """Indices of the remote collectors: ``[0, ..., len(remote_collectors) - 1]``."""
        return list(range(len(self._store.loaders)))

    def _get_server_weights(self) -> WeightDict | None:
        return None if self._policy_weights is None else to_weight_dict(self._policy_weights)

    def _skip_update(self, worker_id: int) -> bool:
        return self._store.skip(worker_id)

    def _workers_version(self) -> int:
        return self._store.workers_version()

    def _sync_weights_with_worker(self, *, worker_id: int, server_weights: Any, version: PushVersion) -> Any:
        """Ask worker ``worker_id`` to apply the payload behind the ObjectRef ``server_weights``."""
        return self._store.load(worker_id, server_weights, version)

    def reset_delta_base(self) -> None:
        """Forget the last pushed weights (with ``delta``): the next push is a full push to every worker."""
        self._store.reset_delta_base()

    @property
    def uses_delta(self) -> bool:
        """Whether the next push may be a delta push (with ``delta="auto"``: what was chosen last)."""
        return self._store.delta_base is not None

    def push_weights(
        self,
        policy_or_weights: Any = None,
        worker_ids: WorkerIds = None,
        *,
        wait: bool = True,
        version: int | None = None,
    ) -> PushHandle | None:
        """Push to ``worker_ids`` (default: all) as ``version`` (default: one more than the last
        push; only ever up). Returns None once every targeted worker has applied the weights, or
        with ``wait=False`` a :class:`PushHandle` right away."""
        handle = self._push(policy_or_weights, worker_ids, version=version, wait=wait)
        assert handle is None or isinstance(handle, PushHandle)
        return handle


RayWeightUpdater = RayRemoteWeightUpdater


def _loader_of(collector: Any, index: int) -> ActorWeightLoader:
    """The target of ``remote_collectors[index]``: a proxy of its actor's weight loader."""
    if isinstance(collector, ActorHandle):
        return ActorWeightLoader(collector)
    target = collector.weight_target() if isinstance(collector, HoldsWeightUpdater) else None
    if isinstance(target, ActorWeightLoader):  # a RayLLMCollector's (it remembers pushes for restarts)
        return target
    raise TypeError(
        f"remote_collectors[{index}] is a {type(collector).__name__}; pass RayLLMCollector objects or "
        "the actor handles of collector actors."
    )
