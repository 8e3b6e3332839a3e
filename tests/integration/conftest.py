"""One local Ray cluster for the whole integration test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            # test modules must be importable inside actors (functions defined there are pickled by name)
            runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}},
        )
    yield ray
    ray.shutdown()
