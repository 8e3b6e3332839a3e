"""The replay buffer's actor SIGKILLed: the next call raises ``BufferActorError`` naming the buffer and the
way back (a new buffer, the last checkpoint), within the call timeout.

Found by the chaos harness (``benchmarks/chaos.py``, kill kind ``actor:buffer``): the driver got Ray's own
``ActorDiedError`` (class name, actor id, worker exit code), which names neither lmcollect's buffer nor
what to do.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from lmcollect.ray import BufferActorError, RayReplayBuffer

pytestmark = pytest.mark.integration

CALL_TIMEOUT_S = 20.0


@pytest.mark.fault_timeout(90)
def test_a_killed_buffer_actor_raises_buffer_actor_error_within_the_call_timeout(ray_cluster, fault_table) -> None:
    buffer = RayReplayBuffer(capacity=8, seed=0, call_timeout_s=CALL_TIMEOUT_S)
    try:
        assert len(buffer) == 0
        pid = ray.get(buffer.actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=CALL_TIMEOUT_S)
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(BufferActorError, match=r"RayReplayBuffer.__len__\(\): the buffer's actor died"):
            len(buffer)
        elapsed = time.monotonic() - start
        assert elapsed < CALL_TIMEOUT_S
        with pytest.raises(BufferActorError, match="load_checkpoint"):
            buffer.sample(1)
    finally:
        ray.kill(buffer.actor)  # dead already; a no-op then
    fault_table.add(
        "the replay buffer's actor dies",
        "SIGKILL of RayReplayBuffer's actor process",
        "BufferActorError naming the buffer and the way back (a new buffer, load_checkpoint)",
        elapsed,
        "the buffer's contents (restore the last checkpoint)",
    )
