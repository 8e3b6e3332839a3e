"""Turns collected turns into batches: fixed steps per env, completed trajectories, or last steps."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from tensordict import TensorDictBase

from lmcollect.data.turns import stack_rows, stack_turns

BatchMode = Literal["steps", "trajectories", "last_steps"]


@dataclass
class CollectedTurn:
    """A turn with the bookkeeping the batcher needs (kept outside the TensorDict for speed)."""

    slot: int
    traj_id: int
    done: bool
    td: TensorDictBase


class Batcher:
    """Accumulates turns per env slot and releases batches of at least ``turns_per_batch`` turns.

    Modes:
      * ``"steps"``: T = ceil(turns_per_batch / num_slots) consecutive turns from every slot,
        shaped ``(num_slots, T)`` (or flat). Trajectories continue across batches.
      * ``"trajectories"``: whole completed trajectories, each contiguous, flat; trajectories
        past the threshold wait for the next batch.
      * ``"last_steps"``: exactly ``turns_per_batch`` rows, the last turn of distinct trajectories.
    Nothing is dropped: what does not fit in a batch is carried to the next one.
    """

    def __init__(self, *, mode: BatchMode, num_slots: int, turns_per_batch: int, flatten: bool) -> None:
        self.mode = mode
        self.num_slots = num_slots
        self.turns_per_batch = turns_per_batch
        self.flatten = flatten
        self.steps_per_slot = math.ceil(turns_per_batch / num_slots)
        self._per_slot: list[deque[CollectedTurn]] = [deque() for _ in range(num_slots)]
        self._completed: deque[list[CollectedTurn]] = deque()
        self._num_completed_turns = 0

    def add(self, turn: CollectedTurn) -> None:
        if self.mode == "steps":
            self._per_slot[turn.slot].append(turn)
            return
        pending = self._per_slot[turn.slot]
        pending.append(turn)
        if turn.done:
            traj = list(pending)
            pending.clear()
            if self.mode == "last_steps":
                traj = traj[-1:]
            self._completed.append(traj)
            self._num_completed_turns += len(traj)

    def ready(self) -> bool:
        if self.mode == "steps":
            return all(len(q) >= self.steps_per_slot for q in self._per_slot)
        return self._num_completed_turns >= self.turns_per_batch

    @property
    def batch_rows(self) -> int | None:
        """Rows of every batch (None in ``"trajectories"`` mode, whose batches end on whole trajectories)."""
        if self.mode == "steps":
            return self.steps_per_slot * self.num_slots
        return self.turns_per_batch if self.mode == "last_steps" else None

    @property
    def num_completed_turns(self) -> int:
        """Turns of completed trajectories waiting for a batch (trajectory modes)."""
        return self._num_completed_turns

    def num_pending_steps(self, slot: int) -> int:
        """Turns of ``slot`` waiting for a batch (steps mode)."""
        return len(self._per_slot[slot])

    def pop(self, *, take_all: bool = False) -> TensorDictBase:
        """The next batch; call only when :meth:`ready`.

        ``take_all`` (``"trajectories"`` mode, the collector's last batch): every completed
        trajectory goes into it, so no finished turn is left behind.
        """
        assert self.ready() or (take_all and self.mode == "trajectories"), "pop() called before the batch was ready"
        if self.mode == "steps":
            rows = [[q.popleft().td for _ in range(self.steps_per_slot)] for q in self._per_slot]
            return stack_turns([t for row in rows for t in row]) if self.flatten else stack_rows(rows)
        turns: list[TensorDictBase] = []
        while self._completed and (len(turns) < self.turns_per_batch or (take_all and self.mode == "trajectories")):
            traj = self._completed.popleft()
            self._num_completed_turns -= len(traj)
            turns.extend(t.td for t in traj)
        return stack_turns(turns)

    def pop_completed(self) -> list[TensorDictBase]:
        """Every turn of the completed trajectories (``"trajectories"`` / ``"last_steps"``), however few."""
        turns = [t.td for traj in self._completed for t in traj]
        self._completed.clear()
        self._num_completed_turns = 0
        return turns

    def drop_pending(self, slot: int) -> int:
        """Forget the unfinished trajectory of ``slot`` (after a forced reset); returns turns dropped."""
        if self.mode == "steps":
            return 0
        dropped = len(self._per_slot[slot])
        self._per_slot[slot].clear()
        return dropped

    def state_dict(self) -> dict:
        """The turns run but not yet yielded (they go into the next batches after a restore)."""
        return {
            "per_slot": [[turn_state(t) for t in q] for q in self._per_slot],
            "completed": [[turn_state(t) for t in traj] for traj in self._completed],
        }

    def check_state_dict(self, state: dict) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        self._parsed_state(state)

    def load_state_dict(self, state: dict) -> None:
        self._per_slot, self._completed = self._parsed_state(state)
        self._num_completed_turns = sum(len(traj) for traj in self._completed)

    def _parsed_state(self, state: dict) -> tuple[list[deque[CollectedTurn]], deque[list[CollectedTurn]]]:
        if len(state["per_slot"]) != self.num_slots:
            raise ValueError(
                f"the state holds turns of {len(state['per_slot'])} env slots, this collector has {self.num_slots}; "
                "restore into a collector with the same envs and batch sizes."
            )
        per_slot = [deque(turn_from_state(t, self.num_slots) for t in q) for q in state["per_slot"]]
        completed = deque([turn_from_state(t, self.num_slots) for t in traj] for traj in state["completed"])
        return per_slot, completed

    @property
    def num_buffered_turns(self) -> int:
        return sum(len(q) for q in self._per_slot) + self._num_completed_turns


def turn_state(turn: CollectedTurn) -> dict:
    return {"slot": turn.slot, "traj_id": turn.traj_id, "done": turn.done, "td": turn.td}


def turn_from_state(state: dict, num_slots: int | None = None) -> CollectedTurn:
    """The turn :func:`turn_state` described, every field checked (ValueError otherwise);
    ``num_slots``: how many env slots the collector has (None: any slot number)."""
    slot, traj_id, done, td = state["slot"], state["traj_id"], state["done"], state["td"]
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0 or (num_slots is not None and slot >= num_slots):
        raise ValueError(f"a saved turn's slot {slot!r:.40} is not one of this collector's env slots.")
    if isinstance(traj_id, bool) or not isinstance(traj_id, int) or not isinstance(done, bool):
        raise ValueError(f"a saved turn has traj_id={traj_id!r:.40}, done={done!r:.40}: an int and a bool expected.")
    if not isinstance(td, TensorDictBase):
        raise ValueError(f"a saved turn's data is a {type(td).__name__}, not a TensorDict.")
    return CollectedTurn(slot=slot, traj_id=traj_id, done=done, td=td)
