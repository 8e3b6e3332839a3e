"""From collected turns (TensorDicts) to GRPO inputs: group advantages at collection time, packed tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, stack_turns
from lmcollect.envs import PROMPT_ID
from lmcollect.training.grpo import ADVANTAGE, PackedTurns, group_advantages, pack_turns

LEARNER_KEYS = (
    keys.TOKENS_PROMPT,
    keys.TOKENS_RESPONSE,
    keys.LOG_PROBS_RESPONSE,
    keys.NEXT_REWARD,
    keys.POLICY_VERSION,
    keys.TOKEN_VERSIONS,
    keys.KV_VERSIONS,
    keys.TRAJ_IDS,
    keys.GROUP_ID,
    PROMPT_ID,
    ADVANTAGE,
)
"""What :func:`train_batch_from_turns` reads (plus ids for debugging): ``GroupAdvantage(keep_keys=...)``."""

_MAX_PENDING_GROUPS = 10_000


@dataclass(kw_only=True)
class GroupAdvantage:
    """A collector ``postproc`` writing each turn's GRPO advantage next to its reward.

    Groups are keyed by ``("collector", "group_id")``, unique across a collector's envs and
    across collectors, so answers to different prompts never share a baseline. With
    ``group_size``, only complete groups (exactly ``group_size`` turns) are normalised and
    written; the turns of an incomplete group wait in this object for the rest of their group
    (a later batch), and :attr:`pending_groups` reports how many wait. Advantages are thus exact
    however the buffer is sampled later (torchrl's ``MCAdvantage`` also works at write time).
    """

    group_size: int | None = None
    """Turns per complete group (the env's ``repeats`` for single-turn tasks). None: every group
    in a batch counts as complete (use only when a batch is known to hold whole groups)."""
    normalize_std: bool = True
    """Divide by the group's reward std (GRPO); False only subtracts the group mean."""
    eps: float = 1e-6
    """Added to the std before dividing."""
    keep_keys: tuple | None = None
    """Keep only these keys in each turn (e.g. :data:`LEARNER_KEYS`): turns then cross the object
    store about four times faster; histories and texts are dropped. None keeps every key."""
    per_dialog: bool = False
    """Multi-turn credit: each dialog's return (the sum of its turns' rewards) is normalised over its
    group's dialogs, and every turn of the dialog gets that advantage (agents, tool dialogs whose
    reward comes at the end). Needs whole dialogs in each batch, as the continuous collector's GRPO
    groups give (so ``group_size=None``). False: each turn's own reward is normalised over its group's turns."""

    def __post_init__(self) -> None:
        if self.group_size is not None and (isinstance(self.group_size, bool) or self.group_size < 1):
            raise ValueError(f"group_size must be a positive int or None, got {self.group_size!r}.")
        if self.per_dialog and self.group_size is not None:
            raise ValueError(
                "per_dialog=True normalises whole dialogs, which the continuous collector's GRPO groups bring "
                f"in one batch; drop group_size={self.group_size} (it counts turns)."
            )
        self._pending: dict[int, list[TensorDictBase]] = {}

    @property
    def pending_groups(self) -> int:
        """Incomplete groups whose turns wait for the rest of their group."""
        return len(self._pending)

    def __call__(self, batch: TensorDictBase) -> TensorDictBase | None:
        turns = self._complete(flatten_turns(batch))
        if not turns:
            return None  # every group is still incomplete: nothing to write yet
        rewards = torch.stack([turn.get(keys.NEXT_REWARD).sum() for turn in turns])
        groups = torch.stack([_group_of(turn) for turn in turns])
        if self.per_dialog:
            advantages = self._dialog_advantages(turns, rewards, groups)
        else:
            advantages = group_advantages(rewards, groups, normalize_std=self.normalize_std, eps=self.eps)
        for turn, advantage in zip(turns, advantages, strict=True):
            turn.set(ADVANTAGE, advantage)
        if self.keep_keys is not None:
            turns = [turn.select(*self.keep_keys, strict=False) for turn in turns]
        return stack_turns(turns)

    def _dialog_advantages(
        self, turns: list[TensorDictBase], rewards: torch.Tensor, groups: torch.Tensor
    ) -> torch.Tensor:
        """Each turn's dialog's advantage: dialog returns normalised within their groups."""
        dialogs = torch.stack([turn.get(keys.TRAJ_IDS).reshape(()) for turn in turns])
        ids, dialog_of_turn = torch.unique(dialogs, return_inverse=True)
        returns = torch.zeros(len(ids)).index_add_(0, dialog_of_turn, rewards.float())
        dialog_groups = torch.zeros(len(ids), dtype=groups.dtype).index_copy_(0, dialog_of_turn, groups)
        per_dialog = group_advantages(returns, dialog_groups, normalize_std=self.normalize_std, eps=self.eps)
        return per_dialog[dialog_of_turn]

    def _complete(self, turns: list[TensorDictBase]) -> list[TensorDictBase]:
        """The turns of complete groups (pending ones first joined with their earlier turns)."""
        if self.group_size is None:
            return turns
        for turn in turns:
            self._pending.setdefault(int(_group_of(turn)), []).append(turn)
        complete: list[TensorDictBase] = []
        for group_id in [g for g, members in self._pending.items() if len(members) >= self.group_size]:
            members = self._pending.pop(group_id)
            if len(members) > self.group_size:
                raise ValueError(
                    f"group {group_id} has {len(members)} turns, more than group_size={self.group_size}; set "
                    "group_size to the env's repeats (answers per prompt) with single-turn tasks."
                )
            complete.extend(members)
        if len(self._pending) > _MAX_PENDING_GROUPS:
            raise RuntimeError(
                f"{len(self._pending)} groups are still incomplete; groups never fill up (is group_size="
                f"{self.group_size} the env's repeats? do resets drop turns?)."
            )
        return complete


def _group_of(turn: TensorDictBase) -> torch.Tensor:
    group = turn.get(keys.GROUP_ID, None)
    if group is None:  # turns built outside a collector: the env's own draw id
        group = turn.get(PROMPT_ID)
    return group.reshape(())


@dataclass(frozen=True, kw_only=True)
class TrainBatch:
    """One optimisation batch: packed tokens, advantages and what to log about the turns."""

    packed: PackedTurns
    """Prompt + response tokens, response mask and behaviour log-probs."""
    advantages: torch.Tensor
    """float32 ``[N]``: one advantage per turn."""
    rewards: torch.Tensor
    """float32 ``[N]``: the turns' rewards."""
    policy_versions: torch.Tensor
    """int64 ``[N]``: version of the weights that generated each turn."""


def train_batch_from_turns(batch: TensorDictBase, *, pad_token_id: int) -> TrainBatch:
    """Read a (sampled) batch of turns that went through :class:`GroupAdvantage`."""
    turns = flatten_turns(batch)
    packed = pack_turns(
        [turn.get(keys.TOKENS_PROMPT) for turn in turns],
        [turn.get(keys.TOKENS_RESPONSE) for turn in turns],
        [turn.get(keys.LOG_PROBS_RESPONSE) for turn in turns],
        pad_token_id=pad_token_id,
    )
    if any(ADVANTAGE not in turn for turn in turns):
        raise KeyError(f"turns have no {ADVANTAGE!r}; collect them with postproc=GroupAdvantage().")
    return TrainBatch(
        packed=packed,
        advantages=torch.stack([turn.get(ADVANTAGE).float().reshape(()) for turn in turns]),
        rewards=torch.stack([turn.get(keys.NEXT_REWARD).float().sum() for turn in turns]),
        policy_versions=torch.stack([turn.get(keys.POLICY_VERSION).reshape(()) for turn in turns]),
    )
