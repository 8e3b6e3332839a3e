"""vLLMUpdater's default master_address across Ray nodes, for real: a two-node cluster on this machine, in a subprocess."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_push_into_an_engine_on_another_node_uses_this_node_ip() -> None:
    pytest.importorskip("vllm")
    script = Path(__file__).with_name("vllm_multinode_check.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0 and "VLLM MULTINODE OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
