"""Weight sync through Ray's object store: one object per push, pulled by each collector actor."""

from __future__ import annotations

from typing import Any

import ray

from lmcollect.ray.bounded import get_within
from lmcollect.ray.carrier import put_weights
from lmcollect.transports.base import WeightReceiver, WeightSender
from lmcollect.weights.tensors import WeightDict, non_finite_problems, raise_if_problems, to_weight_dict


class WeightMailbox:
    """Holds the newest push (version and ObjectRef); a plain class, run as a tiny actor."""

    def __init__(self) -> None:
        self._version = 0
        self._refs: list[Any] = []

    def publish(self, version: int, refs: list[Any]) -> None:
        # refs arrive wrapped in a list, so Ray passes the ObjectRef itself, not its value
        self._version, self._refs = version, refs

    def latest(self, after_version: int) -> tuple[int, list[Any]] | None:
        return None if self._version <= after_version else (self._version, self._refs)

    def ready(self) -> bool:
        return True


class RayObjectStoreSender(WeightSender):
    """Puts each push into the object store once and posts its ref in a mailbox actor.

    Receivers (in collector actors, on any node) pull the newest push when their collector's
    ``receive_weights()`` runs: they map the object zero-copy and the collector loads it
    (checked, in place, under its policy lock, one version bump). Older pushes are freed once
    no receiver reads them.

    Example::

        sender = RayObjectStoreSender()
        collector.register_scheme_receiver({"policy": sender.make_receiver()}, synchronize_weights=False)
        sender.send(trainer_model)
        collector.receive_weights()

    Args:
        actor_options: options of the mailbox actor (default: no CPU reserved).
        call_timeout_s: longest a call into the mailbox waits (a hung mailbox raises
            :class:`~lmcollect.ray.bounded.CallTimeoutError` naming this knob).
        start_timeout_s: longest the first push waits for the mailbox actor to start (a new
            worker process: slow on a busy node), before its own ``call_timeout_s`` bound.
        allow_non_finite: publish weights holding NaN or infinite values; False (the default):
            such a push is refused before anything is put (receivers load what comes as checked here).
    """

    def __init__(
        self,
        *,
        actor_options: dict[str, Any] | None = None,
        call_timeout_s: float = 60.0,
        start_timeout_s: float = 120.0,
        allow_non_finite: bool = False,
    ) -> None:
        options = {"num_cpus": 0, **(actor_options or {})}
        self._mailbox = ray.remote(**options)(WeightMailbox).remote()
        self._version = 0
        self.call_timeout_s = call_timeout_s
        self.start_timeout_s = start_timeout_s
        self._started = False
        self.allow_non_finite = allow_non_finite

    def send(self, weights: object) -> None:
        weights = to_weight_dict(weights)
        if not self.allow_non_finite:
            raise_if_problems(non_finite_problems(weights), where=" before publishing (or allow_non_finite=True)")
        if not self._started:
            _wait_started(self._mailbox, self.start_timeout_s, "RayObjectStoreSender(start_timeout_s=...)")
            self._started = True
        ref = put_weights(weights)
        get_within(
            self._mailbox.publish.remote(self._version + 1, [ref]),
            timeout_s=self.call_timeout_s,
            call="RayObjectStoreSender.send (publish)",
            knob="RayObjectStoreSender(call_timeout_s=...)",
        )
        self._version += 1

    def make_receiver(self, *, call_timeout_s: float = 60.0) -> RayObjectStoreReceiver:
        """A receiver of this sender's pushes (its first pull waits up to ``start_timeout_s`` for the mailbox)."""
        return RayObjectStoreReceiver(
            self._mailbox,
            call_timeout_s=call_timeout_s,
            start_timeout_s=None if self._started else self.start_timeout_s,
        )

    def close(self) -> None:
        ray.kill(self._mailbox)


class RayObjectStoreReceiver(WeightReceiver):
    """Pulls the newest push from a :class:`RayObjectStoreSender` 's mailbox (see the sender)."""

    def __init__(self, mailbox: Any, *, call_timeout_s: float = 60.0, start_timeout_s: float | None = None) -> None:
        super().__init__()
        self._mailbox = mailbox
        self._seen = 0
        self.call_timeout_s = call_timeout_s
        self._start_timeout_s = start_timeout_s  # None: the mailbox is known to run

    def receive(self, timeout_s: float | None = None) -> WeightDict | None:
        """Views of the newest push's tensors (valid while the caller holds them), or None."""
        if self._start_timeout_s is not None:
            _wait_started(self._mailbox, self._start_timeout_s, "RayObjectStoreSender(start_timeout_s=...)")
            self._start_timeout_s = None
        knob = "make_receiver(call_timeout_s=...)"
        found = get_within(
            self._mailbox.latest.remote(self._seen),
            timeout_s=self.call_timeout_s,
            call="RayObjectStoreReceiver.receive (latest)",
            knob=knob,
        )
        if found is None:
            return None
        version, (ref,) = found
        buckets = get_within(
            ref, timeout_s=self.call_timeout_s, call="RayObjectStoreReceiver.receive (the weights)", knob=knob
        )
        self._seen = version
        return buckets.tensors()


def _wait_started(mailbox: Any, timeout_s: float, knob: str) -> None:
    """Wait for the mailbox actor to start (a new worker process: slow on a busy node), bounded on
    its own, so that each call's bound is for the call alone."""
    get_within(mailbox.ready.remote(), timeout_s=timeout_s, call="starting the weight mailbox actor", knob=knob)
