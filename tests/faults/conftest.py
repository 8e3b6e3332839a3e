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

import pytest

from tests.faults.table import FaultTable
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


_TABLE = FaultTable()


@pytest.fixture
def fault_table() -> FaultTable:
    return _TABLE
