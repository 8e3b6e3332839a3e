"""`lmcollect view`: one self-contained HTML report of a rollouts file (open it in any browser, offline).

Run: ``lmcollect view --rollouts rollouts.parquet [--output report.html] [--model PATH]`` on a file
written by ``lmcollect collect`` (.parquet or .jsonl). With ``--model`` the response tokens show
as text (the folder's tokenizer decodes them), without it as token ids. Kept free of heavy imports
at module level: ``lmcollect --help`` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lmcollect.cli.configs import UsageError

if TYPE_CHECKING:  # transformers is heavy: imported for the annotation only
    from transformers import PreTrainedTokenizerBase


@dataclass(kw_only=True)
class ViewConfig:
    """Write a self-contained HTML report of a rollouts file: a table of dialogs, tokens coloured by log-prob."""

    rollouts: str | None = None
    """Rollouts file written by `lmcollect collect` (.parquet or .jsonl); required."""
    output: str | None = None
    """HTML file to write; default: the rollouts file with .html in place of its suffix."""
    model: str | None = None
    """Model folder whose tokenizer decodes the response tokens to text; default: show token ids."""
    title: str | None = None
    """Title of the page; default: the rollouts file's name."""
    max_dialogs: int = 2000
    """Keep the last this many dialogs of the file (0: all; a browser slows down past ~10k)."""

    def __post_init__(self) -> None:
        if self.rollouts is None:
            raise ValueError("--rollouts is required: pass the .parquet or .jsonl file written by `lmcollect collect`.")
        if not self.rollouts.endswith((".parquet", ".jsonl")):
            raise ValueError(f"--rollouts must be a .parquet or .jsonl file, got {self.rollouts!r}.")
        if self.output is not None and not self.output.endswith((".html", ".htm")):
            raise ValueError(f"--output must end with .html, got {self.output!r}.")
        if self.max_dialogs < 0:
            raise ValueError(f"--max-dialogs must be >= 0 (0: all), got {self.max_dialogs}.")

    @property
    def output_path(self) -> Path:
        assert self.rollouts is not None  # checked in __post_init__
        return Path(self.output) if self.output is not None else Path(self.rollouts).with_suffix(".html")


def run_view(config: ViewConfig) -> int:
    from lmcollect.viewer import read_rollout_records, write_rollout_report

    rollouts = config.rollouts
    assert rollouts is not None  # checked in __post_init__
    try:
        records = read_rollout_records(rollouts)
    except ValueError as exc:  # no such file, no rows, missing columns: the message names the file
        raise UsageError(f"--rollouts {exc}") from exc
    tokenizer = _load_tokenizer(config.model) if config.model is not None else None
    path = write_rollout_report(
        records,
        config.output_path,
        title=config.title,
        source=Path(rollouts).name,
        tokenizer=tokenizer,
        max_dialogs=config.max_dialogs,
    )
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); open it in a browser")
    return 0


def _load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    from lmcollect.cli.builders import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(model)))
