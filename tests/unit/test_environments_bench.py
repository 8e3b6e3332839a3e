"""benchmarks/environments.py at its --quick budget: a row per adapter whose package is installed, the rest skipped by name."""
from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("skyrl_gym")  # the skyrl-gym extra; make test installs it

from benchmarks import environments  # noqa: E402 - after the extra's check


def test_quick_run_gives_a_row_per_installed_adapter_and_names_the_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    result = environments.main(["--quick"])
    measured = {row["adapter"] for row in result["rows"]}
    assert "skyrl-gym" in measured and measured | set(result["skipped"]) == set(environments.PAIRS)
    for row in result["rows"]:
        assert row["adapter_turns_per_s"] > 0 and row["native_turns_per_s"] > 0 and row["ratio"] > 0
    for adapter in result["skipped"]:
        assert importlib.util.find_spec(environments.NEEDS[adapter]) is None
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"benchmark": "environments"')
