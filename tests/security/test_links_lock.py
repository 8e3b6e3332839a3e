"""The multi-node test clusters' slot lock, as another run or a local user would attack it (issue 42, items 11-12).

``tests/links.py`` runs as root and makes machine-wide namespaces, bridges and addresses for the
slot it locks. Two runs must never hold the same slot, whatever their ``TMPDIR``, and the lock file
must not follow a symlink planted at its path (as root, with ``fs.protected_symlinks=0``, that
would truncate or create any file). Unit-level: the lock functions only, no namespace is made.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import links

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0
# one run's claim: the slot it got, held until its stdin closes (a crashed run would also let go)
CLAIMER = "from tests import links; import sys; slot = links.claim_slot(); print(slot.index, flush=True); sys.stdin.read()"


@pytest.fixture
def claimers(tmp_path: Path) -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.stdin.close()  # type: ignore[union-attr]
        process.wait(timeout=WAIT_S)


def claim_in_run(tmp_dir: Path, started: list[subprocess.Popen]) -> int:
    """Another test run (a process whose TMPDIR is ``tmp_dir``) claims a slot and holds it; its index."""
    tmp_dir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_dir), "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", CLAIMER], cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    started.append(process)
    line = process.stdout.readline()  # type: ignore[union-attr]
    assert line.strip().isdigit(), f"the claiming run failed (exit {process.poll()}): {line!r}"
    return int(line)


def test_two_runs_with_different_tmpdirs_cannot_claim_the_same_slot(
    tmp_path: Path, claimers: list[subprocess.Popen]
) -> None:
    first = claim_in_run(tmp_path / "tmp_a", claimers)
    second = claim_in_run(tmp_path / "tmp_b", claimers)
    assert first != second, "two runs hold the same slot: the second would delete the first's namespaces"
    assert not links.LOCK_DIR.is_relative_to(tmp_path)


@pytest.fixture
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private lock directory for this test (the real one is machine-wide)."""
    folder = tmp_path / "locks"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(links, "LOCK_DIR", folder)
    return folder


@pytest.mark.parametrize("claim", [links.claim_slot, links.remove_stale_clusters], ids=["claim", "clean_up"])
def test_a_symlink_planted_at_the_lock_path_is_not_followed(lock_dir: Path, tmp_path: Path, claim: object) -> None:
    victim = tmp_path / "victim.conf"
    victim.write_text("precious\n", encoding="utf-8")
    absent = tmp_path / "created_by_root"
    (lock_dir / f"{links.PREFIX}-slot0.lock").symlink_to(victim)
    (lock_dir / f"{links.PREFIX}-slot1.lock").symlink_to(absent)  # a dangling link would create its target
    with pytest.raises(RuntimeError, match="symlink"):
        claim()  # type: ignore[operator]
    assert victim.read_text(encoding="utf-8") == "precious\n"
    assert not absent.exists()


def test_a_lock_directory_that_is_a_symlink_or_writable_by_others_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "linked").symlink_to(elsewhere)
    monkeypatch.setattr(links, "LOCK_DIR", tmp_path / "linked")
    with pytest.raises(RuntimeError, match="not a directory"):
        links.claim_slot()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(links, "LOCK_DIR", shared)
    with pytest.raises(RuntimeError, match="mode 700"):
        links.claim_slot()
    assert list(elsewhere.iterdir()) == [] and list(shared.iterdir()) == []


def test_a_claimed_slot_is_held_until_its_lock_closes_and_the_lock_file_is_private(lock_dir: Path) -> None:
    first = links.claim_slot()
    second = links.claim_slot()
    assert (first.index, second.index) == (0, 1)
    first.lock.close()
    again = links.claim_slot()
    assert again.index == 0
    mode = (lock_dir / f"{links.PREFIX}-slot0.lock").stat().st_mode & 0o777
    assert mode == 0o600, oct(mode)
    second.lock.close()
    again.lock.close()
