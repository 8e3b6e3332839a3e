"""Build seeded, randomly initialised Qwen2 causal LMs from a ``ModelSpec`` (in memory, offline)."""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from lmcollect.models.spec import ModelSpec

logger = logging.getLogger(__name__)


def build_config(spec: ModelSpec, *, eos_token_id: int | None = None, pad_token_id: int | None = None) -> Qwen2Config:
    """The ``Qwen2Config`` of ``spec``: tied embeddings, fp32, ``spec.resolved_vocab_size`` rows."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}; pass e.g. ModelSpec(size='tiny').")
    arch = spec.preset
    return Qwen2Config(
        vocab_size=spec.resolved_vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=arch.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        use_cache=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def count_parameters(spec: ModelSpec) -> int:
    """Number of distinct parameters of ``spec``'s model (tied weights once), built on the meta device."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(build_config(spec))
    return sum(p.numel() for p in model.parameters())


def _special_ids(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> tuple[int, int]:
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos is None or pad is None:
        raise ValueError(
            f"tokenizer needs eos and pad tokens (got eos_token_id={eos}, pad_token_id={pad}); "
            "use lmcollect.models.build_tokenizer."
        )
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the spec's vocab_size is {vocab_size}; "
            f"build the tokenizer with build_tokenizer(vocab_size={vocab_size})."
        )
    return eos, pad


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A ``Qwen2ForCausalLM`` with weights drawn from ``spec.seed`` (fp32, eval mode, CPU).

    The global torch RNG state is left as it was: the init runs inside ``torch.random.fork_rng``.
    """
    eos, pad = _special_ids(tokenizer, spec.resolved_vocab_size)
    config = build_config(spec, eos_token_id=eos, pad_token_id=pad)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model = model.to(torch.float32).eval()
    _set_generation_defaults(model, eos=eos, pad=pad)
    logger.info("built %s model (seed %d): %d parameters", spec.size, spec.seed, model.num_parameters())
    return model


def _set_generation_defaults(model: PreTrainedModel, *, eos: int, pad: int) -> None:
    gen = model.generation_config
    gen.eos_token_id = eos
    gen.pad_token_id = pad
    gen.bos_token_id = None


__all__ = ["build_config", "build_model", "count_parameters"]
