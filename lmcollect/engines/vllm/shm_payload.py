"""A push's byte buffers shared with vLLM workers in other processes: files under /dev/shm, mapped once.

vLLM's ``collective_rpc`` serialises its arguments when the engine core or the workers run in
other processes: a push's buffers would be copied into the message, sent over ZeroMQ and copied
out again (four times the reload itself). Instead the engine packs each push straight into one of
two sets of buffers that live in shared memory (:class:`SharedPackSets`): one file per set under
``/dev/shm``, created exclusively, mode 0600, with a random name, kept from push to push and
removed when the engine closes. The engine holds a shared lock on each file while it lives, so a
file left by an engine that was killed (SIGKILL: an OOM kill) is one nobody locks: the next engine
removes such files as it starts (:func:`remove_stale_push_files`), or RAM would hold them for good.
A push sends only the file's path and where each buffer starts
(:class:`SharedBuffers`); a worker maps each file once and keeps the mapping
(:class:`MappedBufferFiles`), so after the first two pushes neither side allocates or maps
anything: one copy in all, into memory that is already there.

Two sets, as in-process: the worker's base (for LoRA adapters and deltas) is views of the set
its last full push came in, so the next push must be packed into the other one. A push that is
refused leaves the base where it was, and the engine packs its next push into the same spare set.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import mmap
import os
import secrets
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
FILE_PREFIX = "lmcollect-push-"
ALIGN_BYTES = 64  # every buffer starts on a 64-byte boundary, so any dtype view of it is aligned


@dataclass(frozen=True)
class SharedBuffers:
    """Where one push's buffers are: a file and each buffer's byte offset and size, in order
    (JSON-able, for the RPC)."""

    path: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def as_args(self) -> dict[str, Any]:
        return {"path": self.path, "offsets": list(self.offsets), "sizes": list(self.sizes)}


def shared_memory_available() -> bool:
    """Whether buffers can go through ``/dev/shm`` (a Linux tmpfs; elsewhere they go in the RPC)."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def buffer_offsets(sizes: Sequence[int]) -> list[int]:
    """Each buffer's start when ``sizes`` are laid out one after another on ``ALIGN_BYTES`` boundaries."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end = -(-(end + size) // ALIGN_BYTES) * ALIGN_BYTES
    return offsets


class SharedBufferFile:
    """One file under ``/dev/shm`` of ``nbytes``, mapped read-write in this process until removed.

    Created exclusively (no other file or link of that name can be taken over), mode 0600, named
    ``lmcollect-push-<pid>-<random>``. :meth:`remove` (or this object's collection, or the
    interpreter's exit) removes the file; mappings of it, here and in the workers, stay valid.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(1, int(nbytes))
        path = SHM_DIR / f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held while this process lives: the file is not stale
            os.ftruncate(fd, self.nbytes)
            self._mapped = mmap.mmap(fd, self.nbytes)
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(fd)
            raise
        self.path = str(path)
        self._remove = weakref.finalize(self, _release, self.path, fd)

    def views(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[torch.Tensor]:
        """Writable uint8 tensors over the given byte ranges of the file (no copy)."""
        return [
            torch.frombuffer(self._mapped, dtype=torch.uint8, count=size, offset=offset)
            if size
            else torch.empty(0, dtype=torch.uint8)
            for offset, size in zip(offsets, sizes, strict=True)
        ]

    def remove(self) -> None:
        """Remove the file (idempotent); the mapping goes once no view of it is left."""
        self._remove()


def _release(path: str, fd: int) -> None:
    Path(path).unlink(missing_ok=True)
    os.close(fd)  # drops the lock


STALE_AFTER_S = 2.0
"""A push file younger than this is never removed as stale (its creator may be about to lock it: it does
so right after creating it). Short, so that an engine started again after a kill (seconds) removes the
killed one's files even when it pushes nothing."""


def remove_stale_push_files(directory: Path = SHM_DIR, *, min_age_s: float = STALE_AFTER_S) -> list[str]:
    """Remove this user's ``lmcollect-push-*`` files that no live engine holds (their creator was killed
    before it could remove them); returns their paths. A file is stale when its lock can be taken:
    every live engine holds a shared lock on its files, which the kernel drops when it dies."""
    removed = []
    for path in directory.glob(f"{FILE_PREFIX}*"):
        if _is_stale(path, min_age_s):
            path.unlink(missing_ok=True)
            removed.append(str(path))
    return removed


def _is_stale(path: Path, min_age_s: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone meanwhile, a link, or another user's
        return False
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or time.time() - info.st_ctime < min_age_s:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # locked: its engine lives
        return False
    finally:
        os.close(fd)


class SharedPackSets:
    """The engine's two sets of pack buffers, each in a :class:`SharedBufferFile` of its own.

    :meth:`buffers` hands out a set's buffers for a push's sizes: the set's file as it is when they
    fit (every push of one model), else a new, larger file (the old one is removed: it is never the
    worker's base, since the engine only packs into the spare set). Files are created on first use.
    """

    def __init__(self) -> None:
        self._files: list[SharedBufferFile | None] = [None, None]
        stale = remove_stale_push_files()
        if stale:
            logger.warning(
                "removed %d push buffer file(s) left in %s by killed engines: %s", len(stale), SHM_DIR, stale
            )

    def buffers(self, index: int, sizes: Sequence[int]) -> tuple[list[torch.Tensor], SharedBuffers]:
        """Set ``index``'s buffers of ``sizes`` bytes (to pack into) and where they are (to send)."""
        offsets = buffer_offsets(sizes)
        needed = offsets[-1] + sizes[-1] if sizes else 0
        current = self._files[index]
        if current is None or current.nbytes < needed:
            if current is not None:
                current.remove()
            current = self._files[index] = SharedBufferFile(needed)
        where = SharedBuffers(current.path, tuple(offsets), tuple(int(size) for size in sizes))
        return current.views(offsets, sizes), where

    @property
    def paths(self) -> list[str]:
        """The files in use now."""
        return [file.path for file in self._files if file is not None]

    def close(self) -> None:
        """Remove both files (idempotent)."""
        for file in self._files:
            if file is not None:
                file.remove()
        self._files = [None, None]


class MappedBufferFiles:
    """A worker's read-only mappings of the engine's pack-set files, each mapped once and kept.

    Keyed by path; the ``keep`` most recently used stay mapped (two: the engine's two sets; a set's
    file that the engine replaced falls out). A mapping outlives its entry as long as arrays viewing
    it live (the worker's base weights).
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._mapped: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()

    def views(self, args: dict[str, Any]) -> list[np.ndarray]:
        """Read-only uint8 arrays over the buffers :class:`SharedBuffers` (``as_args()``) names.

        Only ``/dev/shm/lmcollect-push-*`` files are mapped (never through a symbolic link), and
        every byte range must lie inside the file: a ``ValueError`` otherwise.
        """
        path = str(args["path"])
        offsets, sizes = [int(o) for o in args["offsets"]], [int(s) for s in args["sizes"]]
        whole = self._mapping(path)
        for offset, size in zip(offsets, sizes, strict=True):
            if offset < 0 or size < 0 or offset + size > whole.size:
                raise ValueError(f"bytes [{offset}, {offset + size}) lie outside {path!r} ({whole.size} bytes).")
        return [whole[offset : offset + size] for offset, size in zip(offsets, sizes, strict=True)]

    def _mapping(self, path: str) -> np.ndarray:
        if path in self._mapped:
            self._mapped.move_to_end(path)
            return self._mapped[path]
        whole = map_push_file(path)
        self._mapped[path] = whole
        while len(self._mapped) > self.keep:
            self._mapped.popitem(last=False)
        return whole

    @property
    def paths(self) -> list[str]:
        """The files mapped now, least recently used first."""
        return list(self._mapped)


def map_push_file(path_name: str) -> np.ndarray:
    """The whole of a ``/dev/shm/lmcollect-push-*`` file, mapped read-only, as a uint8 array."""
    path = Path(path_name)
    if path.parent != SHM_DIR or not path.name.startswith(FILE_PREFIX):
        raise ValueError(f"not a push buffer file: {path_name!r}")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise ValueError(f"push buffer file {path_name!r} is empty.")
        mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype=np.uint8)  # holds the mapping; views of it hold it too
