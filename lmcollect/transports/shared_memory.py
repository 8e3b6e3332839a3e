"""In-process weight sync: the sender packs a snapshot into flat buffers its receivers read directly."""

from __future__ import annotations

import threading
from collections.abc import Callable

from lmcollect.transports.base import WeightReceiver, WeightSender
from lmcollect.weights.buckets import WeightBuckets, pack_buckets
from lmcollect.weights.tensors import WeightDict, non_finite_problems, raise_if_problems, to_weight_dict


class SharedMemorySender(WeightSender):
    """Publishes weights to collectors in this process through one flat buffer per dtype.

    ``send`` copies a snapshot of the weights into the buffers (reused while the layout stays
    the same) and bumps the sender's version. A collector's ``receive_weights()`` copies the
    buffers into its model while holding the sender's lock, so it never reads a half-written
    push; the trainer may keep training on its own tensors meanwhile.

    Example::

        sender = SharedMemorySender()
        collector.register_scheme_receiver({"policy": sender.make_receiver()})
        sender.send(trainer_model)
        collector.receive_weights()  # loads the snapshot, bumps the policy version once

    Args:
        bucket_size_bytes: largest flat buffer (None: one buffer per dtype).
        allow_non_finite: publish weights holding NaN or infinite values; False (the default):
            such a push is refused before anything is published (receivers load what comes as
            checked here).
    """

    def __init__(self, *, bucket_size_bytes: int | None = None, allow_non_finite: bool = False) -> None:
        self.bucket_size_bytes = bucket_size_bytes
        self.allow_non_finite = allow_non_finite
        self._cond = threading.Condition()
        self._buckets: WeightBuckets | None = None
        self._version = 0

    @property
    def version(self) -> int:
        """How many pushes were sent."""
        return self._version

    def send(self, weights: object) -> None:
        weights = to_weight_dict(weights)
        if not self.allow_non_finite:
            raise_if_problems(non_finite_problems(weights), where=" before publishing (or allow_non_finite=True)")
        with self._cond:
            out = self._buckets.buffers if self._buckets is not None else None
            self._buckets = pack_buckets(weights, bucket_size_bytes=self.bucket_size_bytes, out=out, device="cpu")
            self._version += 1
            self._cond.notify_all()

    def make_receiver(self, *, timeout_s: float | None = None) -> SharedMemoryReceiver:
        """A receiver for one collector (``timeout_s``: how long it waits for a new push; None: not at all)."""
        return SharedMemoryReceiver(self, timeout_s=timeout_s)

    def _read_newer(self, seen: int, timeout_s: float | None, read: Callable[[WeightDict], None]) -> int | None:
        """Call ``read`` with the newest weights if newer than ``seen`` (waiting up to timeout_s)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._version > seen, timeout=timeout_s or 0):
                return None
            assert self._buckets is not None, "every push (version > 0) packs buckets"
            read(self._buckets.tensors())
            return self._version


class SharedMemoryReceiver(WeightReceiver):
    """Reads a :class:`SharedMemorySender` 's buffers for one collector (see the sender)."""

    def __init__(self, sender: SharedMemorySender, *, timeout_s: float | None = None) -> None:
        super().__init__()
        self._sender = sender
        self._seen = 0
        self.timeout_s = timeout_s

    def receive_into(self, apply: Callable[[WeightDict], None], *, timeout_s: float | None = None) -> bool:
        version = self._sender._read_newer(self._seen, timeout_s, apply)
        if version is None:
            return False
        self._seen = version
        return True

    def receive(self, timeout_s: float | None = None) -> WeightDict | None:
        """A private copy of the newest weights (receive_into avoids the copy), or None."""
        copies: list[WeightDict] = []
        if not self.receive_into(lambda w: copies.append({k: v.clone() for k, v in w.items()}), timeout_s=timeout_s):
            return None
        return copies[0]
