"""Multi-turn dialogs collected with a real policy, and the token-exact checks run on them (HF and vLLM tests)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from lmcollect.collectors import LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, GuessingGameTask, guessing_game_dataset

NUM_TURNS = 4


def guessing_env(num_envs: int, *, system_prompt: str | None = None, rows: list[dict] | None = None) -> ChatEnv:
    """Guessing games of at most four turns (the env answers "Higher." / "Lower." / "Please answer ...")."""
    rows = rows or guessing_game_dataset(32, seed=0, low=1, high=20, max_turns=NUM_TURNS)
    return ChatEnv(
        rows,
        task=GuessingGameTask(low=1, high=20, max_turns=NUM_TURNS),
        batch_size=num_envs,
        max_turns=NUM_TURNS,
        system_prompt=system_prompt,
        seed=0,
    )


def collect_dialogs(env: ChatEnv, policy: object, num_turns: int) -> list[list[TensorDictBase]]:
    """``num_turns`` turns collected with an LLMCollector, grouped by trajectory, in turn order."""
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=num_turns, flatten_data=True)
    batch = collector.next()
    collector.shutdown()
    dialogs: dict[int, list[TensorDictBase]] = defaultdict(list)
    for turn in flatten_turns(batch):
        dialogs[int(turn[keys.TRAJ_IDS])].append(turn)
    return [sorted(turns, key=lambda t: int(t[keys.STEP_COUNT])) for turns in dialogs.values()]


@dataclass
class DialogCounts:
    num_continued: int = 0
    """Turns followed by another turn of the same dialog (each checked)."""
    num_stopped: int = 0
    """Of those, replies that ended with a stop token."""
    num_truncated: int = 0
    """Of those, replies cut by max_new_tokens."""


def check_token_exact(dialogs: list[list[TensorDictBase]], stop_token_ids: list[int], im_start_id: int) -> DialogCounts:
    """Every next prompt starts with the previous turn's full tokens; a cut reply gets no end token."""
    counts = DialogCounts()
    for turns in dialogs:
        for before, after in zip(turns, turns[1:]):
            full, prompt = before[keys.TOKENS_FULL], after[keys.TOKENS_PROMPT]
            assert torch.equal(prompt[: full.numel()], full), "the next prompt does not start with tokens.full"
            counts.num_continued += 1
            if int(full[-1]) in stop_token_ids:
                counts.num_stopped += 1
            else:
                counts.num_truncated += 1
                # ChatML: the next message opens right after the cut reply, no invented <|im_end|>
                assert int(prompt[full.numel()]) == im_start_id
    return counts
