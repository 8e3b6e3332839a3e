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
    keys.TRAJ_IDS,
    PROMPT_ID,
    ADVANTAGE,
)
"""What :func:`train_batch_from_turns` reads (plus ids for debugging): ``GroupAdvantage(keep_keys=...)``."""


@dataclass(kw_only=True)
class GroupAdvantage:
    """A collector ``postproc`` writing each turn's GRPO advantage next to its reward.

    It runs where a batch is complete: with single-turn tasks and ``dialog_turns_per_batch``
    equal to the env's batch size, a batch holds every answer of each of its prompts (turns with
    the same ``("env", "prompt_id")``), so the advantage is exact however the buffer is sampled
    later (torchrl's ``MCAdvantage`` does the same when writing to its buffer).
    """

    normalize_std: bool = True
    """Divide by the group's reward std (GRPO); False only subtracts the group mean."""
    eps: float = 1e-6
    """Added to the std before dividing."""
    keep_keys: tuple | None = None
    """Keep only these keys in each turn (e.g. :data:`LEARNER_KEYS`): turns then cross the object
    store about four times faster; histories and texts are dropped. None keeps every key."""

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        turns = flatten_turns(batch)
        rewards = torch.stack([turn.get(keys.NEXT_REWARD).sum() for turn in turns])
        groups = torch.stack([turn.get(PROMPT_ID).reshape(()) for turn in turns])
        advantages = group_advantages(rewards, groups, normalize_std=self.normalize_std, eps=self.eps)
        for turn, advantage in zip(turns, advantages):
            turn.set(ADVANTAGE, advantage)
        if self.keep_keys is not None:
            turns = [turn.select(*self.keep_keys) for turn in turns]
        return stack_turns(turns)


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
    if any(ADVANTAGE not in turn.keys() for turn in turns):
        raise KeyError(f"turns have no {ADVANTAGE!r}; collect them with postproc=GroupAdvantage().")
    return TrainBatch(
        packed=packed,
        advantages=torch.stack([turn.get(ADVANTAGE).float().reshape(()) for turn in turns]),
        rewards=torch.stack([turn.get(keys.NEXT_REWARD).float().sum() for turn in turns]),
        policy_versions=torch.stack([turn.get(keys.POLICY_VERSION).reshape(()) for turn in turns]),
    )
