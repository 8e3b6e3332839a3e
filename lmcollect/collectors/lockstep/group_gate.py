"""Dynamic sampling in the lockstep collector: whole GRPO groups, filtered, a fixed number of kept ones per batch (pure logic).

:class:`GroupGate` takes the place of ``LLMCollector``'s batcher. Its turns wait with their group
(``("collector", "group_id")``) in :class:`~lmcollect.collectors.shared.groups.HeldGroups` until the
group's ``k`` dialogs have all ended; the complete group goes through the filter; kept groups wait
until ``G = max(1, dialog_turns_per_batch // k)`` of them make a batch, flat, each group whole, in
completion order (every group is opened under version 0). In lockstep every env element always
generates, so nothing needs to be admitted to refill: a batch takes as many lockstep steps as it
needs kept groups.

A ``reset()`` cuts the dialogs under way: the gate then drops every group not complete, and turns
of those groups that still arrive (from slots not reset) are dropped with them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tensordict import TensorDictBase

from lmcollect.collectors.shared.group_filter import DynamicSampling, GroupTally
from lmcollect.collectors.shared.groups import HeldGroup, HeldGroups
from lmcollect.data import keys
from lmcollect.data.turns import stack_turns

logger = logging.getLogger(__name__)


class GroupGate:
    """Holds turns until their group is complete, filters complete groups, releases ``G`` kept groups.

    Args:
        sampling: the filter and its bound (``oversample_groups`` must be 0: see :func:`lockstep_gate`).
        group_size: ``k``, dialogs per group (the envs' ``repeats``).
        turns_per_batch: ``dialog_turns_per_batch``; a batch holds ``max(1, turns_per_batch // k)`` groups.
    """

    def __init__(self, sampling: DynamicSampling, *, group_size: int, turns_per_batch: int) -> None:
        self.groups: HeldGroups[TensorDictBase] = HeldGroups(
            group_size=group_size,
            turns_per_batch=turns_per_batch,
            sampling=sampling,
            td_of=lambda td: td,
            traj_id_of=lambda td: int(td.get(keys.TRAJ_IDS)),
        )
        self._cut: set[int] = set()  # groups a reset cut: their late turns are dropped

    @property
    def tally(self) -> GroupTally:
        assert self.groups.tally is not None  # a gate always has a filter
        return self.groups.tally

    @property
    def groups_per_batch(self) -> int:
        return self.groups.groups_per_batch

    @property
    def num_buffered_turns(self) -> int:
        """Turns held: of groups under way and of kept groups waiting for a batch."""
        return self.groups.num_held_turns

    def add(self, td: TensorDictBase) -> None:
        """A finished turn."""
        group = int(td.get(keys.GROUP_ID))
        if group in self._cut:
            self.groups.count_generated(td)
            return
        if group not in self.groups.open:
            self.groups.open[group] = HeldGroup(version=0, expected=self.groups.group_size)
        self.groups.add(group, td, ended=bool(td.get(keys.NEXT_DONE).any()))
        self.groups.close_if_complete(group)

    def ready(self) -> bool:
        """Whether ``G`` kept groups wait; raises once the filter has dropped too many groups in a row."""
        return self.groups.batch_ready()

    def pop(self) -> TensorDictBase:
        """The next batch: the ``G`` kept groups that completed first, flat (call only when :meth:`ready`)."""
        assert len(self.groups.kept) >= self.groups_per_batch, "pop() called before G kept groups were complete"
        return stack_turns(self.groups.take_batch())

    def drop_incomplete(self) -> int:
        """Forget every group under way (its dialogs were cut by a reset); returns the turns dropped."""
        held = self.groups.open
        dropped = sum(len(g.turns) for g in held.values())
        if dropped:
            logger.info("reset dropped %d turns of %d GRPO groups under way", dropped, len(held))
        self._cut |= set(held)
        held.clear()
        return dropped

    def state_dict(self) -> dict[str, Any]:
        return {
            "open": {str(g): list(held.turns) for g, held in self.groups.open.items()},
            "ended": {str(g): held.done for g, held in self.groups.open.items() if held.done},
            "kept": [list(turns) for _, _, turns in self.groups.kept],
            "cut": sorted(self._cut),
            "sampling": self.tally.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ended = {int(g): int(n) for g, n in state["ended"].items()}
        self.groups.open = {
            int(g): HeldGroup(version=0, expected=self.groups.group_size, done=ended.get(int(g), 0), turns=list(turns))
            for g, turns in state["open"].items()
        }
        self.groups.kept = []
        for turns in state["kept"]:
            self.groups.keep(0, list(turns))
        self._cut = {int(g) for g in state["cut"]}
        self.tally.load_state_dict(state["sampling"])


def lockstep_gate(
    sampling: DynamicSampling | None, *, group_size: int, turns_per_batch: int, mode: str, flatten_data: bool | None
) -> GroupGate | None:
    """``LLMCollector``'s gate for ``dynamic_sampling`` (None without it), its arguments checked first."""
    if sampling is None:
        return None
    if group_size < 2:
        raise ValueError(
            "dynamic_sampling filters whole GRPO groups, but the env has none (group_size=1); build it with "
            "repeats, e.g. ChatEnv(..., repeats=4, batch_size=8), or drop dynamic_sampling."
        )
    if sampling.oversample_groups:
        raise ValueError(
            f"oversample_groups={sampling.oversample_groups}: LLMCollector steps every env element in lockstep, so "
            "there is no admission to run ahead of; use oversample_groups=0 here (ContinuousLLMCollector takes it)."
        )
    if mode == "last_steps":
        raise ValueError(
            "dynamic_sampling judges whole groups of whole dialogs; it cannot be combined with "
            "yield_only_last_steps=True. Drop one of them."
        )
    if flatten_data is False:
        raise ValueError(
            "with dynamic_sampling a batch is a flat list of whole groups; flatten_data=False cannot be kept. "
            "Leave flatten_data=None."
        )
    return GroupGate(sampling, group_size=group_size, turns_per_batch=turns_per_batch)
