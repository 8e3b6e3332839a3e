"""One self-contained HTML file of rollouts: the dialogs as JSON inside the page, no server, no network.

Run: ``lmcollect view --rollouts rollouts.parquet [--output report.html] [--model PATH]``, or from
Python ``write_rollout_report(records_or_path, "report.html", title="last batches")``.
"""

from __future__ import annotations

import html
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmcollect.files import write_text_atomically
from lmcollect.viewer.dialogs import Dialog, TokenDecoder, Turn, check_columns, group_dialogs, read_rollout_records
from lmcollect.viewer.page import PAGE_SCRIPT, PAGE_STYLE, PAGE_TEMPLATE

DATA_ELEMENT_ID = "rollout-data"
"""Id of the ``<script type="application/json">`` element that holds the report's data (as in the page's script)."""
LOG_PROB_DECIMALS = 4
"""Log-probs are rounded in the page (a smaller file; the colours cannot show more)."""


def write_rollout_report(
    records_or_path: str | Path | Sequence[Mapping[str, Any]],
    out_path: str | Path,
    *,
    title: str | None = None,
    tokenizer: TokenDecoder | None = None,
    max_dialogs: int = 0,
    source: str | None = None,
) -> Path:
    """Write the HTML report of rollout rows (one per turn) or of a ``.parquet`` / ``.jsonl`` file.

    ``title`` defaults to ``source``, which names the input in the page's summary line (default: the
    file's name, or "records"). ``tokenizer`` decodes each response token to its text (default: the
    page shows token ids); ``max_dialogs`` keeps the last dialogs of the input (0: all).
    Returns the written path.
    """
    records: Sequence[Mapping[str, Any]]
    if isinstance(records_or_path, (str, Path)):
        source = source or Path(records_or_path).name
        records = read_rollout_records(records_or_path)
    else:
        source = source or "records"
        records = list(records_or_path)
        check_columns(records, source=source)
    dialogs = group_dialogs(records, tokenizer=tokenizer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    page = render_report(dialogs, title=title or source, source=source, max_dialogs=max_dialogs)
    write_text_atomically(out_path, page)
    return out_path


def render_report(dialogs: Sequence[Dialog], *, title: str, source: str, max_dialogs: int = 0) -> str:
    """The page's HTML: template, style, data and script in one string."""
    if max_dialogs < 0:
        raise ValueError(f"max_dialogs must be >= 0 (0: all), got {max_dialogs}.")
    shown = list(dialogs[-max_dialogs:]) if max_dialogs else list(dialogs)
    data = {
        "title": title,
        "source": source,
        "written": time.strftime("%Y-%m-%d %H:%M"),
        "num_dialogs_in_source": len(dialogs),
        "num_turns_in_source": sum(len(d.turns) for d in dialogs),
        "has_token_texts": any(t.token_texts is not None for d in shown for t in d.turns),
        "has_token_versions": any(t.token_versions is not None for d in shown for t in d.turns),
        "dialogs": [dialog_payload(d) for d in shown],
    }
    values = {"title": html.escape(title), "style": PAGE_STYLE, "script": PAGE_SCRIPT, "data": embed_json(data)}
    # one pass: inserted text (a title, a response) is never searched for placeholders again
    return re.sub(r"\{\{(\w+)\}\}", lambda match: values[match.group(1)], PAGE_TEMPLATE)


def embed_json(data: Any) -> str:
    """JSON that is safe inside a ``<script>`` element: ``<``, ``>`` and ``&`` are escaped as ``\\u003c``...

    In JSON these characters only occur inside strings, where the escapes mean the same, so a
    response such as ``</script>`` cannot end the element. Non-finite floats become null (JSON has none).
    """
    text = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def dialog_payload(dialog: Dialog) -> dict[str, Any]:
    """A dialog as the page reads it. Ids are strings: JavaScript numbers lose digits past 2**53."""
    return {
        "traj": str(dialog.traj_id),
        "group": None if dialog.group_id is None else str(dialog.group_id),
        "prompt_id": dialog.prompt_id,
        "reward": dialog.reward,
        "versions": dialog.policy_versions,
        "done": dialog.done,
        "prompt_tokens": dialog.num_prompt_tokens,
        "response_tokens": dialog.num_response_tokens,
        "turns": [_turn_payload(turn) for turn in dialog.turns],
    }


def _turn_payload(turn: Turn) -> dict[str, Any]:
    return {
        "step": turn.step,
        "prompt": turn.prompt_text,
        "prompt_is_continuation": turn.prompt_is_continuation,
        "response": turn.response,
        "tokens": turn.tokens,
        "token_texts": turn.token_texts,
        "log_probs": [round(x, LOG_PROB_DECIMALS) if math.isfinite(x) else x for x in turn.log_probs],
        "token_versions": turn.token_versions,
        "reward": turn.reward,
        "done": turn.done,
        "version": turn.policy_version,
        "prompt_tokens": turn.num_prompt_tokens,
    }


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
