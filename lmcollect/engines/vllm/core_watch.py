"""Watching vLLM's engine core process: a core that dies while its engine is open fails what waits on it.

With ``VLLMEngine(multiprocess=True)`` vLLM's engine core is a process of its own. When it dies (a
SIGKILL, the out-of-memory killer, or its worker dying, which ends the core too) vLLM 0.32's sync client
marks itself dead and closes its output thread without telling anyone: ``LLMEngine.step()`` then waits
for outputs forever, and a control call (``collective_rpc``) for a reply that never comes. So every
request in flight would hang until its caller's own time bound, and one without a bound for good.

:class:`CoreWatch` waits on the core's process sentinels in a thread of its own. When a core ends
while the engine is open it hands :class:`~lmcollect.engines.protocol.EngineDiedError` to the
engine (which fails every queued and running request with it and refuses new ones), and wakes
the engine's decoding thread wherever it waits on the dead process: the step's output queue and
every control call's reply.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

from lmcollect.engines.protocol import EngineDiedError

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the watch looks whether its engine was closed (a closed engine's core ends on purpose)."""
CALL_DEATH_WAIT_S = 2.0
"""How long a control call that failed with vLLM's plain ``Exception`` waits to learn whether the core is
dying (its worker died under the call): then it raises the death, not the call's failure."""


def core_processes(llm: Any) -> list[Any]:
    """The engine core processes of vLLM's ``LLMEngine`` (``multiprocessing`` process objects), or [] when
    the core runs in this process."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


class CoreWatch:
    """Calls ``on_death(error)`` once when ``llm``'s engine core dies while ``is_open()``: its process ended
    (watched in a thread of its own), or vLLM said so (:meth:`check`, with the error vLLM raised)."""

    def __init__(self, llm: Any, *, is_open: Callable[[], bool], on_death: Callable[[EngineDiedError], None]) -> None:
        self._llm = llm
        self._processes = core_processes(llm)
        self._is_open, self._on_death = is_open, on_death
        self._lock = threading.Lock()
        self._reported = threading.Event()
        self.error: EngineDiedError | None = None
        """The death, once known (what every later call raises)."""
        self._thread = threading.Thread(target=self._watch, name="lmcollect-vllm-core-watch", daemon=True)
        if self._processes:
            self._thread.start()

    @property
    def watching(self) -> bool:
        """Whether there is a core process to watch (``multiprocess=True``)."""
        return bool(self._processes)

    def check(self, error: BaseException, *, wait_s: float = 0.0) -> EngineDiedError | None:
        """The death behind ``error``, else None: vLLM's ``EngineDeadError`` says so itself (reported once);
        for another error, a death the watch sees within ``wait_s`` (a control call whose worker died
        fails with vLLM's plain ``Exception`` a moment before the core ends)."""
        if self.error is None and type(error).__name__ == "EngineDeadError":
            self._report("vLLM's engine core reported itself dead (its worker died, or it failed: see its log)")
        if self.error is None and wait_s > 0 and self.watching:
            self._reported.wait(wait_s)
        return self.error

    def _watch(self) -> None:
        sentinels = [process.sentinel for process in self._processes]
        while self._is_open():
            if connection.wait(sentinels, timeout=POLL_S):
                break
        if self._is_open():  # else closed: the core ended because we asked it to
            ended = ", ".join(f"pid {p.pid}, exit code {p.exitcode}" for p in self._processes)
            self._report(f"vLLM's engine core process ended ({ended}): killed (e.g. out of memory) or its worker died")

    def _report(self, what: str) -> None:
        with self._lock:
            if self.error is not None:
                return
            pids = ", ".join(str(p.pid) for p in self._processes) or "in this process"
            self.error = EngineDiedError(
                f"{what}, while its VLLMEngine was open (engine core: {pids}). Its requests failed and it takes "
                "no more: close it and build a new VLLMEngine (then push the trainer's weights, or restore the "
                "last checkpoint with load_checkpoint)."
            )
        self._reported.set()
        logger.error("%s", self.error)
        self._on_death(self.error)
        wake_waiters(self._llm, self.error)


def wake_waiters(llm: Any, error: EngineDiedError) -> None:
    """Wake whatever waits on a dead core: ``step()`` on the output queue, control calls on their replies."""
    client = llm.engine_core
    with contextlib.suppress(AttributeError):
        client.resources.engine_dead = True  # vLLM's own flag: new inputs raise at once
    outputs = getattr(client, "outputs_queue", None)
    if outputs is not None:
        outputs.put_nowait(error)  # step() raises it
    for reply in list(getattr(client, "utility_results", {}).values()):
        if not reply.done():
            with contextlib.suppress(Exception):  # settled meanwhile
                reply.set_exception(error)
