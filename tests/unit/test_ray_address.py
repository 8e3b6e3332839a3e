"""Attaching to a Ray cluster that is not there fails at once, naming the address."""
from __future__ import annotations

import socket
import time

import pytest

from lmcollect.ray.cluster import check_reachable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_address_is_named_quickly() -> None:
    port = _closed_port()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"127\.0\.0\.1:{port}.*ray start --head"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=120)
    # a closed port refuses at once: far sooner than the connect timeout
    assert time.monotonic() - started < 60, "check_reachable waited for its timeout on a refused connection"


def test_a_listening_address_passes() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")
