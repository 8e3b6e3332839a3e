"""One-call checkpoints of a whole collection setup: collectors and a replay buffer, in a folder.

``save_checkpoint(folder, collectors, replay_buffer=buffer)`` writes, for each collector, its full
:meth:`~lmcollect.collectors.LLMCollector.state_dict` (weights, version, dialogs in flight, turns
not yet yielded, id counters, RNG states) and the buffer's contents, as safetensors files whose
non-tensor part is JSON (no pickle: see :mod:`lmcollect.data.codec`), plus ``manifest.json``.
``load_checkpoint`` restores them into collectors (and a buffer) built the same way, in any
process, and refuses a checkpoint from another configuration with an error naming what differs.

A checkpoint folder is not trusted: loading is all or nothing. Every state file must be a regular
file in the folder (a plain name, no symbolic link), and every collector's state and the buffer's
are checked (layout, version, weights with their names, shapes, dtypes and NaN/Inf, envs, turns,
RNG states) before any of them is loaded; a refused checkpoint raises with nothing changed.

Example::

    save_checkpoint("runs/ckpt-100", [collector], replay_buffer=buffer)
    ...  # the process exits; later, in a new one:
    collector, buffer = build_the_same_setup()
    load_checkpoint("runs/ckpt-100", [collector], replay_buffer=buffer)
    for batch in collector: ...   # exactly the batches the first run would have yielded next
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lmcollect.checkpoint_buffer import load_buffer_state, previous_entry, save_buffer
from lmcollect.data import codec

FORMAT = 2  # 2: the replay buffer in segments (lmcollect.checkpoint_buffer); format 1 still loads
READS_FORMATS = (1, 2)
MANIFEST = "manifest.json"
SAVE_LOCK = ".save.lock"
_RUST_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def save_checkpoint(folder: str | Path, collectors: Sequence[Any], *, replay_buffer: Any = None) -> Path:
    """Write the state of ``collectors`` (local or Ray) and ``replay_buffer`` into ``folder``.

    Each collector's state is taken between two turns (it waits for the batch under way); pause
    background collection (``collector.pause()``) around the call for a consistent cut across
    collectors and buffer.

    Saving over an earlier checkpoint is atomic: this save's files carry a save id of their own,
    the manifest naming them replaces the old one last (``os.replace``), and only then are the old
    files removed. A save that crashes midway leaves the earlier checkpoint whole and loadable.
    One save at a time per folder: a second one, from any thread or process, is refused
    (RuntimeError) while the first holds the folder's lock (``.save.lock``). Files are written 0600
    (they hold weights and prompts).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with _save_lock(folder):
        return _save(folder, collectors, replay_buffer)


@contextlib.contextmanager
def _save_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s save lock, or refuse: two saves at once would delete each other's files."""
    fd = os.open(folder / SAVE_LOCK, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another save_checkpoint is writing into {folder} now (it holds {folder / SAVE_LOCK}); wait for "
                "it to return, or save into another folder (e.g. one per step: runs/ckpt-<step>)."
            ) from None
        yield
    finally:
        os.close(fd)  # drops the lock


def _save(folder: Path, collectors: Sequence[Any], replay_buffer: Any) -> Path:
    save_id = uuid.uuid4().hex[:12]
    entries = []
    for i, collector in enumerate(collectors):
        state = collector.state_dict()
        name = f"collector-{i}.{save_id}.safetensors"
        codec.save(folder / name, dict(state))
        entries.append({"file": name, "layout": state.get("layout"), "kind": type(collector).__name__})
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "save_id": save_id,
        "saved_at": time.time(),
        "collectors": entries,
        "replay_buffer": None,
    }
    if replay_buffer is not None:  # only the turns added since the previous save in this folder
        manifest["replay_buffer"] = save_buffer(folder, replay_buffer, save_id, previous_entry(folder, MANIFEST))
    tmp = folder / f"{MANIFEST}.{save_id}.tmp"
    with os.fdopen(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "w", encoding="utf-8") as out:
        out.write(json.dumps(manifest, indent=2))
    os.replace(tmp, folder / MANIFEST)  # the manifest is written last: until then the old one holds
    _remove_other_saves(folder, keep={entry["file"] for entry in _manifest_files(manifest)})
    return folder


