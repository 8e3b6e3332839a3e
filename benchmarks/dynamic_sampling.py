"""Dynamic sampling: useful turns per second with the group filter (over-sampling 0, 1, 2) vs no filter.

Run: python benchmarks/dynamic_sampling.py [--quick] [--backend transformers|vllm] [--reps 3] [--size small]
(``python``: the project's virtual environment, e.g. ``<venv>/bin/python``.)

RL as it runs, as ``benchmarks/agentic.py``'s GRPO rows: ``ContinuousLLMCollector`` over
calculator-tool dialogs of 3-5 turns (each tool call answered after a seeded 0-300 ms, see
``agentic.py``), GRPO groups of ``GROUP_SIZE`` (4) dialogs per row, ``max_policy_lag=1`` and a push
of the checkpoint's weights after every batch. A dialog's reward (on its last turn) depends on its
row: ``UNIFORM_SHARE`` of the rows are "solved" or "unsolved" (every answer gets 1, or 0: the group
teaches nothing), the others are "mixed" (the parity of a hash of the answer's text: answers of one
row differ, so a group's rewards mostly differ too).

Modes (each sample a fresh process; samples of the modes alternate, medians reported):

- ``no-filter``: every group reaches the trainer, useful or not.
- ``filter-osN`` (N = 0, 1, 2): ``dynamic_sampling=DynamicSampling(group_filter=drop_uniform_rewards(),
  oversample_groups=N)``: groups whose rewards are all equal are dropped and others admitted instead.

Each sample takes one batch (and its push) to warm up, then times ``num_batches`` batches. A turn is
**useful** when its group's rewards are not all equal (every turn of a filtered batch; the share of
such groups in an unfiltered one). The metric is useful turns/s against ``no-filter``; each row also
carries the counts of its samples, warm-up batch included (groups generated / kept / dropped by
reason, tokens generated vs delivered, from ``collector.sampling_counts``). Prints a table; the last line is JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script or loaded by `lmcollect bench`: agentic.py is a sibling
    sys.path.insert(0, str(ROOT))

from benchmarks import agentic  # noqa: E402
from lmcollect.data import History, keys  # noqa: E402
from lmcollect.data.turns import flatten_turns  # noqa: E402
from lmcollect.envs import ChatEnv  # noqa: E402
from lmcollect.envs.tasks.base import TaskReply  # noqa: E402
from lmcollect.envs.tasks.tool_calc import ToolCalcState  # noqa: E402

GROUP_SIZE = 4
UNIFORM_SHARE = 0.4
"""Share of the rows whose answers all get the same reward (half "solved", half "unsolved")."""
OVERSAMPLING = (0, 1, 2)
SAMPLE_PREFIX = "DYNAMIC_SAMPLING_SAMPLE "


@dataclass(kw_only=True)
class Workload(agentic.Workload):
    """``agentic.Workload`` (model, sampling, tool latencies) plus the GRPO and reward settings."""

    backend: str = "transformers"
    """The engine: "transformers" (``TransformersEngine``) or "vllm" (``VLLMEngine``)."""
    slots: int = 16
    """Dialogs in flight (``GROUP_SIZE`` slots per group)."""
    groups_per_batch: int = 4
    """Kept groups per batch (``dialog_turns_per_batch = groups_per_batch * GROUP_SIZE``)."""
    uniform_share: float = UNIFORM_SHARE
    """Share of the rows whose groups teach nothing."""


@dataclass(frozen=True, slots=True)
class GradedState(ToolCalcState):
    """A tool dialog's state and the kind of its row ("solved", "unsolved" or "mixed")."""

    kind: str = "mixed"


class GradedTurnsTask(agentic.ToolTurnsTask):
    """``agentic.ToolTurnsTask`` (every turn but the row's last a tool call, seeded latencies) whose last
    turn is rewarded by the row's kind: 1, 0, or the parity of a hash of the answer."""

    def start(self, sample: dict[str, Any], rng: random.Random) -> GradedState:
        return GradedState(answer=int(sample["answer"]), num_turns=int(sample["num_turns"]),
                           latency_seed=int(sample["latency_seed"]), kind=str(sample["kind"]))

    def reply_of(self, state: GradedState, history: History) -> tuple[TaskReply, float]:
        reply, wait_s = super().reply_of(state, history)
        if not reply.done:
            return reply, wait_s
        return TaskReply(reward=_reward(state.kind, history.messages[-1].content), done=True), wait_s


