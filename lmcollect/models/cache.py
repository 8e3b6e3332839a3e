"""Save built models to an on-disk cache (atomically) and load any local Hugging Face model folder."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lmcollect.models.factory import build_model
from lmcollect.models.spec import ModelSpec
from lmcollect.models.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "LMCOLLECT_CACHE"
FORMAT_VERSION = 1  # bump when the corpus, tokenizer or architecture changes: old folders are then ignored
SPEC_FILE = "lmcollect_spec.json"  # written last; marks a complete folder


def default_cache_dir() -> Path:
    """``$LMCOLLECT_CACHE/models`` if that variable is set, else ``~/.cache/lmcollect/models``."""
    root = os.environ.get(CACHE_ENV_VAR)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "lmcollect"
    return base / "models"


def model_dir_name(spec: ModelSpec) -> str:
    """The cache subfolder of ``spec``, e.g. ``tiny-seed0-vocab1024-fmt1``."""
    return f"{spec.size}-seed{spec.seed}-vocab{spec.resolved_vocab_size}-fmt{FORMAT_VERSION}"


def _resolve_cache_dir(cache_dir: str | Path | None) -> Path:
    if cache_dir is None:
        return default_cache_dir()
    if not isinstance(cache_dir, (str, Path)):
        raise TypeError(f"cache_dir must be a str, Path or None, got {type(cache_dir).__name__}; pass a folder path.")
    return Path(cache_dir).expanduser()


def _write_model(spec: ModelSpec, folder: Path) -> None:
    """Build tokenizer + model for ``spec`` and ``save_pretrained`` both into ``folder``."""
    tokenizer = build_tokenizer(vocab_size=spec.resolved_vocab_size, seed=spec.seed)
    model = build_model(spec, tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    record = {
        "size": spec.size,
        "seed": spec.seed,
        "vocab_size": spec.resolved_vocab_size,
        "format_version": FORMAT_VERSION,
    }
    (folder / SPEC_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; if another process got there first, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / SPEC_FILE).is_file():
            raise
        logger.info("another process cached %s first; using it", final)
        shutil.rmtree(tmp, ignore_errors=True)


def get_model_path(spec: ModelSpec | None = None, *, cache_dir: str | Path | None = None) -> Path:
    """The cached folder of ``spec`` (default ``ModelSpec()``), building it on first use.

    The folder holds ``config.json``, the safetensors weights and the tokenizer files, so
    ``from_pretrained`` (Transformers or vLLM) loads it. It is written to a temporary sibling and
    renamed into place, so concurrent callers (e.g. Ray actors) never see a partial folder.
    """
    spec = ModelSpec() if spec is None else spec
    if not isinstance(spec, ModelSpec):
        raise TypeError(
            f"spec must be a ModelSpec or None, got {type(spec).__name__}; pass e.g. ModelSpec(size='tiny')."
        )
    root = _resolve_cache_dir(cache_dir)
    final = root / model_dir_name(spec)
    existed = final.exists()  # checked first: a folder renamed in meanwhile is already complete
    if (final / SPEC_FILE).is_file():
        return final
    if existed:
        raise FileExistsError(f"{final} exists but is not a complete lmcollect model folder; delete it and retry.")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        _write_model(spec, tmp)
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("cached %s model at %s", spec.size, final)
    return final


def _resolve_model_dir(path_or_spec: str | Path | ModelSpec, cache_dir: str | Path | None) -> Path:
    if isinstance(path_or_spec, ModelSpec):
        return get_model_path(path_or_spec, cache_dir=cache_dir)
    if not isinstance(path_or_spec, (str, Path)):
        raise TypeError(
            f"path_or_spec must be a str, Path or ModelSpec, got {type(path_or_spec).__name__}; "
            "pass a local model folder or e.g. ModelSpec(size='tiny')."
        )
    path = Path(path_or_spec).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no Hugging Face model folder (with config.json) at {path}; make one with "
            "lmcollect.models.get_model_path(ModelSpec(...)) or pass a ModelSpec instead of a path."
        )
    return path


def load_model_and_tokenizer(
    path_or_spec: str | Path | ModelSpec,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM (eval mode, ``dtype``) and its tokenizer, never touching the network.

    ``path_or_spec`` is any local Hugging Face model folder, or a ``ModelSpec`` (built and cached
    under ``cache_dir`` by :func:`get_model_path` first).
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}; pass e.g. torch.float32.")
    path = _resolve_model_dir(path_or_spec, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


__all__ = [
    "CACHE_ENV_VAR",
    "FORMAT_VERSION",
    "default_cache_dir",
    "get_model_path",
    "load_model_and_tokenizer",
    "model_dir_name",
]
