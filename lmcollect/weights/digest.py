"""Keyed digests (HMAC-SHA256) of weight bytes: what a receiver checks before it loads bytes that crossed a network.

A CRC catches accidents but not an attacker, who can change bytes and fix the CRC up; a keyed
digest can only be made by a holder of the key (a process group's secret: see
:func:`derive_key`). HMAC-SHA256 rather than keyed BLAKE2b: with the SHA extensions of current
x86 and ARM CPUs, OpenSSL's SHA-256 runs about twice as fast. Buffers are hashed in chunks on a
small thread pool (hashlib releases the GIL), reading CPU tensors in place; a chunk of a GPU
buffer is copied to the host first.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

CHUNK_BYTES = 16 << 20  # hashed one chunk per task: large enough to amortize, small enough to spread
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, the pool)
_pool_lock = threading.Lock()


def derive_key(secret: str, purpose: str) -> bytes:
    """A key for one ``purpose`` from a shared ``secret`` (the HMAC of the purpose's name), so the
    digests of one purpose never verify as another's."""
    return hmac.new(secret.encode(), purpose.encode(), hashlib.sha256).digest()


def same_digest(a: str, b: str) -> bool:
    """Compare two hex digests in constant time."""
    return hmac.compare_digest(a.encode(), b.encode())


class BufferDigest:
    """A keyed digest (HMAC-SHA256) of a sequence of byte buffers, fed as they are sent or received
    (:meth:`add`).

    Each chunk of each buffer is hashed on its own (its buffer and chunk index first) while the
    caller goes on; :meth:`hexdigest` waits for them and hashes ``context``, then every chunk's
    size and digest in order. ``context`` binds the digest to one push (its number and version), so
    the digest of an earlier push never verifies a later one.
    """

    def __init__(self, key: bytes, context: bytes) -> None:
        self._key, self._context = key, context
        self._parts: list[tuple[int, int, Future[bytes]]] = []
        self._num_buffers = 0

    def add(self, buffer: torch.Tensor) -> None:
        """Hash ``buffer`` (a contiguous tensor, read as bytes) as the next buffer: starts at once,
        in the background. Do not write into it until :meth:`hexdigest` returned."""
        flat = buffer.detach().reshape(-1).view(torch.uint8)
        index = self._num_buffers
        self._num_buffers += 1
        for chunk_index, start in enumerate(range(0, flat.numel(), CHUNK_BYTES)):
            chunk = flat[start : start + CHUNK_BYTES]
            where = struct.pack("<QQ", index, chunk_index)
            self._parts.append((index, chunk.numel(), _thread_pool().submit(_hash_chunk, chunk, self._key, where)))

    def hexdigest(self) -> str:
        """The digest of everything added (waits for the chunks still being hashed)."""
        final = hmac.new(self._key, self._context, hashlib.sha256)
        for index, nbytes, part in self._parts:
            final.update(struct.pack("<QQ", index, nbytes))
            final.update(part.result())
        final.update(struct.pack("<Q", self._num_buffers))
        return final.hexdigest()


def keyed_checksum(arrays: list[torch.Tensor], key: bytes) -> int:
    """The keyed digest (HMAC-SHA256, its first 64 bits) of the bytes of ``arrays`` in order (a
    delta entry's checksum)."""
    digest = hmac.new(key, b"lmcollect arrays", hashlib.sha256)
    for array in arrays:
        digest.update(struct.pack("<Q", array.numel() * array.element_size()))
        digest.update(_host_bytes(array.detach().reshape(-1)))
    return int.from_bytes(digest.digest()[:8], "little")


def _hash_chunk(chunk: torch.Tensor, key: bytes, where: bytes) -> bytes:
    digest = hmac.new(key, where, hashlib.sha256)  # which buffer and chunk: bytes cannot move between them
    digest.update(_host_bytes(chunk))
    return digest.digest()


def _host_bytes(flat: torch.Tensor) -> memoryview:
    """The bytes of a flat tensor: in place on the CPU, else a host copy."""
    host = flat if flat.device.type == "cpu" else flat.cpu()
    return memoryview(host.contiguous().view(torch.uint8).numpy())


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():  # a forked child has none of its parent's threads
            _pool = (
                os.getpid(),
                ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="lmcollect-digest"),
            )
        return _pool[1]
