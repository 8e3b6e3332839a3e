"""ProcessGroupConfig: where and how a process-group sender and its receivers meet (a PushConfig plus the group's size)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lmcollect.weights.delta import DeltaConfig, resolve_delta
from lmcollect.weights.push_config import Backend, PushConfig

DEFAULT_ADDRESS = "127.0.0.1"
DEFAULT_BUCKET_SIZE_BYTES = 64 * 2**20


@dataclass(frozen=True, init=False)
class ProcessGroupConfig:
    """Where and how the sender and its receivers meet: the push options of a
    :class:`~lmcollect.weights.push_config.PushConfig` (declared there once: ``master_address``,
    ``master_port``, ``backend``, ``timeout_s``, ``bucket_size_bytes``, ``convert_dtype``,
    ``allow_non_finite``, ``digest``, ``delta``) plus the group's own ``num_receivers``.

    Build it with keywords (``ProcessGroupConfig(num_receivers=2, backend="gloo", timeout_s=30)``:
    every keyword but ``num_receivers`` is a PushConfig field) or from a PushConfig
    (``ProcessGroupConfig(num_receivers=2, push=config)``). Ray-only options are refused.
    ``delta="auto"`` is the updater's to resolve: a group pushes delta or full (``use_delta``).

    What listens where: the sender's rendezvous store (a ``torch.distributed.TCPStore``) on
    ``master_port`` on *all* interfaces, whatever ``master_address`` says (that is only where
    receivers connect to); then every rank of the group opens the backend's own ports: gloo
    listens on ephemeral TCP ports of the address its host name resolves to (or of
    ``GLOO_SOCKET_IFNAME``), NCCL on ephemeral ports of ``NCCL_SOCKET_IFNAME`` (plus NVLink /
    InfiniBand). Firewall ``master_port`` and the ephemeral range so that only the trainer and
    engine hosts reach them, or keep the group on a private network: see :class:`ProcessGroupSender`
    for what the group's secret protects and what it does not.
    """

    push: PushConfig
    """The push options (see :class:`~lmcollect.weights.push_config.PushConfig`)."""
    num_receivers: int
    """Receivers in the group (ranks 1..num_receivers)."""

    def __init__(self, *, num_receivers: int = 1, push: PushConfig | None = None, **push_options: Any) -> None:
        if isinstance(num_receivers, bool) or not isinstance(num_receivers, int) or num_receivers < 1:
            raise ValueError(f"num_receivers must be an int >= 1, got {num_receivers!r}.")
        if push is not None and not isinstance(push, PushConfig):
            raise TypeError(f"ProcessGroupConfig(push=...) takes a PushConfig, got {type(push).__name__}.")
        unknown = sorted(set(push_options) - set(PushConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(
                f"ProcessGroupConfig got unknown option(s) {unknown}: it takes num_receivers, push and the "
                "fields of PushConfig (lmcollect.weight_sync.PushConfig)."
            )
        config = replace(push if push is not None else PushConfig(), **push_options)
        config.check_for("process group", updater="ProcessGroupConfig")
        if config.delta == "auto":
            raise ValueError(
                "ProcessGroupConfig(delta='auto'): a group's sender pushes delta or full; 'auto' is chosen per "
                "push by vLLMUpdater(config=PushConfig(delta='auto')). Pass delta=True or a DeltaConfig."
            )
        object.__setattr__(self, "push", config)
        object.__setattr__(self, "num_receivers", num_receivers)

    # ------------------------------------------------------------------ the push options, as the group reads them
    @property
    def master_address(self) -> str:
        """Address of the sender (rank 0) that receivers connect to (PushConfig's, else loopback)."""
        return self.push.master_address or DEFAULT_ADDRESS

    @property
    def master_port(self) -> int:
        """TCP port of the rendezvous store, on all interfaces (0: pick a free one; see ``connection_info()``)."""
        return self.push.master_port or 0

    @property
    def backend(self) -> Backend:
        """ "auto" (NCCL when CUDA is available, buffers on the GPU; else gloo), "gloo" or "nccl"."""
        return self.push.backend

    @property
    def timeout_s(self) -> float:
        """Longest wait for the rendezvous, a push's metadata, or a broadcast."""
        assert self.push.timeout_s is not None, "check_for('process group') refuses None"
        return self.push.timeout_s

    @property
    def bucket_size_bytes(self) -> int:
        """Largest broadcast buffer (PushConfig's, else 64 MiB)."""
        return self.push.bucket_size_bytes or DEFAULT_BUCKET_SIZE_BYTES

    @property
    def convert_dtype(self) -> bool:
        return self.push.convert_dtype

    @property
    def allow_non_finite(self) -> bool:
        return self.push.allow_non_finite

    @property
    def digest(self) -> bool:
        return self.push.digest

    @property
    def delta(self) -> DeltaConfig | None:
        """The delta encoding of every push (None: full pushes)."""
        delta = self.push.delta
        assert delta != "auto", "refused by __init__"
        return resolve_delta(delta)
