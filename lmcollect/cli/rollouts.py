"""Collected turns as flat records (one row per turn), written to parquet or jsonl."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensordict import TensorDictBase

from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.envs import PROMPT_ID
from lmcollect.files import replacing

COLUMNS = (
    "prompt",
    "response",
    "tokens_prompt",
    "tokens_response",
    "log_probs",
    "reward",
    "done",
    "policy_version",
    "traj_id",
    "step",
    "prompt_id",
    "group_id",
    "token_versions",
    "kv_versions",
)
"""Columns of the output, in order. ``prompt`` is the prompt as the model saw it (chat template applied)."""


def _text(turn: TensorDictBase, key: tuple[str, str]) -> str:
    return non_tensor_values(turn, key)[0]


def turn_record(turn: TensorDictBase) -> dict[str, Any]:
    """One turn (an empty-batch TensorDict) as a flat record with :data:`COLUMNS`."""
    return {
        "prompt": _text(turn, keys.TEXT_PROMPT),
        "response": _text(turn, keys.TEXT_RESPONSE),
        "tokens_prompt": turn.get(keys.TOKENS_PROMPT).tolist(),
        "tokens_response": turn.get(keys.TOKENS_RESPONSE).tolist(),
        "log_probs": turn.get(keys.LOG_PROBS_RESPONSE).tolist(),
        "reward": float(turn.get(keys.NEXT_REWARD).sum()),
        "done": bool(turn.get(keys.NEXT_DONE).any()),
        "policy_version": int(turn.get(keys.POLICY_VERSION)),
        "traj_id": int(turn.get(keys.TRAJ_IDS)),
        "step": int(turn.get(keys.STEP_COUNT)),
        "prompt_id": int(turn.get(PROMPT_ID)),
        "group_id": int(turn.get(keys.GROUP_ID, -1)),
        "token_versions": turn.get(keys.TOKEN_VERSIONS).tolist(),
        "kv_versions": turn.get(keys.KV_VERSIONS).tolist(),
    }


def batch_records(batch: TensorDictBase) -> list[dict[str, Any]]:
    return [turn_record(turn) for turn in flatten_turns(batch)]


def write_records(records: Sequence[dict[str, Any]], path: Path) -> Path:
    """Write to ``path``: ``.parquet`` (pyarrow) or ``.jsonl`` (one JSON object per line); the file
    appears whole (written beside it, then renamed), so a crash never leaves it truncated."""
    if path.suffix not in (".parquet", ".jsonl"):
        raise ValueError(f"cannot write {path}: use a .parquet or .jsonl file name.")
    with replacing(path) as tmp:
        if path.suffix == ".parquet":
            import pyarrow as pa  # imported here: only parquet output pays for it
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(list(records)), tmp)
        else:
            with tmp.open("w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
    return path
