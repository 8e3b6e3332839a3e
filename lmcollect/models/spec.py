"""Model size presets and the ``ModelSpec`` that names one seeded, offline-built model."""

from __future__ import annotations

from dataclasses import dataclass

MIN_VOCAB_SIZE = 512  # 256 byte tokens + 3 special tokens + room for some merges
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class ArchPreset:
    """The architecture of one size preset (a Qwen2 decoder with tied embeddings)."""

    hidden_size: int
    """Width of the residual stream."""
    num_hidden_layers: int
    """Number of decoder blocks."""
    num_attention_heads: int
    """Query heads; ``hidden_size // num_attention_heads`` is the head dim (64 for every preset)."""
    num_key_value_heads: int
    """Key/value heads (grouped-query attention when fewer than the query heads)."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    vocab_size: int
    """Default vocabulary size (tokenizer target and embedding rows) for this preset."""
    max_position_embeddings: int = 4096
    """Longest sequence the rotary embedding is configured for."""


def _preset(*, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int) -> ArchPreset:
    """An :class:`ArchPreset` from short names, so that each preset below fits on one line."""
    return ArchPreset(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        vocab_size=vocab,
    )


PRESETS: dict[str, ArchPreset] = {
    # ~2.1M parameters: fast enough to call ``generate`` many times per test on 2 CPU cores.
    "tiny": _preset(hidden=256, layers=2, heads=4, kv_heads=2, mlp=1024, vocab=1024),
    # ~10.2M parameters.
    "small": _preset(hidden=384, layers=6, heads=6, kv_heads=2, mlp=1024, vocab=2048),
    # ~75M parameters.
    "medium": _preset(hidden=768, layers=12, heads=12, kv_heads=4, mlp=1920, vocab=2048),
}
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Names a model that is built offline and deterministically: same spec, same weights."""

    size: str = "tiny"
    """Preset name: one of ``PRESET_NAMES`` ("tiny", "small", "medium")."""
    seed: int = 0
    """Seed of the random weight init (the tokenizer does not depend on it)."""
    vocab_size: int | None = None
    """Tokenizer target size and embedding rows; None uses the preset's default."""

    def __post_init__(self) -> None:
        _check_size(self.size)
        _check_seed(self.seed)
        if self.vocab_size is not None:
            validate_vocab_size(self.vocab_size)

    @property
    def preset(self) -> ArchPreset:
        """The architecture preset named by ``size``."""
        return PRESETS[self.size]

    @property
    def resolved_vocab_size(self) -> int:
        """``vocab_size``, or the preset's default when it is None."""
        return self.vocab_size if self.vocab_size is not None else self.preset.vocab_size


def _check_size(size: object) -> None:
    if not isinstance(size, str):
        raise TypeError(f"ModelSpec size must be a str, got {type(size).__name__}; use one of {PRESET_NAMES}.")
    if size not in PRESETS:
        raise ValueError(f"ModelSpec size {size!r} is unknown; use one of {PRESET_NAMES}.")


def _check_seed(seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"ModelSpec seed must be an int, got {type(seed).__name__}; pass e.g. seed=0.")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"ModelSpec seed must be in [0, 2**63 - 1], got {seed}; pass a non-negative int.")


def validate_vocab_size(vocab_size: object) -> None:
    """Raise TypeError/ValueError unless ``vocab_size`` is an int >= ``MIN_VOCAB_SIZE``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(
            f"vocab_size must be an int or None, got {type(vocab_size).__name__}; pass e.g. vocab_size=1024."
        )
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}; pass a larger value.")
