"""Weight sync over a torch.distributed process group: metadata through the store, buffers by broadcast."""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from lmcollect.transports.base import WeightReceiver, WeightSender
from lmcollect.transports.rendezvous import (
    GroupStore,
    check_secret,
    parse_header,
    parse_layout,
    raise_if_layout_problems,
    version_from_json,
    version_json,
)
from lmcollect.weights.buckets import (
    BucketLayout,
    WeightBuckets,
    layout_problems,
    layout_to_json,
    max_layout_nbytes,
    metadata_from_json,
    metadata_to_json,
    pack_buckets,
    plan_layout,
)
from lmcollect.weights.delta import (
    DeltaBase,
    DeltaConfig,
    DeltaRejectedError,
    EncodedDelta,
    PreparedPush,
    PushStats,
    WeightDelta,
    distinct_tensors,
    prepare_delta,
)
from lmcollect.weights.digest import BufferDigest, derive_key, same_digest
from lmcollect.weights.tensors import (
    WeightDict,
    agreed_held_dtypes,
    non_finite_problems,
    problems_per_receiver,
    raise_if_problems,
    to_weight_dict,
    weight_problems,
)
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)

_SENDER_RANK = 0
_DIGEST_PURPOSE = "lmcollect full push digest"  # keys derived from the group's secret, one per use
_DELTA_PURPOSE = "lmcollect delta checksum"
DIRECT_SEND_MIN_BYTES = 1 << 20  # full pushes without delta send tensors this large from the trainer's memory


@dataclass(frozen=True, kw_only=True)
class ProcessGroupConfig:
    """Where and how the sender and its receivers meet.

    What listens where: the sender's rendezvous store (a ``torch.distributed.TCPStore``) on
    ``master_port`` on *all* interfaces, whatever ``master_address`` says (that is only where
    receivers connect to); then every rank of the group opens the backend's own ports: gloo
    listens on ephemeral TCP ports of the address its host name resolves to (or of
    ``GLOO_SOCKET_IFNAME``), NCCL on ephemeral ports of ``NCCL_SOCKET_IFNAME`` (plus NVLink /
    InfiniBand). Firewall ``master_port`` and the ephemeral range so that only the trainer and
    engine hosts reach them, or keep the group on a private network: see :class:`ProcessGroupSender`
    for what the group's secret protects and what it does not.
    """

    master_address: str = "127.0.0.1"
    """Address of the sender (rank 0); receivers connect to it. Use a routable address across nodes.
    The store listens on every interface regardless: firewall ``master_port``."""
    master_port: int = 0
    """TCP port of the rendezvous store, on all interfaces (0: pick a free one; see ``connection_info()``)."""
    num_receivers: int = 1
    """Receivers in the group (ranks 1..num_receivers)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """"auto": NCCL when CUDA is available (buffers on the GPU), else gloo (buffers in RAM)."""
    timeout_s: float = 300.0
    """Longest wait for the rendezvous, a push's metadata, or a broadcast."""
    bucket_size_bytes: int = 64 * 2**20
    """Largest broadcast buffer: weights travel as per-dtype buffers up to this size."""
    convert_dtype: bool = False
    """Accept floating tensors of another dtype than the receivers hold (e.g. an fp32 trainer and a
    bf16 engine) and cast them on this side while packing each bucket; False: such a push is refused."""
    allow_non_finite: bool = False
    """Send weights holding NaN or infinite values; False: such a push is refused before anything is
    sent (checked on the values as the receivers will hold them: an fp32 1e5 for an fp16 receiver is
    infinite; with delta, on the changed values)."""
    digest: bool = True
    """Authenticate a full push's bytes: a keyed digest (HMAC-SHA256 with a key derived from the
    group's secret) of its buffers, which every receiver verifies before anything is loaded, so
    bytes changed on the way (a host on the network path, a rewritten gloo/NCCL rendezvous) are
    refused. It costs a hash of every byte on each side, overlapped with the transfer (chunks on a
    few threads; GPU buffers are copied to the host first). False: no digest, for a group on a
    network nothing untrusted reaches (one host with the store's port firewalled, a private fabric).
    Delta pushes keep their keyed checksums either way."""
    delta: DeltaConfig | None = None
    """Delta pushes: the sender keeps its packed buffers of the last push, and the next push
    broadcasts only the changed elements; each receiver patches its copy of the last push (its
    receive buffers), verifies the checksums and acknowledges; if any receiver refuses, a full
    push follows at once. None: every push is a full push."""

    def __post_init__(self) -> None:
        if self.num_receivers < 1:
            raise ValueError(f"num_receivers must be >= 1, got {self.num_receivers}.")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}.")
        if self.timeout_s <= 0 or self.bucket_size_bytes <= 0:
            raise ValueError("timeout_s and bucket_size_bytes must be positive.")


