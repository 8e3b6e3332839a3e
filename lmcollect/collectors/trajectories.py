"""Per-slot trajectory bookkeeping: ids, step counts and the versions a trajectory saw."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _SlotState:
    traj_id: int
    step_count: int = 0
    min_version: int = 0


class TrajectoryTracker:
    """Hands out unique trajectory ids to env slots and counts steps within each trajectory.

    A slot is one element of one env. ``stamp(slot, version_index)`` returns the bookkeeping of
    the turn the slot is about to record; ``end(slot)`` starts a new trajectory in that slot.
    """

    def __init__(self, num_slots: int, *, first_id: int = 0) -> None:
        self._next_id = first_id
        self._slots = [self._new_state(0) for _ in range(num_slots)]

    def _new_state(self, version_index: int) -> _SlotState:
        state = _SlotState(traj_id=self._next_id, min_version=version_index)
        self._next_id += 1
        return state

    def stamp(self, slot: int, version_index: int) -> tuple[int, int, int]:
        """(trajectory id, step count, oldest version index of the trajectory) for the next turn."""
        state = self._slots[slot]
        if state.step_count == 0:
            state.min_version = version_index
        stamp = (state.traj_id, state.step_count, state.min_version)
        state.step_count += 1
        return stamp

    def end(self, slot: int, version_index: int = 0) -> None:
        """Start a new trajectory in ``slot`` (an id no turn has used yet is kept)."""
        if self._slots[slot].step_count == 0:
            self._slots[slot].min_version = version_index
        else:
            self._slots[slot] = self._new_state(version_index)

    def set_id_base(self, base: int) -> None:
        """Number future trajectories from ``base`` (distinct bases keep ids unique across collectors)."""
        self._next_id = max(self._next_id, base)
        for state in self._slots:
            if state.step_count == 0:
                state.traj_id = self._next_id
                self._next_id += 1

    def traj_id(self, slot: int) -> int:
        return self._slots[slot].traj_id

    def state_dict(self) -> dict:
        return {"next_id": self._next_id, "slots": [vars(s).copy() for s in self._slots]}

    def load_state_dict(self, state: dict) -> None:
        self._next_id = state["next_id"]
        self._slots = [_SlotState(**s) for s in state["slots"]]
