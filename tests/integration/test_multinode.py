"""The multi-node paths for real: one three-node Ray cluster started on this machine, in a subprocess.

The subprocess (multinode_check.py) runs both checks on one cluster (a cluster costs ~15 s to start
here); each test reads its own line of the output.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def checked() -> subprocess.CompletedProcess:
    script = Path(__file__).with_name("multinode_check.py")
    argv = [sys.executable, str(script), *(["--vllm"] if HAS_VLLM else [])]
    return subprocess.run(argv, capture_output=True, text=True, timeout=500)


def _printed(result: subprocess.CompletedProcess) -> str:
    return f"exit status {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_collectors_on_two_nodes_buffer_on_a_third(checked: subprocess.CompletedProcess) -> None:
    assert any(line.startswith("MULTINODE OK") for line in checked.stdout.splitlines()), _printed(checked)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_push_into_an_engine_on_another_node_uses_this_node_ip(checked: subprocess.CompletedProcess) -> None:
    assert checked.returncode == 0 and "VLLM MULTINODE OK" in checked.stdout, _printed(checked)
