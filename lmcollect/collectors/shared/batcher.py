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
    Nothing is dropped: what does not fit in a batch is carried to the next one. :meth:`pop_counted`
    also says how many turns ran for a batch (``total_dialog_turns`` counts those): its rows, and in
    ``"last_steps"`` mode the intermediate turns of their trajectories too (run, then left out).
    """

    def __init__(self, *, mode: BatchMode, num_slots: int, turns_per_batch: int, flatten: bool) -> None:
        self.mode = mode
        self.num_slots = num_slots
        self.turns_per_batch = turns_per_batch
        self.flatten = flatten
        self.steps_per_slot = math.ceil(turns_per_batch / num_slots)
        self._per_slot: list[deque[CollectedTurn]] = [deque() for _ in range(num_slots)]
        self._completed: deque[list[CollectedTurn]] = deque()
        self._completed_run: deque[int] = deque()  # turns each completed trajectory ran (last steps: > its rows)
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
            self._completed_run.append(len(traj))
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

    def covers(self, budget: int) -> bool:
        """Trajectory modes: whether the completed trajectories waiting fill every batch still due.

        Batches are due until the turns they ran reach ``budget``; in ``"trajectories"`` mode the
        last one takes every completed trajectory, so the rows must reach ``budget`` (and a batch);
        in ``"last_steps"`` mode whole batches of ``turns_per_batch`` rows are taken in order.
        """
        if budget <= 0:
            return True
        if self.mode == "trajectories":
            return self._num_completed_turns >= max(budget, self.turns_per_batch)
        runs, per_batch = list(self._completed_run), self.turns_per_batch
        for start in range(0, len(runs) - per_batch + 1, per_batch):
            budget -= sum(runs[start : start + per_batch])
            if budget <= 0:
                return True
        return False

    def num_pending_steps(self, slot: int) -> int:
        """Turns of ``slot`` waiting for a batch (steps mode)."""
        return len(self._per_slot[slot])

    def pop(self, *, take_all: bool = False) -> TensorDictBase:
        """The next batch; call only when :meth:`ready`.

        ``take_all`` (trajectory modes, the collector's last batch): every completed trajectory
        goes into it, so no finished turn is left behind.
        """
        return self.pop_counted(take_all=take_all)[0]

    def pop_counted(self, *, take_all: bool = False) -> tuple[TensorDictBase, int]:
        """:meth:`pop`, and the turns that ran for the batch (see the class docstring)."""
        assert self.ready() or (take_all and self.mode != "steps"), "pop() called before the batch was ready"
        if self.mode == "steps":
            rows = [[q.popleft().td for _ in range(self.steps_per_slot)] for q in self._per_slot]
            batch = stack_turns([t for row in rows for t in row]) if self.flatten else stack_rows(rows)
            return batch, batch.batch_size.numel()
        turns: list[TensorDictBase] = []
        run = 0
        while self._completed and (len(turns) < self.turns_per_batch or take_all):
            traj = self._completed.popleft()
            run += self._completed_run.popleft()
            self._num_completed_turns -= len(traj)
            turns.extend(t.td for t in traj)
        return stack_turns(turns), run

    def pop_completed(self) -> tuple[list[TensorDictBase], int]:
        """Every turn of the completed trajectories (``"trajectories"`` / ``"last_steps"``), however
        few, and the turns that ran for them."""
        turns = [t.td for traj in self._completed for t in traj]
        run = sum(self._completed_run)
        self._completed.clear()
        self._completed_run.clear()
        self._num_completed_turns = 0
        return turns, run

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
            "completed_run": list(self._completed_run),
        }

    def check_state_dict(self, state: dict) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        self._parsed_state(state)

    def load_state_dict(self, state: dict) -> None:
        self._per_slot, self._completed, self._completed_run = self._parsed_state(state)
        self._num_completed_turns = sum(len(traj) for traj in self._completed)

    def _parsed_state(self, state: dict) -> tuple[list[deque[CollectedTurn]], deque[list[CollectedTurn]], deque[int]]:
        if len(state["per_slot"]) != self.num_slots:
            raise ValueError(
                f"the state holds turns of {len(state['per_slot'])} env slots, this collector has {self.num_slots}; "
                "restore into a collector with the same envs and batch sizes."
            )
        per_slot = [deque(turn_from_state(t, self.num_slots) for t in q) for q in state["per_slot"]]
        completed = deque([turn_from_state(t, self.num_slots) for t in traj] for traj in state["completed"])
        # a state from before the turns run were kept: each trajectory ran the rows it kept
        completed_run = deque(int(n) for n in state.get("completed_run", [len(traj) for traj in completed]))
        if len(completed_run) != len(completed) or any(
            n < len(t) for n, t in zip(completed_run, completed, strict=True)
        ):
            raise ValueError(
                "the state's completed_run does not match its completed trajectories; it was not saved by lmcollect."
            )
        return per_slot, completed, completed_run

    @property
    def num_buffered_turns(self) -> int:
        """Rows held for the next batches (trajectories under way, completed ones waiting)."""
        return sum(len(q) for q in self._per_slot) + self._num_completed_turns

    @property
    def num_uncounted_turns(self) -> int:
        """Turns run that no batch has counted yet: :attr:`num_buffered_turns`, and in ``"last_steps"``
        mode the intermediate turns of the completed trajectories waiting too."""
        return sum(len(q) for q in self._per_slot) + sum(self._completed_run)


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
