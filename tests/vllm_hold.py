"""Holding a vLLM engine inside one decoding step, for the engine contract's ``hold_step``.

The worker extension below runs in the engine's worker process (vLLM imports it there by name, so
it lives in an importable module of its own); :func:`held_step` arms it from the test process and
watches for the file it touches once the held step is reached.
"""
from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmcollect.engines.vllm.worker_ext import VLLMWeightReceiverExtension

HOLD_S = 1.0
HOLDING_EXTENSION = "tests.vllm_hold.HoldingReceiverExtension"


class HoldingReceiverExtension(VLLMWeightReceiverExtension):
    """lmcollect's weight receiver plus a test hook: hold the ``step``-th forward pass from now."""

    def hold_forward(self, step: int, hold_s: float, reached_file: str) -> None:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        calls = 0

        def hook(module: Any, *_args: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == step:
                handle.remove()
                Path(reached_file).touch()
                time.sleep(hold_s)

        handle = model.register_forward_hook(hook)

    def base_buffer_addresses(self) -> list[int]:
        """Where the bytes of the base this worker keeps (its last full push) start, one per buffer."""
        base = self._lmcollect_base or {}
        return sorted({tensor.untyped_storage().data_ptr() for tensor in base.values() if tensor.numel()})


@contextlib.contextmanager
def held_step(engine: Any, step: int, folder: Path, hold_s: float = HOLD_S) -> Iterator[threading.Event]:
    """``engine`` (with :class:`HoldingReceiverExtension`) holds its ``step``-th forward pass from now
    for ``hold_s``; the event is set once the pass is reached (a request's prefill is pass 1)."""
    reached_file = folder / f"reached-{uuid.uuid4().hex}"
    engine.collective_rpc_each("hold_forward", [(step, hold_s, str(reached_file))])
    reached, stop = threading.Event(), threading.Event()

    def watch() -> None:
        while not stop.is_set() and not reached.is_set():
            if reached_file.exists():
                reached.set()
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, name="held-step-watch", daemon=True)
    watcher.start()
    try:
        yield reached
    finally:
        stop.set()
        watcher.join(5)
