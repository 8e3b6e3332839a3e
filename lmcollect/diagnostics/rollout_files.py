"""The rows of a rollouts file as `lmcollect collect` writes it: a Parquet table, or JSON lines.

Pure Python (pyarrow only for Parquet, imported when needed): the viewer and `lmcollect check-logprobs`
read their input with it, and each checks the columns it needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_rollout_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of ``path``: a ``.parquet`` file's table, else JSON lines (blank lines skipped)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # imported here: only parquet input pays for it

        return pq.read_table(path).to_pylist()
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
