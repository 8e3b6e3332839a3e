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


# The slowest test files, slowest first (seconds on 2 busy cores): `make test` hands whole files to two
# pytest workers in collection order, so these start first and the short ones fill the gaps at the end.
SLOWEST_FIRST = (
    "integration/test_soak.py",  # ~90
    "integration/test_vllm_server.py",  # ~90
    "integration/test_vllm_updater.py",  # ~85
    "integration/test_ray_collector.py",  # ~120, many short tests
    "integration/test_multinode.py",  # ~80, two Ray clusters of their own
    "integration/test_collector_contract.py",  # ~80, many short tests
    "integration/test_data_contract_ray.py",  # ~75
    "integration/test_vllm_async_engine.py",  # ~65
    "integration/test_continuous_ray_engines.py",  # ~60
    "integration/test_ray_engines.py",  # ~60 (the engine contract through actors)
    "integration/test_resume_ray.py",  # ~55
    "integration/test_cli_demo.py",  # ~55
    "integration/test_vllm_policy.py",  # ~55
    "faults/test_fault_vllm.py",  # ~45
    "integration/test_weight_sync_ray.py",  # ~40
    "integration/test_cli_collect.py",  # ~35
    "faults/test_fault_ray_head.py",  # ~35
    "faults/test_fault_collector_actor.py",  # ~30
    "integration/test_delta_sync_ray.py",  # ~25
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

