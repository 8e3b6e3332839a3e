"""Validation of the collector's batching arguments (pure logic, shared by local and Ray collectors)."""
from __future__ import annotations

from lmcollect.collectors.batcher import BatchMode


def resolve_batching(
    *,
    dialog_turns_per_batch: int,
    total_dialog_turns: int,
    yield_only_last_steps: bool | None,
    yield_completed_trajectories: bool | None,
    flatten_data: bool | None,
) -> tuple[BatchMode, bool]:
    """Check the batching arguments and return (batch mode, flatten)."""
    if not isinstance(dialog_turns_per_batch, int) or dialog_turns_per_batch <= 0:
        raise ValueError(
            f"dialog_turns_per_batch must be a positive int, got {dialog_turns_per_batch!r}; "
            "pass how many dialog turns each batch should hold, e.g. dialog_turns_per_batch=64."
        )
    if not isinstance(total_dialog_turns, int) or (total_dialog_turns <= 0 and total_dialog_turns != -1):
        raise ValueError(
            f"total_dialog_turns must be a positive int or -1 (endless), got {total_dialog_turns!r}."
        )
    # As in the API we follow: yield_only_last_steps=True means "completed trajectories, last
    # step only", so yield_completed_trajectories defaults to it and may not contradict it.
    if yield_completed_trajectories is None:
        yield_completed_trajectories = bool(yield_only_last_steps)
    if yield_only_last_steps and not yield_completed_trajectories:
        raise TypeError(
            "yield_only_last_steps=True yields the last step of completed trajectories, so it needs "
            "yield_completed_trajectories=True (or None, its default); drop yield_completed_trajectories=False."
        )
    if yield_only_last_steps:
        mode: BatchMode = "last_steps"
    elif yield_completed_trajectories:
        mode = "trajectories"
    else:
        mode = "steps"
    if mode != "steps" and flatten_data is False:
        raise ValueError(
            f"flatten_data=False cannot be combined with {'yield_only_last_steps' if mode == 'last_steps' else 'yield_completed_trajectories'}=True: "
            "those batches are flat lists of turns. Leave flatten_data=None or set it to True."
        )
    flatten = True if mode != "steps" else bool(flatten_data)
    return mode, flatten
