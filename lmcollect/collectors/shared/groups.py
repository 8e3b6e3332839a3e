"""GRPO groups held until complete, judged by the group filter and released whole (pure logic).

Both collectors hold the turns of a group (``("collector", "group_id")``) until every dialog of
the group has ended, send the complete group through dynamic sampling's filter
(:class:`~lmcollect.collectors.shared.group_filter.GroupTally`), keep it, and release
``G = max(1, dialog_turns_per_batch // k)`` kept groups per batch, each group whole, flat.
:class:`HeldGroups` is that bookkeeping, once. What differs stays with its user:

* :class:`~lmcollect.collectors.lockstep.group_gate.GroupGate` (lockstep) opens a group at its
  first turn, with admission version 0 (so release is in completion order), and drops the late
  turns of groups a ``reset()`` cut.
* :class:`~lmcollect.collectors.continuous.group_flow.GroupFlow` (continuous) opens a group when
  it admits it, under the current version; a cut dialog lowers the group's ``expected``; release
  takes the oldest admissions first, under ``max_policy_lag``, after dropping stale kept groups.

A held turn is whatever the user holds (a TensorDict, or a ``CollectedTurn``): ``td_of`` and
``traj_id_of`` read its TensorDict and trajectory id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tensordict import TensorDictBase

from lmcollect.collectors.shared.group_filter import DynamicSampling, GroupTally

T = TypeVar("T")
E = TypeVar("E", bound=tuple)


@dataclass
class HeldGroup(Generic[T]):
    """A group under way: its admission version, the dialogs it waits for and its turns so far."""

    version: int
    expected: int
    done: int = 0
    turns: list[T] = field(default_factory=list)


class HeldGroups(Generic[T]):
    """Groups under way (:attr:`open`) and complete kept groups waiting for a batch (:attr:`kept`).

    Args:
        group_size: ``k``, dialogs per group (the envs' ``repeats``).
        turns_per_batch: ``dialog_turns_per_batch``; a batch holds ``max(1, turns_per_batch // k)`` groups.
        sampling: the group filter and its bound, or None (every complete group is kept).
        td_of: a held turn's TensorDict.
        traj_id_of: a held turn's trajectory id (the filter reads rewards per dialog).
    """

    def __init__(
        self,
        *,
        group_size: int,
        turns_per_batch: int,
        sampling: DynamicSampling | None,
        td_of: Callable[[T], TensorDictBase],
        traj_id_of: Callable[[T], int],
    ) -> None:
        self.group_size = group_size
        self.groups_per_batch = max(1, turns_per_batch // group_size)
        self.tally = None if sampling is None else GroupTally(sampling)
        self.open: dict[int, HeldGroup[T]] = {}  # group id -> group under way
        self.kept: list[tuple[int, int, list[T]]] = []  # (admission version, completion seq, turns)
        self._td_of = td_of
        self._traj_id_of = traj_id_of
        self._seq = 0

    @property
    def num_held_turns(self) -> int:
        """Turns held: of groups under way and of kept groups waiting for a batch."""
        return sum(len(g.turns) for g in self.open.values()) + sum(len(turns) for _, _, turns in self.kept)

    def count_generated(self, turn: T) -> None:
        """Count a finished turn's tokens as generated (dynamic sampling's counts)."""
        if self.tally is not None:
            self.tally.generated(self._td_of(turn))

    def add(self, group: int, turn: T, *, ended: bool) -> None:
        """A finished turn of ``group`` (open); ``ended``: its dialog ended with it."""
        self.count_generated(turn)
        held = self.open[group]
        held.turns.append(turn)
        if ended:
            held.done += 1

    def close_if_complete(self, group: int) -> list[T] | None:
        """Once every dialog ``group`` waits for has ended: close it and keep it unless the filter
        drops it. Returns the turns of a group the filter dropped, else None."""
        held = self.open[group]
        if held.done < held.expected:
            return None
        del self.open[group]
        if not held.turns:
            return None
        judged = [(self._traj_id_of(t), self._td_of(t)) for t in held.turns]
        if self.tally is not None and self.tally.judge(judged) is not None:
            return held.turns
        self.keep(held.version, held.turns)
        return None

    def keep(self, version: int, turns: list[T]) -> None:
        """Add a complete group to the kept ones (also to restore a checkpoint, in completion order)."""
        self.kept.append((version, self._seq, turns))
        self._seq += 1

    def batch_ready(self) -> bool:
        """Whether ``G`` kept groups wait; raises once the filter has dropped too many groups in a row."""
        if self.tally is not None:
            self.tally.raise_if_failed()
        return len(self.kept) >= self.groups_per_batch

    def drop_stale(self, version_index: int, max_policy_lag: int) -> list[list[T]]:
        """Drop the kept groups admitted before ``version_index - max_policy_lag``; returns their turns."""
        stale = [turns for version, _, turns in self.kept if version + max_policy_lag < version_index]
        if stale:
            self.kept = [item for item in self.kept if item[0] + max_policy_lag >= version_index]
            for _ in stale:
                if self.tally is not None:
                    self.tally.drop_stale()
        return stale

    def take_batch(self) -> list[TensorDictBase]:
        """The next batch's turns: the ``G`` kept groups admitted first (ties: completed first), in
        completion order, each group's turns in finish order."""
        taken, self.kept = take_oldest(self.kept, self.groups_per_batch)
        return self._deliver(taken, batch=True)

    def take_all(self) -> list[TensorDictBase]:
        """Every kept group's turns, in completion order (at the end of collection)."""
        taken, self.kept = sorted(self.kept, key=lambda item: item[1]), []
        return self._deliver(taken, batch=False)

    def _deliver(self, taken: list[tuple[int, int, list[T]]], *, batch: bool) -> list[TensorDictBase]:
        tds = [self._td_of(turn) for _, _, turns in taken for turn in turns]
        if self.tally is not None:
            self.tally.delivered(tds, num_groups=len(taken), batch=batch)
        return tds


def take_oldest(finished: list[E], count: int) -> tuple[list[E], list[E]]:
    """Of ``(version, seq, item)`` entries: the ``count`` oldest by version (ties: lowest seq first),
    in seq (finish) order, and the rest."""
    taken = sorted(finished, key=lambda entry: entry[:2])[:count]
    chosen = {id(entry) for entry in taken}
    rest = [entry for entry in finished if id(entry) not in chosen]
    return sorted(taken, key=lambda entry: entry[1]), rest
