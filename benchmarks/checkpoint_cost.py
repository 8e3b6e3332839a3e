"""Checkpoint cost of a replay buffer: a full save next to an incremental one (issue 53).

A ``ReplayBuffer`` of 10,000 tiny turns (a few tokens each); each round adds 64 new turns, then
saves it with ``save_checkpoint`` twice, alternated: into a fresh folder (every turn written: what
every save cost before segments) and into one folder that keeps being saved into (only the 64 new
turns, plus the small state). Prints the median seconds of each and their ratio (full /
incremental). Run: ``python benchmarks/checkpoint_cost.py`` (``--quick``: 2,000 turns, 5 rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tensordict import TensorDict, lazy_stack

from lmcollect.buffers import ReplayBuffer
from lmcollect.checkpoint import save_checkpoint
from lmcollect.data import keys


def _turns(start: int, count: int) -> TensorDict:
    return lazy_stack(
        [
            TensorDict(
                {"tokens": torch.arange(i % 7 + 4), "reward": torch.tensor(0.5), keys.POLICY_VERSION: torch.tensor(0)},
                batch_size=[],
            )
            for i in range(start, start + count)
        ]
    )


def _timed(folder: Path, buffer: ReplayBuffer) -> float:
    began = time.perf_counter()
    save_checkpoint(folder, [], replay_buffer=buffer)
    return time.perf_counter() - began


def run(turns: int, new_per_save: int, rounds: int) -> dict[str, float]:
    buffer = ReplayBuffer(capacity=turns, seed=0)
    for start in range(0, turns, 1000):
        buffer.extend(_turns(start, min(1000, turns - start)))
    full, incremental = [], []
    with tempfile.TemporaryDirectory() as root:
        kept = Path(root) / "kept"
        save_checkpoint(kept, [], replay_buffer=buffer)  # the first save into a folder writes every turn
        for r in range(rounds):
            buffer.extend(_turns(turns + r * new_per_save, new_per_save))
            incremental.append(_timed(kept, buffer))
            full.append(_timed(Path(root) / f"fresh-{r}", buffer))
    result = {"turns": turns, "new_per_save": new_per_save, "rounds": rounds}
    result |= {"full_s": statistics.median(full), "incremental_s": statistics.median(incremental)}
    return result | {"ratio_full_over_incremental": result["full_s"] / result["incremental_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 turns, 5 rounds: shows the script works")
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--new-per-save", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    turns, rounds = (2_000, 5) if args.quick else (args.turns, args.rounds)
    result = run(turns, args.new_per_save, rounds)
    print(json.dumps(result, indent=2))
    print(
        f"full save {result['full_s'] * 1e3:.1f} ms, incremental {result['incremental_s'] * 1e3:.1f} ms "
        f"(median of {rounds}): {result['ratio_full_over_incremental']:.1f}x"
    )


if __name__ == "__main__":
    main()
