"""What engines whose decoding thread sleeps on a condition share: counting their requests in flight."""

from __future__ import annotations

import threading
from collections.abc import Sized


class QueuedAndRunning:
    """An engine keeping submitted requests in ``_queued`` and ``_running``, guarded by ``_wake``
    (the condition its decoding thread sleeps on): ``VLLMEngine``, ``ScriptedEngine``."""

    _wake: threading.Condition
    _queued: Sized
    _running: Sized

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished (queued or running)."""
        with self._wake:
            return len(self._queued) + len(self._running)
