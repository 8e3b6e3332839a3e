"""Process-table helpers for tests: they read only live processes and tolerate what they did not start.

Earlier tests (or Ray, or vLLM) may leave zombie children or processes that exit while we look;
reading one of those must never fail a test that is about something else.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil


def live_descendants(exclude_cmdline: tuple[str, ...] = ("resource_tracker",)) -> set[int]:
    """PIDs of this process's live descendants, less those whose command line holds one of ``exclude_cmdline``."""
    pids = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # gone, or a zombie, between listing and reading: not a live child
        if not any(word in command for word in exclude_cmdline):
            pids.add(proc.pid)
    return pids


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has exited: it only waits for its parent to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


class Child:
    """A subprocess whose output goes to a file (no pipe to fill), killed and reaped on exit.

    Use it as a context manager; :meth:`output` is what it printed so far, for assertion messages.
    """

    def __init__(self, argv: list[str], log_path: "os.PathLike[str] | str", **popen_kwargs: object) -> None:
        self.argv, self.log_path = argv, Path(log_path)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, text=True, **popen_kwargs)

    def output(self, last_chars: int = 8000) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text[-last_chars:]

    def wait(self, timeout_s: float, what: str) -> int:
        """Wait for the exit; on time-out fail with what it printed."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what}: still running after {timeout_s:.0f} s; it printed:\n{self.output()}") from None

    def __enter__(self) -> "Child":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        finally:
            self._log.close()