def _manifest_files(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    buffer = manifest.get("replay_buffer")
    buffer_files = [] if buffer is None else [buffer, *buffer.get("segments", [])]
    return list(manifest.get("collectors", [])) + buffer_files


def _remove_other_saves(folder: Path, keep: set[str]) -> None:
    """Files of earlier (or crashed) saves: the state files the manifest no longer names, and the
    ``.tmp`` files a save killed mid-write left (a state file's or the manifest's; found by the chaos
    harness, benchmarks/chaos.py: they stayed in the folder forever), safetensors' own included."""
    for path in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.tmp")]:
        if path.name not in keep and (path.name.startswith("collector-") or path.name.startswith("replay_buffer")):
            path.unlink(missing_ok=True)
    for path in folder.glob(f"{MANIFEST}.*.tmp"):
        path.unlink(missing_ok=True)
    for path in folder.glob(".tmp*"):  # safetensors writes through a Rust NamedTempFile: ".tmp" + 6 characters
        if _RUST_TMP.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)


def _checked_file(folder: Path, entry: Any) -> Path:
    """The state file a manifest entry names: a plain file name inside ``folder``, nothing else."""
    name = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise ValueError(
            f"{folder / MANIFEST} names the state file {name!r}: a checkpoint's files are plain file names in "
            "its own folder (no path, no '..'); this manifest was not written by save_checkpoint."
        )
    return _regular_file_in(folder, name)


def _regular_file_in(folder: Path, name: str) -> Path:
    """``folder / name`` if it is a regular file there, not a symbolic link (which may point
    anywhere, e.g. at another run's state or out of the folder); ValueError otherwise."""
    path = folder / name
    try:
        mode = os.lstat(path).st_mode  # the entry itself: a link is not followed
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete; pick another folder.") from None
    if stat.S_ISLNK(mode) or not stat.S_ISREG(mode) or path.resolve().parent != folder.resolve():
        what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise ValueError(
            f"{path} is {what}: a checkpoint's files are regular files in its own folder; refused, nothing was "
            "loaded. Copy the files themselves into the folder (or save the checkpoint again)."
        )
    return path


def load_checkpoint(
    folder: str | Path, collectors: Sequence[Any], *, replay_buffer: Any = None, allow_non_finite: bool = False
) -> None:
    """Restore what :func:`save_checkpoint` wrote into collectors (and a buffer) built the same way.

    All or nothing: every file is read and every state checked (``check_state_dict`` of each
    collector and of the buffer) before any is loaded; a refused checkpoint raises ValueError
    naming what is wrong, with no collector and no buffer changed. ``allow_non_finite=True``
    restores weights holding NaN or Inf (refused by default, as pushes are). Once loaded, the files a
    crashed save left in the folder (ones the manifest does not name) are removed.
    """
    folder = Path(folder)
    states, buffer_state = _read_checkpoint(folder, len(collectors), replay_buffer)
    options = {"allow_non_finite": True} if allow_non_finite else {}
    _check_states(folder, collectors, states, options)
    if buffer_state is not None:
        try:
            replay_buffer.check_state_dict(buffer_state)
        except ValueError as exc:  # designed: name the buffer; nothing was loaded yet
            raise ValueError(f"{folder}: the replay buffer's state was refused, nothing was loaded: {exc}") from exc
    for collector, state in zip(collectors, states, strict=True):  # every state checked: now load them all
        collector.load_state_dict(state, **options)
    if buffer_state is not None:
        replay_buffer.load_state_dict(buffer_state)
    _remove_crashed_saves(folder)


