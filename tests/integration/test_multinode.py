"""The multi-node path for real: a three-node Ray cluster started on this machine, in a subprocess."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_collectors_on_two_nodes_buffer_on_a_third() -> None:
    script = Path(__file__).with_name("multinode_check.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0 and "MULTINODE OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
