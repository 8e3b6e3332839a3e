"""ProcessGroupReceiver: one receiving rank of the group (checks every header before allocating for it)."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lmcollect.transports.base import WeightReceiver
from lmcollect.transports.process_group.group import (
    DELTA_PURPOSE,
    DIGEST_PURPOSE,
    SENDER_RANK,
    buffer_checksums,
    digest_context,
    make_group,
    shutdown_group,
)
from lmcollect.transports.rendezvous import (
    GroupStore,
    check_secret,
    parse_header,
    parse_layout,
    raise_if_layout_problems,
    version_from_json,
)
from lmcollect.weights.buckets import (
    BucketLayout,
    WeightBuckets,
    layout_problems,
    max_layout_nbytes,
    metadata_to_json,
)
from lmcollect.weights.delta import DeltaRejectedError, WeightDelta, prepare_delta
from lmcollect.weights.digest import BufferDigest, derive_key, same_digest
from lmcollect.weights.tensors import WeightDict, weight_problems
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)


class ProcessGroupReceiver(WeightReceiver):
    """One receiving rank of a :class:`ProcessGroupSender` 's group (see the sender).

    Every header is checked before anything is allocated for it: its signature (the group's
    secret), its kind, a full push's layout against this receiver's model metadata (names,
    dtypes, shapes: the sender already cast to this side's dtypes) and its buffer sizes against
    what those tensors need, a delta's buffer sizes against the full push held. A refused header
    raises ValueError and changes nothing. Once a full push's buffers are in, their keyed digest
    must match the one the sender signed (``digest/<n>``), else ValueError and nothing is
    loaded; a delta's keyed checksums are verified as it is applied.

    Args:
        timeout_s: how long ``receive_weights()`` waits for the next push (None: the group's
            ``timeout_s``); with no push by then it returns without loading anything.
    """

    def __init__(self, *, timeout_s: float | None = None) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        self._info: dict[str, Any] | None = None
        self._rank = -1
        self._store: GroupStore | None = None
        self._group: Any = None
        self._expected: tuple[dict, dict] = ({}, {})  # this model's metadata and aliases, as posted at connect
        self._num_pushes = 0
        self._buffers: list[torch.Tensor] | None = None
        self._layout: BucketLayout | None = None  # of the full push the buffers hold
        self._held: PushVersion | None = None  # the push the buffers hold (a delta's base)
        self._digest_key = b""  # derived from the group's secret by set_connection_info
        self._delta_key = b""
        self.last_receive_info: dict[str, Any] = {}
        """The last push received: "kind" (full / delta), "nbytes" received, "refused" (why a
        delta was refused, or None)."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_store=None, _group=None, _buffers=None)  # connections never travel
        return state

    def set_connection_info(self, connection_info: dict[str, Any], worker_idx: int = 0) -> None:
        """Where the sender is (its ``connection_info()``, secret included); this receiver becomes
        rank ``worker_idx + 1``. A refused ``connection_info`` changes nothing."""
        info = dict(connection_info)
        check_secret(info.get("secret"))
        rank = worker_idx + 1
        if not 1 <= rank < info["world_size"]:
            raise ValueError(
                f"worker_idx={worker_idx} is out of range: the group has {info['world_size'] - 1} receivers "
                "(worker_idx 0..num_receivers-1)."
            )
        self._info, self._rank = info, rank
        self._digest_key = derive_key(info["secret"], DIGEST_PURPOSE)
        self._delta_key = derive_key(info["secret"], DELTA_PURPOSE)

    def connect(self) -> None:
        """Post this collector's model metadata and join the group (blocks until all have joined)."""
        if self._info is None or self.context is None:
            raise RuntimeError(
                "register this receiver with a collector and call set_connection_info(...) before connect()."
            )
        timeout = datetime.timedelta(seconds=self._info["timeout_s"])
        tcp_store = dist.TCPStore(
            self._info["master_address"], self._info["master_port"], is_master=False, timeout=timeout
        )
        self._store = GroupStore(tcp_store, self._info["secret"])
        self._expected = self.context.weight_metadata(self.model_id or "policy")
        self._store.set(f"meta/{self._rank}", metadata_to_json(*self._expected))
        version_index = getattr(self.context, "version_index", None)  # the collector's; a vLLM worker has none
        self._store.set(f"held/{self._rank}", str(int(version_index()) if callable(version_index) else 0))
        self._group = make_group(
            self._info["backend"], self._store, self._rank, self._info["world_size"], timeout,
            toward=self._info["master_address"],
        )  # fmt: skip

    def receive(self, timeout_s: float | None = None) -> WeightDict | None:
        """Wait for the next push, take its broadcasts, return views of the weights it brings.

        A delta push patches the buffers of the last push; if this receiver (or another) refuses
        it, the full push that follows is taken in the same call."""
        if self._group is None:
            raise RuntimeError("call connect() before receiving weights.")
        info, _ = self._joined()
        wait_s = timeout_s if timeout_s is not None else info["timeout_s"]
        header = self._wait_header(wait_s)
        if header is None:
            return None
        refused_delta = None
        if header["kind"] == "delta":
            if self._receive_delta(header):
                return self._weights()
            refused_delta = self.last_receive_info
            header = self._wait_header(info["timeout_s"])  # the sender sends the full push next
            if header is None or header["kind"] != "full":
                raise RuntimeError("the sender announced a full push after a refused delta, and none came.")
        self._receive_full(header)
        if refused_delta is not None:
            self.last_receive_info["after_refused_delta"] = refused_delta
        return self._weights()

    def receive_into(self, apply: Callable[..., None], *, timeout_s: float | None = None) -> bool:
        """Receive and hand the weights to ``apply`` (the collector's loader) with the version the
        sender gave the push (``version=``): the collector takes it, and refuses (changing nothing)
        a push older than the weights it holds. False if none came."""
        weights = self.receive(timeout_s=timeout_s)
        if weights is None:
            return False
        apply(weights, version=self._held)
        return True

    def _joined(self) -> tuple[dict[str, Any], GroupStore]:
        """The sender's connection info and the group's store (both set by :meth:`connect`)."""
        assert self._info is not None and self._store is not None, "connect() joins the group first"
        return self._info, self._store

    def _wait_header(self, wait_s: float) -> dict | None:
        key = f"push/{self._num_pushes}"
        _, store = self._joined()
        try:
            store.wait([key], datetime.timedelta(seconds=wait_s))
        except dist.DistStoreError:
            return None
        return parse_header(store.get(key), key)

    def _check_full_layout(self, header: dict) -> BucketLayout:
        """The layout of a full push, if it is exactly this model's (ValueError otherwise)."""
        layout = parse_layout(header)
        raise_if_layout_problems(layout_problems(layout), self._rank)
        expected, aliases = self._expected
        problems = weight_problems(layout.metadata(), expected, aliases=aliases)
        limit = max_layout_nbytes(expected, aliases)
        if layout.total_nbytes > limit:
            problems.append(
                f"its buffers hold {layout.total_nbytes} bytes, more than this model's tensors need ({limit})"
            )
        raise_if_layout_problems(problems, self._rank)
        return layout

    def _check_delta_layout(self, header: dict) -> BucketLayout:
        """The layout of a delta push, if it is sound and no larger than the full push held.

        The sender never sends a delta above ``DeltaConfig.max_fraction`` (at most 1) of the
        bytes of its last full push, which this receiver holds: so that size bounds a delta."""
        layout = parse_layout(header)
        problems = layout_problems(layout)
        limit = self._layout.total_nbytes if self._layout is not None else max_layout_nbytes(*self._expected)
        if not problems and layout.total_nbytes > limit:
            problems.append(
                f"its buffers hold {layout.total_nbytes} bytes, more than the full push it patches ({limit})"
            )
        raise_if_layout_problems(problems, self._rank)
        try:
            WeightDelta.from_header(header, WeightBuckets(layout, []))  # its entries parse; nothing is read yet
        except (KeyError, TypeError, ValueError) as exc:  # designed: an untrusted header
            raise ValueError(f"delta header refused by receiver {self._rank}: malformed entries ({exc!r}).") from None
        return layout

    def _receive_full(self, header: dict) -> None:
        layout = self._check_full_layout(header)
        self._held = None  # the buffers are being overwritten
        if self._buffers is None or [b.numel() for b in self._buffers] != list(layout.buffer_nbytes):
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self._device()) for n in layout.buffer_nbytes]
        n = self._num_pushes
        self._layout = None  # until the digest matches: the buffers hold bytes nobody vouched for
        # a signed header says whether a digest follows (ProcessGroupConfig.digest)
        wanted = header.get("digest") is not False
        digest = BufferDigest(self._digest_key, digest_context(n, header["version"])) if wanted else None
        # every broadcast posted at once (the sender packs and sends buffer by buffer), all taken
        # even on an error, so the group stays in step; each hashed (on other threads) once it is in
        for work, buffer in [(self._group.broadcast(buffer, SENDER_RANK), buffer) for buffer in self._buffers]:
            work.wait()
            if digest is not None:
                digest.add(buffer)
        self._num_pushes += 1
        if digest is not None:
            self._verify_digest(n, digest)
        self._layout, self._held = layout, version_from_json(header["version"])
        self.last_receive_info = {"kind": "full", "nbytes": layout.total_nbytes, "refused": None}

    def _verify_digest(self, n: int, digest: BufferDigest) -> None:
        """Raise ValueError unless ``digest`` (of the buffers received) is the one the sender signed for push ``n``."""
        key = f"digest/{n}"
        info, store = self._joined()
        try:
            store.wait([key], datetime.timedelta(seconds=info["timeout_s"]))
        except dist.DistStoreError:  # designed: a sender that died, or a store that lost the key
            raise ValueError(
                f"full push {n} refused by receiver {self._rank}: no digest of its bytes came within "
                f"timeout_s={info['timeout_s']}; nothing was loaded."
            ) from None
        if not same_digest(store.get(key), digest.hexdigest()):  # get: ValueError if a forger wrote it
            raise ValueError(
                f"full push {n} refused by receiver {self._rank}: its bytes do not match the digest the sender "
                "signed, so they were changed on the way (a host on the network path, or a tampered gloo/NCCL "
                "rendezvous); nothing was loaded. Keep the group on a private network (see ProcessGroupConfig)."
            )

    def _receive_delta(self, header: dict) -> bool:
        """Take a delta's broadcasts, patch the buffers (or refuse), acknowledge, and return
        whether the sender's verdict is "ok" (False: a full push follows)."""
        layout = self._check_delta_layout(header)
        buffers = [torch.empty(n, dtype=torch.uint8, device=self._device()) for n in layout.buffer_nbytes]
        for buffer in buffers:
            self._group.broadcast(buffer, SENDER_RANK).wait()
        n = self._num_pushes
        self._num_pushes += 1
        refused = None
        try:
            if self._buffers is None or self._layout is None:
                raise DeltaRejectedError("this receiver holds no full push yet.")
            delta = WeightDelta.from_header(header, WeightBuckets(layout, buffers))
            prepare_delta(delta, self._weights(), held_version=self._held, checksum_key=self._delta_key).apply_()
        except DeltaRejectedError as exc:
            refused = str(exc)
            logger.warning("refusing delta push %d: %s", n, exc)
        _, store = self._joined()
        store.set(f"ack/{n}/{self._rank}", "ok" if refused is None else f"refused: {refused}")
        self._held = None  # the buffers are the new version only once the sender says so
        accepted = self._read_verdict(n)
        self._held = version_from_json(header["version"]) if accepted else None
        self.last_receive_info = {"kind": "delta", "nbytes": layout.total_nbytes, "refused": refused}
        return accepted

    def _read_verdict(self, n: int) -> bool:
        """The sender's verdict on delta push ``n``: True for "ok", False for "full"; ValueError
        for any other value or an unsigned one (this receiver then holds no base: the next
        delta is refused and a full push repairs it)."""
        key = f"verdict/{n}"
        info, store = self._joined()
        store.wait([key], datetime.timedelta(seconds=info["timeout_s"]))
        verdict = store.get(key)
        if verdict not in ("ok", "full"):
            raise ValueError(f"the verdict on delta push {n} is {verdict[:40]!r}, neither 'ok' nor 'full': refused.")
        return verdict == "ok"

    def _weights(self) -> WeightDict:
        assert self._layout is not None and self._buffers is not None
        return WeightBuckets(self._layout, self._buffers).tensors()

    def _device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self._joined()[0]["backend"] == "nccl"
            else torch.device("cpu")
        )

    @property
    def rank(self) -> int:
        """This receiver's rank in the group (-1 before ``set_connection_info``)."""
        return self._rank

    # the older private name, kept for callers written against it
    _set_dist_connection_info = set_connection_info

    def last_checksums(self) -> list[int]:
        """CRC32 of each buffer of the last push received (see ``ProcessGroupSender.last_checksums``)."""
        return buffer_checksums(self._buffers or [])

    def close(self) -> None:
        shutdown_group(self._group)
        self._group = None
