"""Builds the collectors of the resume tests; run as a module it restores a checkpoint in a fresh
process, collects more batches and saves them (``python -m tests.resume_worker KIND CKPT N OUT [MODEL]``)."""
from __future__ import annotations

import sys

from lmcollect.buffers import ReplayBuffer
from lmcollect.checkpoint import load_checkpoint
from lmcollect.collectors import LLMCollector
from lmcollect.data import codec
from lmcollect.data.turns import flatten_turns


def build(kind: str, model_path: str | None = None) -> tuple[LLMCollector, ReplayBuffer | None]:
    """``scripted``: multi-turn guessing games, completed trajectories (turns wait across batches);
    ``tiny``: the tiny model sampling at temperature 1 on multi-turn games, steps mode, into a buffer."""
    from tests.factories import make_guesser, make_guessing_env

    if kind == "scripted":
        collector = LLMCollector(
            make_guessing_env, policy=make_guesser(), dialog_turns_per_batch=3, yield_completed_trajectories=True,
            track_policy_version=True,
        )
        buffer = None
    elif kind == "tiny":
        from lmcollect.models import load_model_and_tokenizer
        from lmcollect.policies import TransformersPolicy

        model, tokenizer = load_model_and_tokenizer(model_path)
        policy = TransformersPolicy(model, tokenizer, max_new_tokens=8, temperature=1.0, seed=0)
        buffer = ReplayBuffer(capacity=64, seed=0)
        collector = LLMCollector(make_guessing_env, policy=policy, dialog_turns_per_batch=4, track_policy_version=True)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    collector.worker_idx = 0
    return collector, buffer


def collect(collector: LLMCollector, buffer: ReplayBuffer | None, num_batches: int) -> list:
    turns = []
    for _ in range(num_batches):
        batch = collector.next()
        turns.extend(flatten_turns(batch))
        if buffer is not None:
            buffer.extend(batch)
    return turns


def main(argv: list[str]) -> None:
    kind, folder, num_batches, out = argv[0], argv[1], int(argv[2]), argv[3]
    collector, buffer = build(kind, argv[4] if len(argv) > 4 else None)
    load_checkpoint(folder, [collector], replay_buffer=buffer)
    turns = collect(collector, buffer, num_batches)
    samples = buffer.sample(8) if buffer is not None else None
    codec.save(out, {"turns": turns, "samples": samples})


if __name__ == "__main__":
    main(sys.argv[1:])
