"""The collector as it runs inside a Ray actor: the local collector plus RPC-friendly methods."""
from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch
from tensordict import TensorDictBase

from lmcollect.collectors.llm_collector import LLMCollector

logger = logging.getLogger(__name__)


class CollectorWorker(LLMCollector):
    """An :class:`LLMCollector` whose methods can all be called through an actor handle.

    It is a plain class (Ray is applied where the actor is created); env and policy
    constructors are called here, inside the actor, so no model travels through the driver.
    """

    def __init__(self, *args: Any, torch_threads: int | None = None, **kwargs: Any) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        super().__init__(*args, **kwargs)

    def ping(self) -> bool:
        return True

    def process_info(self) -> dict[str, Any]:
        """Where this collector runs: process id and host (for placement checks and debugging)."""
        info: dict[str, Any] = {"pid": os.getpid(), "hostname": socket.gethostname(), "node_id": None}
        try:  # only meaningful inside a Ray worker; imported here so the class stays Ray-free
            import ray

            if ray.is_initialized():
                info["node_id"] = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return info

    def get_attribute(self, name: str) -> Any:
        """Read a property (properties are not reachable through an actor handle)."""
        if name not in _READABLE:
            raise AttributeError(f"{name!r} is not a readable collector attribute; readable: {sorted(_READABLE)}.")
        return getattr(self, name)

    def set_worker_idx(self, worker_idx: int | None) -> None:
        self.worker_idx = worker_idx

    def collect_next(self) -> tuple[TensorDictBase | None, bool]:
        """(next batch or None, whether the collector is finished after it)."""
        if self._finished():
            return None, True
        batch = self.next()
        return batch, self._finished()

    def rollout_once(self) -> TensorDictBase:
        return self.rollout()

    def is_finished(self) -> bool:
        return self._finished()


_READABLE = {
    "dialog_turns_per_batch",
    "total_dialog_turns",
    "turns_run",
    "policy_version",
    "worker_idx",
    "weight_updater",
    "replay_buffer",
}
