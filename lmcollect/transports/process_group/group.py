"""The group both sides form: the backend, the gloo device, digests and checksums, shutdown."""

from __future__ import annotations

import datetime
import json
import os
import socket
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lmcollect.transports.rendezvous import GroupStore

SENDER_RANK = 0
DIGEST_PURPOSE = "lmcollect full push digest"  # keys derived from the group's secret, one per use
DELTA_PURPOSE = "lmcollect delta checksum"


def digest_context(n: int, version: Sequence[Any]) -> bytes:
    """What a full push's digest is bound to: its number in the group and its version (as JSON)."""
    return json.dumps(["lmcollect full push", n, version]).encode()


def buffer_checksums(buffers: list[torch.Tensor]) -> list[int]:
    """CRC32 of each 1-D uint8 buffer (GPU buffers are copied to the CPU first: a debugging aid)."""
    return [zlib.crc32(b.detach().cpu().contiguous().numpy()) for b in buffers]


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError("backend='nccl' needs a CUDA build of torch with NCCL; use backend='gloo' on CPU.")
    return backend


def make_group(
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


def shutdown_group(group: Any) -> None:
    shutdown = getattr(group, "shutdown", None)
    if callable(shutdown):
        shutdown()
