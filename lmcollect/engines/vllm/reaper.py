"""The vLLM engine core's reaper: when the process that owns a ``VLLMEngine(multiprocess=True)`` dies
without closing it (SIGKILL, the out-of-memory killer), end the engine's processes; and its folder.

vLLM's engine core does not watch its parent: with its owner gone it waits for requests forever,
holding its memory (GPU memory on a GPU), its worker processes and their shared-memory segments.
:class:`Reaper` (in the owner) starts this file as a small standard-library-only Python process
before vLLM starts its engine, with a pipe on its stdin:

- while the engine starts (until the owner writes ``built``), it notes every child the owner starts
  (by pid and start time, so a reused pid is never signalled): the engine core (not multiprocessing's
  resource tracker, which ignores SIGTERM and ends by itself once the core has, removing the shared
  memory the core left);
- the owner's ``close`` writes ``closed`` and closes the pipe: the reaper exits, doing nothing;
- an end of the pipe without ``closed`` means the owner died (the kernel closed its end): the
  reaper sends SIGTERM to the noted processes still alive (vLLM's core then shuts down its workers,
  which removes their shared memory), waits ``GRACE_S``, sends SIGKILL to any left, and exits.

The engine's folder (:attr:`Reaper.folder`, a new temporary folder) holds what vLLM's processes write
to the temporary folder: their ZeroMQ socket files, which vLLM leaves behind even when it shuts down
cleanly (seven per engine). The reaper removes it as it exits, either way.

Run as ``python -S reaper.py OWNER_PID FOLDER`` (no site packages: it starts in milliseconds).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

GRACE_S = 10.0
"""How long the noted processes get to end after SIGTERM before SIGKILL."""
SCAN_S = 0.05
"""How often the reaper looks for new children of the owner while the engine starts."""
BOUND_S = 10.0
"""How long the owner waits for the reaper's start and its exit."""
RPC_PATH_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM puts its socket files (read when a socket is made; its processes inherit it)."""
_STARTING = threading.Lock()
"""One engine of this process starts at a time while the environment names its folder."""


SOCKET_PATH_MAX = 107
"""The longest path a Unix socket may have (``sun_path``); vLLM's are ``<folder>/<a uuid>``."""


def socket_parent() -> str:
    """The temporary folder, or ``/tmp`` where the temporary folder's path is too long for the engine
    folder's socket paths (``<parent>/lmcollect-vllm-XXXXXXXX/<36-character uuid>``)."""
    parent = tempfile.gettempdir()
    if len(parent) + len("/lmcollect-vllm-XXXXXXXX/") + 36 > SOCKET_PATH_MAX:
        return "/tmp"
    return parent


class Reaper:
    """The owner's side: start the reaper before vLLM starts its processes; ``built()`` once it has;
    ``close()`` after the engine closed (the reaper exits, doing nothing)."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="lmcollect-vllm-", dir=socket_parent()))
        """The engine's folder for vLLM's socket files (see :meth:`starting`); removed by the reaper."""
        self._proc = subprocess.Popen(
            [sys.executable, "-S", str(Path(__file__).resolve()), str(os.getpid()), str(self.folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], BOUND_S)
        if not ready or self._proc.stdout.readline() != b"ready\n":  # it scans from here on
            self._proc.kill()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise RuntimeError(f"the vLLM engine's reaper process did not start within {BOUND_S} s.")

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """While vLLM starts the engine: its socket files go to :attr:`folder` (the environment says so to
        this process's vLLM and to the processes it starts; one engine of this process at a time)."""
        with _STARTING:
            saved = os.environ.get(RPC_PATH_ENV)
            os.environ[RPC_PATH_ENV] = str(self.folder)
            try:
                yield
            finally:
                if saved is None:
                    del os.environ[RPC_PATH_ENV]
                else:
                    os.environ[RPC_PATH_ENV] = saved

    @property
    def pid(self) -> int:
        return self._proc.pid

    def built(self) -> None:
        """vLLM started its processes: stop noting the owner's new children."""
        self._say(b"built\n")

    def close(self) -> None:
        """The engine closed: the reaper exits without touching anything."""
        self._say(b"closed\n")
        self._end(BOUND_S)

    def reap(self) -> None:
        """The engine failed to start: end what vLLM started of it now (as if the owner had died)."""
        self._end(GRACE_S + BOUND_S)

    def _end(self, timeout_s: float) -> None:
        assert self._proc.stdin is not None
        if not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=BOUND_S)
        assert self._proc.stdout is not None
        self._proc.stdout.close()

    def _say(self, line: bytes) -> None:
        assert self._proc.stdin is not None
        if not self._proc.stdin.closed:
            self._proc.stdin.write(line)
            self._proc.stdin.flush()


# ---------------------------------------------------------------------- the reaper process
def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the process's name (state first), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None when it is gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(child) for child in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def is_resource_tracker(pid: int) -> bool:
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def alive(noted: dict[int, int]) -> dict[int, int]:
    """The noted processes still running (same pid and start time; zombies count as ended)."""
    left = {}
    for pid, started in noted.items():
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z" and int(fields[19]) == started:
            left[pid] = started
    return left


def signal_all(noted: dict[int, int], signum: int) -> None:
    for pid in alive(noted):
        if is_resource_tracker(pid):  # noted in the instant between its fork and its exec
            continue
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue


def reap(noted: dict[int, int]) -> None:
    signal_all(noted, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while alive(noted) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_all(noted, signal.SIGKILL)


def main(owner: int, folder: str) -> None:
    try:
        serve(owner)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def serve(owner: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the owner's group: the owner decides
    me = os.getpid()
    before = children(owner)
    noted: dict[int, int] = {}
    said, chunk = b"", None
    print("ready", flush=True)
    stdin = sys.stdin.fileno()  # read with os.read: unbuffered, so select() tells the truth
    while b"built\n" not in said:  # the engine starts: note the owner's new children
        fresh = {
            pid: started
            for pid in children(owner) - before - {me} - set(noted)
            if (started := start_time(pid)) is not None and not is_resource_tracker(pid)
        }
        readable, _, _ = select.select([stdin], [], [], SCAN_S)
        chunk = os.read(stdin, 256) if readable else None
        said += chunk or b""
        if b"built\n" not in said:  # else this scan may have seen the owner's own children, started after
            noted.update(fresh)
        if chunk == b"":  # the pipe's end: the owner died while the engine started
            break
    while chunk != b"" and b"closed\n" not in said:
        chunk = os.read(stdin, 256)  # blocks until the owner says more, or its end of the pipe closes
        said += chunk
    if b"closed\n" not in said:  # the pipe's end without "closed": the owner died
        reap(noted)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
