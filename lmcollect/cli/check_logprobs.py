"""`lmcollect check-logprobs`: recompute a rollouts file's log-probs with a forward pass and report the mismatch.

Run: ``lmcollect check-logprobs --rollouts rollouts.parquet --model PATH`` on a file written by
``lmcollect collect`` (.parquet or .jsonl; columns ``tokens_prompt``, ``tokens_response``,
``log_probs``). ``--model`` is the reference: the trainer's weights, as the rollouts' policy
version had them. Kept free of heavy imports at module level: ``lmcollect --help`` imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcollect.cli.configs import UsageError
from lmcollect.diagnostics.rollout_files import read_rollout_rows
from lmcollect.files import write_text_atomically

COLUMNS = ("tokens_prompt", "tokens_response", "log_probs")


@dataclass(kw_only=True)
class CheckLogprobsConfig:
    """Recompute the log-probs of a rollouts file with a forward pass and report train-inference mismatch."""

    rollouts: str | None = None
    """Rollouts file written by `lmcollect collect` (.parquet or .jsonl); required."""
    model: str | None = None
    """Model folder whose forward pass is the reference; default: the 'tiny' model, built offline on first use."""
    max_abs_diff: float | None = None
    """Exit with status 1 if any token's |recomputed - stored| log-prob exceeds this."""
    tokens_per_forward: int = 8192
    """Padded tokens per forward pass (bounds memory)."""
    output: str | None = None
    """Also write the report as JSON to this file."""

    def __post_init__(self) -> None:
        if self.rollouts is None:
            raise ValueError("--rollouts is required: pass the .parquet or .jsonl file written by `lmcollect collect`.")
        if not self.rollouts.endswith((".parquet", ".jsonl")):
            raise ValueError(f"--rollouts must be a .parquet or .jsonl file, got {self.rollouts!r}.")
        if self.tokens_per_forward <= 0:
            raise ValueError(f"--tokens-per-forward must be positive, got {self.tokens_per_forward}.")


def run_check_logprobs(config: CheckLogprobsConfig) -> int:
    import torch

    from lmcollect.cli.builders import resolve_model_path
    from lmcollect.diagnostics.logprobs import StoredSequence, compare_log_probs, stale_context_of
    from lmcollect.models import load_model_and_tokenizer

    assert config.rollouts is not None  # checked in __post_init__
    records = read_rollouts(Path(config.rollouts))
    sequences = [
        StoredSequence(
            torch.tensor(r["tokens_prompt"] + r["tokens_response"], dtype=torch.long),
            torch.tensor(r["log_probs"], dtype=torch.float32),
            stale_context_of(r.get("token_versions"), r.get("kv_versions")),  # files of older versions lack them
        )
        for r in records
    ]
    model, _ = load_model_and_tokenizer(resolve_model_path(config.model))
    report = compare_log_probs(model.eval(), sequences, tokens_per_forward=config.tokens_per_forward)
    print(report.summary())
    if config.output is not None:
        Path(config.output).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(config.output, json.dumps(report.to_dict(), indent=2) + "\n")
    if config.max_abs_diff is not None and report.max_abs_diff > config.max_abs_diff:
        print(f"max |diff| {report.max_abs_diff:.3e} exceeds --max-abs-diff {config.max_abs_diff:.3e}")
        return 1
    return 0


def read_rollouts(path: Path) -> list[dict[str, Any]]:
    """The rows of a rollouts file, checked for the columns this command needs."""
    if not path.is_file():
        raise UsageError(f"--rollouts {path}: no such file.")
    rows = read_rollout_rows(path)
    if not rows:
        raise UsageError(f"--rollouts {path}: the file has no rows.")
    missing = [c for c in COLUMNS if c not in rows[0]]
    if missing:
        raise UsageError(f"--rollouts {path}: missing columns {missing}; use a file written by `lmcollect collect`.")
    return rows
