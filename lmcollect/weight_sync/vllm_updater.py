"""vLLMUpdater: pushes a trainer's weights into the vLLM engine behind a collector over a process group."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from lmcollect.engines.protocol import worker_rpc_engine_of
from lmcollect.engines.vllm.worker_ext import RayNode, current_ray_node
from lmcollect.engines.weight_group import GroupPush
from lmcollect.transports.process_group import PreparedPush, ProcessGroupConfig, ProcessGroupSender
from lmcollect.weight_sync.base import WeightPushError, WeightUpdaterBase
from lmcollect.weight_sync.loader import WeightLoader
from lmcollect.weight_sync.target import Metadata, Wait, WeightTarget
from lmcollect.weights.cost_model import VLLM_CPU_PUSH_COST, DeltaChooser
from lmcollect.weights.delta import DeltaConfig, distinct_nbytes, resolve_delta
from lmcollect.weights.lora import LoraAdapter
from lmcollect.weights.push_config import Backend, PushConfig, push_config_or_default, with_keywords
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


class vLLMUpdater(WeightUpdaterBase[int]):
    """Sends a trainer's weights to the vLLM workers of a collector's ``VLLMPolicy``.

    The trainer is rank 0 of a process group whose other ranks are the engine's workers (ranks
    ``1..tp`` per replica; gloo when the weights are on the CPU, NCCL when on CUDA). The engine
    needs ``worker_extension_cls=VLLM_EXTENSION`` (``lmcollect.engines.vllm.worker_ext``).
    The engine may be in this process (a local ``LLMCollector``), in a ``RayLLMCollector``'s
    actor, in engine actors (``VLLMReplicas``), or a vLLM server (``VLLMServerPolicy``, through its
    development endpoints, which also pause the server's generation for the call); the updater
    reaches it through the collector.

    One push, in order:

    1. check the weights against what every worker accepts, and for NaN/Inf (one ValueError,
       nothing sent);
    2. the collector's ``receive_weights(GroupPush(...))`` starts without the trainer waiting for
       it: the engine's ``load_weights`` holds it (the collector's policy lock or the engine's
       pause, so no turn runs) while its workers receive;
    3. send: the layout (metadata) through the store, then a few flat per-dtype buckets by broadcast
       (with ``convert_dtype``, each tensor is cast to the engine's dtype as its bucket is packed);
       with ``delta``, after the first push only the changed elements travel: each worker patches
       its copy of the last push and verifies per-tensor checksums, and if any worker refuses (a
       failed checksum, another base) the full weights follow in the same pause;
    4. load: each worker reloads the weights (vLLM fuses q/k/v etc.); the trainer waits for all,
       at most ``timeout_s`` from the start of the push, then compares checksums with ``verify``;
    5. still inside the same load, the engine resets its prefix cache and takes the version, the
       collector its policy version; then generation resumes and the post-hooks run.

    Args:
        master_address: address the workers reach the trainer at (``PushConfig.master_address``;
            None: chosen at :meth:`init` by :func:`default_master_address`).
        master_port: port of the rendezvous store (``PushConfig.master_port``; None: a free one).
        model_metadata: name -> (dtype, shape) the trainer will push; checked against the engine
            at :meth:`init` (None: the engine's own checkpoint metadata, read by its workers).
        vllm_tp_size: tensor-parallel size of each engine replica (``PushConfig.vllm_tp_size``; None: 1).
        config: how it pushes (:class:`~lmcollect.weights.push_config.PushConfig`: timeout, dtype
            conversion, NaN/Inf, bucket size, delta / "auto", and the process-group options
            ``verify``, ``digest``, ``backend``). The three keywords above set the same fields;
            a keyword that disagrees with ``config`` is a ValueError. With ``delta``, the engine
            still reloads every tensor, so a delta saves the transfer, not the reload.

    Example::

        policy = VLLMPolicy(path, engine_kwargs={"worker_extension_cls": VLLM_EXTENSION, ...})
        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=64,
                                 weight_updater=vLLMUpdater(config=PushConfig(timeout_s=60)),
                                 track_policy_version=True)
        for batch in collector:
            train_step(trainer_model, batch)
            collector.update_policy_weights_(trainer_model)  # group formed on the first push
    """

    def __init__(
        self,
        master_address: str | None = None,
        master_port: int | None = None,
        model_metadata: Metadata | None = None,
        vllm_tp_size: int | None = None,
        *,
        config: PushConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = with_keywords(
            push_config_or_default(config, updater="vLLMUpdater"),
            updater="vLLMUpdater",
            master_address=master_address,
            master_port=master_port,
            vllm_tp_size=vllm_tp_size,
        )
        self.config.check_for("process group", updater="vLLMUpdater")
        self.model_metadata = model_metadata
        self._chooser = (
            DeltaChooser(self.config.cost_model or VLLM_CPU_PUSH_COST, bandwidth_gbit=self.config.link_gbit)
            if self.config.delta == "auto"
            else None
        )
        self._push_started = 0.0  # when the push being made began (timed for delta="auto")
        self._policy: Any = None  # set by from_policy: an engine reached without a collector (its loader)
        self._sender: ProcessGroupSender | None = None
        self._num_replicas = 1
        self.last_push_info: list[dict[str, Any]] = []
        self._prepared: PreparedPush | None = None  # checked (and delta-encoded) by _validate, sent by _sync

    # ------------------------------------------------------------------ settings, read from the config
    @property
    def master_address(self) -> str | None:
        """The address the workers reach the trainer at (None: chosen at :meth:`init`)."""
        return self.config.master_address

    @property
    def master_port(self) -> int | None:
        """Port of the rendezvous store (None: a free one)."""
        return self.config.master_port

    @property
    def vllm_tp_size(self) -> int:
        """Tensor-parallel size of each engine replica."""
        return self.config.vllm_tp_size or 1

    @property
    def timeout_s(self) -> float:
        """Longest a push (or ``init``) may take."""
        assert self.config.timeout_s is not None, "check_for('process group') refuses None"
        return self.config.timeout_s

    @property
    def _delta_config(self) -> DeltaConfig | None:
        """The delta encoding of every push (None: full pushes, or "auto", which chooses per push)."""
        return None if self.config.delta == "auto" else resolve_delta(self.config.delta)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_sender=None, _prepared=None)  # connections and threads never travel
        return state

    # ------------------------------------------------------------------ spec API
    @classmethod
    def from_policy(cls, policy: Any) -> vLLMUpdater | None:
        """An updater for a policy backed by an engine with worker processes (a ``VLLMPolicy``, a
        ``VLLMEngine``: see :class:`~lmcollect.engines.WorkerRpcEngine`), else None."""
        engine = worker_rpc_engine_of(policy)
        if engine is None:
            return None
        updater = cls()
        updater._policy = policy
        updater._weight_target = WeightLoader(policy, version=None)  # the engine counts its versions
        return updater

    @classmethod
    def get_model_metadata(cls, model: Any) -> Metadata:
        """name -> (dtype, shape) of a trainer model, or of a ``VLLMPolicy``'s checkpoint."""
        if isinstance(model, torch.nn.Module) or isinstance(getattr(model, "model", None), torch.nn.Module):
            return super().get_model_metadata(model)
        if isinstance(getattr(model, "model_path", None), str) and worker_rpc_engine_of(model) is not None:
            from lmcollect.engines.vllm.common import checkpoint_dtype  # plain helpers: no vllm import
            from lmcollect.engines.vllm.worker_ext import checkpoint_metadata

            name = checkpoint_dtype(model.model_path)
            return checkpoint_metadata(model.model_path, dtype=getattr(torch, name) if name else None)[0]
        raise TypeError(f"get_model_metadata needs an nn.Module or a (vLLM) policy, got {type(model).__name__}.")

    def all_worker_ids(self) -> list[int]:
        """[0]: the engine (all its replicas and tensor-parallel workers) is one worker."""
        return [0]

    def _get_server_weights(self) -> None:
        """Not used: pass the weights to ``push_weights``."""
        return None

    def _maybe_map_weights(self, server_weights: WeightDict) -> WeightDict:
        """No mapping: vLLM's loader takes Hugging Face names and fuses layers itself."""
        return server_weights

    # ------------------------------------------------------------------ the group
    def init(self, model_metadata: Metadata | None = None, *, device: torch.device | str | None = None) -> None:
        """Form the process group with the engine's workers (again, if one was formed before).

        ``device`` (of the weights to push) chooses the backend when it is "auto"; None: CUDA if
        this process has it. ``model_metadata`` (or the constructor's) is checked against what
        the workers accept.
        """
        self.close()
        metadata = model_metadata if model_metadata is not None else self.model_metadata
        self._num_replicas = self._call_num_replicas()
        config = ProcessGroupConfig(
            num_receivers=self.vllm_tp_size * self._num_replicas,
            push=self.config,
            master_address=self.config.master_address or self._default_master_address(),
            backend=self._choose_backend(device),
            delta=self._delta_config or False,  # "auto": chosen per push (sender.use_delta)
            link_gbit=None,  # the updater's chooser reads them
            cost_model=None,
        )
        sender = ProcessGroupSender(config)
        info = sender.connection_info()
        deadline = time.monotonic() + self.timeout_s
        joined = self._target().submit_join_weight_group(info, ranks_per_replica=self.vllm_tp_size)
        try:
            sender.connect()
        except Exception as exc:  # a worker that never joins: the group times out
            sender.close()
            raise WeightPushError(
                f"vLLM worker 0 did not join the weight group at {config.master_address}:{info['master_port']}: "
                f"{self._cause(joined, exc)}. The workers must reach that address: for an engine on another "
                "machine (e.g. a vLLM server) pass vLLMUpdater(master_address=<this machine's address as the "
                "engine sees it>), e.g. lmcollect.engines.served.master_address_for(server_url)."
            ) from exc
        self._wait(joined, deadline, "join_weight_group")
        self._sender = sender
        if metadata is not None:
            self.model_metadata = metadata
            expected, aliases = sender.receiver_metadata[0]
            problems = weight_problems(metadata, expected, aliases=aliases, convert_dtype=self.config.convert_dtype)
            raise_if_problems(problems, where=" (model_metadata at init)")
        logger.info(
            "vLLMUpdater: group formed with %d worker(s) at %s, backend %s",
            config.num_receivers,
            config.master_address,
            config.backend,
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

    def reset_delta_base(self) -> None:
        """Forget the last pushed weights (with ``delta``): the next push sends the full weights."""
        if self._sender is not None:
            self._sender.reset_delta_base()

    def close(self) -> None:
        """Leave the process group (the next push forms a new one)."""
        if self._sender is not None:
            self._sender.close()
        self._sender = None

    # ------------------------------------------------------------------ one push
    def _validate(self, weights: WeightDict, worker_ids: list[int]) -> None:
        self._prepared = None
        self._push_started = time.perf_counter()
        if self._sender is None:
            if not self.config.allow_non_finite:  # before the group forms (NaN/Inf as pushed stays so once cast)
                raise_if_problems(non_finite_problems(weights))
            first = next(iter(weights.values()), None)
            self.init(device=None if first is None else first.device)
        if self.model_metadata is not None:  # the trainer's contract, then what every worker accepts
            raise_if_problems(weight_problems(tensor_metadata(weights), self.model_metadata), where=" (model_metadata)")
        assert self._sender is not None
        if self._chooser is not None:
            self._choose_delta(self._sender, weights)
        # checks (NaN/Inf too, on what travels as the engine holds it); with delta also encodes; sends nothing
        self._prepared = self._sender.prepare(weights)

    def _choose_delta(self, sender: ProcessGroupSender, weights: WeightDict) -> None:
        """``delta="auto"``: delta pushes on (a base kept from the next push) or off (base dropped)."""
        assert self._chooser is not None
        use_delta = self._chooser.use_delta(distinct_nbytes(weights))
        if use_delta != sender.uses_delta:
            logger.info("vLLMUpdater delta='auto': %s pushes (link %s Gbit/s)", "delta" if use_delta else "full",
                        self._chooser.link_gbit)  # fmt: skip
        sender.use_delta(DeltaConfig() if use_delta else None)

    @property
    def uses_delta(self) -> bool:
        """Whether the next push may be a delta push (with ``delta="auto"``: what was chosen last)."""
        if self._sender is not None:
            return self._sender.uses_delta
        return self._delta_config is not None

    def _sync_weights_with_worker(self, *, worker_id: int, server_weights: WeightDict, version: PushVersion) -> None:
        sender = self._sender
        assert sender is not None, "_validate forms the group"
        deadline = time.monotonic() + self.timeout_s
        # The engine's load: its workers receive while the trainer sends, then the prefix-cache
        # reset and the version, in one hold of the engine (a collector's policy lock or pause).
        received = self._target().submit_load(
            GroupPush(timeout_s=self.timeout_s, verify=self.config.verify), version=version
        )
        prepared, self._prepared = self._prepared, None
        try:
            sender.send(prepared if prepared is not None else server_weights, version=version)
        except Exception as exc:  # a worker died mid-broadcast: the group is broken, name it and start over
            self.close()
            raise WeightPushError(f"push to vLLM worker {worker_id} failed: {self._cause(received, exc)}") from exc
        stats = self.last_push_stats = sender.last_push_stats
        if self._chooser is not None and stats is not None:
            self._chooser.observe(stats.kind, stats.nbytes, stats.full_nbytes, time.perf_counter() - self._push_started)
        sent = sender.last_checksums() if self.config.verify else None  # while the workers reload
        self.last_push_info = self._wait(received, deadline, "receive_weights")
        if sent is not None:
            self._check_checksums(sent)

    # ------------------------------------------------------------------ LoRA adapters
    def _adapter_metadata(self, worker_id: int) -> Metadata | None:
        """The trainer's ``model_metadata`` when given; else None: the engine checks the adapter
        itself before any worker changes (every replica serves the same model)."""
        return self.model_metadata

    def _send_adapter(self, *, worker_id: int, adapter: LoraAdapter, version: PushVersion) -> None:
        """An adapter is a few MB: it goes in the engine's load call itself (``VLLMEngine`` sends it
        to its workers, which merge it), not through the process group's broadcast."""
        deadline = time.monotonic() + self.timeout_s
        received = self._target().submit_load(adapter.to("cpu"), version=version)
        self.last_push_info = self._wait(received, deadline, "receive_weights")

    def _record_push_stats(self, weights: WeightDict, targets: list[int]) -> None:
        """Kept as the sender measured them while sending (full or delta)."""

    def _check_checksums(self, sent: list[int]) -> None:
        bad = [info.get("rank") for info in self.last_push_info if info.get("checksums") != sent]
        if bad:
            self.close()
            raise WeightPushError(
                f"vLLM worker rank(s) {bad} received buckets whose checksums differ from the sent ones."
            )

    # ------------------------------------------------------------------ reaching the engine
    # Through the registered collector's target (its WeightLoader, or a proxy of its actor's), else
    # the from_policy engine's loader: the engine names its workers' methods.
    def _target(self) -> WeightTarget:
        if self._weight_target is None and self._policy is not None:  # from_policy, after unpickling
            self._weight_target = WeightLoader(self._policy, version=None)
        if self._weight_target is None:
            raise RuntimeError(
                "this vLLMUpdater has no collector: pass it as weight_updater=... to a collector whose "
                "policy is a VLLMPolicy (or build it with vLLMUpdater.from_policy(policy))."
            )
        return super()._target()

    def _call_num_replicas(self) -> int:
        return self._target().num_replicas()

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


VLLMUpdater = vLLMUpdater
