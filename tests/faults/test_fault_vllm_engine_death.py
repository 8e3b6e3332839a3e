"""A vLLM engine process killed while requests run: ``VLLMEngine(multiprocess=True)`` fails them with
``EngineDiedError`` within seconds, refuses more, and closes without a hang or a leftover.

vLLM's own sync client, when its engine core process dies, marks itself dead and stops reading
outputs: without lmcollect's watch (``lmcollect/engines/vllm/core_watch.py``) ``step()`` waits forever,
so every request hangs until its caller's own time bound. Found by the chaos harness
(``benchmarks/chaos.py``, ``engine:*`` kills). Two layouts: the engine core alone in its own process
(killed directly), and the core with its worker in a third process (``distributed_executor_backend="mp"``;
the worker killed, which ends the core). Skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from lmcollect.engines import EngineDiedError, EngineRequest
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.engines.vllm.shm_payload import SHM_DIR
from tests.factories import perturbed_model
from tests.integration.conftest import CPU_ENGINE_KWARGS

pytest.importorskip("vllm")
from lmcollect.engines.vllm.core_watch import core_processes  # noqa: E402
from lmcollect.engines.vllm.engine import VLLMEngine  # noqa: E402
from lmcollect.engines.vllm.reaper import children  # noqa: E402

pytestmark = pytest.mark.integration

BOUND_S = 15.0
"""How long a request may wait after the kill before it fails (the watch looks every 0.5 s)."""
LONG = SamplingConfig(temperature=1.0, max_new_tokens=4000, ignore_eos=True, seed=0)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_while_running(engine: VLLMEngine, victim: int) -> tuple[EngineDiedError, float]:
    """Start a long request, SIGKILL ``victim`` once it decodes, and wait (bounded) for the request to fail."""
    future = engine.submit(EngineRequest(prompt_ids=[1, 2, 3, 4, 5], sampling=LONG))
    deadline = time.monotonic() + 60
    while not engine._running and time.monotonic() < deadline:  # decoding: the request is in vLLM
        time.sleep(0.01)
    assert engine._running, "the request never started"
    time.sleep(0.2)
    assert not future.done(), "4000 tokens decoded in 0.2 s: the request is too short to be killed mid-way"
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(EngineDiedError) as caught:
        future.result(timeout=BOUND_S + 30)
    return caught.value, time.monotonic() - killed


def check_dead_engine(engine: VLLMEngine, error: EngineDiedError, waited_s: float, core: int) -> None:
    assert waited_s < BOUND_S, f"the request failed {waited_s:.1f} s after the kill"
    assert "build a new VLLMEngine" in str(error) and str(core) in str(error), error
    with pytest.raises(EngineDiedError):  # refused at once, never queued
        engine.submit(EngineRequest(prompt_ids=[1, 2, 3], sampling=LONG))
    started = time.monotonic()
    with pytest.raises(EngineDiedError):  # a control call: not a wait for a reply that never comes
        engine.pause()
    assert time.monotonic() - started < BOUND_S
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < BOUND_S, "close() of a dead engine waited"


@pytest.mark.fault_timeout(240)
def test_a_killed_engine_core_fails_its_requests_within_seconds(tiny_model_path: Path, fault_table) -> None:
    before = set(SHM_DIR.glob(f"lmcollect-push-{os.getpid()}-*"))
    engine = VLLMEngine(tiny_model_path, engine_kwargs=CPU_ENGINE_KWARGS, multiprocess=True, timeout_s=120)
    try:
        [core] = [process.pid for process in core_processes(engine._llm)]
        engine.load_weights(perturbed_model(tiny_model_path, seed=41).state_dict().items(), version=1)
        error, waited_s = kill_while_running(engine, core)
        check_dead_engine(engine, error, waited_s, core)
    finally:
        engine.close()
    assert set(SHM_DIR.glob(f"lmcollect-push-{os.getpid()}-*")) == before, "the push files outlived the engine"
    fault_table.add(
        "vLLM engine core process killed (multiprocess=True)",
        "SIGKILL of the engine core while a request decodes",
        "EngineDiedError naming the process and the fix; later submits and control calls refused at once; "
        "close() returns; its shared-memory push files removed",
        waited_s,
        None,
    )


@pytest.mark.fault_timeout(240)
def test_a_killed_engine_worker_ends_the_core_and_fails_its_requests(tiny_model_path: Path, fault_table) -> None:
    kwargs = {**CPU_ENGINE_KWARGS, "distributed_executor_backend": "mp"}
    engine = VLLMEngine(tiny_model_path, engine_kwargs=kwargs, multiprocess=True, timeout_s=120)
    try:
        [core] = [process.pid for process in core_processes(engine._llm)]
        [worker] = [pid for pid in children(core) if "Worker" in Path(f"/proc/{pid}/cmdline").read_text()]
        error, waited_s = kill_while_running(engine, worker)
        check_dead_engine(engine, error, waited_s, core)
        deadline = time.monotonic() + BOUND_S
        while alive(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(core), "the engine core outlived its worker and its engine"
    finally:
        engine.close()
    fault_table.add(
        "vLLM engine worker process killed (multiprocess=True, mp executor)",
        "SIGKILL of the worker while a request decodes (the core ends with it)",
        "EngineDiedError naming the core; later calls refused at once; close() returns; no process left",
        waited_s,
        None,
    )
