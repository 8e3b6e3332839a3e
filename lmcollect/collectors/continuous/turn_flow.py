"""Admission and release of turns in continuous collection: backpressure and bounded policy lag (pure logic).

The continuous collector runs every dialog on its own; this module decides when a dialog may start
its next turn and when finished turns may leave as a batch. One thread (the collector's event
loop) calls it, so it holds no lock.

**Admission.** A turn starts only while the turns started and not yet consumed (in flight, or
finished and waiting for a batch) stay below ``capacity`` (``max_buffered_turns``, or
``(max_policy_lag + 1) * B``), so a consumer that stops reading stops generation. With
``max_policy_lag=k`` it also needs AReaL's rule ``started < (k + v + 1) * B`` (``started`` counted
from the version ``base_version`` the flow began at), where the versions advanced, ``v``, count at
most one per batch consumed (a push before the first batch does not let more turns in).

**Release with bounded lag** (``max_policy_lag=k``, flat turn batches). A turn started under
version ``s`` must leave in a batch released while the collector's version is at most ``s + k``
(its deadline). A batch takes the ``B`` finished turns with the oldest versions (ties: first
finished first), and is released only if every turn left behind, finished or in flight, can
still meet its deadline when each later batch brings at most one new version: sorted by deadline,
the ``i``-th remaining turn (0-based) needs ``deadline >= v + ceil((i + 1) / B)``. Otherwise the
batch waits for the old turns still in flight. With admission, every deadline can be met, and
nothing is discarded. The bound assumes at most one push per batch consumed (train, push, next
batch); pushing more often makes versions outrun it (a batch then leaves once no turn is in
flight). A consumer that takes ``k + 1`` batches without a push has nothing more to take:
:meth:`TurnFlow.stalled` says so.

Trajectory modes (``yield_completed_trajectories`` / ``yield_only_last_steps``) release completed
trajectories in completion order (:class:`~lmcollect.collectors.shared.batcher.Batcher`); there, only new
dialogs wait for admission (a dialog under way always finishes), and ``max_policy_lag`` is refused.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from tensordict import TensorDictBase

from lmcollect.collectors.shared.batcher import Batcher, BatchMode, CollectedTurn, turn_from_state
from lmcollect.collectors.shared.groups import take_oldest
from lmcollect.data.turns import stack_turns

if TYPE_CHECKING:
    from lmcollect.collectors.continuous.group_flow import GroupFlow


class TurnFlow:
    """Counts started, in-flight, finished and consumed turns; decides admission and release.

    Args:
        mode: the batch mode (``"steps"``: flat batches of turns in finish order).
        num_slots: dialogs run at once (env slots).
        turns_per_batch: ``B``, turns per batch.
        capacity: turns started and not consumed beyond which no turn (steps) or dialog
            (trajectory modes) starts.
        max_policy_lag: ``k`` (steps mode only), or None for no lag bound.
        max_turns: ``total_dialog_turns``, turns to run in the collector's life (None: endless). Steps
            mode starts exactly that many rounded up to whole batches; trajectory modes start no
            dialog once that many turns have started, every dialog under way finishes, and the last
            batch takes every trajectory left.
        base_version: the version index when the flow began (AReaL's rule counts versions from it).
    """

    tally = None
    """(GroupFlow's: dynamic sampling's counts; turns without groups are never filtered.)"""

    def __init__(
        self,
        *,
        mode: BatchMode,
        num_slots: int,
        turns_per_batch: int,
        capacity: int,
        max_policy_lag: int | None,
        max_turns: int | None,
        base_version: int = 0,
    ) -> None:
        if max_policy_lag is not None and mode != "steps":
            raise ValueError(
                "max_policy_lag bounds the lag of turns in flat turn batches; it cannot be combined with "
                "yield_completed_trajectories / yield_only_last_steps. Drop max_policy_lag, or yield turns."
            )
        self.mode = mode
        self.num_slots = num_slots
        self.turns_per_batch = turns_per_batch
        self.capacity = capacity
        self.max_policy_lag = max_policy_lag
        if max_turns is not None and mode == "steps":  # whole batches
            max_turns = math.ceil(max_turns / turns_per_batch) * turns_per_batch
        self.max_turns = max_turns
        self.base_version = base_version
        self.num_started = 0
        self.num_consumed = 0
        self.num_counted = 0  # turns run for the consumed rows (last steps: their dialogs' every turn)
        self.num_batches = 0
        self.num_dialogs_running = 0
        self.num_dialogs_started = 0
        self._in_flight: Counter[int] = Counter()  # version index -> turns in flight
        self._num_in_flight = 0  # their sum (read from other threads: an int, never a dict being changed)
        self._finished: list[tuple[int, int, CollectedTurn]] = []  # steps mode: (version, seq, turn)
        self._seq = 0
        self._batcher = (
            None
            if mode == "steps"
            else Batcher(mode=mode, num_slots=num_slots, turns_per_batch=turns_per_batch, flatten=True)
        )

    # ------------------------------------------------------------------ admission
    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def num_buffered_turns(self) -> int:
        """Finished turns not consumed yet (trajectory modes: also turns of dialogs under way)."""
        return len(self._finished) if self._batcher is None else self._batcher.num_buffered_turns

    def budget_left(self) -> bool:
        """Whether a turn (trajectory modes: a new dialog) may still start: turns that ran count,
        in every mode (last steps too: a row stands for its dialog's turns), as torchrl counts."""
        return self.max_turns is None or self.num_started < self.max_turns

    def may_start(self, *, new_dialog: bool, version_index: int, group: int | None = None) -> bool:
        """Whether a dialog may start its next turn (a new dialog: its first one; ``group``: see GroupFlow)."""
        if self._batcher is not None and not new_dialog:
            return True  # a dialog under way always finishes: its trajectory is needed whole
        if not self.budget_left():
            return False
        if self.num_buffered_turns + self.num_in_flight >= self.capacity:
            return False
        return self._lag_admits(version_index)

    def _lag_admits(self, version_index: int) -> bool:
        return lag_admits(self, version_index, self.turns_per_batch)

    def stalled(self, version_index: int) -> bool:
        """Nothing can move until a push: no batch is ready, none in flight, and the lag rule admits no turn."""
        return (
            self.max_policy_lag is not None
            and self.budget_left()
            and not self.num_in_flight
            and not self.ready(version_index)
            and not self._lag_admits(version_index)
        )

    def assign(self, slot: int, group: int) -> None:
        """(GroupFlow's: which group a slot's new dialog answers; turns here have no groups.)"""

    def start_turn(self, version_index: int, *, new_dialog: bool, group: int | None = None) -> None:
        if self.num_started == 0 and self.num_batches == 0:
            # collection begins here: versions pushed before it are where it begins, not versions it advanced
            self.base_version = version_index
        self.num_started += 1
        self._in_flight[version_index] += 1
        self._num_in_flight += 1
        if new_dialog:
            self.num_dialogs_running += 1
            self.num_dialogs_started += 1

    def abandon_turn(self, version_index: int, *, end_dialog: bool) -> None:
        """A turn that failed: it leaves the in-flight count (and its dialog ends if ``end_dialog``)."""
        self._remove_in_flight(version_index)
        self.num_started -= 1
        if end_dialog:  # its turns are dropped: another dialog may take its place in the budget
            self.num_dialogs_running -= 1
            self.num_dialogs_started -= 1

    def finish_turn(self, version_index: int, turn: CollectedTurn) -> None:
        self._remove_in_flight(version_index)
        if turn.done:
            self.num_dialogs_running -= 1
        if self._batcher is not None:
            self._batcher.add(turn)
            return
        self._finished.append((version_index, self._seq, turn))
        self._seq += 1

    def drop_dialog(self, slot: int) -> int:
        """Forget the unfinished trajectory of ``slot`` (its dialog was abandoned); turns dropped."""
        return 0 if self._batcher is None else self._batcher.drop_pending(slot)

    def _remove_in_flight(self, version_index: int) -> None:
        self._num_in_flight -= 1
        self._in_flight[version_index] -= 1
        if self._in_flight[version_index] <= 0:
            del self._in_flight[version_index]

    # ------------------------------------------------------------------ release
    def ready(self, version_index: int) -> bool:
        """Whether a batch may leave now, the collector holding ``version_index``."""
        if self._batcher is not None:
            return self._batcher.ready() or self._last_trajectories_due()
        if len(self._finished) < self.turns_per_batch:
            return False
        if self.max_policy_lag is None:
            return True
        _, left = self._split()
        # with no turn in flight, waiting cannot help (only extra pushes make deadlines unmeetable)
        return not self._in_flight or deadlines_met(left, version_index, self.max_policy_lag, self.turns_per_batch)

    def pop(self, version_index: int) -> TensorDictBase:
        """The next batch (call only when :meth:`ready`)."""
        assert self.ready(version_index), "pop() called before a batch was ready"
        if self._batcher is not None:
            batch, run = self._batcher.pop_counted(take_all=self._last_trajectories_due())
            self.num_consumed += batch.shape[0]
            self.num_counted += run
            self.num_batches += 1
            return batch
        if self.max_policy_lag is None:
            taken, self._finished = self._finished[: self.turns_per_batch], self._finished[self.turns_per_batch :]
        else:
            taken, self._finished = take_oldest(self._finished, self.turns_per_batch)
        self.num_consumed += len(taken)
        self.num_counted += len(taken)
        self.num_batches += 1
        return stack_turns([item[2].td for item in taken])

    def _last_trajectories_due(self) -> bool:
        """Trajectory modes, budget spent, every dialog ended: the rest goes out as the last batch."""
        return (
            self.mode != "steps"
            and not self.budget_left()
            and not self.num_in_flight
            and not self.num_dialogs_running
            and self._batcher is not None  # it is in a trajectory mode
            and self._batcher.num_completed_turns > 0
        )

    def _split(self) -> tuple[list[int], list[int]]:
        """(versions of the next batch, versions of every turn left: finished and in flight)."""
        ordered = sorted(self._finished, key=lambda item: item[:2])
        taken = [v for v, _, _ in ordered[: self.turns_per_batch]]
        left = [v for v, _, _ in ordered[self.turns_per_batch :]] + list(self._in_flight.elements())
        return taken, left

    def exhausted(self) -> bool:
        """The turn budget is spent and nothing more can ever make a batch."""
        if self.budget_left() or self.num_in_flight:
            return False
        if self._batcher is not None:
            return not self.num_dialogs_running and not self.ready(self.base_version)
        return len(self._finished) < self.turns_per_batch

    def drain(self) -> TensorDictBase | None:
        """Every finished turn that could go into a batch (trajectory modes: whole trajectories), consumed now."""
        if self._batcher is not None:
            tds, run = self._batcher.pop_completed()
        else:
            tds, run = [item[2].td for item in self._finished], len(self._finished)
            self._finished = []
        self.num_consumed += len(tds)
        self.num_counted += run
        return stack_turns(tds) if tds else None

    def drain_incomplete(self) -> TensorDictBase | None:
        """(GroupFlow's: turns of groups under way; here every finished turn was drained.)"""
        return None

    def state_dict(self) -> dict:
        """The finished turns not consumed yet and the counters (taken with no turn in flight)."""
        assert not self._in_flight, "state_dict() with turns in flight"
        pending = (
            self._batcher.state_dict()
            if self._batcher is not None
            else [
                {"version": v, "slot": t.slot, "traj_id": t.traj_id, "done": t.done, "td": t.td}
                for v, _, t in self._finished
            ]
        )
        counters = {k: getattr(self, k) for k in (*_COUNTERS, "num_dialogs_started", "num_counted")}
        return {**counters, "pending": pending}

    def check_state_dict(self, state: dict) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        self._parsed_state(state)

    def load_state_dict(self, state: dict) -> None:
        counters, finished = self._parsed_state(state)  # everything checked before anything changes
        for name, value in counters.items():
            setattr(self, name, value)
        if self._batcher is not None:
            self._batcher.load_state_dict(state["pending"])
            return
        self._finished = []
        for version, turn in finished:
            self._finished.append((version, self._seq, turn))
            self._seq += 1

    def _parsed_state(self, state: dict) -> tuple[dict[str, int], list[tuple[int, CollectedTurn]]]:
        if "open" in state:
            raise ValueError(
                "this state holds GRPO groups; restore it into a collector whose envs have the same repeats."
            )
        counters = {name: int(state[name]) for name in _COUNTERS}
        # a state from before dialogs were counted: as many as rows were taken (last-steps mode)
        counters["num_dialogs_started"] = int(state.get("num_dialogs_started", counters["num_consumed"]))
        counters["num_counted"] = int(state.get("num_counted", counters["num_consumed"]))  # older states counted rows
        if self._batcher is not None:
            self._batcher.check_state_dict(state["pending"])
            return counters, []
        return counters, [(int(item["version"]), turn_from_state(item, self.num_slots)) for item in state["pending"]]


_COUNTERS = ("base_version", "num_started", "num_consumed", "num_batches")


def lag_admits(flow: TurnFlow | GroupFlow, version_index: int, per_batch: int, extra: int = 0) -> bool:
    """AReaL's rule: ``started < (k + v + 1) * per_batch + extra`` units (turns, or groups), ``v`` the
    versions advanced since ``flow.base_version``, at most one per batch consumed; always True without
    a lag bound. ``extra``: units admitted ahead (dynamic sampling's over-sampling)."""
    if flow.max_policy_lag is None:
        return True
    advanced = min(version_index - flow.base_version, flow.num_batches)  # at most one per batch
    return flow.num_started < (flow.max_policy_lag + advanced + 1) * per_batch + extra


def deadlines_met(
    versions: list[int], version_index: int, max_policy_lag: int, turns_per_batch: int, spare: int = 0
) -> bool:
    """Whether turns of these versions can all leave in time, one batch (and at most one version) at a
    time; ``spare`` of them may miss (over-sampled groups, dropped as stale when they do)."""
    missed = placed = 0
    for version in sorted(versions):  # earliest deadline first: the fewest misses
        if version + max_policy_lag < version_index + math.ceil((placed + 1) / turns_per_batch):
            missed += 1
            if missed > spare:
                return False
            continue
        placed += 1
    return True
