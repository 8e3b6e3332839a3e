"""vLLMUpdater: pushes a trainer's weights into the vLLM engine behind a collector over a process group."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lmcollect.engines.protocol import worker_rpc_engine_of
from lmcollect.transports.process_group import ProcessGroupSender
from lmcollect.weight_sync.base import WeightUpdaterBase
from lmcollect.weight_sync.group_sender import (  # noqa: F401 - LOOPBACK, default_master_address: importable here
    LOOPBACK,
    ProcessGroupPushSender,
    default_master_address,
)
from lmcollect.weight_sync.loader import WeightLoader
from lmcollect.weight_sync.target import Metadata, WeightTarget
from lmcollect.weights.push_config import PushConfig, push_config_or_default, with_keywords
from lmcollect.weights.tensors import WeightDict
from lmcollect.weights.version import PushVersion


class vLLMUpdater(WeightUpdaterBase[int]):
    """Sends a trainer's weights to the vLLM workers of a collector's ``VLLMPolicy``.

    The trainer is rank 0 of a process group whose other ranks are the engine's workers (ranks
    ``1..tp`` per replica; gloo when the weights are on the CPU, NCCL when on CUDA). The engine
    needs ``worker_extension_cls=VLLM_EXTENSION`` (``lmcollect.engines.vllm.worker_ext``).
    The engine may be in this process (a local ``LLMCollector``), in a ``RayLLMCollector``'s
    actor, in engine actors (``VLLMReplicas``), or a vLLM server (``VLLMServerPolicy``, through its
    development endpoints, which also pause the server's generation for the call); the updater
    reaches it through the collector's weight loader (or a proxy of its actor's), learnt when the
    collector registers, and pushes through a
    :class:`~lmcollect.weight_sync.group_sender.ProcessGroupPushSender`.

    One push, in order:

    1. check the weights against what every worker accepts, and for NaN/Inf (one ValueError,
       nothing sent);
    2. the loader's load of ``GroupPush(...)`` starts without the trainer waiting for it: the
       engine's ``load_weights`` holds it (the collector's policy lock or the engine's pause, so
       no turn runs) while its workers receive;
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
        self._policy: Any = None  # set by from_policy: an engine reached without a collector (its loader)

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

    # ------------------------------------------------------------------ the mechanism (a ProcessGroupPushSender)
    sender_class: ClassVar[type[ProcessGroupPushSender]] = ProcessGroupPushSender
    """The mechanism's class (a subclass may change how it plans or sends)."""

    def _make_sender(self) -> ProcessGroupPushSender:
        return self.sender_class(self.config, target=self._target, model_metadata=lambda: self.model_metadata)

    @property
    def _group_sender(self) -> ProcessGroupPushSender:
        sender = self.push_sender
        assert isinstance(sender, ProcessGroupPushSender), "_make_sender builds it"
        return sender

    @property
    def _sender(self) -> ProcessGroupSender | None:
        """The process group's sender (None: no group formed)."""
        return None if self._push_sender is None else self._group_sender.group

    @property
    def last_push_info(self) -> list[dict[str, Any]]:
        """The workers' reports of the last push (ranks, checksums with ``verify``)."""
        return [] if self._push_sender is None else self._group_sender.last_push_info

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
        metadata = model_metadata if model_metadata is not None else self.model_metadata
        self._group_sender.connect(metadata, device)
        self.model_metadata = metadata

    def reset_delta_base(self) -> None:
        """Forget the last pushed weights (with ``delta``): the next push sends the full weights."""
        if self._sender is not None:
            self._sender.reset_delta_base()

    def close(self) -> None:
        """Leave the process group (the next push forms a new one)."""
        if self._push_sender is not None:
            self._group_sender.close()

    @property
    def uses_delta(self) -> bool:
        """Whether the next push may be a delta push (with ``delta="auto"``: what was chosen last)."""
        return self._group_sender.uses_delta

    def _sync_weights_with_worker(self, *, worker_id: int, server_weights: WeightDict, version: PushVersion) -> None:
        """One push of ``server_weights`` to the engine's workers as ``version`` (check, plan, send, wait)."""
        sender = self._group_sender
        sender.check(server_weights, [worker_id])
        sent = sender.send(server_weights, [worker_id], version, sender.plan(server_weights, [worker_id]))
        sender.wait(sent, [worker_id], version, wait=True, on_done=lambda: None)

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


VLLMUpdater = vLLMUpdater
