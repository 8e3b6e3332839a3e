"""Env and policy factories shared by the tests (picklable: they travel into Ray actors)."""
from __future__ import annotations

import functools

from lmcollect.envs import ChatEnv, GuessingGameTask, binary_search_player, guessing_game_dataset
from lmcollect.policies import ScriptedPolicy

make_guessing_env = functools.partial(
    ChatEnv,
    guessing_game_dataset(64, seed=0, low=1, high=20, max_turns=5),
    task=GuessingGameTask(low=1, high=20, max_turns=5),
    batch_size=2,
    max_turns=5,
    seed=0,
)
"""Two multi-turn guessing-game dialogs at a time."""

make_guesser = functools.partial(ScriptedPolicy, binary_search_player)
"""A deterministic player that always wins within five guesses."""
