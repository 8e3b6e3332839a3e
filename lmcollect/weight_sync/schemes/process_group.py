"""Weight sync over a torch.distributed process group: metadata through the store, buffers by broadcast."""
from __future__ import annotations

import datetime
import logging
import zlib
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from lmcollect.weight_sync.buckets import (
    WeightBuckets,
    layout_from_json,
    layout_to_json,
    metadata_from_json,
    metadata_to_json,
    pack_buckets,
)
from lmcollect.weight_sync.schemes.base import WeightReceiver, WeightSender
from lmcollect.weight_sync.weights import WeightDict, raise_if_problems, tensor_metadata, to_weight_dict, weight_problems

logger = logging.getLogger(__name__)

_SENDER_RANK = 0


@dataclass(frozen=True, kw_only=True)
class ProcessGroupConfig:
    """Where and how the sender and its receivers meet."""

    master_address: str = "127.0.0.1"
    """Address of the sender (rank 0); receivers connect to it. Use a routable address across nodes."""
    master_port: int = 0
    """TCP port of the rendezvous store (0: pick a free one; see ``connection_info()``)."""
    num_receivers: int = 1
    """Receivers in the group (ranks 1..num_receivers)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """"auto": NCCL when CUDA is available (buffers on the GPU), else gloo (buffers in RAM)."""
    timeout_s: float = 300.0
    """Longest wait for the rendezvous, a push's metadata, or a broadcast."""
    bucket_size_bytes: int = 512 * 2**20
    """Largest broadcast buffer: weights travel as per-dtype buffers up to this size."""
    convert_dtype: bool = False
    """Accept floating tensors of another dtype than the receivers hold (e.g. an fp32 trainer and a
    bf16 engine) and cast them on this side while packing each bucket; False: such a push is refused."""

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
    per-dtype buffers; each receiver, inside ``collector.receive_weights()``, takes them and its
    collector loads them (checked, in place, under its policy lock, one version bump).

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
        self._store = dist.TCPStore(
            self.config.master_address,
            self.config.master_port,
            self.config.num_receivers + 1,
            is_master=True,
            timeout=self._timeout,
            wait_for_workers=False,
        )
        self._group: Any = None
        self._receiver_metadata: list[tuple[dict, dict]] = []
        self._num_pushes = 0
        self._out: list[torch.Tensor] | None = None

    def connection_info(self) -> dict[str, Any]:
        """What receivers need to join (plain data: picklable, JSON-able)."""
        return {
            "master_address": self.config.master_address,
            "master_port": self._store.port,
            "world_size": self.config.num_receivers + 1,
            "backend": self.backend,
            "timeout_s": self.config.timeout_s,
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
        sent = tensor_metadata(to_weight_dict(weights))
        convert = self.config.convert_dtype
        problems = []
        for rank, (expected, aliases) in enumerate(self._receiver_metadata, start=1):
            problems += [
                f"receiver {rank}: {p}" for p in weight_problems(sent, expected, aliases=aliases, convert_dtype=convert)
            ]
        raise_if_problems(problems, where=" on every receiver")

    def receiver_dtypes(self, weights: WeightDict) -> dict[str, torch.dtype]:
        """name -> the dtype the receivers hold it in, for every floating tensor sent in another one
        (call after :meth:`check`). Every receiver gets the same broadcast buffers, so all must agree."""
        dtypes: dict[str, torch.dtype] = {}
        for name, tensor in weights.items():
            held = {expected[aliases.get(name, name)][0] for expected, aliases in self._receiver_metadata}
            if len(held) > 1:
                raise ValueError(
                    f"receivers hold {name!r} in different dtypes {sorted(map(str, held))}; one broadcast "
                    "cannot feed them all: give every engine the same dtype."
                )
            dtype = held.pop()
            if tensor.is_floating_point() and dtype != tensor.dtype:
                dtypes[name] = dtype
        return dtypes

    def last_checksums(self) -> list[int]:
        """CRC32 of each buffer of the last push (compare with the receivers' :meth:`last_checksums`)."""
        return buffer_checksums(self._out or [])

    def connect(self) -> None:
        """Form the group (blocks until every receiver has called ``connect``)."""
        self._group = _make_group(self.backend, self._store, _SENDER_RANK, self.config.num_receivers + 1, self._timeout)
        self._receiver_metadata = [
            metadata_from_json(self._store.get(f"meta/{rank}")) for rank in range(1, self.config.num_receivers + 1)
        ]
        logger.info("process group formed: %d receiver(s), backend %s", self.config.num_receivers, self.backend)

    def send(self, weights: object) -> None:
        weights = to_weight_dict(weights)
        self.check(weights)
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        dtypes = self.receiver_dtypes(weights) if self.config.convert_dtype else None
        buckets = pack_buckets(
            weights, bucket_size_bytes=self.config.bucket_size_bytes, out=self._out, device=device, dtypes=dtypes
        )
        self._out = buckets.buffers
        self._store.set(f"push/{self._num_pushes}", layout_to_json(buckets.layout))
        if self._num_pushes > 0:
            self._store.delete_key(f"push/{self._num_pushes - 1}")
        for buffer in buckets.buffers:
            self._group.broadcast(buffer, _SENDER_RANK).wait()
        self._num_pushes += 1

    def close(self) -> None:
        _shutdown(self._group)
        self._group = None


class ProcessGroupReceiver(WeightReceiver):
    """One receiving rank of a :class:`ProcessGroupSender` 's group (see the sender).

    Args:
        timeout_s: how long ``receive_weights()`` waits for the next push (None: the group's
            ``timeout_s``); with no push by then it returns without loading anything.
    """

    def __init__(self, *, timeout_s: float | None = None) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        self._info: dict[str, Any] | None = None
        self._rank = -1
        self._store: Any = None
        self._group: Any = None
        self._num_pushes = 0
        self._buffers: list[torch.Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_store=None, _group=None, _buffers=None)  # connections never travel
        return state

    def set_connection_info(self, connection_info: dict[str, Any], worker_idx: int = 0) -> None:
        """Where the sender is (its ``connection_info()``); this receiver becomes rank ``worker_idx + 1``."""
        self._info = dict(connection_info)
        self._rank = worker_idx + 1
        if not 1 <= self._rank < self._info["world_size"]:
            raise ValueError(
                f"worker_idx={worker_idx} is out of range: the group has {self._info['world_size'] - 1} receivers "
                "(worker_idx 0..num_receivers-1)."
            )

    def connect(self) -> None:
        """Post this collector's model metadata and join the group (blocks until all have joined)."""
        if self._info is None or self.context is None:
            raise RuntimeError(
                "register this receiver with a collector and call set_connection_info(...) before connect()."
            )
        timeout = datetime.timedelta(seconds=self._info["timeout_s"])
        self._store = dist.TCPStore(self._info["master_address"], self._info["master_port"], is_master=False, timeout=timeout)
        expected, aliases = self.context.weight_metadata(self.model_id or "policy")
        self._store.set(f"meta/{self._rank}", metadata_to_json(expected, aliases))
        self._group = _make_group(self._info["backend"], self._store, self._rank, self._info["world_size"], timeout)

    def receive(self, timeout_s: float | None = None) -> WeightDict | None:
        """Wait for the next push's layout, take its broadcasts, return views of the received buffers."""
        if self._group is None:
            raise RuntimeError("call connect() before receiving weights.")
        key = f"push/{self._num_pushes}"
        wait_s = timeout_s if timeout_s is not None else self._info["timeout_s"]
        try:
            self._store.wait([key], datetime.timedelta(seconds=wait_s))
        except dist.DistStoreError:
            return None
        layout = layout_from_json(self._store.get(key))
        device = torch.device("cuda", torch.cuda.current_device()) if self._info["backend"] == "nccl" else torch.device("cpu")
        if self._buffers is None or [b.numel() for b in self._buffers] != list(layout.buffer_nbytes):
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in layout.buffer_nbytes]
        for buffer in self._buffers:  # always take every broadcast, so the group stays in step
            self._group.broadcast(buffer, _SENDER_RANK).wait()
        self._num_pushes += 1
        return WeightBuckets(layout, self._buffers).tensors()

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


def buffer_checksums(buffers: list[torch.Tensor]) -> list[int]:
    """CRC32 of each 1-D uint8 buffer (GPU buffers are copied to the CPU first: a debugging aid)."""
    return [zlib.crc32(b.detach().cpu().contiguous().numpy()) for b in buffers]


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError("backend='nccl' needs a CUDA build of torch with NCCL; use backend='gloo' on CPU.")
    return backend


def _make_group(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    # A standalone group: the trainer's default process group (if any) is left alone.
    prefixed = dist.PrefixStore("lmcollect/weights/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout  # the attribute torch's own init_process_group sets
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def _shutdown(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        shutdown()
