"""Byte buffers handed to vLLM workers in other processes through one shared-memory file, not the RPC.

vLLM's ``collective_rpc`` serialises its arguments when the engine core or the workers run in
other processes: a push's buffers would be copied into the message, sent over ZeroMQ and copied
out again (about 0.25 s for 42 MiB here, four times the reload itself). Instead the engine writes
them into one file under ``/dev/shm`` (created exclusively, mode 0600, a random name), sends its
path and the buffers' sizes, and the workers map it read-only: one copy in all. The engine
removes the file once the call returned; a worker's mapping stays valid after that, as long as
its arrays live (they are the base a later LoRA adapter or delta applies to).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class SharedBuffers:
    """Where the buffers are: a file and each buffer's size, in order (JSON-able, for the RPC)."""

    path: str
    sizes: tuple[int, ...]

    def as_args(self) -> dict[str, Any]:
        return {"path": self.path, "sizes": list(self.sizes)}


def shared_memory_available() -> bool:
    """Whether buffers can go through ``/dev/shm`` (a Linux tmpfs; elsewhere they go in the RPC)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


@contextlib.contextmanager
def buffers_in_shared_memory(buffers: Sequence[np.ndarray]) -> Iterator[SharedBuffers]:
    """Write ``buffers`` (1-D uint8 arrays) one after another into a new file under ``/dev/shm``;
    yields its :class:`SharedBuffers` and removes the file on exit (also after an error)."""
    sizes = tuple(int(buffer.nbytes) for buffer in buffers)
    path = SHM_DIR / f"lmcollect-push-{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.ftruncate(fd, max(1, sum(sizes)))
            with mmap.mmap(fd, max(1, sum(sizes))) as mapped:
                offset = 0
                for buffer, size in zip(buffers, sizes, strict=True):
                    mapped[offset : offset + size] = buffer.data.cast("B")
                    offset += size
        finally:
            os.close(fd)
        yield SharedBuffers(str(path), sizes)
    finally:
        path.unlink(missing_ok=True)


def map_shared_buffers(args: dict[str, Any]) -> list[np.ndarray]:
    """A worker's read-only views of :class:`SharedBuffers` (``as_args()``): numpy arrays over one
    mapping of the file, which lasts as long as any of them (also after the engine removed the file)."""
    path, sizes = Path(str(args["path"])), [int(size) for size in args["sizes"]]
    if path.parent != SHM_DIR or not path.name.startswith("lmcollect-push-"):
        raise ValueError(f"not a push buffer file: {str(path)!r}")
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, max(1, sum(sizes)), access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    whole = np.frombuffer(mapped, dtype=np.uint8)  # holds the mapping; the views below hold it
    offsets = np.cumsum([0, *sizes])
    return [whole[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]
