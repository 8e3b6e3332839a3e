"""Rollout rows (one per turn, as `lmcollect collect` writes them) grouped into dialogs for the report.

Pure Python: no torch, no tokenizer import. A tokenizer, when given, only has to decode token ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lmcollect.diagnostics.rollout_files import read_rollout_rows

REQUIRED_COLUMNS = ("traj_id", "step", "response", "tokens_response", "log_probs", "reward")
"""Columns a rollouts file needs; ``prompt``, ``tokens_prompt``, ``done``, ``policy_version``,
``group_id``, ``prompt_id`` and ``token_versions`` (one version per response token) are optional."""

PolicyVersion = int | str  # int versions, or str for uuid versions (docs/collectors.md, "The data")


class TokenDecoder(Protocol):
    """What the report needs of a tokenizer (a Hugging Face tokenizer fits): the text of token ids."""

    def decode(
        self, token_ids: list[int], skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...
    ) -> str: ...


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One turn of a dialog, with the text it added to the dialog and its per-token data."""

    step: int
    """Index of the turn in its trajectory."""
    prompt_text: str
    """The prompt text this turn added: all of it for the dialog's first turn, else what follows the
    previous turn's prompt and response (the env's reply and the generation prompt)."""
    prompt_is_continuation: bool
    """Whether ``prompt_text`` is only the part after the previous turn (False: the whole prompt)."""
    response: str
    """The response text."""
    tokens: list[int]
    """Response token ids."""
    token_texts: list[str] | None
    """Text of each response token (None without a tokenizer)."""
    log_probs: list[float]
    """Log-prob of each response token under the generating weights."""
    token_versions: list[PolicyVersion] | None
    """Policy version of each response token, when the file has a ``token_versions`` column."""
    reward: float
    """Reward of this turn."""
    done: bool
    """Whether the dialog ended with this turn."""
    policy_version: PolicyVersion
    """Version of the weights that generated the turn (-1: untracked)."""
    num_prompt_tokens: int
    """Tokens in the prompt as the model saw it (the whole dialog so far)."""


@dataclass(frozen=True, kw_only=True)
class Dialog:
    """The turns of one trajectory, ordered by step."""

    traj_id: int
    """Unique trajectory id."""
    group_id: int | None
    """GRPO group key (-1: the env draws no groups; None: not in the file)."""
    prompt_id: int | None
    """The env's draw counter, when in the file."""
    turns: list[Turn]
    """The turns in step order."""

    @property
    def reward(self) -> float:
        """Sum of the turns' rewards (the return of the dialog)."""
        return sum(turn.reward for turn in self.turns)

    @property
    def policy_versions(self) -> list[PolicyVersion]:
        """Distinct versions of the turns, in the order they first appear."""
        return list(dict.fromkeys(turn.policy_version for turn in self.turns))

    @property
    def done(self) -> bool:
        return self.turns[-1].done

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the first prompt."""
        return self.turns[0].num_prompt_tokens

    @property
    def num_response_tokens(self) -> int:
        """Tokens generated over all turns."""
        return sum(len(turn.tokens) for turn in self.turns)


def read_rollout_records(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``.parquet`` or ``.jsonl`` rollouts file, checked for :data:`REQUIRED_COLUMNS`."""
    path = Path(path)
    if path.suffix not in (".parquet", ".jsonl"):
        raise ValueError(f"{path}: a rollouts file is .parquet or .jsonl (as `lmcollect collect --output` writes).")
    if not path.is_file():
        raise ValueError(f"{path}: no such file.")
    rows = read_rollout_rows(path)
    check_columns(rows, source=str(path))
    return rows


def check_columns(records: Sequence[Mapping[str, Any]], *, source: str) -> None:
    if not records:
        raise ValueError(f"{source}: no rows.")
    missing = [c for c in REQUIRED_COLUMNS if c not in records[0]]
    if missing:
        raise ValueError(f"{source}: missing columns {missing}; use a file written by `lmcollect collect`.")


def group_dialogs(records: Iterable[Mapping[str, Any]], *, tokenizer: TokenDecoder | None = None) -> list[Dialog]:
    """Turns grouped by ``traj_id`` and ordered by ``step``; dialogs in the order they first appear."""
    by_traj: dict[int, list[Mapping[str, Any]]] = {}
    for record in records:
        by_traj.setdefault(int(record["traj_id"]), []).append(record)
    token_texts = _TokenTexts(tokenizer) if tokenizer is not None else None
    return [_dialog(traj_id, rows, token_texts) for traj_id, rows in by_traj.items()]


def _dialog(traj_id: int, rows: list[Mapping[str, Any]], token_texts: _TokenTexts | None) -> Dialog:
    rows = sorted(rows, key=lambda r: int(r["step"]))
    turns, previous = [], None
    for row in rows:
        turns.append(_turn(row, previous, token_texts))
        previous = row
    first = rows[0]
    return Dialog(
        traj_id=traj_id,
        group_id=_optional_int(first.get("group_id")),
        prompt_id=_optional_int(first.get("prompt_id")),
        turns=turns,
    )


def _turn(row: Mapping[str, Any], previous: Mapping[str, Any] | None, token_texts: _TokenTexts | None) -> Turn:
    tokens = [int(t) for t in row["tokens_response"]]
    prompt_text, is_continuation = _new_prompt_text(row, previous)
    token_versions = row.get("token_versions")
    return Turn(
        step=int(row["step"]),
        prompt_text=prompt_text,
        prompt_is_continuation=is_continuation,
        response=str(row["response"]),
        tokens=tokens,
        token_texts=None if token_texts is None else [token_texts(t) for t in tokens],
        log_probs=[float(x) for x in row["log_probs"]],
        token_versions=None if token_versions is None else list(token_versions),
        reward=float(row["reward"]),
        done=bool(row.get("done", False)),
        policy_version=row.get("policy_version", -1),
        num_prompt_tokens=len(row.get("tokens_prompt") or ()),
    )


def _new_prompt_text(row: Mapping[str, Any], previous: Mapping[str, Any] | None) -> tuple[str, bool]:
    """The part of the prompt after the previous turn's prompt and response, when the prompt extends them.

    Prompts are rendered token-exactly (docs/collectors.md, "Tokens are the truth"), so turn t+1's prompt starts
    with turn t's prompt and response; a file that skips turns shows the whole prompt instead.
    """
    prompt = str(row.get("prompt", ""))
    if previous is None:
        return prompt, False
    so_far = str(previous.get("prompt", "")) + str(previous["response"])
    if so_far and prompt.startswith(so_far):
        return prompt[len(so_far) :], True
    return prompt, False


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


class _TokenTexts:
    """Text of one token id, decoded once per id (responses reuse a small vocabulary)."""

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            # no clean-up: it would drop the leading space of tokens such as " 's"
            text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self.cache[token_id] = text
        return text
