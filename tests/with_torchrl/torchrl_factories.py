"""A torchrl user's env and lmcollect's policy for the torchrl suite (module level: they travel into Ray actors)."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader

ROWS = [{"query": f"What is {i} + {i}?", "answer": f"{i} plus {i} #### {2 * i}"} for i in range(64)]
"""GSM8K-shaped rows: a question, and an answer ending in ``#### <number>`` (what GSM8KRewardParser reads)."""
MAX_STEPS = 2
"""Turns per dialog: StepCounter truncates every dialog after two (the tiny model never answers right)."""


def collate(rows: list[dict]) -> dict:
    return {"query": [row["query"] for row in rows], "answer": [row["answer"] for row in rows]}


def make_torchrl_env(num_envs: int = 2):
    """A torchrl ChatEnv in history mode, as its docs build one: prompts from a dataloader, the GSM8K
    reward parser and a StepCounter. Nothing of lmcollect in it."""
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv
    from torchrl.envs.llm.reward import GSM8KRewardParser

    dataloader = DataLoader(ROWS, batch_size=num_envs, shuffle=False, collate_fn=collate)
    env = ChatEnv.from_dataloader(
        dataloader, batch_size=(num_envs,), input_mode="history", system_prompt="Answer in <answer></answer> tags."
    )
    env.append_transform(StepCounter(max_steps=MAX_STEPS))
    env.append_transform(GSM8KRewardParser())
    return env


def make_one_dialog_env():
    """The same env with one dialog (a continuous collector's slot)."""
    return make_torchrl_env(num_envs=1)


def make_policy(model_path: str):
    """lmcollect's TransformersPolicy over the tiny model (sampled, seeded)."""
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.policies import TransformersPolicy

    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer(model_path)
    return TransformersPolicy(model, tokenizer, max_new_tokens=8, temperature=1.0, seed=0)
