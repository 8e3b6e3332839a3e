"""LoopThread.close leaves no task pending on the closed loop (its finalizer would run later, anywhere)."""
from __future__ import annotations

import asyncio

from lmcollect.plumbing import LoopThread


def test_close_cancels_pending_tasks_and_lets_them_end() -> None:
    loop = LoopThread("test-loop", join_timeout_s=5)
    ended: list[str] = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("cleaned up")  # runs on the loop, before it closes

    async def start() -> asyncio.Task:
        return asyncio.ensure_future(waits_forever())

    task = loop.call(start(), timeout_s=5)
    loop.close()
    assert loop.loop.is_closed()
    assert task.cancelled() and ended == ["cleaned up"]

