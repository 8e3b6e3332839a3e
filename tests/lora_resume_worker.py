"""Builds the collectors of the LoRA tests (lockstep and continuous, over the tiny model); run as a
module it restores a checkpoint of both in a fresh process, pushes an adapter, collects, and saves
what it got (``python -m tests.lora_resume_worker CKPT ADAPTER MODEL OUT``)."""
from __future__ import annotations

import sys
from typing import Any

import torch

from lmcollect.checkpoint import load_checkpoint
from lmcollect.collectors import ContinuousLLMCollector, LLMCollector
from lmcollect.data import codec
from lmcollect.data.turns import flatten_turns
from lmcollect.engines import EngineRequest, TransformersEngine
from lmcollect.engines.protocol import engine_of
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import SamplingConfig, TransformersPolicy
from lmcollect.weight_sync import LocalWeightUpdater
from lmcollect.weights.lora import LoraAdapter
from tests.factories import make_arithmetic_env

KINDS = ("lockstep", "continuous")
PROMPTS = ([5, 17, 230, 41], [9, 300, 12, 12, 77, 4, 8])
TIMEOUT_S = 60


def build(kind: str, model_path: str) -> Any:
    """A collector of ``kind`` over the tiny model as saved (its own copy), with a LocalWeightUpdater:
    ``lockstep`` samples at temperature 1 (seeded), ``continuous`` answers greedily."""
    model, tokenizer = load_model_and_tokenizer(model_path)
    if kind == "lockstep":
        policy = TransformersPolicy(model, tokenizer, max_new_tokens=6, temperature=1.0, seed=0)
        collector: Any = LLMCollector(
            make_arithmetic_env(), policy=policy, dialog_turns_per_batch=4, track_policy_version=True,
            weight_updater=LocalWeightUpdater(),
        )
        collector.worker_idx = 0
        return collector
    if kind == "continuous":
        return ContinuousLLMCollector(
            [make_arithmetic_env()], engine=TransformersEngine(model, tokenizer), tokenizer=tokenizer,
            dialog_turns_per_batch=2, track_policy_version=True, weight_updater=LocalWeightUpdater(),
            sampling=SamplingConfig(max_new_tokens=6, temperature=0),
        )
    raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")


def model_of(collector: Any) -> torch.nn.Module:
    """The torch model the collector's engine serves (and merges adapters into)."""
    return engine_of(collector.policy).model


def weights_of(collector: Any) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model_of(collector).state_dict().items()}


def greedy_answers(collector: Any, max_new_tokens: int = 8) -> list[list[int]]:
    """The collector's engine's greedy answers to PROMPTS (straight to the engine, between batches)."""
    engine = engine_of(collector.policy)
    sampling = SamplingConfig(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    requests = [EngineRequest(prompt_ids=list(p), sampling=sampling) for p in PROMPTS]
    return [result.tokens.tolist() for result in engine.generate_batch(requests, timeout_s=TIMEOUT_S)]


def collect(collector: Any, num_batches: int) -> list:
    """The turns of ``num_batches`` batches (the continuous collector's are not compared turn for
    turn: which dialog finishes first depends on timing)."""
    turns = []
    for _ in range(num_batches):
        turns.extend(flatten_turns(collector.next()))
    return turns


def close(collector: Any) -> None:
    collector.shutdown()
    engine_of(collector.policy).close()


def after_restore(collector: Any, adapter: LoraAdapter, num_batches: int) -> dict[str, Any]:
    """Push ``adapter``, collect ``num_batches``; the weights, greedy answers, version and turns."""
    collector.update_policy_weights_(adapter)
    turns = collect(collector, num_batches)
    return {
        "weights": weights_of(collector),
        "answers": greedy_answers(collector),
        "version": collector.version_index(),
        "turns": turns,
    }


def main(argv: list[str]) -> None:
    folder, adapter_file, model_path, out = argv
    collectors = [build(kind, model_path) for kind in KINDS]
    try:
        load_checkpoint(folder, collectors)
        adapter = LoraAdapter.from_state(codec.load(adapter_file))
        codec.save(out, {kind: after_restore(c, adapter, 2) for kind, c in zip(KINDS, collectors, strict=True)})
    finally:
        for collector in collectors:
            close(collector)


if __name__ == "__main__":
    main(sys.argv[1:])
