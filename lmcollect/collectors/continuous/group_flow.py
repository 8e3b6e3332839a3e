"""Admission and release of whole GRPO groups in continuous collection (pure logic).

With envs that declare groups (``ChatEnv(repeats=k)``), ``k`` dialogs answer each prompt draw,
one per slot, each at its own pace (a slot that ends early starts its next draw's dialog at once).
:class:`GroupFlow` holds a group's turns until all its dialogs ended and releases whole groups: a
batch holds ``G = max(1, dialog_turns_per_batch // k)`` complete groups with every turn of their
dialogs (exactly ``dialog_turns_per_batch`` turns for single-turn tasks when ``k`` divides it).
So ``GroupAdvantage`` sees every group whole, in one batch.

The unit is a group, and :class:`~lmcollect.collectors.continuous.turn_flow.TurnFlow`'s rules apply to it:

* **Admission.** A group is admitted when its first dialog is about to start its first turn, if the
  groups admitted and not consumed stay below ``capacity`` (a group whose failed dialog's slot ran
  ahead is admitted beyond it: see :meth:`GroupFlow._skipped_by_a_partner`) and, with
  ``max_policy_lag=L``, AReaL's rule holds in groups: ``admitted < (L + v + 1) * G`` (``v``: versions advanced, at most one per
  batch). Every later turn of an admitted group starts at once: a group under way completes without
  waiting for a push, so the rules never deadlock.
* **Release.** ``G`` complete groups with the oldest admission versions leave together, and only if
  every group left behind (complete, or under way) can still leave within ``L`` versions of its
  admission when each later batch brings one version (the deadline rule, counted in groups).

So ``max_policy_lag`` holds per group: a group admitted under version ``s`` leaves in a batch
released while the collector holds at most ``s + L`` (and each turn's own version is ``>= s``).
A dialog that fails, or that ``reset()`` / ``set_seed()`` cuts, leaves its group: the group then
completes with one answer fewer, and the cut dialog's turns are dropped (logged by the caller).

**Dynamic sampling** (``sampling``, see :mod:`~lmcollect.collectors.shared.group_filter`). A complete group
goes through the filter; a dropped group is forgotten and no longer counts as admitted, so another
group takes its place under the same rules (the refill), and a batch still holds ``G`` kept groups.
``oversample_groups=N`` raises both admission limits by ``N`` groups; with ``max_policy_lag`` a
batch may then leave even though up to ``N`` groups left behind would miss their deadline, and a
kept group whose deadline has passed (``version + L`` below the collector's version) is dropped as
``"stale"``: no kept group ever leaves later than the bound.
"""

from __future__ import annotations

from collections import Counter

from tensordict import TensorDictBase

from lmcollect.collectors.continuous.turn_flow import deadlines_met, lag_admits
from lmcollect.collectors.shared.batcher import CollectedTurn, turn_from_state, turn_state
from lmcollect.collectors.shared.group_filter import DynamicSampling, GroupTally, missing_filter_state
from lmcollect.collectors.shared.groups import HeldGroup, HeldGroups
from lmcollect.data.turns import stack_turns


