"""A process-group push in one process for the security suite: gloo on CPU, the receiver in a thread, every wait bounded."""
from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from lmcollect.engines.vllm.worker_ext import EngineWeights
from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupReceiver, ProcessGroupSender
from lmcollect.weights.tensors import tensor_metadata

TIMEOUT_S = 10.0


def weights(step: int = 0) -> dict[str, torch.Tensor]:
    """A tiny model's state at a training step: a tied embedding/head, a norm (the only tensor a
    step changes, so a push after the first is a delta) and an integer buffer."""
    embed = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return {"embed.weight": embed, "head.weight": embed, "norm.weight": torch.ones(4) * (step + 1), "steps": torch.arange(3)}


def engine_weights(dtype: torch.dtype = torch.float32) -> EngineWeights:
    """What the receiving engine accepts (the vLLM worker's context), its floats in ``dtype``."""
    metadata = {
        name: (dtype if held.is_floating_point else held, shape) for name, (held, shape) in tensor_metadata(weights()).items()
    }
    del metadata["head.weight"]
    return EngineWeights(metadata, {"head.weight": "embed.weight"})


@dataclass
class Group:
    sender: ProcessGroupSender
    receiver: ProcessGroupReceiver
    context: EngineWeights  # the receiver holds it by weakref only
    pool: ThreadPoolExecutor

    def push(self, pushed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        received = self.pool.submit(self.receiver.receive)
        self.sender.send(pushed)
        return received.result(timeout=TIMEOUT_S)

    def client(self) -> dist.TCPStore:
        """A plain store client, as any host that reaches the sender's port can make."""
        info = self.sender.connection_info()
        timeout = datetime.timedelta(seconds=5)
        return dist.TCPStore(info["master_address"], info["master_port"], is_master=False, timeout=timeout)


@pytest.fixture()
def make_group() -> Iterator[Callable[..., Group]]:
    """``make_group(sender_cls=ProcessGroupSender, context=engine_weights(), **config)``: a formed group of one receiver."""
    groups: list[Group] = []

    def make(sender_cls: type[ProcessGroupSender] = ProcessGroupSender, context: EngineWeights | None = None, **settings) -> Group:
        config = ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=TIMEOUT_S, **settings)
        context = context or engine_weights()
        group = Group(sender_cls(config), ProcessGroupReceiver(timeout_s=TIMEOUT_S), context, ThreadPoolExecutor(1))
        groups.append(group)
        group.receiver.init_on_receiver(model_id="policy", context=group.context)
        group.receiver.set_connection_info(group.sender.connection_info(), worker_idx=0)
        joined = group.pool.submit(group.receiver.connect)
        group.sender.connect()
        joined.result(timeout=TIMEOUT_S)
        return group

    yield make
    for group in groups:
        group.sender.close()
        group.receiver.close()
        group.pool.shutdown(wait=False)


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
