"""Fault-injection suite: the integration fixtures, a time bound per case, and the fault table.

Every case is bounded: ``@pytest.mark.fault_timeout(s)`` (default 120 s) raises ``FaultTimeout``
in the test when it runs past ``s`` seconds, and a case stuck where Python cannot interrupt it
(inside a C call) ends the whole run ``BACKSTOP_S`` later with every thread's stack on stderr, so
a hang fails the suite instead of stalling it. Each case may record a row of the fault table
(``fault_table.add(...)``), printed at the end of the run.
"""
from __future__ import annotations

import faulthandler
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.integration.conftest import ray_cluster  # noqa: F401 - the session's one local Ray cluster

DEFAULT_TIMEOUT_S = 120.0
BACKSTOP_S = 60.0


class FaultTimeout(Exception):
    """A fault case ran past its ``fault_timeout``."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fault_timeout(seconds): the longest a fault-injection case may run")


@pytest.fixture(autouse=True)
def fault_deadline(request: pytest.FixtureRequest) -> Iterator[float]:
    """Interrupt the case after its time bound; end the process if even that does not stop it."""
    marker = request.node.get_closest_marker("fault_timeout")
    limit_s = float(marker.args[0]) if marker else DEFAULT_TIMEOUT_S

    def interrupt(signum: int, frame: object) -> None:
        raise FaultTimeout(f"{request.node.nodeid} ran past its fault_timeout of {limit_s:.0f} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    faulthandler.dump_traceback_later(limit_s + BACKSTOP_S, exit=True, file=sys.stderr)
    try:
        yield limit_s
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


@dataclass(frozen=True)
class FaultRow:
    fault: str
    injected: str
    outcome: str
    time_to_error_s: float | None
    turns_lost: int | str | None


class FaultTable:
    """Rows of the report: what was broken, how, what followed, how fast, what was lost."""

    def __init__(self) -> None:
        self.rows: list[FaultRow] = []

    def add(
        self, fault: str, injected: str, outcome: str, time_to_error_s: float | None, turns_lost: int | str | None
    ) -> None:
        self.rows.append(FaultRow(fault, injected, outcome, time_to_error_s, turns_lost))

    def lines(self) -> list[str]:
        out = ["| fault | how injected | outcome | time to error (s) | turns lost |", "|---|---|---|---|---|"]
        for r in self.rows:
            seconds = "-" if r.time_to_error_s is None else f"{r.time_to_error_s:.2f}"
            lost = "-" if r.turns_lost is None else str(r.turns_lost)
            out.append(f"| {r.fault} | {r.injected} | {r.outcome} | {seconds} | {lost} |")
        return out


_TABLE = FaultTable()


@pytest.fixture
def fault_table() -> FaultTable:
    return _TABLE


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _TABLE.rows:
        terminalreporter.section("fault table")
        for line in _TABLE.lines():
            terminalreporter.write_line(line)
