"""ProcessGroupSender: rank 0 of the group, which sends each push (metadata first, then a few flat buckets)."""

from __future__ import annotations

import datetime
import json
import logging
import secrets
from typing import Any

import torch
import torch.distributed as dist

from lmcollect.transports.base import WeightSender
from lmcollect.transports.process_group.config import ProcessGroupConfig
from lmcollect.transports.process_group.group import (
    DELTA_PURPOSE,
    DIGEST_PURPOSE,
    SENDER_RANK,
    buffer_checksums,
    digest_context,
    make_group,
    resolve_backend,
    shutdown_group,
)
from lmcollect.transports.rendezvous import GroupStore, version_json
from lmcollect.weights.buckets import (
    BucketLayout,
    layout_to_json,
    metadata_from_json,
    pack_buckets,
    plan_layout,
)
from lmcollect.weights.delta import (
    DeltaBase,
    DeltaConfig,
    EncodedDelta,
    PreparedPush,
    PushStats,
    distinct_tensors,
)
from lmcollect.weights.digest import BufferDigest, derive_key
from lmcollect.weights.tensors import (
    WeightDict,
    agreed_held_dtypes,
    non_finite_problems,
    problems_per_receiver,
    raise_if_problems,
    to_weight_dict,
)
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)

DIRECT_SEND_MIN_BYTES = 1 << 20  # full pushes without delta send tensors this large from the trainer's memory


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
        self.backend = resolve_backend(self.config.backend)
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
        self._digest_key = derive_key(self._secret, DIGEST_PURPOSE)
        self._delta_key = derive_key(self._secret, DELTA_PURPOSE)
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
        self._group = make_group(
            self.backend, self._store, SENDER_RANK, self.config.num_receivers + 1, self._timeout,
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
            sending.append(self._group.broadcast(buffer, SENDER_RANK))
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
            self._group.broadcast(buffer, SENDER_RANK).wait()
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
        shutdown_group(self._group)
        self._group = None