def _reward(kind: str, answer: str) -> float:
    if kind != "mixed":
        return 1.0 if kind == "solved" else 0.0
    return float(hashlib.sha256(answer.encode("utf-8")).digest()[0] % 2)


def graded_rows(w: Workload) -> agentic.SharedRows:
    """agentic's rows (one shared cursor), each with a seeded kind."""
    kinds = random.Random(w.seed + 2)
    rows = []
    for row in agentic.workload_rows(w):
        draw = kinds.random()
        kind = "mixed" if draw >= w.uniform_share else ("solved" if draw < w.uniform_share / 2 else "unsolved")
        rows.append({**row, "kind": kind})
    return agentic.SharedRows(rows, seed=w.seed)


# ---------------------------------------------------------------------- one sample
def run_sample(mode: str, w: Workload) -> dict[str, Any]:
    """One timed run of ``mode`` in this process: what the timed batches held, and the counts."""
    from lmcollect.collectors import ContinuousLLMCollector, DynamicSampling, drop_uniform_rewards
    from lmcollect.models import ModelSpec, get_model_path

    path = str(get_model_path(ModelSpec(size=w.size)))
    engine, tokenizer, weights = agentic._engine(w.backend, path, w, w.slots)
    rows = graded_rows(w)
    task = GradedTurnsTask(max_latency_s=w.max_latency_s)
    envs = [ChatEnv(rows, task=task, batch_size=GROUP_SIZE, repeats=GROUP_SIZE, max_turns=agentic.MAX_TURNS,
                    seed=w.seed) for _ in range(w.slots // GROUP_SIZE)]
    sampling = None
    if mode != "no-filter":
        sampling = DynamicSampling(group_filter=drop_uniform_rewards(), oversample_groups=int(mode.removeprefix("filter-os")))
    collector = ContinuousLLMCollector(
        envs, engine=engine, tokenizer=tokenizer, sampling=dataclasses.replace(agentic.sampling_of(w), seed=None),
        stop_token_ids=agentic._eos_ids(path, tokenizer) + agentic.extra_stop_ids(path, w),
        dialog_turns_per_batch=w.groups_per_batch * GROUP_SIZE, track_policy_version=True, max_policy_lag=1,
        dynamic_sampling=sampling,
    )
    try:
        return _timed(collector, weights, w, mode)
    finally:
        collector.shutdown()
        engine.close()


def _timed(collector: Any, weights: dict, w: Workload, mode: str) -> dict[str, Any]:
    collector.next()
    collector.update_policy_weights_(weights)
    start = time.perf_counter()
    batches = []
    for _ in range(w.num_batches):
        batches.append(collector.next())
        collector.update_policy_weights_(weights)
    wall_s = time.perf_counter() - start
    # the whole sample's counts: a window's would set tokens delivered in it against tokens generated
    # in it, while a batch's groups started before it
    counts = None if collector.sampling_counts is None else collector.sampling_counts.to_state()
    turns = [turn for batch in batches for turn in flatten_turns(batch)]
    return {"mode": mode, "wall_s": wall_s, "turns": len(turns), "useful_turns": _useful_turns(turns),
            "tokens_delivered": sum(int(t[keys.TOKENS_RESPONSE].numel()) for t in turns), "counts": counts}


def _useful_turns(turns: list) -> int:
    """Turns of the groups whose dialogs' returns are not all equal."""
    returns: dict[int, dict[int, float]] = {}
    sizes: dict[int, int] = {}
    for turn in turns:
        group, dialog = int(turn[keys.GROUP_ID]), int(turn[keys.TRAJ_IDS])
        per_dialog = returns.setdefault(group, {})
        per_dialog[dialog] = per_dialog.get(dialog, 0.0) + float(turn[keys.NEXT_REWARD].sum())
        sizes[group] = sizes.get(group, 0) + 1
    return sum(sizes[g] for g, per_dialog in returns.items() if len(set(per_dialog.values())) > 1)


# ---------------------------------------------------------------------- samples in fresh processes
def sample_in_subprocess(mode: str, w: Workload, timeout_s: float = 900) -> dict[str, Any]:
    spec = json.dumps({"mode": mode, "workload": dataclasses.asdict(w)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--sample", spec], capture_output=True,
                         text=True, env=env, timeout=timeout_s, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(SAMPLE_PREFIX)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} sample failed (exit {out.returncode}): {out.stderr[-3000:]}")
    return json.loads(lines[-1][len(SAMPLE_PREFIX):])


def alternate(modes: list[str], w: Workload, reps: int) -> dict[str, list[dict[str, Any]]]:
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(reps):
        for mode in modes:
            samples[mode].append(sample_in_subprocess(mode, w))
    return samples


# ---------------------------------------------------------------------- rows
def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the samples, and the counts of all of them together."""
    fields: dict[str, Any] = {
        "useful_turns_per_s": round(statistics.median(s["useful_turns"] / s["wall_s"] for s in samples), 2),
        "turns_per_s": round(statistics.median(s["turns"] / s["wall_s"] for s in samples), 2),
        "useful_share": round(sum(s["useful_turns"] for s in samples) / max(1, sum(s["turns"] for s in samples)), 3),
        "turns_timed": [s["turns"] for s in samples],
        "tokens_delivered_timed": sum(s["tokens_delivered"] for s in samples),
    }
    counts = [s["counts"] for s in samples if s["counts"] is not None]
    if counts:
        from lmcollect.collectors import SamplingCounts
        from lmcollect.collectors.shared.group_filter import total_counts

        total = total_counts([SamplingCounts.from_state(c) for c in counts])
        assert total is not None, "counts is not empty"
        fields |= {
            "groups_generated": total.groups_generated, "groups_kept": total.groups_kept,
            "groups_dropped": dict(total.groups_dropped), "kept_share": total.kept_share,
            "tokens_generated": total.tokens_generated, "tokens_delivered": total.tokens_delivered,
        }
    return fields


def ratio_row(name: str, this: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [a["useful_turns"] / a["wall_s"] / max(1e-9, b["useful_turns"] / b["wall_s"]) for a, b in zip(this, base, strict=True)]
    value, fields = statistics.median(ratios), summary(this)
    counts = (f"; groups kept {fields['groups_kept']} of {fields['groups_generated']}, tokens delivered "
              f"{fields['tokens_delivered']} of {fields['tokens_generated']}") if "groups_kept" in fields else ""
    return {"row": name, "metric": "useful turns/s vs no filter" + counts, "value": round(value, 3), "target": "",
            "met": None, "ratios": [round(r, 3) for r in ratios], "this": fields, "baseline": summary(base)}


def rows_of(w: Workload, reps: int) -> list[dict[str, Any]]:
    modes = ["no-filter", *(f"filter-os{n}" for n in OVERSAMPLING)]
    s = alternate(modes, w, reps)
    label = f"{w.backend}: GRPO groups of {GROUP_SIZE}, {w.slots} slots, lag 1, push per batch"
    return [ratio_row(f"{label}: drop uniform rewards, over-sampling {n}", s[f"filter-os{n}"], s["no-filter"])
            for n in OVERSAMPLING]


def run(*, quick: bool = False, backend: str = "transformers", reps: int = 3, size: str = "small",
        num_batches: int = 4) -> list[dict[str, Any]]:
    """Every row of this benchmark (``lmcollect bench`` calls this)."""
    slots = 8 if backend == "transformers" else 16  # the transformers engine on CPU: fewer dialogs at once
    w = Workload(size=size, backend=backend, slots=slots, groups_per_batch=2 if backend == "transformers" else 4,
                 num_batches=2 if quick else num_batches)
    return rows_of(w, 1 if quick else reps)


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'row':88} {'value':>7}  useful turns/s (this / no filter)  kept share  tokens delivered/generated")
    for row in rows:
        this, base = row["this"], row["baseline"]
        share = this.get("kept_share")
        print(f"{row['row']:88} {row['value']:7.3f}  {this['useful_turns_per_s']:8.2f} / {base['useful_turns_per_s']:<8.2f}"
              f"          {'-' if share is None else f'{share:.2f}':>6}  "
              f"{this.get('tokens_delivered')}/{this.get('tokens_generated')}  dropped {this.get('groups_dropped')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition per mode, fewer timed batches")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size", default="small")
    parser.add_argument("--num-batches", type=int, default=4)
    parser.add_argument("--sample", help=argparse.SUPPRESS)  # internal: run one sample, print it as JSON
    args = parser.parse_args()
    if args.sample:
        spec = json.loads(args.sample)
        sample = run_sample(spec["mode"], Workload(**spec["workload"]))
        print(SAMPLE_PREFIX + json.dumps(sample), flush=True)
        return
    rows = run(quick=args.quick, backend=args.backend, reps=args.reps, size=args.size, num_batches=args.num_batches)
    print_rows(rows)
    print(json.dumps({"benchmark": "dynamic_sampling", "rows": rows}))


if __name__ == "__main__":
    main()
