"""What a run leaves behind: its folder, summary.json and a PNG plot (metrics.jsonl: lmcollect.loggers)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table
from tensordict import TensorDictBase

from lmcollect.collectors.shared.group_filter import SamplingCounts
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.engines.kv_policy import PushCost
from lmcollect.envs import PROMPT_ID
from lmcollect.files import write_text_atomically

SUMMARY_FILE = "summary.json"
PLOT_FILE = "training.png"
ROLLOUT_REPORT_FILE = "rollouts.html"


def make_run_dir(output_dir: str | Path, prefix: str) -> Path:
    """A new folder ``output_dir/<prefix>-YYYYmmdd-HHMMSS`` (suffixed ``-2``, ``-3``... if taken)."""
    base = Path(output_dir) / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def mean_of(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over ``records`` (None when there are none)."""
    return sum(r[key] for r in records) / len(records) if records else None


def run_summary(
    *, task: str, model: str, interrupted: bool, records: Sequence[Mapping[str, Any]], version: int, rewards: Any
) -> dict[str, Any]:
    """What every demo's ``summary.json`` opens with: the run, its steps and its rewards."""
    return {
        "command": "demo",
        "task": task,
        "model": model,
        "interrupted": interrupted,
        "steps": len(records),
        "policy_version": version,
        "reward": rewards,
        "train_reward": {
            "first_10_steps": mean_of(records[:10], "reward/mean"),
            "last_10_steps": mean_of(records[-10:], "reward/mean"),
        },
        "turns_collected": records[-1]["collect/turns"] if records else 0,
    }


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> Path:
    path = run_dir / SUMMARY_FILE
    write_text_atomically(path, json.dumps(summary, indent=2, default=str) + "\n")
    return path


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_training(records: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Reward, throughput and weight-push time over training steps, one panel each (None: no step ran)."""
    if not records:
        return None
    import matplotlib  # imported here: only runs that train pay for it

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    panels = [
        ("reward/mean", "mean reward of the batch", True),
        ("collect/turns_per_s", "turns collected / s", False),
        ("timing/weight_sync/push_s", "weight push (s)", False),
    ]
    if all("sampling/kept_share" in r for r in records):  # dynamic sampling: the share of groups kept
        panels.append(("sampling/kept_share", "groups kept (share)", True))
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 8), sharex=True)
    for ax, (key, label, smooth) in zip(axes, panels, strict=True):
        values = [float(r[key]) for r in records]
        ax.plot(steps, values, lw=0.8, alpha=0.5 if smooth else 1.0)
        if smooth:
            ax.plot(steps, _moving_average(values, 10), lw=2, label="moving average (10 steps)")
            ax.legend(loc="lower right")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("training step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def summary_table(rows: Sequence[tuple[str, str]], *, title: str) -> Table:
    """A two-column rich table of (what, value) rows."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table


def decoded_turn_records(batches: Iterable[TensorDictBase], tokenizer: Any) -> list[dict[str, Any]]:
    """Single-turn records with :data:`lmcollect.cli.rollouts.COLUMNS` from turns that kept only the
    learner's keys (tokens, log-probs, reward, ids: ``GroupAdvantage(keep_keys=LEARNER_KEYS)``).

    The texts are decoded from the tokens (the prompt with its special tokens, as the model saw it;
    the response as the policy decodes it), so they equal what ``batch_records`` reads from full
    turns. A turn sampled twice (replay buffers sample with replacement) is kept once.
    """
    records: dict[int, dict[str, Any]] = {}
    for batch in batches:
        for turn in flatten_turns(batch):
            traj_id = int(turn.get(keys.TRAJ_IDS))
            if traj_id in records:
                continue
            prompt, response = turn.get(keys.TOKENS_PROMPT).tolist(), turn.get(keys.TOKENS_RESPONSE).tolist()
            records[traj_id] = {
                "prompt": tokenizer.decode(prompt),
                "response": tokenizer.decode(response, skip_special_tokens=True),
                "tokens_prompt": prompt,
                "tokens_response": response,
                "log_probs": turn.get(keys.LOG_PROBS_RESPONSE).tolist(),
                "reward": float(turn.get(keys.NEXT_REWARD).sum()),
                "done": True,  # single-turn tasks: every turn ends its dialog
                "policy_version": int(turn.get(keys.POLICY_VERSION)),
                "traj_id": traj_id,
                "step": 0,
                "prompt_id": int(turn.get(PROMPT_ID)),
                "group_id": int(turn.get(keys.GROUP_ID, -1)),
                "token_versions": turn.get(keys.TOKEN_VERSIONS).tolist(),
                "kv_versions": turn.get(keys.KV_VERSIONS).tolist(),
            }
    return list(records.values())


def sampling_rows(sampling: dict[str, Any]) -> list[tuple[str, str]]:
    """The demo summary's dynamic sampling rows: groups kept and dropped, the kept share early and late,
    tokens delivered of those generated (``sampling``: summary.json's ``dynamic_sampling``)."""
    counts = sampling["counts"]
    if not sampling["on"] or counts is None:
        return [("dynamic sampling", f"off ({sampling['mode']})")]
    total = SamplingCounts.from_state(counts)
    share = sampling["kept_share"]
    delivered = total.tokens_delivered / total.tokens_generated if total.tokens_generated else None
    return [
        (
            "groups kept in batches / generated (dropped)",
            f"{total.groups_kept} / {total.groups_generated} ({total.dropped}: "
            + ", ".join(f"{reason} {n}" for reason, n in total.groups_dropped.items())
            + ")",
        ),
        (
            "kept share of groups, first / last 10 steps",
            f"{_fmt_value(share['first_10_steps'], '.2f')} / {_fmt_value(share['last_10_steps'], '.2f')}",
        ),
        (
            "tokens delivered / generated",
            f"{total.tokens_delivered} / {total.tokens_generated} ({_fmt_value(delivered, '.0%')})",
        ),
    ]


def _fmt_value(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


PUSH_STAGES = ("copy_s", "wait_s", "load_s", "reset_s", "first_step_s")  # a push's timeline (PushCost), in order


def push_cost_summary(costs: Sequence[PushCost]) -> dict[str, Any]:
    """What a push cost the engines, per push and engine (means): its timeline (copy, wait for the
    step under way, load, reset, first step after), the load call, and the tokens prefilled again."""
    fields = ("call_s", "recomputed_tokens", "recompute_s", *PUSH_STAGES)
    if not costs:
        return {"pushes": 0, **dict.fromkeys(fields), "kv_policy": None}
    means = {field: sum(getattr(c, field) for c in costs) / len(costs) for field in fields}
    return {"pushes": len(costs), **means, "kv_policy": costs[-1].kv_policy}


def push_cost_rows(cost: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The summary table's rows of :func:`push_cost_summary` ("-" where no engine recorded pushes)."""
    seconds = [_fmt_value(cost.get(field), ".3f") for field in (*PUSH_STAGES, "call_s", "recompute_s")]
    return [
        ("push timeline per engine, s: copy / wait / load / reset / first step", " / ".join(seconds[:5])),
        (
            "push cost per engine: load s / tokens prefilled again / their s",
            f"{seconds[5]} / {_fmt_value(cost['recomputed_tokens'], '.0f')} / {seconds[6]} (kv_policy {cost['kv_policy']})",
        ),
    ]
