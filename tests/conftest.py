"""Shared fixtures: the tiny offline model, envs and a scripted guesser."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.faults.table import TABLE_DIR_ENV, read_table


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controlling process: its workers inherit the folder
        os.environ[TABLE_DIR_ENV] = tempfile.mkdtemp(prefix="lmcollect-fault-table-")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault table of tests/faults (every worker's rows)."""
    if hasattr(terminalreporter.config, "workerinput") or not os.environ.get(TABLE_DIR_ENV):
        return
    table = read_table(os.environ[TABLE_DIR_ENV])
    if table.rows:
        terminalreporter.section("fault table")
        for line in table.lines():
            terminalreporter.write_line(line)


# The slowest test files, slowest first (summed test seconds of a `make test` run on 2 busy cores,
# 2026-12-02): `make test` hands whole files to two pytest workers in this order (longest first, so
# the short files fill the gaps at the end and both workers finish together).
SLOWEST_FIRST = (
    "integration/test_ray_collector.py",  # ~280 (many Ray actors)
    "integration/test_collector_contract.py",  # ~170
    "integration/test_vllm_server.py",  # ~150
    "integration/test_vllm_updater.py",  # ~140
    "integration/test_vllm_policy.py",  # ~110
    "integration/test_cli_demo.py",  # ~110
    "integration/test_data_contract_ray.py",  # ~105
    "integration/test_vllm_async_engine.py",  # ~95
    "integration/test_soak.py",  # ~95
    "integration/test_continuous_ray_engines.py",  # ~95
    "integration/test_ray_engines.py",  # ~90 (the engine contract through actors)
    "integration/test_weight_sync_ray.py",  # ~75
    "faults/test_fault_vllm.py",  # ~55
    "faults/test_fault_ray_head.py",  # ~45
    "faults/test_fault_collector_actor.py",  # ~45
    "integration/test_resume_ray.py",  # ~45
    "integration/test_vllm_multinode.py",  # ~45
    "integration/test_cli_collect.py",  # ~40
    "integration/test_multinode.py",  # ~40
)


def _relative(item: pytest.Item) -> str:
    path = item.path.as_posix()
    return path[path.rfind("tests/") + len("tests/") :]


def _slowness_rank(item: pytest.Item) -> int:
    relative = _relative(item)
    return SLOWEST_FIRST.index(relative) if relative in SLOWEST_FIRST else len(SLOWEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_slowness_rank)  # stable: tests keep their order within a file
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