def _remove_crashed_saves(folder: Path) -> None:
    """After a load: remove the files of a save killed between its manifest's replace and its removal of
    the old files (found by the chaos harness: with no later save, e.g. a run resumed at its last batch,
    they stayed forever). Under the folder's save lock; skipped while a save holds it (that save removes them)."""
    try:
        with _save_lock(folder):
            manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            _remove_other_saves(folder, keep={entry["file"] for entry in _manifest_files(manifest)})
    except (RuntimeError, OSError):  # a save is under way, or the folder is read-only: nothing to do now
        return


def _read_checkpoint(folder: Path, num_collectors: int, replay_buffer: Any) -> tuple[list[Any], Any]:
    """Every state a checkpoint folder holds (the collectors', the buffer's or None), read whole
    before anything changes; errors name what does not fit the collectors and buffer given."""
    if not (folder / MANIFEST).exists() and not (folder / MANIFEST).is_symlink():
        raise FileNotFoundError(
            f"{folder} has no {MANIFEST}: not a checkpoint, or one whose save did not finish; pick another folder."
        )
    manifest = json.loads(_regular_file_in(folder, MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("format") not in READS_FORMATS:
        raise ValueError(
            f"{folder}: checkpoint format {manifest.get('format')!r}, this lmcollect reads formats {READS_FORMATS}."
        )
    entries = manifest["collectors"]
    if len(entries) != num_collectors:
        raise ValueError(
            f"{folder} holds {len(entries)} collector state(s), {num_collectors} collector(s) were given; "
            "restore into as many collectors, in the same order."
        )
    saved_buffer = manifest.get("replay_buffer")
    if (saved_buffer is None) != (replay_buffer is None):
        raise ValueError(
            f"{folder} {'has no' if saved_buffer is None else 'has a'} replay buffer state; "
            f"{'drop replay_buffer=' if saved_buffer is None else 'pass replay_buffer='} to restore it."
        )
    paths = [_checked_file(folder, entry) for entry in entries]
    states = [codec.load(path) for path in paths]
    if saved_buffer is not None and not isinstance(saved_buffer, dict):
        raise ValueError(f"{folder / MANIFEST}: its replay_buffer entry is malformed; not written by save_checkpoint.")
    buffer_state = None
    if saved_buffer is not None:
        buffer_state = load_buffer_state(folder, saved_buffer, lambda entry: _checked_file(folder, entry))
    if buffer_state is not None and buffer_state.get("capacity") != replay_buffer_capacity(replay_buffer):
        raise ValueError(
            f"{folder}: the replay buffer was saved with capacity={buffer_state.get('capacity')}, the given one has "
            f"capacity={replay_buffer_capacity(replay_buffer)}; build it with the same capacity."
        )
    return states, buffer_state


def _check_states(folder: Path, collectors: Sequence[Any], states: list[Any], options: dict[str, Any]) -> None:
    """Check every collector's state (its layout first, for a clearer error) before any is loaded."""
    for i, (collector, state) in enumerate(zip(collectors, states, strict=True)):
        mine, saved = collector.layout(), state.get("layout") if isinstance(state, dict) else None
        wrong = [
            f"{k}={saved.get(k)!r} (given collector: {v!r})" for k, v in mine.items() if saved and saved.get(k) != v
        ]
        if wrong:
            raise ValueError(
                f"{folder}: collector {i} was saved with another configuration: {'; '.join(wrong)}. Build the "
                "collectors with the same envs and batching arguments as the saved run."
            )
        try:
            collector.check_state_dict(state, **options)
        except ValueError as exc:  # designed: name the collector; nothing was loaded yet
            raise ValueError(f"{folder}: collector {i}'s state was refused, nothing was loaded: {exc}") from exc


def replay_buffer_capacity(buffer: Any) -> int:
    return int(buffer.capacity)
