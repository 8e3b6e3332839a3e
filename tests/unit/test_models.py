"""Tests of lmcollect.models: offline tokenizer, seeded Qwen2 models, the on-disk cache."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lmcollect.models import (
    PRESET_NAMES,
    ModelSpec,
    build_model,
    build_tokenizer,
    count_parameters,
    default_cache_dir,
    get_model_path,
    load_model_and_tokenizer,
)
from lmcollect.models import cache as cache_mod
from lmcollect.models.corpus_gen import CORPUS_PATH, generate_corpus

logger = logging.getLogger(__name__)

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12 + 7?"},
    {"role": "assistant", "content": "12 + 7 = 19"},
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer(vocab_size=1024)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return get_model_path(ModelSpec(), cache_dir=tmp_path_factory.mktemp("cache"))


# --- tokenizer ---------------------------------------------------------------------------


def test_chat_template_renders_chatml(tokenizer: PreTrainedTokenizerFast) -> None:
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
        "<|im_start|>assistant\n12 + 7 = 19<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == expected
    with_prompt = tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert with_prompt == expected.split("<|im_start|>assistant")[0] + "<|im_start|>assistant\n"


def test_assistant_tokens_mask(tokenizer: PreTrainedTokenizerFast) -> None:
    out = tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    kept = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(kept) == "12 + 7 = 19<|im_end|>"


def test_special_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    ids = tokenizer("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tokenizer.eos_token_id
    assert len(tokenizer) == 1024


def test_digits_are_single_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "12 + 7 = 19, then 98765 - 4321 = 94444 and 2024."
    tokens = [tokenizer.convert_tokens_to_string([t]) for t in tokenizer.tokenize(text)]
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens and all(len(t) == 1 for t in digit_tokens), digit_tokens
    assert "".join(tokens) == text


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! Is 42 higher or lower? Correct guess.",
        "  leading spaces\n\nnew lines\ttabs   and trailing  ",
        "Café, naïve, 日本語, emoji 🙂 and symbols <>{}[]#@$%^&*",
        "<|im_start|>user\nWhat is 3 * 4?<|im_end|>\n<|im_start|>assistant\n",
    ],
)
def test_encode_decode_round_trip(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tokenizer_is_deterministic(tokenizer: PreTrainedTokenizerFast) -> None:
    again = build_tokenizer(vocab_size=1024, seed=3)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_tokenizer_rejects_bad_vocab_size() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(vocab_size=100)
    with pytest.raises(TypeError, match="vocab_size"):
        build_tokenizer(vocab_size="1024")  # type: ignore[arg-type]


def test_corpus_is_reproducible() -> None:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    assert generate_corpus() == text
    assert 30_000 <= len(text.encode()) <= 80_000
    for word in ("higher", "lower", "correct", "guess", " + ", " = "):
        assert word in text


# --- spec and model ----------------------------------------------------------------------


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="tiny.*small.*medium"):
        ModelSpec(size="huge")
    with pytest.raises(TypeError, match="seed"):
        ModelSpec(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        ModelSpec(seed=-1)
    with pytest.raises(ValueError, match="vocab_size"):
        ModelSpec(vocab_size=10)
    with pytest.raises(TypeError):
        ModelSpec("tiny")  # type: ignore[misc]  # keyword-only
    assert ModelSpec().resolved_vocab_size == 1024
    assert ModelSpec(size="small", vocab_size=4096).resolved_vocab_size == 4096


def test_model_config(tokenizer: PreTrainedTokenizerFast) -> None:
    model = build_model(ModelSpec(), tokenizer)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert cfg.eos_token_id == tokenizer.eos_token_id and cfg.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert cfg.vocab_size == len(tokenizer)
    assert model.dtype == torch.float32 and not model.training


def test_same_seed_same_weights(tokenizer: PreTrainedTokenizerFast) -> None:
    rng_before = torch.get_rng_state()
    a = build_model(ModelSpec(seed=0), tokenizer).state_dict()
    b = build_model(ModelSpec(seed=0), tokenizer).state_dict()
    c = build_model(ModelSpec(seed=1), tokenizer).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before), "build_model must not move the global RNG"
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_build_model_rejects_larger_tokenizer() -> None:
    big = build_tokenizer(vocab_size=2048)
    with pytest.raises(ValueError, match="vocab_size=1024"):
        build_model(ModelSpec(vocab_size=1024), big)


def test_preset_param_counts() -> None:
    counts = {size: count_parameters(ModelSpec(size=size)) for size in PRESET_NAMES}
    logger.info("preset parameter counts: %s", counts)
    assert 1_000_000 <= counts["tiny"] <= 5_000_000
    assert 8_000_000 <= counts["small"] <= 25_000_000
    assert 60_000_000 <= counts["medium"] <= 90_000_000


def test_tiny_count_matches_built_model(tokenizer: PreTrainedTokenizerFast) -> None:
    assert build_model(ModelSpec(), tokenizer).num_parameters() == count_parameters(ModelSpec())


# --- cache and loading -------------------------------------------------------------------


def test_cache_folder_is_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ModelSpec(seed=7)
    path = get_model_path(spec, cache_dir=tmp_path)
    assert path.parent == tmp_path and "tiny" in path.name and "seed7" in path.name
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "temp folder left behind"

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("cached model was rebuilt")

    monkeypatch.setattr(cache_mod, "_write_model", no_rebuild)
    assert get_model_path(spec, cache_dir=str(tmp_path)) == path


def test_publish_keeps_the_first_folder(tmp_path: Path) -> None:
    final = get_model_path(ModelSpec(), cache_dir=tmp_path)
    loser = tmp_path / ".race.tmp"
    loser.mkdir()
    (loser / "config.json").write_text("{}")
    cache_mod._publish(loser, final)  # another process finished first: keep theirs, drop ours
    assert not loser.exists() and (final / "model.safetensors").is_file()


def test_incomplete_folder_is_reported(tmp_path: Path) -> None:
    (tmp_path / cache_mod.model_dir_name(ModelSpec())).mkdir()
    with pytest.raises(FileExistsError, match="delete it"):
        get_model_path(ModelSpec(), cache_dir=tmp_path)


def test_default_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMCOLLECT_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("LMCOLLECT_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "lmcollect" / "models"


def test_load_saved_folder_and_generate(model_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    model, tok = load_model_and_tokenizer(model_dir)
    assert not model.training and model.dtype == torch.float32
    text = "<|im_start|>user\nIs 50 higher than 49? Guess: 1234<|im_end|>\n"
    assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    built = build_model(ModelSpec(), tokenizer).state_dict()
    loaded = model.state_dict()
    assert all(torch.equal(built[k], loaded[k]) for k in built)

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=False
    )
    inputs = tok(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 5) or tok.eos_token_id in out[0].tolist()
    assert isinstance(tok.decode(out[0, inputs["input_ids"].shape[1] :]), str)


def test_load_from_spec_and_dtype(model_dir: Path) -> None:
    model, tok = load_model_and_tokenizer(ModelSpec(), cache_dir=model_dir.parent, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and tok.eos_token == "<|im_end|>"
    auto_tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert auto_tok.pad_token_id == tok.pad_token_id


def test_missing_folder_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model") as info:
        load_model_and_tokenizer(missing)
    assert "get_model_path" in str(info.value)
    with pytest.raises(TypeError, match="path_or_spec"):
        load_model_and_tokenizer(42)  # type: ignore[arg-type]
