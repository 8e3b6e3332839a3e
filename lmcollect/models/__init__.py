"""Offline, seeded test models: a BPE tokenizer trained on a packaged corpus and a Qwen2 causal LM."""

from lmcollect.models.cache import (
    CACHE_ENV_VAR,
    FORMAT_VERSION,
    default_cache_dir,
    get_model_path,
    load_model_and_tokenizer,
)
from lmcollect.models.factory import build_config, build_model, count_parameters
from lmcollect.models.spec import PRESET_NAMES, PRESETS, ArchPreset, ModelSpec
from lmcollect.models.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, build_tokenizer

__all__ = [
    "CACHE_ENV_VAR",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "FORMAT_VERSION",
    "PAD_TOKEN",
    "PRESETS",
    "PRESET_NAMES",
    "ArchPreset",
    "ModelSpec",
    "build_config",
    "build_model",
    "build_tokenizer",
    "count_parameters",
    "default_cache_dir",
    "get_model_path",
    "load_model_and_tokenizer",
]
