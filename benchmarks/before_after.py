"""Before and after a change, in one run: the same benchmarks from two checkouts, alternated.

Run: python benchmarks/before_after.py --before REV [--rounds 2] [--bench "weight_sync.py --quick" ...]
(``python``: the project's virtual environment, e.g. ``<venv>/bin/python``.)

``REV`` (a commit, tag or branch) is checked out into a temporary folder (a detached git worktree,
removed at the end); the working tree this script lives in is "after". Each round runs every
``--bench`` command (default: ``weight_sync.py --quick`` and ``agentic.py --rows push --quick``)
once from each checkout, with that checkout's own script and package (``PYTHONPATH``), the order of
the two alternating from round to round, so that a machine getting slower or faster in the middle
of the run weighs on both alike. Every benchmark prints JSON as its last line; per row this script
takes the median over rounds of the row's seconds (``median_s``, lower is better), or of its own
ratio (``value``: measured within one run against that run's baseline, so a machine that is slower
for a while weighs on both; higher is better) and the tokens/s of what it times, and prints
``speed after / before`` (above 1: the change is faster) with every round's number. Rows that only one checkout prints are listed as such. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
DEFAULT_BENCHES = ("weight_sync.py --quick", "agentic.py --rows push --quick")


def checkout(rev: str, into: Path) -> Path:
    """``rev`` as a detached worktree under ``into`` (what "before" runs)."""
    tree = into / "before"
    subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    return tree


def run_bench(tree: Path, bench: str, timeout_s: float) -> list[dict]:
    """The rows the benchmark ``bench`` prints as JSON when run from ``tree``."""
    script, *args = shlex.split(bench)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / script), *args],
        cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{bench} in {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["rows"]


def metrics(row: dict) -> list[tuple[str, str, float]]:
    """(name, unit, number) of one benchmark row: its median seconds; else its own ratio (``value``,
    measured within the run against its baseline, higher is better) and the tokens/s of what it times."""
    if isinstance(row.get("median_s"), (int, float)):
        return [("", "s", float(row["median_s"]))]
    found = []
    if isinstance(row.get("value"), (int, float)):
        found.append(("", "ratio", float(row["value"])))
    this = row.get("this")
    if isinstance(this, dict) and isinstance(this.get("tokens_per_s"), (int, float)):
        found.append((" [tokens/s]", "tokens/s", float(this["tokens_per_s"])))
    return found


def collect(trees: dict[str, Path], benches: list[str], rounds: int, timeout_s: float) -> dict:
    """samples[(bench, row)][side] = [numbers], the sides alternating first from round to round."""
    samples: dict[tuple[str, str], dict[str, list[float]]] = {}
    units: dict[tuple[str, str], str] = {}
    for r in range(rounds):
        for bench in benches:
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            for side in order:
                started = time.perf_counter()
                for row in run_bench(trees[side], bench, timeout_s):
                    for suffix, unit, number in metrics(row):
                        key = (bench, row["row"] + suffix)
                        units[key] = unit
                        samples.setdefault(key, {"before": [], "after": []})[side].append(number)
                print(f"round {r + 1}/{rounds} {side:6} {bench}: {time.perf_counter() - started:.0f} s", flush=True)
    return {"samples": samples, "units": units}


def table(samples: dict, units: dict) -> list[dict]:
    rows = []
    for key, sides in samples.items():
        if not sides["before"] or not sides["after"]:
            rows.append({"bench": key[0], "row": key[1], "only": "before" if sides["before"] else "after"})
            continue
        before, after = statistics.median(sides["before"]), statistics.median(sides["after"])
        speed = before / after if units[key] == "s" else after / before
        rows.append({"bench": key[0], "row": key[1], "unit": units[key], "before": round(before, 4),
                     "after": round(after, 4), "speed_after_over_before": round(speed, 3), "n": len(sides["after"]),
                     "samples": {side: [round(x, 4) for x in xs] for side, xs in sides.items()}})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit, tag or branch to compare against")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every benchmark from each checkout")
    parser.add_argument("--bench", action="append", help="a benchmark script and its arguments (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="bound on one benchmark run")
    args = parser.parse_args()
    benches = args.bench or list(DEFAULT_BENCHES)
    head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="lmcollect-before-") as tmp:
        before = checkout(args.before, Path(tmp))
        try:
            found = collect({"before": before, "after": HERE}, benches, args.rounds, args.timeout_s)
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(before)], check=False)
    rows = table(found["samples"], found["units"])
    print(f"\nbefore {args.before}, after {head.stdout.strip()} (working tree), {args.rounds} rounds, medians")
    print(f"{'row':86} {'unit':>7} {'before':>9} {'after':>9} {'speed after/before':>19}")
    for row in rows:
        if "only" in row:
            print(f"{row['row'][:86]:86} only in {row['only']}")
            continue
        print(f"{row['row'][:86]:86} {row['unit']:>8} {row['before']:9.4f} {row['after']:9.4f} "
              f"{row['speed_after_over_before']:19.3f}   before {row['samples']['before']} after {row['samples']['after']}")  # fmt: skip
    print(json.dumps({"benchmark": "before_after", "before": args.before, "after": head.stdout.strip(), "rows": rows}))


if __name__ == "__main__":
    main()
