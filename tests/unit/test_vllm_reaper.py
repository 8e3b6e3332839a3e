"""The vLLM engine core's reaper (``lmcollect/engines/vllm/reaper.py``), with plain processes in the
engine core's place: an owner that dies without closing its engine has the children it started while
the engine started ended (SIGTERM, then SIGKILL past the grace), and the engine's folder removed; an
owner that closes its engine has nothing touched but the folder; children started after ``built()``
are never touched. No vLLM needed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcollect.engines.vllm.reaper import GRACE_S, RPC_PATH_ENV, Reaper, socket_parent

BOUND_S = 15.0
OWNER = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from lmcollect.engines.vllm.reaper import Reaper

    reaper = Reaper()
    with reaper.starting():  # the engine core's place: started while the engine starts (seconds)
        core = subprocess.Popen([sys.executable, "-c", sys.argv[1], os.environ["VLLM_RPC_BASE_PATH"]])
        deadline = time.monotonic() + 10
        while not (reaper.folder / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    reaper.built()
    later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the owner's own
    print(json.dumps({"core": core.pid, "later": later.pid, "reaper": reaper.pid, "folder": str(reaper.folder)}), flush=True)
    if sys.argv[2] == "close":
        reaper.close()
        print("closed", flush=True)
    time.sleep(600)
    """
)
CORE = "import sys, time, pathlib; pathlib.Path(sys.argv[1], 'started').touch(); time.sleep(600)"
STUBBORN_CORE = (
    "import signal, sys, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "pathlib.Path(sys.argv[1], 'started').touch(); time.sleep(600)"
)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, what: str, timeout_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


@contextlib.contextmanager
def engine_owner(core: str, mode: str) -> Iterator[tuple[subprocess.Popen, dict]]:
    """An owner process that started an engine (``core`` in the engine core's place) and then dies
    (``mode="die"``: when the test kills it) or closes the engine first (``"close"``); every process it
    started is ended afterwards."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, core, mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    pids: dict = {}
    try:
        line = owner.stdout.readline()
        assert line, "the owner process ended before it started its engine"
        pids = json.loads(line)
        yield owner, pids
    finally:
        kill(owner)
        owner.stdout.close()
        for name in ("core", "later", "reaper"):
            with contextlib.suppress(KeyError, ProcessLookupError):
                os.kill(pids[name], signal.SIGKILL)


def kill(owner: subprocess.Popen) -> None:
    owner.kill()
    owner.wait(timeout=BOUND_S)


def test_a_killed_owners_engine_processes_and_folder_are_removed_and_nothing_else() -> None:
    with engine_owner(CORE, "die") as (owner, pids):
        assert (Path(pids["folder"]) / "started").exists()  # the core wrote to the engine's folder
        kill(owner)
        wait_until(lambda: not running(pids["core"]), "the reaper ended the engine core")
        wait_until(lambda: not running(pids["reaper"]), "the reaper exited")
        assert not Path(pids["folder"]).exists(), "the engine's folder outlived its owner"
        assert running(pids["later"]), "the reaper ended a process started after the engine had"


def test_a_core_that_ignores_sigterm_gets_sigkill_after_the_grace() -> None:
    with engine_owner(STUBBORN_CORE, "die") as (owner, pids):
        kill(owner)
        time.sleep(1.0)
        assert running(pids["core"]), "SIGKILL came before the grace"
        wait_until(lambda: not running(pids["core"]), "the stubborn core got SIGKILL", GRACE_S + BOUND_S)


def test_a_closed_engine_leaves_its_processes_alone_and_removes_its_folder() -> None:
    with engine_owner(CORE, "close") as (owner, pids):
        assert owner.stdout.readline().strip() == "closed"
        assert not running(pids["reaper"]) and not Path(pids["folder"]).exists()
        kill(owner)
        time.sleep(0.5)
        assert running(pids["core"]), "a closed engine's reaper signalled a process"


def test_the_environment_names_the_folder_only_while_the_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RPC_PATH_ENV, "/elsewhere")
    reaper = Reaper()
    try:
        with reaper.starting():
            assert os.environ[RPC_PATH_ENV] == str(reaper.folder)
        assert os.environ[RPC_PATH_ENV] == "/elsewhere"
        # vLLM's socket paths (<folder>/<uuid>) fit a Unix socket's 107 characters
        assert len(str(reaper.folder)) + 1 + 36 <= 107
    finally:
        reaper.close()
    assert not reaper.folder.exists()


def test_a_long_temporary_folder_puts_the_engine_folder_in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import tempfile

    deep = tmp_path / ("d" * 80)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert socket_parent() == "/tmp"
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    assert socket_parent() == "/tmp"
