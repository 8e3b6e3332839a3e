"""Per-slot trajectory bookkeeping: ids, group ids, step counts and the versions a trajectory saw."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

ID_BLOCK_BITS = 32
"""Each collector numbers its trajectories and groups within its own block of 2**32 ids."""
RESTART_BITS = 26
"""A restarted collector actor continues in a fresh sub-block of 2**26 ids of its block."""
_RANDOM_NAMESPACES = (1 << 16, 1 << 30)
"""A collector with no worker index takes a random block number from this range (worker
indices, set by RayCollectorGroup, stay below it)."""


def random_namespace() -> int:
    """A block number for a collector built on its own (collisions: ~1e-9 per pair)."""
    return random.SystemRandom().randrange(*_RANDOM_NAMESPACES)


def id_base(namespace: int, restarts: int = 0) -> int:
    """The first id of block ``namespace`` (after ``restarts`` restarts of its actor)."""
    if namespace < 0 or namespace >= 1 << (63 - ID_BLOCK_BITS):
        raise ValueError(f"an id namespace must be in [0, 2**31), got {namespace}.")
    if restarts < 0 or restarts >= 1 << (ID_BLOCK_BITS - RESTART_BITS):
        raise ValueError(f"restarts must be in [0, 64), got {restarts}.")
    return (namespace << ID_BLOCK_BITS) + (restarts << RESTART_BITS)


@dataclass
class _SlotState:
    traj_id: int
    step_count: int = 0
    min_version: int = 0


class TrajectoryTracker:
    """Hands out unique trajectory ids to env slots and counts steps within each trajectory.

    A slot is one element of one env. ``stamp(slot, version_index)`` returns the bookkeeping of
    the turn the slot is about to record; ``end(slot)`` starts a new trajectory in that slot.
    Ids start at ``first_id`` (the collector's id block, see :func:`id_base`). Thread-safe: env
    threads of ``async_envs`` call it concurrently.
    """

    def __init__(self, num_slots: int, *, first_id: int = 0) -> None:
        self._lock = threading.Lock()
        self._base = first_id
        self._next_id = first_id
        self._slots = [self._new_state(0) for _ in range(num_slots)]

    @property
    def base(self) -> int:
        """The first id of this tracker's block."""
        return self._base

    def _new_state(self, version_index: int) -> _SlotState:
        state = _SlotState(traj_id=self._next_id, min_version=version_index)
        self._next_id += 1
        return state

    def stamp(self, slot: int, version_index: int) -> tuple[int, int, int]:
        """(trajectory id, step count, oldest version index of the trajectory) for the next turn."""
        with self._lock:
            state = self._slots[slot]
            if state.step_count == 0:
                state.min_version = version_index
            stamp = (state.traj_id, state.step_count, state.min_version)
            state.step_count += 1
            return stamp

    def end(self, slot: int, version_index: int = 0) -> None:
        """Start a new trajectory in ``slot`` (an id no turn has used yet is kept)."""
        with self._lock:
            if self._slots[slot].step_count == 0:
                self._slots[slot].min_version = version_index
            else:
                self._slots[slot] = self._new_state(version_index)

    def group_id(self, env_number: int, num_envs: int, prompt_id: int) -> int:
        """The collector-wide GRPO group id of draw ``prompt_id`` of env ``env_number``.

        Envs number their prompt draws from 0 each; interleaving them by env and offsetting by
        the id block makes the id unique across the collector's envs and across collectors.
        """
        return self._base + prompt_id * num_envs + env_number

    def set_id_base(self, base: int) -> None:
        """Number future trajectories (and groups) from ``base`` (a new id block; same block: no-op)."""
        with self._lock:
            if base == self._base:
                return
            self._base = base
            self._next_id = base
            for state in self._slots:
                if state.step_count == 0:
                    state.traj_id = self._next_id
                    self._next_id += 1

    def traj_id(self, slot: int) -> int:
        return self._slots[slot].traj_id

    def state_dict(self) -> dict:
        with self._lock:
            return {"base": self._base, "next_id": self._next_id, "slots": [vars(s).copy() for s in self._slots]}

    def check_state_dict(self, state: dict) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        self._parsed_state(state)

    def load_state_dict(self, state: dict) -> None:
        base, next_id, slots = self._parsed_state(state)
        with self._lock:
            self._base, self._next_id, self._slots = base, next_id, slots

    def _parsed_state(self, state: dict) -> tuple[int, int, list[_SlotState]]:
        base, next_id = state.get("base", self._base), state["next_id"]
        slots = [_SlotState(**s) for s in state["slots"]]
        numbers = [base, next_id, *(n for s in slots for n in (s.traj_id, s.step_count, s.min_version))]
        if any(isinstance(n, bool) or not isinstance(n, int) for n in numbers):
            raise ValueError("the trajectory ids, step counts and versions of this state are not all ints.")
        if len(slots) != len(self._slots):
            raise ValueError(
                f"the state tracks {len(slots)} env slots, this collector has {len(self._slots)}; restore into a "
                "collector with the same envs and batch sizes."
            )
        return base, next_id, slots
