"""TensorDict plumbing of ChatEnv: build the per-element lazy stack, read histories and masks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from lmcollect.data import keys
from lmcollect.data.history import History
from lmcollect.envs.sampling import Draw

PROMPT_ID = ("env", "prompt_id")
"""Unique id of the prompt draw an element answers (int64 scalar); equal ids form a GRPO group."""
SAMPLE_INDEX = ("env", "sample_index")
"""Dataset row index of the prompt (int64 scalar)."""


def build_batch(
    prompts: Sequence[History],
    rewards: Sequence[float],
    flags: Sequence[tuple[bool, bool, bool]],
    draws: Sequence[Draw | None],
    *,
    with_reward: bool,
) -> TensorDictBase:
    """A lazy stack of one TensorDict per element (batch ``(B,)``).

    Each holds ``("history", "prompt")``, ``done`` / ``terminated`` / ``truncated`` (bool ``[1]``),
    ``("env", "prompt_id")``, ``("env", "sample_index")`` and, if ``with_reward``, ``reward``
    (float32 ``[1]``).
    """
    b = len(prompts)
    flag_t = torch.tensor(flags, dtype=torch.bool).reshape(b, 3, 1).unbind(0)
    ids = (
        torch.tensor([(-1, -1) if d is None else (d.prompt_id, d.sample_index) for d in draws], dtype=torch.int64)
        .reshape(b, 2)
        .unbind(0)
    )
    reward_t = torch.tensor(rewards, dtype=torch.float32).reshape(b, 1).unbind(0) if with_reward else None
    elements = []
    for i in range(b):
        f, ident = flag_t[i], ids[i]
        entries = {
            "history": {"prompt": prompts[i]},
            keys.DONE: f[0],
            keys.TERMINATED: f[1],
            keys.TRUNCATED: f[2],
            "env": {"prompt_id": ident[0], "sample_index": ident[1]},
        }
        if reward_t is not None:
            entries[keys.REWARD] = reward_t[i]
        elements.append(TensorDict(entries, batch_size=[]))
    return lazy_stack(elements)


def read_histories(td: TensorDictBase, key: tuple[str, ...], batch: int) -> list[History]:
    """The ``batch`` History objects stored at ``key`` (lazy stack, NonTensorStack or broadcast)."""
    value = td.get(key, None)
    if value is None:
        raise KeyError(
            f"ChatEnv.step: the input has no {key} entry; the policy must write the prompt plus its "
            "answer there (prompt.append('assistant', response))."
        )
    if isinstance(value, History):
        values = [value] * batch
    elif hasattr(value, "tolist"):
        values = value.tolist()
    else:
        values = list(value)
    if len(values) != batch:
        raise ValueError(f"ChatEnv.step: {key} holds {len(values)} histories, expected batch_size={batch}.")
    for i, h in enumerate(values):
        if not isinstance(h, History):
            raise TypeError(f"ChatEnv.step: {key} of element {i} must be a History, got {type(h).__name__}.")
    return values


def read_reset_mask(td: TensorDictBase | None, batch: int) -> list[bool] | None:
    """The ``"_reset"`` mask as a list of B bools, or None when absent (reset everything)."""
    if td is None:
        return None
    mask = td.get(keys.RESET, None)
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.numel() != batch:
        raise ValueError(
            f"reset: td['_reset'] must be a bool tensor of shape ({batch}, 1), got "
            f"{getattr(mask, 'dtype', type(mask).__name__)} of shape {tuple(getattr(mask, 'shape', ()))}."
        )
    return mask.reshape(batch).tolist()
