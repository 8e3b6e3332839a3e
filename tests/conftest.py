"""Shared fixtures: the tiny offline model, envs and a scripted guesser."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch



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