class GroupFlow:
    """Counts groups admitted, under way, complete and consumed; decides admission and release.

    Same interface as :class:`~lmcollect.collectors.continuous.turn_flow.TurnFlow` (the dialog tasks call
    either), plus :meth:`assign` (which group a slot's new dialog answers) and
    :meth:`drain_incomplete`.

    Args:
        group_size: ``k``, dialogs per prompt draw.
        turns_per_batch: ``dialog_turns_per_batch``; a batch holds ``max(1, turns_per_batch // k)`` groups.
        capacity: groups admitted and not consumed beyond which no group is admitted.
        max_policy_lag: ``L``, or None for no lag bound.
        max_turns: ``total_dialog_turns``, turns to run in the collector's life (None: endless): groups
            are admitted until the turns they run reach it (a group counts ``k`` turns when admitted,
            and each later turn of its dialogs one more), then to fill the last batch's groups.
        base_version: the version index when the flow began.
        sampling: dynamic sampling (filter complete groups, refill, over-sample), or None.
    """

    mode = "steps"

    def __init__(
        self,
        *,
        group_size: int,
        turns_per_batch: int,
        capacity: int,
        max_policy_lag: int | None,
        max_turns: int | None,
        base_version: int = 0,
        sampling: DynamicSampling | None = None,
    ) -> None:
        self.groups: HeldGroups[CollectedTurn] = HeldGroups(
            group_size=group_size,
            turns_per_batch=turns_per_batch,
            sampling=sampling,
            td_of=lambda turn: turn.td,
            traj_id_of=lambda turn: turn.traj_id,
        )
        self.group_size = group_size
        self.turns_per_batch = turns_per_batch
        self.groups_per_batch = self.groups.groups_per_batch
        self.capacity = capacity
        self.max_policy_lag = max_policy_lag
        self.max_turns = max_turns
        self.num_turns_counted = 0  # turns of the admitted groups: k each at admission, then every later turn
        self.base_version = base_version
        self.num_started = 0  # groups admitted (and not dropped by the group filter)
        self.num_consumed = 0  # turns that left in batches
        self.num_batches = 0
        self.num_dialogs_running = 0
        self.num_dialogs_started = 0
        self._num_in_flight = 0  # turns (read from other threads: an int)
        self._slot_group: dict[int, int] = {}  # slot -> the group its current dialog answers
        self._missing: Counter[int] = Counter()  # groups not admitted yet -> dialogs cut before they began
        self.oversample = 0 if sampling is None else sampling.oversample_groups

    # ------------------------------------------------------------------ counts
    @property
    def tally(self) -> GroupTally | None:
        """Dynamic sampling's filter and counts (None without it)."""
        return self.groups.tally

    @property
    def num_in_flight(self) -> int:
        """Turns started and not finished."""
        return self._num_in_flight

    @property
    def num_buffered_turns(self) -> int:
        """Finished turns not consumed: those of complete groups and those held for groups under way."""
        return self.groups.num_held_turns

    @property
    def num_counted(self) -> int:
        """Turns counted against ``total_dialog_turns`` that left: every turn of a group is a row."""
        return self.num_consumed

    @property
    def num_groups_open(self) -> int:
        """Groups admitted and not complete."""
        return len(self.groups.open)

    def budget_left(self) -> bool:
        """Whether a group may still be admitted: turns run count, as torchrl counts ``total_dialog_turns``."""
        if self.max_turns is None or self.num_turns_counted < self.max_turns:
            return True
        return self.num_started % self.groups_per_batch != 0  # fill the last batch with whole groups

    # ------------------------------------------------------------------ admission
    def assign(self, slot: int, group: int) -> None:
        """Slot ``slot`` holds a new dialog (reset, not started) answering ``group``."""
        self._slot_group[slot] = group

    def may_start(self, *, new_dialog: bool, version_index: int, group: int | None = None) -> bool:
        if group in self.groups.open or not new_dialog:
            return True  # a group under way always completes
        if not self.budget_left() or (self.tally is not None and self.tally.failure is not None):
            return False
        if len(self.groups.open) + len(self.groups.kept) >= self.capacity + self.oversample:
            return group is not None and self._skipped_by_a_partner(group)
        return self._lag_admits(version_index)

    def _skipped_by_a_partner(self, group: int) -> bool:
        """A group one of whose dialogs failed before starting, drawn before a group under way, passes
        the capacity check: the slot that failed ran ahead into newer groups, which wait for this
        slot, so holding it back would stop everything. At most one such group per slot: capacity
        is exceeded by no more than the slots, and only after a failure."""
        return self._missing[group] > 0 and any(group < other for other in self.groups.open)

    def _lag_admits(self, version_index: int) -> bool:
        return lag_admits(self, version_index, self.groups_per_batch, self.oversample)

    def stalled(self, version_index: int) -> bool:
        """Nothing can move until a push: no group under way, no batch ready, no group admitted."""
        return (
            self.max_policy_lag is not None
            and self.budget_left()
            and not self._num_in_flight
            and not self.groups.open
            and not self.ready(version_index)
            and not self._lag_admits(version_index)
        )

    def start_turn(self, version_index: int, *, new_dialog: bool, group: int | None = None) -> None:
        if group is None:
            raise ValueError("GroupFlow.start_turn needs the turn's group")
        if self.num_dialogs_started == 0 and self.num_batches == 0:
            self.base_version = version_index  # as TurnFlow: versions pushed before collection do not count
        if group not in self.groups.open:
            expected = self.group_size - self._missing.pop(group, 0)
            self.groups.open[group] = HeldGroup(version=version_index, expected=max(1, expected))
            self.num_started += 1
            self.num_turns_counted += self.groups.open[group].expected
        if not new_dialog:
            self.num_turns_counted += 1
        self._num_in_flight += 1
        if new_dialog:
            self.num_dialogs_running += 1
            self.num_dialogs_started += 1

    def abandon_turn(self, version_index: int, *, end_dialog: bool) -> None:
        """A turn that failed; with ``end_dialog`` its dialog ends (:meth:`drop_dialog` follows)."""
        self._num_in_flight -= 1
        if end_dialog:
            self.num_dialogs_running -= 1

    def finish_turn(self, version_index: int, turn: CollectedTurn) -> None:
        self._num_in_flight -= 1
        group = self._slot_group[turn.slot]
        self.groups.add(group, turn, ended=turn.done)
        if turn.done:
            self.num_dialogs_running -= 1
            del self._slot_group[turn.slot]
            self._complete_if_done(group)

    def drop_dialog(self, slot: int) -> int:
        """The dialog of ``slot`` was cut: it leaves its group; returns its turns dropped."""
        group = self._slot_group.pop(slot, None)
        if group is None:
            return 0
        held = self.groups.open.get(group)
        if held is None:  # its group was not admitted yet: it will wait for one dialog fewer
            self._missing[group] += 1
            return 0
        kept = [t for t in held.turns if t.slot != slot]
        dropped = len(held.turns) - len(kept)
        held.turns = kept
        held.expected -= 1
        self._complete_if_done(group)
        return dropped

    def _complete_if_done(self, group: int) -> None:
        dropped = self.groups.close_if_complete(group)
        if dropped is not None:
            self.num_started -= 1  # dropped: it frees its admission place, a refill takes it
            self.num_turns_counted -= len(dropped)  # the budget counts delivered turns (drops: sampling counts)

    # ------------------------------------------------------------------ release
    def ready(self, version_index: int) -> bool:
        """Whether a batch may leave now (dynamic sampling: drops stale groups first, and raises once
        the filter has dropped too many groups in a row)."""
        if self.tally is not None and self.max_policy_lag is not None:
            for turns in self.groups.drop_stale(version_index, self.max_policy_lag):
                self.num_started -= 1  # its place goes to a refill, as a filtered group's does
                self.num_turns_counted -= len(turns)
        if not self.groups.batch_ready():
            return False
        if self.max_policy_lag is None or not self.groups.open:
            return True
        ordered = sorted(self.groups.kept, key=lambda item: item[:2])
        left = [v for v, _, _ in ordered[self.groups_per_batch :]] + [g.version for g in self.groups.open.values()]
        return deadlines_met(left, version_index, self.max_policy_lag, self.groups_per_batch, spare=self.oversample)

    def pop(self, version_index: int) -> TensorDictBase:
        """The next batch: ``G`` whole groups, oldest admission first (call only when :meth:`ready`)."""
        assert self.ready(version_index), "pop() called before a batch was ready"
        tds = self.groups.take_batch()
        self.num_consumed += len(tds)
        self.num_batches += 1
        return stack_turns(tds)

    def exhausted(self) -> bool:
        """The group budget is spent and nothing more can ever make a batch."""
        if self.budget_left() or self._num_in_flight or self.groups.open:
            return False
        return len(self.groups.kept) < self.groups_per_batch

    def drain(self) -> TensorDictBase | None:
        """Every complete group not consumed yet, consumed now (completion order)."""
        tds = self.groups.take_all()
        self.num_consumed += len(tds)
        return stack_turns(tds) if tds else None

    def drain_incomplete(self) -> TensorDictBase | None:
        """The turns held for groups under way (at shutdown: their other dialogs will never run)."""
        tds = [turn.td for held in self.groups.open.values() for turn in held.turns]
        self.groups.open.clear()
        self._slot_group.clear()
        self.num_consumed += len(tds)
        return stack_turns(tds) if tds else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Counters, complete groups and groups under way with their turns (taken with no turn in flight)."""
        assert not self._num_in_flight, "state_dict() with turns in flight"
        return {
            **{k: getattr(self, k) for k in _COUNTERS},
            "num_turns_counted": self.num_turns_counted,
            "finished": [{"version": v, "turns": [turn_state(t) for t in turns]} for v, _, turns in self.groups.kept],
            "open": {
                str(g): {
                    "version": h.version,
                    "expected": h.expected,
                    "done": h.done,
                    "turns": [turn_state(t) for t in h.turns],
                }
                for g, h in self.groups.open.items()
            },
            "slot_group": {str(s): g for s, g in self._slot_group.items()},
            "missing": {str(g): n for g, n in self._missing.items()},
            **({} if self.tally is None else {"sampling": self.tally.state_dict()}),
        }

    def check_state_dict(self, state: dict) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        self._parsed_state(state)

    def load_state_dict(self, state: dict) -> None:
        counters, finished, self.groups.open, self._slot_group, self._missing = self._parsed_state(state)
        if self.tally is not None:
            self.tally.load_state_dict(state["sampling"])
        for name, value in counters.items():
            setattr(self, name, value)
        self.groups.kept = []
        for version, turns in finished:
            self.groups.keep(version, turns)

    def _parsed_state(
        self, state: dict
    ) -> tuple[
        dict[str, int],
        list[tuple[int, list[CollectedTurn]]],
        dict[int, HeldGroup[CollectedTurn]],
        dict[int, int],
        Counter[int],
    ]:
        """Every field of ``state``, checked and converted, before anything changes."""
        if "open" not in state:
            raise ValueError(
                "this state holds turns without GRPO groups; restore it into a collector whose envs have no repeats."
            )
        if ("sampling" in state) != (self.tally is not None):
            raise missing_filter_state("ContinuousLLMCollector")
        counters = {name: int(state[name]) for name in _COUNTERS}
        # a state from before turns were counted: k turns per group admitted (single-turn dialogs)
        counters["num_turns_counted"] = int(state.get("num_turns_counted", counters["num_started"] * self.group_size))
        finished = [(int(item["version"]), [turn_from_state(t) for t in item["turns"]]) for item in state["finished"]]
        open_groups = {
            int(g): HeldGroup(
                int(h["version"]), int(h["expected"]), int(h["done"]), [turn_from_state(t) for t in h["turns"]]
            )
            for g, h in state["open"].items()
        }
        slot_group = {int(s): int(g) for s, g in state["slot_group"].items()}
        missing = Counter({int(g): int(n) for g, n in state["missing"].items()})
        return counters, finished, open_groups, slot_group, missing


_COUNTERS = ("base_version", "num_started", "num_consumed", "num_batches", "num_dialogs_started")
