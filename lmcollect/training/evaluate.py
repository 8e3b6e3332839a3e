"""Mean reward of a policy on fixed prompts: the demo's before / after measurement."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lmcollect.envs.datasets import row_to_history
from lmcollect.envs.tasks.base import Task
from lmcollect.policies.transformers_policy import TransformersPolicy


def mean_reward(policy: TransformersPolicy, rows: Sequence[Mapping[str, Any]], task: Task, *, seed: int = 0) -> float:
    """One sampled answer per row, scored by ``task`` after its first turn; the mean reward.

    Single-turn tasks are scored completely; multi-turn ones only on their first answer.
    ``seed`` fixes the sampling, so two calls on unchanged weights agree.
    """
    if not rows:
        raise ValueError("mean_reward needs at least one row.")
    histories = [row_to_history(row) for row in rows]
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays as it was
        torch.manual_seed(seed)
        _, responses, _ = policy.generate([h.apply_chat_template(policy.tokenizer) for h in histories])
    total = 0.0
    for row, history, response in zip(rows, histories, responses, strict=True):
        text = policy.tokenizer.decode(response, skip_special_tokens=True)
        state = task.start(row, random.Random(seed))
        total += task.respond(state, history.append("assistant", text)).reward
    return total / len(rows)
