"""Shared fixtures: the tiny offline model, envs and a scripted guesser."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

# One OpenMP thread per process, set before torch is imported so that every process the tests start
# (Ray workers, vLLM engines, subprocesses) inherits it. Two pytest workers, their actors and engines
# share two cores: with a thread per core in each process, OpenMP threads spin waiting for cores other
# processes hold (the unit tier took 22% longer that way). Tests that need more threads set them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.faults.table import TABLE_DIR_ENV, read_table


# tests/with_torchrl needs torchrl itself, which lives in its own venv (`make test-torchrl`)
collect_ignore = [] if importlib.util.find_spec("torchrl") else ["with_torchrl"]
# tests/with_envs needs openenv and verifiers, which need mcp<2 (vLLM needs mcp>=2): their own venv (`make test-envs`)
if not (importlib.util.find_spec("openenv") and importlib.util.find_spec("verifiers")):
    collect_ignore.append("with_envs")


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
# pytest workers in collection order (`--no-loadscope-reorder`: by default xdist orders files by their
# number of tests, which left the one-test soak and demo files to the end), so these start first and the
# short ones fill the gaps at the end.
SLOWEST_FIRST = (  # summed seconds of each file in a full run of 2026-12-03 (2 workers)
    "integration/test_vllm_server.py",  # ~122; these seven are one unit, see IN_PROCESS_VLLM_FILES
    "integration/test_vllm_updater.py",  # ~91
    "integration/test_vllm_policy.py",  # ~73
    "integration/test_delta_sync_vllm.py",  # ~8
    "integration/test_vllm_token_exact.py",  # ~3
    "integration/test_agents_vllm.py",  # agents over the in-process engine, before test_vllm_engine closes it
    "integration/test_vllm_engine.py",  # last of the seven: its last test closes the session's in-process engine
    "integration/test_ray_collector.py",  # ~126, many short tests
    "integration/test_cli_demo.py",  # ~90
    "integration/test_soak.py",  # ~87
    "integration/test_data_contract_ray.py",  # ~83
    "faults/test_fault_vllm.py",  # ~82
    "integration/test_collector_contract.py",  # ~80, many short tests
    "integration/test_multinode.py",  # ~42 (2026-12-04), a three-node Ray cluster behind rate-limited links
    "integration/test_continuous_ray_engines.py",  # ~77
    "integration/test_weight_sync_ray.py",  # ~64
    "integration/test_ray_engines.py",  # ~51
    "faults/test_fault_ray_head.py",  # ~44
    "integration/test_cli_collect.py",  # ~43
    "integration/test_resume_ray.py",  # ~43
    "faults/test_fault_collector_actor.py",  # ~38
    "integration/test_delta_sync_ray.py",  # ~37
    "faults/test_fault_process_group.py",  # ~24
    "integration/test_vllm_engine_multiprocess.py",  # ~25 (2026-12-04), an engine core process of its own
    "unit/test_resume.py",  # ~20
    "integration/test_continuous_ray.py",  # ~16
)


# Files that use the in-process vLLM engine of tests/integration/conftest.py (one per pytest worker):
# `make test` hands them to one worker as one unit, so one process imports vLLM and builds that engine
# (~25 CPU-s) instead of both.
IN_PROCESS_VLLM_FILES = frozenset({
    "integration/test_vllm_server.py",
    "integration/test_vllm_updater.py",
    "integration/test_vllm_policy.py",
    "integration/test_vllm_token_exact.py",
    "integration/test_agents_vllm.py",
    "integration/test_delta_sync_vllm.py",
    "integration/test_vllm_engine.py",
})


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """With ``--dist loadfile``: whole files per worker, the in-process vLLM files as one unit."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndVLLMGroup(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "in-process vLLM files" if _relative_path(scope) in IN_PROCESS_VLLM_FILES else scope

    return FilesAndVLLMGroup(config, log)


def _relative_path(path: str) -> str:
    """``.../tests/integration/test_x.py`` -> ``integration/test_x.py`` (the form the lists above use)."""
    return path[path.rfind("tests/") + len("tests/") :]


def _relative(item: pytest.Item) -> str:
    return _relative_path(item.path.as_posix())


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

