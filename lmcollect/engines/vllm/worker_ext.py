"""The vLLM worker side of the process-group weight sync: join a ProcessGroupSender's group, reload pushes.

Give the engine ``worker_extension_cls=VLLM_EXTENSION`` (a ``vllm.EngineArgs`` argument, e.g. through
``VLLMEngine(engine_kwargs=...)``, where it is the default; for a server ``vllm serve --worker-extension-cls``, whose
``/collective_rpc`` development endpoint passes JSON arguments and results); vLLM then mixes
:class:`VLLMWeightReceiverExtension` into every worker, and its methods become ``collective_rpc``
targets. The trainer side is the plain
:class:`~lmcollect.transports.process_group.ProcessGroupSender` (rank 0); each worker
is a :class:`~lmcollect.transports.process_group.ProcessGroupReceiver` (rank >= 1).

Steps, in order (the engine calls the workers; a trainer calls engine verbs):

1. once: ``join_weight_group(engine, sender.connection_info(), ranks_per_replica=tp)`` (the
   engine calls ``init_weight_group`` on every worker) while the trainer calls
   ``sender.connect()`` (both block until the group is formed, so one of them runs in a thread
   or a Ray task); each worker posts what its model accepts (checkpoint names, shapes, the
   engine's dtype, tied aliases) for the sender to check;
2. per push: ``engine.load_weights(GroupPush(...), version=v)`` (the engine calls
   ``receive_weights`` on every worker between two decoding steps) while the trainer calls
   ``sender.send(model)``: the layout goes through the store, then a few flat per-dtype buffers
   by broadcast;
3. each worker hands the tensors, under their Hugging Face names, to vLLM's
   ``reload_weights(..., is_checkpoint_format=True)``, which fuses (q/k/v -> qkv_proj) and
   repacks them, then rebuilds tied modules (see :func:`refresh_tied_modules`);
4. still inside the load, the engine resets its prefix cache (it lives in the scheduler, out of
   the workers' reach) and takes the version; then generation goes on.

Example (trainer process, ``engine`` a ``VLLMEngine`` or ``VLLMReplicas`` with one replica; a
``vLLMUpdater`` does all of this)::

    sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=1))
    pool = ThreadPoolExecutor(1)  # the workers' side returns only once the trainer's side is done
    joined = pool.submit(join_weight_group, engine, sender.connection_info(), ranks_per_replica=1)
    sender.connect()
    joined.result()
    for step in itertools.count(1):
        ...  # train
        done = pool.submit(engine.load_weights, GroupPush(), version=step)
        sender.send(model)
        done.result()

The engine always reloads the whole model: vLLM's layerwise reload processes a fused layer only
once all of its checkpoint tensors arrived. A delta push (``ProcessGroupConfig(delta=...)``)
carries only the changed elements: the worker's receiver patches its copy of the last push (its
receive buffers, in checkpoint format), verifies the per-tensor checksums, and the reload reads
the patched copy; a refused delta is followed by the full weights before the reload.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from lmcollect.engines.vllm.direct_load import DirectLoad, direct_load_for
from lmcollect.engines.vllm.shm_payload import MappedBufferFiles
from lmcollect.transports.process_group import ProcessGroupReceiver
from lmcollect.weights.buckets import WeightBuckets, layout_from_json, packed_weights
from lmcollect.weights.delta import DeltaRejectedError, WeightDelta, prepare_delta
from lmcollect.weights.lora import LoraAdapter, check_merge
from lmcollect.weights.tensors import raise_if_problems, weight_problems

logger = logging.getLogger(__name__)

VLLM_EXTENSION = "lmcollect.engines.vllm.worker_ext.VLLMWeightReceiverExtension"
LOAD_LORA_ADAPTER = "load_lora_adapter"
HELD_BASE_WEIGHTS = "held_base_weights"
LOAD_SHARED_WEIGHTS = "load_shared_weights"
STAGE_WEIGHT_DELTA = "stage_weight_delta"
COMMIT_STAGED_WEIGHTS = "commit_staged_weights"
DROP_STAGED_WEIGHTS = "drop_staged_weights"

# What vLLM's in-place reload logs for every layer a partial reload leaves as it was: expected
# for a LoRA reload, which sends only the adapted blocks' tensors.
_PARTIAL_RELOAD_NOTES = ("Failed to load weights", "Following weights were not loaded")

# safetensors header dtype names -> torch dtypes
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def checkpoint_metadata(
    model_dir: str | Path, *, dtype: torch.dtype | None = None, tie_word_embeddings: bool = False
) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
    """What a checkpoint folder's model accepts: name -> (dtype, shape) from its safetensors headers,
    and its tied aliases. ``dtype`` replaces floating dtypes (the engine may run in another one)."""
    from safetensors import safe_open  # a dependency of transformers; only the headers are read

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}; the vLLM weight receiver needs a local folder.")
    metadata: dict[str, tuple[torch.dtype, torch.Size]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                tensor = handle.get_slice(name)
                stored = _SAFETENSORS_DTYPES[tensor.get_dtype()]
                wanted = dtype if dtype is not None and stored.is_floating_point else stored
                metadata[name] = (wanted, torch.Size(tensor.get_shape()))
    # Tied checkpoints omit the output embedding; a trainer's state_dict still names it.
    tied = tie_word_embeddings and "lm_head.weight" not in metadata and "model.embed_tokens.weight" in metadata
    return metadata, ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})


class RayNode(NamedTuple):
    """A Ray node as Ray reports it."""

    node_id: str
    ip: str


def current_ray_node() -> RayNode | None:
    """This process's Ray node, or None when Ray is not running in this process."""
    ray = sys.modules.get("ray")  # a process that never imported Ray is not part of a cluster: no import
    if ray is None or not ray.is_initialized():
        return None
    return RayNode(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def refresh_tied_modules(model: torch.nn.Module) -> list[str]:
    """Re-run weight processing of modules whose parameter is tied to an earlier module's.

    vLLM's layerwise reload (0.32) processes only the layers that received weights. A tied
    ``lm_head`` receives none (the loader skips its name), so on CPU its prepacked GEMM weight
    keeps the old values although the shared tensor changed; reprocessing rebuilds it. Returns
    the names of the modules refreshed.
    """
    first_owner: dict[int, str] = {}
    refreshed: list[str] = []
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            quant_method = getattr(module, "quant_method", None)
            if id(param) in first_owner and quant_method is not None:
                quant_method.process_weights_after_loading(module)
                refreshed.append(name)
            first_owner.setdefault(id(param), name)
    return refreshed


@dataclass
class EngineWeights:
    """The receiver's context: what the engine's model accepts (``ProcessGroupReceiver`` asks it)."""

    metadata: dict[str, tuple[torch.dtype, torch.Size]]
    """Checkpoint name -> (dtype, shape)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied names the trainer may send: alias -> the name it shares storage with."""

    def weight_metadata(self, model_id: str) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        return self.metadata, self.aliases


class VLLMWeightReceiverExtension:
    """Mixed into every vLLM worker by ``worker_extension_cls``; its methods are ``collective_rpc`` targets.

    vLLM adds this class to the worker's bases (its ``__init__`` never runs), so state is created
    by :meth:`init_weight_group`; attribute names must not clash with the worker's own.
    """

    _lmcollect_receiver: ProcessGroupReceiver | None = None
    _lmcollect_context: EngineWeights | None = None  # held here: the receiver keeps only a weakref
    _lmcollect_num_pushes: int = 0
    _lmcollect_base: dict[str, torch.Tensor] | None = None  # the last full push (checkpoint names), LoRA's base
    _lmcollect_adapted: frozenset[str] = frozenset()  # blocks the last LoRA adapter touched
    _lmcollect_staged: dict[str, torch.Tensor] | None = None  # a checked delta's result, not yet reloaded
    _lmcollect_mapped: MappedBufferFiles | None = None  # the engine's shared pack files, each mapped once
    _lmcollect_direct: DirectLoad | bool | None = None  # full pushes' loader (False: vLLM's reload; None: not made)

    def init_weight_group(self, connection_info: dict[str, Any], first_rank: int = 1) -> None:
        """Join the sender's group as rank ``first_rank + worker rank`` (blocks until the group forms).

        A worker that was in an earlier group (an earlier updater) leaves it first.
        """
        self.close_weight_group()
        metadata, aliases = self._lmcollect_weight_metadata()
        self._lmcollect_context = EngineWeights(metadata, aliases)
        receiver = ProcessGroupReceiver()
        receiver.init_on_receiver(model_id="policy", context=self._lmcollect_context)
        rank = first_rank + self.rank  # type: ignore[attr-defined]
        receiver.set_connection_info(connection_info, worker_idx=rank - 1)
        receiver.connect()
        self._lmcollect_receiver = receiver
        logger.info("vLLM worker joined the weight group as rank %d of %d", rank, connection_info["world_size"])

    def receive_weights(self, timeout_s: float | None = None, verify: bool = False) -> dict[str, Any]:
        """Take one push and reload it into the model; returns what was loaded and how long it took.

        With ``verify``, the result also holds ``"checksums"``: the CRC32 of every buffer of the
        weights now held (after a delta: the patched copy), for the trainer to compare with its own.
        ``"push"`` says whether a delta or full push arrived, and why a delta was refused.
        """
        if self._lmcollect_receiver is None:
            raise RuntimeError("receive_weights before init_weight_group; call collective_rpc('init_weight_group').")
        start = time.perf_counter()
        weights = self._lmcollect_receiver.receive(timeout_s=timeout_s)
        if weights is None:
            raise TimeoutError(f"no weight push arrived within timeout_s={timeout_s} (None: the group's timeout).")
        received = time.perf_counter()
        self._lmcollect_reload(weights)
        self._lmcollect_base = weights  # the receiver's copy of this push: the base LoRA adapters merge into
        self._lmcollect_adapted = frozenset()
        info: dict[str, Any] = {
            "rank": self._lmcollect_receiver.rank,
            "num_pushes": self._lmcollect_num_pushes,
            "num_tensors": len(weights),
            "receive_s": received - start,
            "reload_s": time.perf_counter() - received,
            "push": dict(self._lmcollect_receiver.last_receive_info),
        }
        if verify:
            info["checksums"] = self._lmcollect_receiver.last_checksums()
        return info

    def load_packed_weights(self, layout_json: str, buffers: list[bytes]) -> dict[str, Any]:
        """Check and reload weights sent in the call itself: a bucket layout and its byte buffers.

        The path of :meth:`lmcollect.engines.vllm.engine.VLLMEngine.load_weights` (engine and caller
        on one host, no process group): every name, shape and dtype is checked against the
        checkpoint before anything is written, so a refused load changes nothing.
        """
        return self._lmcollect_load_buckets(_received_buckets(layout_json, buffers))

    def load_shared_weights(self, layout_json: str, shared: dict[str, Any]) -> dict[str, Any]:
        """:meth:`load_packed_weights` with the buffers in one of the engine's shared-memory pack
        files (see :mod:`lmcollect.engines.vllm.shm_payload`): what the engine sends when this worker
        runs in another process, so the bytes are not copied through the RPC. Each file is mapped
        once and kept: a push maps nothing new."""
        if self._lmcollect_mapped is None:  # vLLM never runs this class's __init__: made on first use
            self._lmcollect_mapped = MappedBufferFiles()
        buffers = self._lmcollect_mapped.views(shared)
        return self._lmcollect_load_buckets(WeightBuckets(layout_from_json(layout_json), buffers))

    def _lmcollect_load_buckets(self, buckets: WeightBuckets) -> dict[str, Any]:
        metadata, aliases = self._lmcollect_weight_metadata()
        problems = weight_problems(buckets.layout.metadata(), metadata, aliases=aliases)
        raise_if_problems(problems, where=" by the vLLM worker")
        start = time.perf_counter()
        weights = buckets.tensors()
        self._lmcollect_reload(weights)
        self._lmcollect_base = weights  # views of this push's buffers, kept as the base LoRA adapters merge into
        self._lmcollect_adapted = frozenset()
        return {
            "num_pushes": self._lmcollect_num_pushes,
            "num_tensors": len(buckets.layout.slots),
            "reload_s": time.perf_counter() - start,
        }

    def load_lora_adapter(
        self, layout_json: str, buffers: list[bytes], scalings: dict[str, float], rank: int
    ) -> dict[str, Any]:
        """Merge a LoRA adapter into the base weights and reload only the adapted blocks.

        The base is the last full push this worker reloaded (the checkpoint on disk before any):
        every tensor of each block an adapter touches now or touched before (``...self_attn.``,
        ``...mlp.``) is reloaded, adapted layers as ``base + scaling * B @ A``, the others as
        their base, so fused layers (q/k/v -> qkv_proj) get all their parts and an earlier
        adapter's layers go back to the base. Checked by the engine before it calls this.
        """
        buckets = _received_buckets(layout_json, buffers)
        adapter = LoraAdapter.from_flat(buckets.tensors(), scalings, rank)
        start = time.perf_counter()
        blocks = {_block_of(name) for name in adapter.layers} | self._lmcollect_adapted
        base = self._lmcollect_base_weights(blocks)
        check_merge(adapter, base, receiver="the vLLM worker's model")  # before the reload: nothing changes
        weights = {**base, **adapter.merged_into(base)}
        self._lmcollect_reload(weights, partial=True)
        self._lmcollect_adapted = frozenset(_block_of(name) for name in adapter.layers)
        return {
            "num_pushes": self._lmcollect_num_pushes,
            "num_tensors": len(weights),
            "reload_s": time.perf_counter() - start,
        }

    def held_base_weights(self, reply_rank: int = 0, packed: bool = False) -> dict[str, Any]:
        """The base this worker's LoRA adapters merge into (its last full push, or the checkpoint
        read from disk before any), as CPU copies under checkpoint names: what a collector's
        checkpoint saves to restore the worker's weights exactly (with the adapter merged now).

        Every tensor-parallel worker holds it whole: only rank ``reply_rank`` sends it, the others
        ``{}``. ``packed``: as ``{"layout": JSON, "buffers": [bytes]}`` (see :func:`held_base_of`),
        for a caller in another process (vLLM's RPC results carry bytes, not tensors)."""
        if self.rank != reply_rank:  # type: ignore[attr-defined]
            return {}
        base = {name: t.detach().to("cpu", copy=not packed) for name, t in self._lmcollect_base_weights(None).items()}
        if not packed:
            return base
        layout_json, buffers = packed_weights(base)
        return {"layout": layout_json, "buffers": [buffer.tobytes() for buffer in buffers]}

    def stage_weight_delta(self, header: dict[str, Any], layout_json: str, buffers: list[bytes]) -> dict[str, Any]:
        """Apply a delta push to a copy of the tensors it changes, taken from the weights this worker
        holds (its last full push), and keep the result for :meth:`commit_staged_weights`; the model
        is not touched. Returns ``{"refused": reason}`` when the delta does not fit (no full push
        held, a LoRA adapter merged since, unknown names, wrong sizes or dtypes, a checksum that
        fails), else the number of tensors changed.

        The engine stages on every worker, then commits on all of them, or drops on all when any
        refused: the workers never hold different weights.
        """
        self._lmcollect_staged = None
        base = getattr(self, "_lmcollect_base", None)
        if base is None:
            return {"refused": "this worker holds no pushed weights yet (the checkpoint's): push in full first"}
        if self._lmcollect_adapted:
            return {"refused": "a LoRA adapter is merged into the weights this worker holds: push in full"}
        delta = WeightDelta.from_header(header, _received_buckets(layout_json, buffers))
        _, aliases = self._lmcollect_weight_metadata()
        changed = {aliases.get(e.name, e.name) for e in delta.entries}
        copies = {name: base[name].clone() for name in changed if name in base}
        try:  # the engine checked the base version; names, sizes, dtypes and checksums are checked here
            prepare_delta(delta, copies, held_version=delta.base_version, aliases=aliases).apply_()
        except DeltaRejectedError as exc:
            return {"refused": str(exc)}
        self._lmcollect_staged = {**base, **copies}
        return {"num_changed": len(copies)}

    def commit_staged_weights(self) -> dict[str, Any]:
        """Reload the weights :meth:`stage_weight_delta` prepared; they become the held weights."""
        staged = self._lmcollect_staged
        if staged is None:
            raise RuntimeError("commit_staged_weights without a staged delta; call stage_weight_delta first.")
        start = time.perf_counter()
        self._lmcollect_reload(staged)
        self._lmcollect_base, self._lmcollect_staged = staged, None
        return {"num_pushes": self._lmcollect_num_pushes, "reload_s": time.perf_counter() - start}

    def drop_staged_weights(self) -> None:
        self._lmcollect_staged = None

    def _lmcollect_base_weights(self, blocks: set[str] | None) -> dict[str, torch.Tensor]:
        """Every base tensor (checkpoint names) inside ``blocks`` (None: all), from the last full
        push, or from the checkpoint files in the engine's dtype before any."""
        kept = getattr(self, "_lmcollect_base", None)
        if kept is not None:
            return {name: t for name, t in kept.items() if blocks is None or _block_of(name) in blocks}
        from safetensors import safe_open

        model_config = self.model_config  # type: ignore[attr-defined]
        found: dict[str, torch.Tensor] = {}
        for file in sorted(Path(model_config.model).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    if blocks is None or _block_of(name) in blocks:
                        tensor = handle.get_tensor(name)
                        found[name] = tensor.to(model_config.dtype) if tensor.is_floating_point() else tensor
        return found

    def _lmcollect_weight_metadata(self) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """What this worker's model accepts (checkpoint names, the engine's dtype, tied aliases)."""
        model_config = self.model_config  # type: ignore[attr-defined]
        return checkpoint_metadata(
            model_config.model,
            dtype=model_config.dtype,
            tie_word_embeddings=bool(getattr(model_config.hf_config, "tie_word_embeddings", False)),
        )

    def _lmcollect_reload(self, weights: dict[str, torch.Tensor], *, partial: bool = False) -> None:
        """Load checked weights (Hugging Face names) into the model, then rebuild tied modules.

        A full push of an unquantized model goes straight into the parameters (:mod:`~lmcollect.engines.vllm.direct_load`:
        one copy, then the CPU GEMMs packed again); anything else through vLLM's in-place reload.
        ``partial``: only some blocks are sent (a LoRA reload); vLLM keeps the others as they are
        and its notes about each of them are dropped.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        direct = None if partial else self._lmcollect_direct_load(model)
        if direct is not None:
            direct.load(weights)
        else:
            with _quiet_partial_reload() if partial else contextlib.nullcontext():
                self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        refresh_tied_modules(model)
        self._lmcollect_num_pushes += 1

    def _lmcollect_direct_load(self, model: torch.nn.Module) -> DirectLoad | None:
        """The model's :class:`DirectLoad`, made on the first full push (None: vLLM's reload it is)."""
        if self._lmcollect_direct is None:
            from vllm.platforms import current_platform

            platform = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else "other"
            quantization = self.model_config.quantization  # type: ignore[attr-defined]
            self._lmcollect_direct = direct_load_for(model, quantization=quantization, platform=platform) or False
        return self._lmcollect_direct if isinstance(self._lmcollect_direct, DirectLoad) else None

    def ray_node_id(self) -> str | None:
        """The Ray node this worker runs on (None: no Ray in its process, e.g. an engine subprocess;
        it is then on the node of the process that built the engine)."""
        node = current_ray_node()
        return None if node is None else node.node_id

    def close_weight_group(self) -> None:
        if self._lmcollect_receiver is not None:
            self._lmcollect_receiver.close()
        self._lmcollect_receiver = None


def held_base_of(reports: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The base weights in the workers' :meth:`~VLLMWeightReceiverExtension.held_base_weights`
    reports (the one worker that sent them; packed ones unpacked, as views of their bytes)."""
    report = next((report for report in reports if report), {})
    if "layout" in report and "buffers" in report and isinstance(report["layout"], str):
        return _received_buckets(report["layout"], report["buffers"]).tensors()
    return report


def _received_buckets(layout_json: str, buffers: list[bytes]) -> WeightBuckets:
    """The buckets sent in a call: a layout (JSON) and its byte buffers, viewed without a copy."""
    return WeightBuckets(layout_from_json(layout_json), [np.frombuffer(b, dtype=np.uint8) for b in buffers])


def _block_of(name: str) -> str:
    """The block a checkpoint tensor belongs to: ``model.layers.0.self_attn.q_proj.weight`` ->
    ``model.layers.0.self_attn`` (fused layers never cross it)."""
    return name.rsplit(".", 2)[0]


class _DropNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(note in str(record.msg) for note in _PARTIAL_RELOAD_NOTES)


@contextlib.contextmanager
def _quiet_partial_reload() -> Iterator[None]:
    """vLLM's reload loggers without the per-layer notes a partial reload makes (see _PARTIAL_RELOAD_NOTES)."""
    loggers = [
        logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}") for name in ("inplace", "layerwise")
    ]
    note_filter = _DropNotes()
    for each in loggers:
        each.addFilter(note_filter)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(note_filter)
