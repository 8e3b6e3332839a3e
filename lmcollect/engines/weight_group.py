"""Weights that reach an engine's worker processes by a process-group broadcast (vLLM's workers).

A trainer (``vLLMUpdater``) forms a group with the workers once (:func:`join_weight_group`), then
each push is the engine's ordinary ``load_weights(GroupPush(...), version=v)``: inside one pause
the workers receive the broadcast and reload, the prefix cache is reset and the version taken,
while the trainer sends. Only the engines name the workers' methods (those of
:mod:`lmcollect.engines.vllm.worker_ext`); the updater calls engine verbs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the protocol module imports GroupPush (a payload kind engines dispatch on)
    from lmcollect.engines.protocol import WorkerRpcEngine

JOIN_METHOD = "init_weight_group"
RECEIVE_METHOD = "receive_weights"
NODE_METHOD = "ray_node_id"


@dataclass(frozen=True, kw_only=True)
class GroupPush:
    """``load_weights``'s source for a push broadcast by a trainer the engine's workers joined:
    the workers receive and reload it inside the load (the trainer sends meanwhile)."""

    timeout_s: float | None = None
    """Longest the workers wait for the broadcast."""
    verify: bool = False
    """Each worker reports a CRC32 of every bucket it now holds, for the trainer to compare."""

    def worker_args(self) -> tuple[float | None, bool]:
        """The workers' receive arguments."""
        return (self.timeout_s, self.verify)


def join_weight_group(engine: WorkerRpcEngine, connection_info: dict[str, Any], *, ranks_per_replica: int) -> None:
    """Every worker of every replica joins the trainer's group (replica ``i``'s workers take ranks
    from ``1 + i * ranks_per_replica``); returns once the trainer's side has connected too."""
    args = [(connection_info, 1 + replica * ranks_per_replica) for replica in range(engine.num_replicas)]
    engine.collective_rpc_each(JOIN_METHOD, args)


def weight_receiver_nodes(engine: WorkerRpcEngine) -> list[str | None]:
    """The Ray node of every worker (None for a worker outside Ray: a subprocess of the engine's owner)."""
    return engine.collective_rpc_each(NODE_METHOD, [()] * engine.num_replicas)
