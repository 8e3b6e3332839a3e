"""Dynamic sampling (DAPO): which complete GRPO groups are kept, and the count of every group and token.

GRPO learns nothing from a group whose answers all got the same reward (every advantage is 0).
A :class:`GroupFilter` looks at each complete group's rewards and keeps it or names why it is
dropped; :class:`DynamicSampling` is the collectors' setting (``dynamic_sampling=``) that applies
one, refills batches with new groups in place of dropped ones, and bounds how long a filter may
drop everything. :class:`GroupTally` counts groups generated, kept and dropped (by reason) and
tokens generated vs delivered, per batch and in total (:class:`SamplingCounts`). Pure logic: the
collectors' group flows (:mod:`~lmcollect.collectors.continuous.group_flow`, :mod:`~lmcollect.collectors.lockstep.group_gate`)
call it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase

from lmcollect.data import keys

STALE = "stale"
"""Drop reason of a kept group that can no longer leave within ``max_policy_lag`` (over-sampling only)."""
UNIFORM_REWARDS = "uniform_rewards"
"""Drop reason of :func:`drop_uniform_rewards`."""
NON_FINITE_REWARDS = "non_finite_rewards"
"""Drop reason of a group with a NaN or infinite reward (its advantages would be NaN), by the shipped filters."""
FILTERED = "filtered"
"""Drop reason when a filter returns False instead of a reason."""
FILTER_ERROR = "filter_error"
"""Drop reason of the group whose filter call raised (the error then ends collection)."""


@runtime_checkable
class GroupFilter(Protocol):
    """Decides for one complete group: ``filter(rewards)`` with ``rewards`` a 1-D float tensor, one
    return per dialog of the group (the sum of its turns' rewards; the answer's reward for single-turn
    tasks). Returns None (or True) to keep the group, or a short string naming why it is dropped
    (it becomes a metric key, e.g. ``"uniform_rewards"``; False drops it as ``"filtered"``)."""

    def __call__(self, rewards: torch.Tensor) -> str | bool | None: ...


@dataclass(frozen=True, kw_only=True)
class UniformRewardFilter:
    """DAPO's rule: drop a group whose rewards are all equal (max - min <= ``tol``): zero advantage.
    A group with a NaN or infinite reward is dropped as ``"non_finite_rewards"``."""

    tol: float = 1e-6
    """Rewards this close count as equal."""

    def __post_init__(self) -> None:
        if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not self.tol >= 0:
            raise ValueError(f"tol must be a float >= 0, got {self.tol!r}; e.g. drop_uniform_rewards(tol=1e-6).")

    def __call__(self, rewards: torch.Tensor) -> str | None:
        if not bool(torch.isfinite(rewards).all()):
            return NON_FINITE_REWARDS
        spread = float(rewards.max() - rewards.min()) if rewards.numel() else 0.0
        return UNIFORM_REWARDS if spread <= self.tol else None


@dataclass(frozen=True, kw_only=True)
class MeanRewardBand:
    """Keep only groups whose mean reward lies in ``[low, high]`` (e.g. drop prompts the policy
    always or never solves, in expectation rather than exactly). A group with a NaN or infinite
    reward is dropped as ``"non_finite_rewards"``."""

    low: float = -math.inf
    """Groups with a lower mean reward are dropped as ``"mean_below_band"``."""
    high: float = math.inf
    """Groups with a higher mean reward are dropped as ``"mean_above_band"``."""

    def __post_init__(self) -> None:
        if math.isnan(self.low) or math.isnan(self.high) or not self.low <= self.high:
            raise ValueError(f"low={self.low!r} must be <= high={self.high!r}; e.g. keep_mean_reward_in(0.1, 0.9).")

    def __call__(self, rewards: torch.Tensor) -> str | None:
        if not bool(torch.isfinite(rewards).all()):
            return NON_FINITE_REWARDS
        mean = float(rewards.float().mean())
        if mean < self.low:
            return "mean_below_band"
        return "mean_above_band" if mean > self.high else None


def drop_uniform_rewards(*, tol: float = 1e-6) -> UniformRewardFilter:
    """The DAPO filter: drop groups whose rewards are all equal within ``tol``."""
    return UniformRewardFilter(tol=tol)


def keep_mean_reward_in(low: float = -math.inf, high: float = math.inf) -> MeanRewardBand:
    """Keep groups whose mean reward lies in ``[low, high]``; drop the others."""
    return MeanRewardBand(low=low, high=high)


@dataclass(frozen=True, kw_only=True)
class DynamicSampling:
    """The collectors' ``dynamic_sampling=`` setting: filter complete groups and refill batches.

    Every complete GRPO group goes through ``group_filter``; a dropped group never reaches a batch
    or the replay buffer, and frees its admission place, so the collector admits another group
    (the refill): a batch holds exactly ``dialog_turns_per_batch // k`` kept groups.
    """

    group_filter: GroupFilter
    """Keeps a complete group or names why it is dropped (see :class:`GroupFilter`), e.g.
    :func:`drop_uniform_rewards` or :func:`keep_mean_reward_in`."""
    oversample_groups: int = 0
    """``ContinuousLLMCollector`` only: admit up to this many groups beyond what the admission
    rules (``max_buffered_turns``, ``max_policy_lag``) allow, so that a batch does not wait for
    refills when some groups are dropped. Kept extras go into later batches; with
    ``max_policy_lag``, one that could no longer leave within the lag bound is dropped as
    ``"stale"`` (counted). 0: no extra group."""
    max_consecutive_drops: int = 1000
    """Collection ends with an error naming the filter and the counts once the filter has dropped
    this many groups in a row (a filter that drops everything would otherwise generate forever)."""

    def __post_init__(self) -> None:
        if not callable(self.group_filter):
            raise TypeError(
                f"group_filter must be callable (rewards -> None or a drop reason), got {self.group_filter!r}; "
                "e.g. DynamicSampling(group_filter=drop_uniform_rewards())."
            )
        _check_int("oversample_groups", self.oversample_groups, minimum=0, hint="e.g. oversample_groups=2")
        _check_int("max_consecutive_drops", self.max_consecutive_drops, minimum=1, hint="e.g. 1000")


def as_dynamic_sampling(value: Any) -> DynamicSampling | None:
    """The setting from what a collector was given: None, a :class:`DynamicSampling`, or a bare
    filter (shorthand for ``DynamicSampling(group_filter=value)``)."""
    if value is None or isinstance(value, DynamicSampling):
        return value
    if callable(value):
        return DynamicSampling(group_filter=value)
    raise TypeError(
        f"dynamic_sampling must be a DynamicSampling, a group filter or None, got {type(value).__name__}; "
        "e.g. dynamic_sampling=DynamicSampling(group_filter=drop_uniform_rewards(), oversample_groups=1)."
    )


def _check_int(name: str, value: Any, *, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r} ({hint}).")


@dataclass(frozen=True, kw_only=True)
class SamplingCounts:
    """Groups and tokens of dynamic sampling: totals, or one batch's share (the totals' change
    since the batch before). ``groups_generated = groups_kept + dropped + groups_waiting``."""

    groups_generated: int = 0
    """Complete groups the filter judged."""
    groups_kept: int = 0
    """Kept groups that left in a batch (or, at shutdown, into the replay buffer)."""
    groups_dropped: Mapping[str, int] = field(default_factory=dict)
    """Dropped groups by reason (the filter's reasons, and ``"stale"``)."""
    tokens_generated: int = 0
    """Response tokens of every finished turn (kept, dropped, or of a group not complete yet)."""
    tokens_delivered: int = 0
    """Response tokens of the turns that left in batches (what reached the trainer)."""
    batches: int = 0
    """Batches released."""

    @property
    def dropped(self) -> int:
        """Dropped groups, every reason together."""
        return sum(self.groups_dropped.values())

    @property
    def groups_waiting(self) -> int:
        """Groups kept by the filter that have not left in a batch yet."""
        return self.groups_generated - self.groups_kept - self.dropped

    @property
    def kept_share(self) -> float | None:
        """Share of the judged groups that were not dropped (None before any)."""
        judged = self.groups_generated
        return None if not judged else (judged - self.dropped) / judged

    def plus(self, other: SamplingCounts) -> SamplingCounts:
        """The sum of two counts (e.g. of several collectors)."""
        return self._combine(other, 1)

    def minus(self, other: SamplingCounts) -> SamplingCounts:
        """What happened since ``other`` (an earlier total)."""
        return self._combine(other, -1)

    def _combine(self, other: SamplingCounts, sign: int) -> SamplingCounts:
        reasons = set(self.groups_dropped) | set(other.groups_dropped)
        dropped = {r: self.groups_dropped.get(r, 0) + sign * other.groups_dropped.get(r, 0) for r in sorted(reasons)}
        numbers = {f.name: getattr(self, f.name) + sign * getattr(other, f.name) for f in _NUMBER_FIELDS}
        return SamplingCounts(**numbers, groups_dropped={r: n for r, n in dropped.items() if n})

    def as_metrics(self, prefix: str = "sampling/") -> dict[str, float]:
        """Flat metric keys for an experiment logger (``sampling/groups_kept``, ``sampling/dropped/<reason>``...)."""
        metrics: dict[str, float] = {prefix + f.name: getattr(self, f.name) for f in _NUMBER_FIELDS}
        metrics[prefix + "groups_dropped"] = self.dropped
        metrics.update({f"{prefix}dropped/{reason}": n for reason, n in self.groups_dropped.items()})
        if self.kept_share is not None:
            metrics[prefix + "kept_share"] = self.kept_share
        if self.tokens_generated:
            metrics[prefix + "delivered_token_share"] = self.tokens_delivered / self.tokens_generated
        return metrics

    def to_state(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in _NUMBER_FIELDS}, "groups_dropped": dict(self.groups_dropped)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SamplingCounts:
        numbers = {f.name: int(state[f.name]) for f in _NUMBER_FIELDS}
        return cls(**numbers, groups_dropped={str(r): int(n) for r, n in state["groups_dropped"].items()})


_NUMBER_FIELDS = [f for f in dataclasses.fields(SamplingCounts) if f.name != "groups_dropped"]


def total_counts(counts: Sequence[SamplingCounts | None]) -> SamplingCounts | None:
    """The sum of several collectors' counts (None when none has dynamic sampling)."""
    present = [c for c in counts if c is not None]
    if not present:
        return None
    total = present[0]
    for more in present[1:]:
        total = total.plus(more)
    return total


def group_rewards(turns: Sequence[tuple[int, TensorDictBase]]) -> torch.Tensor:
    """One return per dialog of a group, from its ``(trajectory id, turn)`` pairs (dialogs in order of first turn)."""
    returns: dict[int, float] = {}
    for traj_id, td in turns:
        returns[traj_id] = returns.get(traj_id, 0.0) + float(td.get(keys.NEXT_REWARD).sum())
    return torch.tensor(list(returns.values()), dtype=torch.float32)


def response_tokens(td: TensorDictBase) -> int:
    """Response tokens of one turn."""
    return int(td.get(keys.TOKENS_RESPONSE).numel())


class GroupTally:
    """Applies the filter to complete groups and counts groups and tokens (one thread calls it).

    :attr:`total` and :attr:`last_batch` are immutable snapshots, replaced on every change, so
    another thread may read them at any time.
    """

    def __init__(self, sampling: DynamicSampling) -> None:
        self.sampling = sampling
        self.total = SamplingCounts()
        self.last_batch = SamplingCounts()
        self._at_last_batch = SamplingCounts()
        self.consecutive_drops = 0
        self.failure: Exception | None = None

    def generated(self, td: TensorDictBase) -> None:
        """A turn finished (whatever becomes of its group)."""
        self._add(tokens_generated=response_tokens(td))

    def judge(self, turns: Sequence[tuple[int, TensorDictBase]]) -> str | None:
        """The filter's decision on a complete group: None (kept) or the drop reason; counted.

        The filter is the user's code and runs where no caller would see its error (a dialog task of
        the continuous collector): an error drops the group and ends collection, raised by
        :meth:`raise_if_failed`."""
        try:
            reason = _reason_of(self.sampling.group_filter(group_rewards(turns)), self.sampling.group_filter)
        except Exception as exc:  # designed: surfaced by raise_if_failed (the consumer's next())
            exc.add_note(f"raised by the group filter {self.sampling.group_filter!r} of dynamic_sampling")
            self.failure = self.failure or exc
            reason = FILTER_ERROR
        self._add(groups_generated=1)
        if reason is None:
            self.consecutive_drops = 0
            return None
        self._drop(reason)
        self.consecutive_drops += 1
        if self.consecutive_drops >= self.sampling.max_consecutive_drops and self.failure is None:
            self.failure = RuntimeError(self._failure_message())
        return reason

    def drop_stale(self) -> None:
        """A kept group that can no longer leave within the lag bound."""
        self._drop(STALE)

    def delivered(self, tds: Sequence[TensorDictBase], *, num_groups: int, batch: bool) -> None:
        """Turns of ``num_groups`` kept groups left (``batch``: as a batch; else drained at shutdown)."""
        self._add(groups_kept=num_groups, tokens_delivered=sum(response_tokens(td) for td in tds), batches=int(batch))
        if batch:
            self.last_batch = self.total.minus(self._at_last_batch)
            self._at_last_batch = self.total

    def raise_if_failed(self) -> None:
        """The error that ends collection: the filter dropped too many groups in a row, or raised."""
        if self.failure is not None:
            raise self.failure

    def _add(self, **numbers: int) -> None:
        self.total = dataclasses.replace(self.total, **{k: getattr(self.total, k) + v for k, v in numbers.items()})

    def _drop(self, reason: str) -> None:
        dropped = dict(self.total.groups_dropped)
        dropped[reason] = dropped.get(reason, 0) + 1
        self.total = dataclasses.replace(self.total, groups_dropped=dropped)

    def _failure_message(self) -> str:
        t = self.total
        return (
            f"dynamic sampling: the group filter {self.sampling.group_filter!r} dropped "
            f"{self.consecutive_drops} groups in a row (max_consecutive_drops={self.sampling.max_consecutive_drops}); "
            f"so far {t.groups_generated} groups generated, {t.groups_kept} kept in batches, dropped by reason "
            f"{dict(t.groups_dropped)}, {t.tokens_generated} tokens generated, {t.tokens_delivered} delivered. "
            "Collection stopped: check the rewards (are they all equal, e.g. all 0 from an untrained policy?), "
            "loosen the filter, or raise DynamicSampling(max_consecutive_drops=...)."
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "total": self.total.to_state(),
            "at_last_batch": self._at_last_batch.to_state(),
            "last_batch": self.last_batch.to_state(),
            "consecutive_drops": self.consecutive_drops,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.total = SamplingCounts.from_state(state["total"])
        self._at_last_batch = SamplingCounts.from_state(state["at_last_batch"])
        self.last_batch = SamplingCounts.from_state(state["last_batch"])
        self.consecutive_drops = int(state["consecutive_drops"])
        self.failure = None


def _reason_of(verdict: Any, group_filter: Callable[..., Any]) -> str | None:
    if verdict is None or verdict is True:
        return None
    if verdict is False:
        return FILTERED
    if isinstance(verdict, str) and verdict:
        return verdict
    raise TypeError(
        f"the group filter {group_filter!r} returned {verdict!r}; a filter returns None (or True) to keep a group "
        "and a non-empty string naming the reason (or False) to drop it."
    )


def missing_filter_state(owner: str) -> ValueError:
    """The error for a state and a collector that disagree about dynamic sampling."""
    return ValueError(
        f"this state and the {owner} disagree about dynamic sampling (one has a group filter, the other none); "
        "restore it into a collector built with the same dynamic_sampling setting."
    )