class ProcessGroupSender(WeightSender):
    """Rank 0 of a process group whose other ranks are receivers inside collectors.

    Once: build the sender (it starts the rendezvous store), give ``connection_info()`` to each
    receiver (``set_connection_info``, e.g. through ``collector.cascade_execute``), then
    call ``connect()`` on every side at the same time: each receiver posts its model's metadata,
    and the group forms. Per push: ``send`` checks the weights against every receiver's metadata
    (one ValueError, nothing sent), posts the layout in the store, then broadcasts a few flat
    per-dtype buffers, then a keyed digest of those buffers; each receiver, inside
    ``collector.receive_weights()``, takes them, verifies the digest, and its collector loads them
    (checked, in place, under its policy lock, one version bump).
    With ``config.delta``, a push after the first posts a delta header and broadcasts only the
    changed elements; every receiver patches its buffers of the last push, verifies, posts an
    acknowledgement, and the sender posts a verdict: "ok", or "full" followed by a full push.

    Security: the store listens on ``master_port`` on all interfaces (see
    :class:`ProcessGroupConfig`), and any host that reaches it can read, write, delete and list
    its keys. So each group has a secret (``secrets.token_hex(16)``) that travels in
    ``connection_info()`` over the channel that carries it (the driver, Ray, ``collective_rpc``),
    never through the store and never in a log. Every key lmcollect uses (``meta/``, ``push/``,
    ``digest/``, ``ack/``, ``verdict/``, and the gloo/NCCL rendezvous) lives under a prefix
    derived from it, and every lmcollect value is signed with it (HMAC-SHA256), so a value
    written by a host without the secret is never read or is refused (listing the keys reveals
    the prefix, not the secret). Receivers also check each header against their own model before
    allocating (layout, buffer sizes). The broadcast bytes are authenticated too: a full push's
    buffers by a keyed digest (HMAC-SHA256, with a key derived from the secret) (``digest/<n>``, posted
    once they are packed and verified by each receiver before its collector loads anything), a
    delta's entries by keyed checksums in its signed header; bytes changed on the way (a host on
    the path, a hijacked gloo/NCCL rendezvous) are refused. What the secret does not stop: a
    host reaching the store can delete keys or tamper with the gloo/NCCL rendezvous entries (a
    failed group), and can read the weights (not encrypted). Firewall ``master_port`` and the
    backend's ports to the trainer and engine hosts.

    Example (a collector in a Ray actor)::

        sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=1))
        collector.register_scheme_receiver({"policy": ProcessGroupReceiver()}, synchronize_weights=False)
        collector.cascade_execute("_receiver_schemes['policy'].set_connection_info",
                                  sender.connection_info(), worker_idx=0)
        joined = collector.actor.cascade_execute.remote("_receiver_schemes['policy'].connect")
        sender.connect(); ray.get(joined)
        pulled = collector.actor.receive_weights.remote()
        sender.send(trainer_model); ray.get(pulled)
    """

    def __init__(self, config: ProcessGroupConfig | None = None) -> None:
        self.config = config or ProcessGroupConfig()
        self.backend = _resolve_backend(self.config.backend)
        self._timeout = datetime.timedelta(seconds=self.config.timeout_s)
        self._secret = secrets.token_hex(16)  # travels only in connection_info(): never log it
        tcp_store = dist.TCPStore(
            self.config.master_address,
            self.config.master_port,
            self.config.num_receivers + 1,
            is_master=True,
            timeout=self._timeout,
            wait_for_workers=False,
        )
        self._store = GroupStore(tcp_store, self._secret)
        self._group: Any = None
        self._receiver_metadata: list[tuple[dict, dict]] = []
        self._num_pushes = 0
        self._last_version = 0  # the index of the last push's version (the next one counts up from it)
        self._out: list[torch.Tensor] | None = None  # packing buffers reused by the next full push
        self._sent: list[torch.Tensor] = []  # the buffers of the last full push (checksums, sizes)
        self._digest_key = derive_key(self._secret, _DIGEST_PURPOSE)
        self._delta_key = derive_key(self._secret, _DELTA_PURPOSE)
        self._delta_base = (
            DeltaBase(self.config.delta, checksum_key=self._delta_key) if self.config.delta is not None else None
        )
        self.last_push_stats: PushStats | None = None
        """What the last push moved: full or delta, bytes, changed elements, receivers repaired."""

    def connection_info(self) -> dict[str, Any]:
        """What receivers need to join (plain data: picklable, JSON-able), the group's secret
        included: hand it over a trusted channel only (the driver, Ray, ``collective_rpc``), and
        never log or print it."""
        return {
            "master_address": self.config.master_address,
            "master_port": self._store.store.port,
            "world_size": self.config.num_receivers + 1,
            "backend": self.backend,
            "timeout_s": self.config.timeout_s,
            "secret": self._secret,
        }

    @property
    def receiver_metadata(self) -> list[tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]]:
        """What each receiver (rank 1, 2, ...) accepts: name -> (dtype, shape), and tied aliases."""
        if self._group is None:
            raise RuntimeError("receivers post their metadata in connect(); call connect() first.")
        return list(self._receiver_metadata)

    def check(self, weights: object) -> None:
        """Raise one ValueError, before anything is sent, if ``weights`` do not fit every receiver."""
        if self._group is None:
            raise RuntimeError("call connect() (on the sender and every receiver) before send().")
        per_receiver = problems_per_receiver(
            to_weight_dict(weights), self._receiver_metadata, convert_dtype=self.config.convert_dtype
        )
        problems = [f"receiver {rank}: {p}" for rank, found in enumerate(per_receiver, start=1) for p in found]
        raise_if_problems(problems, where=" on every receiver")

    def last_checksums(self) -> list[int]:
        """CRC32 of each buffer of the last push (compare with the receivers' :meth:`last_checksums`)."""
        return buffer_checksums(self._sent)

    def connect(self) -> None:
        """Form the group (blocks until every receiver has called ``connect``)."""
        self._group = _make_group(
            self.backend, self._store, _SENDER_RANK, self.config.num_receivers + 1, self._timeout,
            toward=self.config.master_address,
        )  # fmt: skip
        self._receiver_metadata = [
            metadata_from_json(self._store.get(f"meta/{rank}")) for rank in range(1, self.config.num_receivers + 1)
        ]  # signed by the receivers: a forged "meta/" value raises here
        # count up from the newest version a receiver's collector holds: a new sender's pushes are not stale
        held = [int(self._store.get(f"held/{rank}")) for rank in range(1, self.config.num_receivers + 1)]
        self._last_version = max(self._last_version, *held)
        logger.info("process group formed: %d receiver(s), backend %s", self.config.num_receivers, self.backend)

    def prepare(self, weights: object) -> PreparedPush:
        """Check ``weights`` against every receiver, with delta encode the changes since the last
        push, and refuse NaN/Inf in what would travel, as the receivers would hold it (unless
        ``config.allow_non_finite``). Nothing is sent and nothing changes: a caller may still
        refuse the push."""
        weights = to_weight_dict(weights)
        self.check(weights)
        dtypes = None
        if self.config.convert_dtype:
            dtypes = agreed_held_dtypes(
                weights,
                self._receiver_metadata,
                why_one="one broadcast cannot feed them all: give every engine the same dtype.",
            )
        encoded = self._delta_base.encode(weights, dtypes) if self._delta_base is not None else None
        prepared = PreparedPush(weights, dtypes, encoded)
        if not self.config.allow_non_finite:
            problems = non_finite_problems(prepared.sent_values(), dtypes=dtypes)
            raise_if_problems(problems, where=" before sending (or ProcessGroupConfig(allow_non_finite=True))")
        return prepared

    def send(self, weights: object, *, version: PushVersion | None = None) -> None:
        """Push ``weights`` (the weights, or what :meth:`prepare` returned) as ``version`` (None: one
        above the last push's). Receivers refuse a version older than the one their collector holds.

        A delta that a receiver refuses is followed by a full push within this call."""
        prepared = weights if isinstance(weights, PreparedPush) else self.prepare(weights)
        version = version if version is not None else PushVersion(self._last_version + 1)
        self._last_version = version.index
        refused: list[int] = []
        if prepared.encoded is not None:
            refused = self._send_delta(prepared.encoded, version)
            if not refused:
                assert self._delta_base is not None
                self._delta_base.commit(prepared.encoded, version)
                self.last_push_stats = prepared.encoded.stats()
                return
            logger.warning("receiver(s) %s refused the delta push; sending the full weights", refused)
        self._send_full(prepared, version)
        nbytes = sum(b.numel() for b in self._sent)
        self.last_push_stats = PushStats.full(nbytes, num_full=self.config.num_receivers, num_repaired=len(refused))

    @property
    def uses_delta(self) -> bool:
        """Whether pushes after the first may be deltas (a base of the last push is kept)."""
        return self._delta_base is not None

    def use_delta(self, config: DeltaConfig | None) -> None:
        """Turn delta pushes on (with ``config``; the next push is full and becomes the base) or off
        (None: the base is dropped, full pushes again). Keeps a base already kept when turned on again."""
        if config is None:
            self._delta_base = None
        elif self._delta_base is None:
            self._delta_base = DeltaBase(config, checksum_key=self._delta_key)

    def reset_delta_base(self) -> None:
        """Forget the last push (with ``config.delta``): the next push is a full push."""
        if self._delta_base is not None:
            self._delta_base.reset()

    def _send_full(self, prepared: PreparedPush, version: PushVersion) -> None:
        device = self._device()
        layout = self.layout_for(prepared.weights, prepared.dtypes)
        direct = self._delta_base is None  # a delta base must own its bytes: it copies
        if self._delta_base is not None:
            self._delta_base.reset()  # the buffers change now; they are the base again once sent
        n = self._num_pushes
        header: dict[str, Any] = {
            "kind": "full",
            "version": version_json(version),
            "layout": layout_to_json(layout),
            "digest": self.config.digest,  # signed with the header: no one else can switch it off
        }
        self._post_header(header)
        sending: list[Any] = []  # buffer i goes on the wire while later buffers are being packed
        digest = BufferDigest(self._digest_key, digest_context(n, header["version"])) if self.config.digest else None

        def send_packed(_: int, buffer: torch.Tensor) -> None:
            sending.append(self._group.broadcast(buffer, _SENDER_RANK))
            if digest is not None:
                digest.add(buffer)  # hashed on other threads while it is on the wire

        buckets = pack_buckets(
            prepared.weights,
            bucket_size_bytes=self.config.bucket_size_bytes,
            out=self._out,
            device=device,
            dtypes=prepared.dtypes,
            layout=layout,
            on_buffer_packed=send_packed,
            direct=direct,
        )
        if digest is not None:
            self._store.set(f"digest/{n}", digest.hexdigest())  # signed: receivers verify before loading
        for work in sending:
            work.wait()
        self._sent = buckets.buffers
        self._out = None if direct else buckets.buffers  # direct buffers are the trainer's own tensors: no reuse
        self._num_pushes += 1
        if self._delta_base is not None:
            self._delta_base.adopt(distinct_tensors(buckets.tensors()), prepared.weights, version, prepared.dtypes)

    def layout_for(self, weights: WeightDict, dtypes: dict[str, torch.dtype] | None = None) -> BucketLayout:
        """How a full push of ``weights`` is cut into broadcast buffers: tensors of at least
        ``DIRECT_SEND_MIN_BYTES`` travel in buffers of their own, straight from the trainer's memory
        (without delta); the rest is packed into buffers of up to ``bucket_size_bytes``."""
        own = DIRECT_SEND_MIN_BYTES if self._delta_base is None else None
        return plan_layout(
            weights, bucket_size_bytes=self.config.bucket_size_bytes, dtypes=dtypes, own_buffer_min_bytes=own
        )

    def _send_delta(self, encoded: EncodedDelta, version: PushVersion) -> list[int]:
        """Broadcast a delta; returns the ranks that refused it (then a full push must follow)."""
        delta = encoded.delta
        buckets = pack_buckets(
            delta.arrays.tensors(), bucket_size_bytes=self.config.bucket_size_bytes, device=self._device()
        )
        n = self._num_pushes
        self._post_header(
            {
                "kind": "delta",
                "version": version_json(version),
                "layout": layout_to_json(buckets.layout),
                **delta.header(),
            }
        )
        for buffer in buckets.buffers:
            self._group.broadcast(buffer, _SENDER_RANK).wait()
        self._num_pushes += 1
        ranks = range(1, self.config.num_receivers + 1)
        keys = [f"ack/{n}/{rank}" for rank in ranks]
        self._store.wait(keys, self._timeout)
        answers = {rank: self._read_ack(key) for rank, key in zip(ranks, keys, strict=True)}
        for key in keys:
            self._store.delete(key)
        refused = [rank for rank, answer in answers.items() if answer != "ok"]
        for rank in refused:
            logger.info("receiver %d refused delta push %d: %s", rank, n, answers[rank])
        self._post_verdict(n, "full" if refused else "ok")
        return refused

    def _read_ack(self, key: str) -> str:
        """A receiver's answer to a delta: "ok" or "refused: why". Anything else (unsigned,
        unknown) counts as a refusal: the safe side, a full push follows."""
        try:
            answer = self._store.get(key)
        except ValueError as exc:  # designed: a forged or corrupt value in the store
            return f"refused: {exc}"
        if answer == "ok" or answer.startswith("refused: "):
            return answer
        return f"refused: unknown acknowledgement {answer[:40]!r}"

    def _post_verdict(self, n: int, verdict: str) -> None:
        self._store.set(f"verdict/{n}", verdict)

    def _post_header(self, header: dict) -> None:
        n = self._num_pushes
        self._store.set(f"push/{n}", json.dumps(header))
        # Push n-1's header was read by every receiver (they took its broadcasts). A delta's
        # verdict, or a full push's digest, may still be unread when the next header goes up (it
        # is read after the broadcasts), but it was read before push n-1's broadcasts could
        # complete: delete it one push later.
        if n > 0:
            self._store.delete(f"push/{n - 1}")
        if n > 1:
            self._store.delete(f"verdict/{n - 2}")
            self._store.delete(f"digest/{n - 2}")

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        _shutdown(self._group)
        self._group = None


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
        self._digest_key = derive_key(info["secret"], _DIGEST_PURPOSE)
        self._delta_key = derive_key(info["secret"], _DELTA_PURPOSE)

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
        self._group = _make_group(
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
        for work, buffer in [(self._group.broadcast(buffer, _SENDER_RANK), buffer) for buffer in self._buffers]:
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
            self._group.broadcast(buffer, _SENDER_RANK).wait()
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
        _shutdown(self._group)
        self._group = None


def digest_context(n: int, version: Sequence[Any]) -> bytes:
    """What a full push's digest is bound to: its number in the group and its version (as JSON)."""
    return json.dumps(["lmcollect full push", n, version]).encode()


def buffer_checksums(buffers: list[torch.Tensor]) -> list[int]:
    """CRC32 of each 1-D uint8 buffer (GPU buffers are copied to the CPU first: a debugging aid)."""
    return [zlib.crc32(b.detach().cpu().contiguous().numpy()) for b in buffers]


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError("backend='nccl' needs a CUDA build of torch with NCCL; use backend='gloo' on CPU.")
    return backend


def _make_group(
    backend: str, store: GroupStore, rank: int, world_size: int, timeout: datetime.timedelta, *, toward: str
) -> Any:
    # A standalone group: the trainer's default process group (if any) is left alone.
    prefixed = store.backend_store()
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [gloo_device(toward)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout  # the attribute torch's own init_process_group sets
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def gloo_device(toward: str) -> Any:
    """The gloo device of this rank: ``GLOO_SOCKET_IFNAME`` when set, else the local address that
    routes to ``toward`` (the sender's ``master_address``). Gloo's own default, the address this
    host's name resolves to, is often loopback (``/etc/hosts``), which the other nodes cannot reach."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_device(hostname=local_address_toward(toward))


def local_address_toward(address: str) -> str:
    """This host's address on the route to ``address`` (a UDP connect only picks a route: nothing is sent)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])


def _shutdown(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        shutdown()
