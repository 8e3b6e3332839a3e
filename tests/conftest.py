"""Shared fixtures: the tiny offline model, envs and a scripted guesser."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lmcollect.data import History


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmcollect.models import ModelSpec, get_model_path

    return get_model_path(ModelSpec(size="tiny"), cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_path: Path):
    from lmcollect.models import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_path)


def binary_search_guess(history: History) -> str:
    """A deterministic guessing-game player: halves the range after each Higher./Lower."""
    first = history.messages[0].content if history.messages else ""
    bounds = re.findall(r"-?\d+", first)
    low, high = (int(bounds[0]), int(bounds[1])) if len(bounds) >= 2 else (1, 20)
    guess = None
    for message in history.messages[1:]:
        if message.role == "assistant":
            guess = int(re.findall(r"-?\d+", message.content)[-1])
        elif message.role == "user" and guess is not None:
            if message.content.startswith("Higher"):
                low = guess + 1
            elif message.content.startswith("Lower"):
                high = guess - 1
    return str((low + high) // 2)
