"""Dynamic sampling in the lockstep collector: whole GRPO groups, filtered, a fixed number of kept ones per batch (pure logic).

:class:`GroupGate` takes the place of ``LLMCollector``'s batcher. Its turns wait with their group (``("collector", "group_id")``) until the group's ``k`` dialogs have
all ended; the complete group goes through the filter (:class:`~lmcollect.collectors.shared.group_filter.GroupTally`);
kept groups wait until ``G = max(1, dialog_turns_per_batch // k)`` of them make a batch, flat, each
group whole. In lockstep every env element always generates, so nothing needs to be admitted to
refill: a batch takes as many lockstep steps as it needs kept groups.

A ``reset()`` cuts the dialogs under way: the gate then drops every group not complete, and turns
of those groups that still arrive (from slots not reset) are dropped with them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tensordict import TensorDictBase

from lmcollect.collectors.shared.group_filter import DynamicSampling, GroupTally
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
        self.group_size = group_size
        self.groups_per_batch = max(1, turns_per_batch // group_size)
        self.tally = GroupTally(sampling)
        self._open: dict[int, list[TensorDictBase]] = {}  # group id -> its turns so far
        self._ended: Counter[int] = Counter()  # group id -> dialogs ended
        self._kept: list[list[TensorDictBase]] = []  # kept groups waiting for a batch, in completion order
        self._cut: set[int] = set()  # groups a reset cut: their late turns are dropped

    @property
    def num_buffered_turns(self) -> int:
        """Turns held: of groups under way and of kept groups waiting for a batch."""
        return sum(len(t) for t in self._open.values()) + sum(len(t) for t in self._kept)

    def add(self, td: TensorDictBase) -> None:
        """A finished turn."""
        self.tally.generated(td)
        group = int(td.get(keys.GROUP_ID))
        if group in self._cut:
            return
        self._open.setdefault(group, []).append(td)
        if bool(td.get(keys.NEXT_DONE).any()):
            self._ended[group] += 1
            if self._ended[group] >= self.group_size:
                self._complete(group)

    def _complete(self, group: int) -> None:
        turns = self._open.pop(group)
        del self._ended[group]
        if self.tally.judge([(int(td.get(keys.TRAJ_IDS)), td) for td in turns]) is None:
            self._kept.append(turns)

    def ready(self) -> bool:
        """Whether ``G`` kept groups wait; raises once the filter has dropped too many groups in a row."""
        self.tally.raise_if_failed()
        return len(self._kept) >= self.groups_per_batch

    def pop(self) -> TensorDictBase:
        """The next batch: the ``G`` kept groups that completed first, flat (call only when :meth:`ready`)."""
        assert len(self._kept) >= self.groups_per_batch, "pop() called before G kept groups were complete"
        taken, self._kept = self._kept[: self.groups_per_batch], self._kept[self.groups_per_batch :]
        tds = [td for turns in taken for td in turns]
        self.tally.delivered(tds, num_groups=len(taken), batch=True)
        return stack_turns(tds)

    def drop_incomplete(self) -> int:
        """Forget every group under way (its dialogs were cut by a reset); returns the turns dropped."""
        dropped = sum(len(t) for t in self._open.values())
        if dropped:
            logger.info("reset dropped %d turns of %d GRPO groups under way", dropped, len(self._open))
        self._cut |= set(self._open)
        self._open.clear()
        self._ended.clear()
        return dropped

    def state_dict(self) -> dict[str, Any]:
        return {
            "open": {str(g): list(turns) for g, turns in self._open.items()},
            "ended": {str(g): n for g, n in self._ended.items()},
            "kept": [list(turns) for turns in self._kept],
            "cut": sorted(self._cut),
            "sampling": self.tally.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._open = {int(g): list(turns) for g, turns in state["open"].items()}
        self._ended = Counter({int(g): int(n) for g, n in state["ended"].items()})
        self._kept = [list(turns) for turns in state["kept"]]
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
