"""ProcessGroupConfig: where and how a process-group sender and its receivers meet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lmcollect.weights.delta import DeltaConfig


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
