"""``CoreWatch`` (``lmcollect/engines/vllm/core_watch.py``) over a real process in the engine core's place
and a fake of vLLM's client (``FakeSyncClient``: the three things the watch touches; vLLM itself is
exercised in ``tests/faults/test_fault_vllm_engine_death.py``). No vLLM needed."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from lmcollect.engines import EngineDiedError
from lmcollect.engines.vllm.core_watch import CoreWatch

BOUND_S = 10.0


class EngineDeadError(Exception):
    """Named as vLLM's (the watch knows it by name, without importing vLLM)."""


class FakeSyncClient:
    """vLLM's ``SyncMPClient`` as the watch sees it: its core processes, output queue and pending replies."""

    def __init__(self, process: multiprocessing.Process) -> None:
        self.resources = SimpleNamespace(engine_manager=SimpleNamespace(processes=[process]), engine_dead=False)
        self.outputs_queue: queue.Queue = queue.Queue()
        self.utility_results: dict[int, Future] = {}


@pytest.fixture
def core():
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    process.start()
    yield process
    process.kill()
    process.join(BOUND_S)


def watch(core, opened: list[bool]) -> tuple[CoreWatch, FakeSyncClient, list[EngineDiedError]]:
    client = FakeSyncClient(core)
    deaths: list[EngineDiedError] = []
    return CoreWatch(SimpleNamespace(engine_core=client), is_open=lambda: opened[0], on_death=deaths.append), client, deaths


def test_a_core_that_dies_while_open_fails_what_waits_on_it_once(core) -> None:
    opened = [True]
    watcher, client, deaths = watch(core, opened)
    reply: Future = Future()
    client.utility_results[7] = reply
    assert watcher.watching and watcher.check(RuntimeError("a request's own error")) is None
    core.kill()
    error = reply.exception(timeout=BOUND_S)  # a control call waiting for the dead core's reply
    assert isinstance(error, EngineDiedError) and str(core.pid) in str(error) and "build a new VLLMEngine" in str(error)
    assert client.outputs_queue.get(timeout=BOUND_S) is error  # step() waiting for outputs: woken with it
    assert client.resources.engine_dead and deaths == [error] and watcher.error is error
    assert watcher.check(EngineDeadError()) is error and deaths == [error]  # reported once
    opened[0] = False


def test_a_call_that_fails_as_its_core_dies_is_told_the_death(core) -> None:
    opened = [True]
    watcher, _client, deaths = watch(core, opened)
    started = time.monotonic()
    assert watcher.check(Exception("Call to collective_rpc method failed"), wait_s=0.2) is None  # alive: its own error
    assert time.monotonic() - started >= 0.2
    threading.Timer(0.3, core.kill).start()  # the worker died under the call: the core ends a moment later
    died = watcher.check(Exception("Call to collective_rpc method failed"), wait_s=BOUND_S)
    assert isinstance(died, EngineDiedError) and deaths == [died]
    opened[0] = False


def test_vllms_own_dead_error_is_the_death_and_a_closed_engines_core_is_no_death(core) -> None:
    opened = [True]
    watcher, _client, deaths = watch(core, opened)
    died = watcher.check(EngineDeadError("EngineCore encountered an issue"))
    assert isinstance(died, EngineDiedError) and "reported itself dead" in str(died) and deaths == [died]

    other = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    other.start()
    closed = [True]
    quiet, client, quiet_deaths = watch(other, closed)
    closed[0] = False  # the engine closed: its core ends on purpose
    other.kill()
    other.join(BOUND_S)
    time.sleep(1.0)  # two of the watch's looks
    assert quiet_deaths == [] and quiet.error is None and client.outputs_queue.empty()
    opened[0] = False
