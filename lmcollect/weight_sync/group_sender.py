"""ProcessGroupPushSender: a push into an engine's worker processes over a process group (vLLMUpdater's mechanism)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcollect.engines.vllm.worker_ext import RayNode, current_ray_node
from lmcollect.engines.weight_group import GroupPush
from lmcollect.transports.process_group import PreparedPush, ProcessGroupConfig, ProcessGroupSender
from lmcollect.weight_sync.base import WeightPushError
from lmcollect.weight_sync.sender import Payload, PushSender, stats_of
from lmcollect.weight_sync.target import Metadata, Wait, WeightTarget
from lmcollect.weights.cost_model import VLLM_CPU_PUSH_COST, DeltaChooser
from lmcollect.weights.delta import DeltaConfig, distinct_nbytes, resolve_delta
from lmcollect.weights.lora import LoraAdapter, check_adapter
from lmcollect.weights.push_config import Backend, PushConfig
from lmcollect.weights.tensors import (
    WeightDict,
    non_finite_problems,
    raise_if_problems,
    tensor_metadata,
    weight_problems,
)
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
CAUSE_WAIT_S = 5.0  # how long a failed push waits for the worker side's own error


def default_master_address(trainer_node: RayNode | None, engine_node_ids: Sequence[str]) -> str:
    """The address the engine's workers reach the trainer at when none is given.

    Loopback when Ray is not running in the trainer's process (then everything is on this
    machine) or every worker is on the trainer's Ray node; else the trainer node's IP as Ray
    reports it, which the other nodes can reach.
    """
    if trainer_node is None or all(node_id == trainer_node.node_id for node_id in engine_node_ids):
        return LOOPBACK
    return trainer_node.ip


class ProcessGroupPushSender(PushSender[int]):
    """The trainer is rank 0 of a process group whose other ranks are an engine's workers.

    :meth:`connect` forms the group (the first push does when nothing did). Per push: :meth:`check`
    the trainer's ``model_metadata`` contract; :meth:`plan` checks the weights against what every
    worker accepts (and NaN/Inf, as they will hold them) and, with delta, encodes the delta (nothing
    sent); :meth:`send` starts the engine's load (its workers receive inside it) and broadcasts;
    :meth:`wait` takes the workers' reports and compares checksums with ``verify``. A LoRA adapter
    (a few MB) goes in the engine's load call itself, not through the broadcast.
    """

    def __init__(
        self,
        config: PushConfig,
        *,
        target: Callable[[], WeightTarget],
        model_metadata: Callable[[], Metadata | None],
    ) -> None:
        self.config = config
        self._target = target
        self._model_metadata = model_metadata
        self.group: ProcessGroupSender | None = None
        self.last_push_info: list[dict[str, Any]] = []
        self._chooser = (
            DeltaChooser(config.cost_model or VLLM_CPU_PUSH_COST, bandwidth_gbit=config.link_gbit)
            if config.delta == "auto"
            else None
        )
        self._started = 0.0  # when the push being made began (timed for delta="auto")
        self._deadline = 0.0  # by when the workers must have applied the push being made

    @property
    def timeout_s(self) -> float:
        assert self.config.timeout_s is not None, "check_for('process group') refuses None"
        return self.config.timeout_s

    @property
    def tp_size(self) -> int:
        return self.config.vllm_tp_size or 1

    @property
    def delta(self) -> DeltaConfig | None:
        """The delta encoding of every push (None: full pushes, or "auto", which chooses per push)."""
        return None if self.config.delta == "auto" else resolve_delta(self.config.delta)

    # ------------------------------------------------------------------ the group
    def connect(self, metadata: Metadata | None, device: torch.device | str | None) -> None:
        """Form the group with the engine's workers (again, if one was formed before); check
        ``metadata`` (the trainer's) against what the workers accept."""
        self.close()
        config = ProcessGroupConfig(
            num_receivers=self.tp_size * self._target().num_replicas(),
            push=self.config,
            master_address=self.config.master_address or self._default_master_address(),
            backend=self._choose_backend(device),
            delta=self.delta or False,  # "auto": chosen per push (use_delta)
            link_gbit=None,  # the chooser reads them
            cost_model=None,
        )
        group = ProcessGroupSender(config)
        info = group.connection_info()
        deadline = time.monotonic() + self.timeout_s
        joined = self._target().submit_join_weight_group(info, ranks_per_replica=self.tp_size)
        try:
            group.connect()
        except Exception as exc:  # a worker that never joins: the group times out
            group.close()
            raise WeightPushError(
                f"vLLM worker 0 did not join the weight group at {config.master_address}:{info['master_port']}: "
                f"{self._cause(joined, exc)}. The workers must reach that address: for an engine on another "
                "machine (e.g. a vLLM server) pass vLLMUpdater(master_address=<this machine's address as the "
                "engine sees it>), e.g. lmcollect.engines.served.master_address_for(server_url)."
            ) from exc
        self._wait(joined, deadline, "join_weight_group")
        self.group = group
        if metadata is not None:
            expected, aliases = group.receiver_metadata[0]
            problems = weight_problems(metadata, expected, aliases=aliases, convert_dtype=self.config.convert_dtype)
            raise_if_problems(problems, where=" (model_metadata at init)")
        logger.info("vLLMUpdater: group formed with %d worker(s) at %s, backend %s",
                    config.num_receivers, config.master_address, config.backend)  # fmt: skip

    def close(self) -> None:
        """Leave the group (the next push forms a new one)."""
        if self.group is not None:
            self.group.close()
        self.group = None

    @property
    def uses_delta(self) -> bool:
        """Whether the next push may be a delta push (with ``delta="auto"``: what was chosen last)."""
        return self.group.uses_delta if self.group is not None else self.delta is not None

    # ------------------------------------------------------------------ one push
    def before_push(self) -> None:
        self._started = time.perf_counter()

    def check(self, payload: Payload, worker_ids: list[int]) -> None:
        metadata = self._model_metadata()
        if isinstance(payload, LoraAdapter):  # else the engine checks it before any worker changes
            if metadata is not None:
                check_adapter(payload, metadata, receiver="worker 0's model")
            return
        if self.group is None:
            if not self.config.allow_non_finite:  # before the group forms (NaN/Inf as pushed stays so once cast)
                raise_if_problems(non_finite_problems(payload))
            first = next(iter(payload.values()), None)
            self.connect(metadata, None if first is None else first.device)
        if metadata is not None:  # the trainer's contract; plan checks what every worker accepts
            raise_if_problems(weight_problems(tensor_metadata(payload), metadata), where=" (model_metadata)")

    def plan(self, payload: Payload, targets: list[int]) -> PreparedPush | None:
        """Checked against every worker (NaN/Inf too, on what travels as the engine holds it);
        with delta also encoded; nothing sent."""
        if isinstance(payload, LoraAdapter) or not targets:
            return None
        assert self.group is not None, "check forms the group"
        if self._chooser is not None:
            self._choose_delta(self.group, payload)
        return self.group.prepare(payload)

    def send(self, payload: Payload, targets: list[int], pushed: PushVersion, plan: Any) -> Wait | None:
        """The engine's load starts (its workers receive while the trainer sends; then the cache
        reset and the version, in one hold of the engine), then the broadcast."""
        if not targets:
            return None
        self._deadline = time.monotonic() + self.timeout_s
        if isinstance(payload, LoraAdapter):
            self.last_push_stats = stats_of(payload, len(targets))
            return self._target().submit_load(payload.to("cpu"), version=pushed)
        group = self.group
        assert group is not None and isinstance(plan, PreparedPush), "check forms the group, plan prepares"
        received = self._target().submit_load(
            GroupPush(timeout_s=self.timeout_s, verify=self.config.verify), version=pushed
        )
        try:
            group.send(plan, version=pushed)
        except Exception as exc:  # a worker died mid-broadcast: the group is broken, name it and start over
            self.close()
            raise WeightPushError(f"push to vLLM worker 0 failed: {self._cause(received, exc)}") from exc
        stats = self.last_push_stats = group.last_push_stats
        if self._chooser is not None and stats is not None:
            self._chooser.observe(stats.kind, stats.nbytes, stats.full_nbytes, time.perf_counter() - self._started)
        return received

    def wait(
        self, sent: Any, targets: list[int], pushed: PushVersion, *, wait: bool, on_done: Callable[[], None]
    ) -> None:
        """The workers' reports (within ``timeout_s`` of the send), checksums compared with ``verify``."""
        if sent is not None:
            checksums = self.group.last_checksums() if self.config.verify and self.group is not None else None
            self.last_push_info = self._wait(sent, self._deadline, "receive_weights")
            if checksums is not None:
                self._check_checksums(checksums)
        on_done()

    # ------------------------------------------------------------------ helpers
    def _choose_delta(self, group: ProcessGroupSender, weights: WeightDict) -> None:
        """``delta="auto"``: delta pushes on (a base kept from the next push) or off (base dropped)."""
        assert self._chooser is not None
        use_delta = self._chooser.use_delta(distinct_nbytes(weights))
        if use_delta != group.uses_delta:
            logger.info("vLLMUpdater delta='auto': %s pushes (link %s Gbit/s)", "delta" if use_delta else "full",
                        self._chooser.link_gbit)  # fmt: skip
        group.use_delta(DeltaConfig() if use_delta else None)

    def _check_checksums(self, sent: list[int]) -> None:
        bad = [info.get("rank") for info in self.last_push_info if info.get("checksums") != sent]
        if bad:
            self.close()
            raise WeightPushError(
                f"vLLM worker rank(s) {bad} received buckets whose checksums differ from the sent ones."
            )

    def _default_master_address(self) -> str:
        trainer_node = current_ray_node()
        if trainer_node is None:  # no Ray here: the engine is in this process or a child of it
            return LOOPBACK
        return default_master_address(trainer_node, self._engine_node_ids(trainer_node.node_id))

    def _engine_node_ids(self, trainer_node_id: str) -> list[str]:
        """The Ray node of every engine worker, as the workers report it."""
        target = self._target()
        reported = target.receiver_nodes()
        owner_node_id = trainer_node_id
        if None in reported:
            # a worker without Ray is a subprocess of the engine's owner: the loader's process
            owner_node_id = target.owner_node() or trainer_node_id
        return [owner_node_id if node_id is None else node_id for node_id in reported]

    def _wait(self, wait: Wait, deadline: float, what: str) -> Any:
        try:
            return wait(max(deadline - time.monotonic(), 0.0))
        except Exception as exc:  # dead actor, worker error or timeout: the group cannot be trusted
            self.close()
            raise WeightPushError(
                f"vLLM worker 0 ({self._target()!r}) failed {what} within timeout_s={self.timeout_s}: {exc}"
            ) from exc

    def _cause(self, wait: Wait, exc: BaseException) -> str:
        """The worker side's error if it fails within a few seconds (it names the dead replica;
        Ray may take a moment to report a dead actor), else ``exc``."""
        try:
            wait(CAUSE_WAIT_S)
        except Exception as worker_exc:  # the informative one, unless the wait merely ran out
            if isinstance(worker_exc, TimeoutError) or isinstance(worker_exc.__cause__, TimeoutError):
                return str(exc)
            return f"{worker_exc} (trainer side: {exc})"
        return str(exc)

    def _choose_backend(self, device: torch.device | str | None) -> Backend:
        if self.config.backend != "auto":
            return self.config.backend
        if device is None:
            return "nccl" if torch.cuda.is_available() else "gloo"
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
