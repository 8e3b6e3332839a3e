"""A replay buffer in a checkpoint folder, saved incrementally as segments of turns.

A save writes only the turns added since the folder's previous save (one new *segment* file) and a
small *head* file (capacity, size, write position, write count, sampler RNG); the manifest's
``replay_buffer`` entry lists the head and every segment that still holds a live turn, each with
the buffer slots it fills. Loading replays the segments in order (a later segment's turn replaces
an earlier one in the same slot) into the buffer's ``state_dict``. A segment whose turns were all
overwritten (a full, circular buffer) leaves the manifest; when over half of the turns the segments
hold are dead, the save writes the whole buffer as one segment instead (compaction), so the folder
holds at most about twice the buffer.

The first save into a folder, a save after the buffer was emptied, reloaded or copied, and a
buffer without ``state_since`` write every stored turn. Checkpoints written before segments (the
manifest's entry has no ``segments``: one file holding the whole ``state_dict``) still load.
"""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcollect.data import codec

MAX_DEAD_FRACTION = 0.5


def save_buffer(folder: Path, buffer: Any, save_id: str, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Write ``buffer``'s changes since ``previous`` (the last manifest's entry, or None) into ``folder``;
    returns the new manifest entry. Writes only new files: the previous checkpoint stays whole."""
    state = _changes(buffer, previous)
    segments = _segments_after(state, previous, f"replay_buffer-turns.{save_id}.safetensors")
    if segments is None:  # too many dead turns, or the previous segments do not fit: write it all
        state = _changes(buffer, None)
        segments = _segments_after(state, None, f"replay_buffer-turns.{save_id}.safetensors")
    assert segments is not None  # a full state always fits
    if state["slots"]:
        codec.save(folder / segments[-1]["file"], {"slots": state["slots"], "turns": state["turns"]})
    head = f"replay_buffer.{save_id}.safetensors"
    codec.save(folder / head, {k: state[k] for k in ("capacity", "size", "cursor", "write_count", "generator")})
    return {
        "file": head,
        "capacity": state["capacity"],
        "size": state["size"],
        "token": state["token"],
        "segments": segments,
    }


def _changes(buffer: Any, previous: dict[str, Any] | None) -> dict[str, Any]:
    """``buffer.state_since`` the previous save's token, or every stored turn (any buffer)."""
    token = None if previous is None else previous.get("token")
    if hasattr(buffer, "state_since"):
        return buffer.state_since(token)
    state = buffer.state_dict()
    storage = list(state["storage"])
    return {
        **state,
        "size": len(storage),
        "slots": list(range(len(storage))),
        "turns": storage,
        "full": True,
        "token": None,
    }


def _segments_after(state: dict[str, Any], previous: dict[str, Any] | None, new_file: str) -> list[dict] | None:
    """The segments that hold the buffer after this save (the new one last, if any turn is new);
    None when the save must write the whole buffer instead (compaction, or segments that do not fit)."""
    old = [] if state["full"] or previous is None else list(previous["segments"])
    slots = state["slots"]
    new = [{"file": new_file, "ranges": _ranges(slots), "count": len(slots)}] if slots else []
    candidates, size = old + new, state["size"]
    owner = [-1] * size
    for index, segment in enumerate(candidates):
        for start, stop in segment["ranges"]:
            owner[start:stop] = [index] * (stop - start)
    if len(owner) != size or -1 in owner:
        return None  # not every slot is covered (or one past the size): the previous save is not ours
    live = Counter(owner)
    kept = [segment for index, segment in enumerate(candidates) if live[index]]
    if not state["full"] and sum(segment["count"] for segment in kept) > size / (1 - MAX_DEAD_FRACTION):
        return None
    return kept


def _ranges(slots: list[int]) -> list[list[int]]:
    """Ascending slots as ``[start, stop)`` runs: ``[3, 4, 5, 9]`` -> ``[[3, 6], [9, 10]]``."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and runs[-1][1] == slot:
            runs[-1][1] += 1
        else:
            runs.append([slot, slot + 1])
    return runs


def previous_entry(folder: Path, manifest_name: str) -> dict[str, Any] | None:
    """The replay-buffer entry of the manifest now in ``folder`` if it is a segmented one whose files
    are all there (regular files); None otherwise (the save then writes the whole buffer)."""
    path = folder / manifest_name
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        entry = json.loads(path.read_text(encoding="utf-8")).get("replay_buffer")
        segments = entry["segments"]
        names = [segment["file"] for segment in segments]
        if not all(Path(n).name == n and stat.S_ISREG(os.lstat(folder / n).st_mode) for n in names):
            return None
        capacity = int(entry["capacity"])
        return entry if all(_fits(segment, capacity) for segment in segments) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # designed: no usable previous save
        return None


def _fits(segment: dict[str, Any], capacity: int) -> bool:
    """A manifest's segment entry has the shape a save wrote (a hand-edited one must not break the next save)."""
    ranges = segment["ranges"]
    ok = all(isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) for r in ranges)
    return ok and all(0 <= a < b <= capacity for a, b in ranges) and type(segment["count"]) is int


def load_buffer_state(folder: Path, entry: dict[str, Any], checked_file: Callable[[Any], Path]) -> dict[str, Any]:
    """The buffer's ``state_dict`` from the manifest's entry: one file (the format before segments),
    or the head and its segments replayed in order. ValueError naming the file for a malformed one."""
    if "segments" not in entry:
        return codec.load(checked_file(entry))
    segments = entry["segments"]
    if not isinstance(segments, list):
        raise ValueError(f"{folder}: the manifest's replay_buffer segments are malformed; it was not loaded.")
    paths = [checked_file(segment) for segment in segments]
    head = codec.load(checked_file(entry))
    size = head.get("size") if isinstance(head, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= int(head.get("capacity", 0)):
        raise ValueError(f"{folder / entry['file']}: the replay buffer's size {size!r} is malformed; not loaded.")
    storage: list[Any] = [None] * size
    for path in paths:
        _replay_segment(path, codec.load(path), storage)
    if any(turn is None for turn in storage):
        raise ValueError(f"{folder}: the replay buffer's segments miss some of its {size} turns; it was not loaded.")
    return {k: head.get(k) for k in ("capacity", "cursor", "write_count", "generator")} | {"storage": storage}


def _replay_segment(path: Path, segment: Any, storage: list[Any]) -> None:
    """Write one segment's turns into their slots of ``storage`` (a later segment's replace earlier ones)."""
    slots = segment.get("slots") if isinstance(segment, dict) else None
    turns = segment.get("turns") if isinstance(segment, dict) else None
    if not isinstance(slots, list) or not isinstance(turns, list) or len(slots) != len(turns):
        raise ValueError(f"{path}: a replay-buffer segment must hold as many slots as turns; it was not loaded.")
    for slot, turn in zip(slots, turns, strict=True):
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(storage):
            raise ValueError(f"{path}: slot {slot!r} is outside the buffer's {len(storage)} turns; it was not loaded.")
        storage[slot] = turn
