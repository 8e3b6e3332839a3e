"""A byte-level BPE tokenizer with ChatML special tokens, trained offline on the packaged corpus."""

from __future__ import annotations

import logging
from functools import lru_cache

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from lmcollect.models.corpus_gen import CORPUS_PATH
from lmcollect.models.spec import MIN_VOCAB_SIZE, validate_vocab_size

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
MODEL_MAX_LENGTH = 4096
# Qwen2's pre-tokenizer split: contractions, letter runs, single digits (``\p{N}``), punctuation
# runs, newlines, then other whitespace.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, as Qwen renders it: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, then
# ``<|im_start|>assistant\n`` when add_generation_prompt is set. The ``generation`` block marks
# assistant content + ``<|im_end|>`` for ``return_assistant_tokens_mask=True``; it renders nothing.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@lru_cache(maxsize=1)
def load_corpus() -> tuple[str, ...]:
    """The lines of the packaged ``corpus.txt`` the tokenizer is trained on."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    return tuple(text.splitlines())


def _empty_bpe() -> Tokenizer:
    """An untrained byte-level BPE with Qwen2's pipeline (NFC, Qwen2 split regex, byte-level).

    It must equal what ``transformers.Qwen2Tokenizer`` rebuilds around the saved vocab and merges
    (``AutoTokenizer`` picks that class for any ``qwen2`` model folder), so a saved and reloaded
    tokenizer encodes exactly as the in-memory one. The regex puts every digit in its own piece.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe(*, vocab_size: int) -> Tokenizer:
    """Train the raw ``tokenizers`` BPE on the corpus (deterministic: no randomness is involved).

    The corpus supports about 2800 tokens; a larger ``vocab_size`` gives a smaller tokenizer
    (the model still gets ``vocab_size`` embedding rows).
    """
    validate_vocab_size(vocab_size)
    tok = _empty_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(load_corpus(), trainer=trainer)
    if tok.get_vocab_size() < vocab_size:
        logger.info(
            "corpus supports only %d tokens (asked for %d); the rest of the embedding stays unused",
            tok.get_vocab_size(),
            vocab_size,
        )
    return tok


def build_tokenizer(*, vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train and wrap the tokenizer: pad ``<|endoftext|>``, eos ``<|im_end|>``, ChatML template.

    ``seed`` is accepted for symmetry with the model; BPE training on the fixed corpus is
    deterministic, so every seed gives the same vocabulary (models of different seeds share it).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}; pass e.g. seed=0.")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size=vocab_size),
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=PAD_TOKEN,  # what Qwen2Tokenizer sets on reload; byte-level BPE never emits it
        extra_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    _check_special_ids(tokenizer)
    return tokenizer


def _check_special_ids(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != list(range(len(SPECIAL_TOKENS))) or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise RuntimeError(f"special tokens {SPECIAL_TOKENS} got ids {ids}; expected 0, 1, 2 (a bug).")


__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "IM_END",
    "IM_START",
    "MIN_VOCAB_SIZE",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "build_tokenizer",
    "load_corpus",
    "train_bpe",
]
