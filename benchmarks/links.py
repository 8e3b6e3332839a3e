"""Pushes and collection across real, rate-limited links: Ray worker nodes in network namespaces.

Run (root, with iproute2; ``python``: the project's virtual environment):
    python benchmarks/links.py                     # every row, rates 1 and 10 Gbit/s, 3 rounds each
    python benchmarks/links.py --quick             # 1 round, the tiny-budget smoke run
    python benchmarks/links.py --rows link,ray --rates 1000 --lrs 1e-6 --reps 1
    python benchmarks/links.py --fit run1.txt run2.txt   # fit the cost model to saved output

One cluster for the whole run (tests/links.py): the head (this process: the trainer, the replay
buffer) and one worker node "far" in its own network namespace, joined by a veth pair with a
``tc tbf`` limit of each ``--rates`` value (Mbit/s, both ways; changed live between rows). No
latency is added (netem is unavailable): the links are bandwidth limits. Rows:

- ``link``: a 64 MiB object pulled by a task on the far node (Ray's object transfer), next to the
  same on the head: the effective Gbit/s of each rate (what the cost model's bandwidth means).
- ``ray``: RayRemoteWeightUpdater into 2 collectors on the far node, the medium model in bf16; per
  round: a full push of the delta updater (its base), one real AdamW step (``--lrs``), a delta push,
  a plain updater's full push of the same weights. Medians; ratio delta / plain full.
- ``vllm``: vLLMUpdater (gloo process group over the link) into a bf16 vLLM engine on the far
  node: per round a full push, one AdamW step, a delta push (only with vLLM installed).
- ``collect``: 2 RayLLMCollectors (small model, TransformersPolicy) filling a RayReplayBuffer on
  the head, placed on the far node behind 1 Gbit/s vs on the head's node: turns/s, alternated.

Prints a "ROW <json>" line per row as it is measured, a table, and last a JSON line: the rows and
the fit of ``lmcollect.weights.cost_model`` to them (per updater: coefficients, predicted vs
measured, the rate below which a delta pays by lr), with predictions for 7B/70B models on GPU links
from assumed coefficients (``GPU_ASSUMED``). ``--fit RUN.txt ...`` only fits saved runs' output.
Targets are the constants below; measured figures live in docs/scaling.md only.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # tests.links: the namespaced cluster
sys.path.insert(0, str(Path(__file__).resolve().parent))  # weight_sync: its model and push helpers

import weight_sync  # noqa: E402

from lmcollect.weights.cost_model import MeasuredPush, PushCostModel, fit_push_cost  # noqa: E402
from tests.links import LinkedCluster, NodeLink, namespaces_unavailable  # noqa: E402

DELTA_TIME_TARGET_1GBIT = 0.2  # delta push / full push at 1 Gbit/s, lr 1e-6
COLLECT_TARGET = 0.95  # turns/s behind a 1 Gbit/s link / on the head's node
FAR = "far"
ALL_ROWS = ("link", "ray", "vllm", "collect")
OBJECT_STORE_BYTES = 1 << 30


def far_options(num_cpus: float) -> dict:
    return {"num_cpus": num_cpus, "resources": {FAR: 0.1}}


def head_options(num_cpus: float) -> dict:
    return {"num_cpus": num_cpus, "resources": {"head": 0.1}}


# ---------------------------------------------------------------------- link
def bench_link(cluster: LinkedCluster, rates: list[int], reps: int) -> list[dict]:
    """Seconds for a task on the far node (and on the head) to get a 64 MiB object put here."""
    import ray

    @ray.remote(num_cpus=0)
    def pull(refs: list) -> int:
        return int(ray.get(refs[0]).nbytes)  # inside a list: Ray does not resolve it before the task runs

    size = 64 << 20
    rows = []
    for rate in [None, *rates]:
        if rate is not None:
            cluster.set_rate(FAR, rate)
        options = {"resources": {FAR if rate else "head": 0.01}}
        seconds = []
        for rep in range(reps + 1):
            ref = ray.put(np.full(size, rep, dtype=np.uint8))
            start = time.perf_counter()
            assert ray.get(pull.options(**options).remote([ref])) == size
            if rep:
                seconds.append(time.perf_counter() - start)
            del ref
        median = statistics.median(seconds)
        rows.append({
            "row": f"object pull, 64 MiB, {'head node (no link)' if rate is None else f'far node, {rate / 1000:g} Gbit/s'}",
            "rate_mbit": rate, "nbytes": size, "median_s": round(median, 4),
            "effective_gbit_s": round(size * 8 / median / 1e9, 3),
        })  # fmt: skip
    return rows


# ---------------------------------------------------------------------- Ray pushes
def bench_ray(cluster: LinkedCluster, rates: list[int], lrs: list[float], reps: int) -> list[dict]:
    """RayRemoteWeightUpdater, medium bf16, 2 collectors on the far node: plain full vs delta."""
    from lmcollect.models import ModelSpec, get_model_path
    from lmcollect.ray.collector import RayLLMCollector
    from lmcollect.ray.updater import RayRemoteWeightUpdater
    from lmcollect.weight_sync import PushConfig

    path = str(get_model_path(ModelSpec(size="medium")))
    build = functools.partial(weight_sync.bf16_medium_model, path)
    collectors = [
        RayLLMCollector(
            weight_sync.make_env,
            policy_factory=functools.partial(weight_sync.ModelOnlyPolicy, build),
            dialog_turns_per_batch=1,
            track_policy_version=True,
            remote_config={**far_options(0.5), "max_concurrency": 2},
        )
        for _ in range(2)
    ]
    rows = []
    try:
        for rate in rates:
            cluster.set_rate(FAR, rate)
            for lr in lrs:
                trainer = build()
                optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
                plain = RayRemoteWeightUpdater(trainer, collectors, config=PushConfig(timeout_s=600))
                delta = RayRemoteWeightUpdater(trainer, collectors, config=PushConfig(timeout_s=600, delta=True))
                version = max(c.policy_version for c in collectors)
                times: dict[str, list[float]] = {"plain": [], "full": [], "delta": []}
                stats = []
                for rep in range(reps + 1):  # round 0 warms up
                    # the delta updater's base (a full push), one AdamW step, then the delta and a plain full push
                    delta.reset_delta_base()
                    for kind, updater in (("full", delta), ("step", None), ("delta", delta), ("plain", plain)):
                        if updater is None:
                            adamw_step(trainer, optimizer, seed=rep)
                            continue
                        version += 1
                        seconds = weight_sync.timed_push(functools.partial(updater.push_weights, version=version))
                        assert updater.last_push_stats.kind == ("delta" if kind == "delta" else "full")
                        if rep:
                            times[kind].append(seconds)
                            if kind == "delta":
                                stats.append(updater.last_push_stats)
                rows += push_rows("Ray", rate, lr, weight_sync.nbytes(trainer), times["plain"], times["delta"], stats)
                rows[-2]["num_buckets"] = rows[-1]["num_buckets"] = 1  # one object per push
    finally:
        for c in collectors:
            c.shutdown()
    return rows


def adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One real optimizer step on one random 16-token sequence: every parameter moves as after a
    longer batch (Adam's first step is about lr x sign(grad)), in seconds instead of half a minute
    (bf16 backward passes are slow on a CPU)."""
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def push_rows(kind: str, rate: int, lr: float, nbytes: int, full_s: list, delta_s: list, stats: list) -> list[dict]:
    where = f"{rate / 1000:g} Gbit/s, lr {lr:g}"
    full = {
        "row": f"{kind} full push, medium bf16, {where}", "rate_mbit": rate, "lr": lr, "kind": "full",
        "nbytes": nbytes, "full_nbytes": nbytes, "median_s": round(statistics.median(full_s), 4),
    }  # fmt: skip
    delta_bytes = int(statistics.median(s.nbytes for s in stats))
    delta = {
        "row": f"{kind} delta push, medium bf16, {where}", "rate_mbit": rate, "lr": lr, "kind": "delta",
        "nbytes": delta_bytes, "full_nbytes": nbytes, "median_s": round(statistics.median(delta_s), 4),
        "changed_fraction": round(statistics.median(s.num_changed / s.numel for s in stats), 5),
        "bytes_over_full": round(delta_bytes / nbytes, 4),
        "time_over_full": round(statistics.median(delta_s) / statistics.median(full_s), 3),
    }  # fmt: skip
    if rate == 1000 and lr == 1e-6:
        delta["target"] = DELTA_TIME_TARGET_1GBIT
    return [full, delta]


# ---------------------------------------------------------------------- vLLM pushes
def bench_vllm(cluster: LinkedCluster, rates: list[int], lrs: list[float], reps: int) -> list[dict]:
    """vLLMUpdater (gloo over the link) into a bf16 vLLM engine on the far node: full vs delta."""
    from lmcollect.engines.vllm.worker_ext import VLLM_EXTENSION
    from lmcollect.models import ModelSpec, get_model_path
    from lmcollect.policies.vllm_policy import VLLMPolicy
    from lmcollect.ray.vllm_replicas import VLLMReplicas
    from lmcollect.weight_sync.vllm_updater import vLLMUpdater
    from lmcollect.weights.delta import DeltaConfig

    path = str(get_model_path(ModelSpec(size="medium")))
    engine_kwargs = {
        "kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "worker_extension_cls": VLLM_EXTENSION,
        "dtype": "bfloat16",
    }  # fmt: skip
    replicas = VLLMReplicas(path, engine_kwargs=engine_kwargs, remote_config=far_options(1))
    rows = []
    try:
        updater = vLLMUpdater.from_policy(VLLMPolicy(path, engine=replicas))
        assert updater is not None
        updater.config = replace(updater.config, backend="gloo", delta=DeltaConfig(), timeout_s=600)
        buckets = None
        for rate in rates:
            cluster.set_rate(FAR, rate)
            for lr in lrs:
                trainer = weight_sync.bf16_medium_model(path)
                optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
                times: dict[str, list[float]] = {"full": [], "delta": []}
                stats = []
                for rep in range(reps + 1):
                    updater.reset_delta_base()  # a full push (the base), one AdamW step, a delta push
                    for kind in ("full", "step", "delta"):
                        if kind == "step":
                            adamw_step(trainer, optimizer, seed=rep)
                            continue
                        seconds = weight_sync.timed_push(functools.partial(updater.push_weights, trainer))
                        assert updater.last_push_stats.kind == kind, updater.last_push_stats
                        if rep:
                            times[kind].append(seconds)
                            if kind == "delta":
                                stats.append(updater.last_push_stats)
                size = weight_sync.nbytes(trainer)
                buckets = buckets or -(-size // (64 << 20))  # ProcessGroupConfig.bucket_size_bytes: 64 MiB
                rows += push_rows("vLLM", rate, lr, size, times["full"], times["delta"], stats)
                rows[-2]["num_buckets"], rows[-1]["num_buckets"] = buckets, 1
        updater.close()
    finally:
        replicas.shutdown()
    return rows


# ---------------------------------------------------------------------- collection
def make_collect_env(batch_size: int):
    from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset

    return ChatEnv(arithmetic_dataset(512, seed=0), reward_fn=MathAnswerReward(), batch_size=batch_size, seed=0)


def small_policy(path: str, max_new_tokens: int):
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.policies import SamplingConfig, TransformersPolicy

    model, tokenizer = load_model_and_tokenizer(path)
    return TransformersPolicy(model, tokenizer, sampling=SamplingConfig(max_new_tokens=max_new_tokens))


def collect_once(where: str, path: str, num_turns: int, batch_size: int) -> float:
    """Turns/s of 2 collectors placed ``where`` ("far" or "head") filling a buffer on the head
    (from start() to the buffer holding ``num_turns``; the actors' start-up is not timed)."""
    from lmcollect.ray import RayReplayBuffer
    from lmcollect.ray.group import RayCollectorGroup

    buffer = RayReplayBuffer(capacity=num_turns, remote_config=head_options(0.1))
    options = far_options(0.9) if where == FAR else head_options(0.9)
    with RayCollectorGroup(
        2,
        env=functools.partial(make_collect_env, batch_size),
        policy_factory=functools.partial(small_policy, path, 16),
        dialog_turns_per_batch=batch_size,
        total_dialog_turns=num_turns // 2,
        replay_buffer=buffer,
        remote_configs=[options, options],
    ) as group:
        start = time.perf_counter()
        group.start()
        deadline = start + 600
        while len(buffer) < num_turns and time.perf_counter() < deadline:
            time.sleep(0.05)
        seconds = time.perf_counter() - start
    assert len(buffer) == num_turns, f"{len(buffer)} of {num_turns} turns arrived within 600 s"
    return num_turns / seconds


def bench_collect(cluster: LinkedCluster, reps: int, num_turns: int) -> list[dict]:
    from lmcollect.models import ModelSpec, get_model_path

    cluster.set_rate(FAR, 1000)
    path = str(get_model_path(ModelSpec(size="small")))
    rates: dict[str, list[float]] = {FAR: [], "head": []}
    for _ in range(reps):
        for where in rates:
            rates[where].append(collect_once(where, path, num_turns, batch_size=8))
    ratio = statistics.median(f / h for f, h in zip(rates[FAR], rates["head"], strict=True))
    return [{
        "row": "2 RayLLMCollectors (small) -> RayReplayBuffer on the head: behind 1 Gbit/s vs on the head's node",
        "turns_per_s_far": round(statistics.median(rates[FAR]), 2),
        "turns_per_s_head": round(statistics.median(rates["head"]), 2),
        "ratio": round(ratio, 3), "target": COLLECT_TARGET, "num_turns": num_turns,
        "all_far": [round(x, 2) for x in rates[FAR]], "all_head": [round(x, 2) for x in rates["head"]],
    }]  # fmt: skip


# ---------------------------------------------------------------------- the cost model
# Assumed, not measured (no GPU here): NCCL over RDMA reaching 80% of the rate, HBM-speed copies
# and engine loads (1 ms/GB), a delta's gather/scatter at 5 ms/GB of delta and its compare pass
# at 3 ms/GB of model, 0.1 ms per 64 MiB bucket, 10 ms per push.
GPU_ASSUMED = PushCostModel(
    fixed_s=0.01, per_byte_s=1e-12, per_delta_byte_s=5e-12, delta_per_full_byte_s=3e-12, link_efficiency=0.8,
    per_bucket_s=1e-4,
)  # fmt: skip
BUCKET_BYTES = 64 << 20
PREDICTED_MODELS = {"7B": 7e9 * 2, "70B": 70e9 * 2}  # bf16 bytes
PREDICTED_LINKS = {"100 Gbit/s": 100.0, "400 Gbit/s": 400.0, "NVLink (450 GB/s)": 3600.0}


def measured_pushes(rows: list[dict], kind: str) -> list[MeasuredPush]:
    """The push rows of one updater ("Ray" or "vLLM") as points to fit."""
    return [
        MeasuredPush(
            kind=r["kind"],
            nbytes=r["nbytes"],
            full_nbytes=r["full_nbytes"],
            bandwidth_gbit=r["rate_mbit"] / 1000,
            seconds=r["median_s"],
            num_buckets=r.get("num_buckets", 1),
        )
        for r in rows
        if r["row"].startswith(f"{kind} ") and r.get("kind") in ("full", "delta")
    ]


def fit_report(rows: list[dict]) -> dict:
    """Fit one model per updater; predicted vs measured for every point, and the GPU predictions."""
    report: dict = {"models": {}, "points": [], "predictions": []}
    for kind in ("Ray", "vLLM"):
        points = measured_pushes(rows, kind)
        if len({p.bandwidth_gbit for p in points}) < 2:
            continue
        model = fit_push_cost(points)
        report["models"][kind] = model.__dict__
        for r, p in zip([r for r in rows if r["row"].startswith(f"{kind} ") and "kind" in r], points, strict=True):
            report["points"].append({"row": r["row"], "measured_s": p.seconds, "predicted_s": round(model.predict(p), 4)})
        fractions = sorted({r["lr"]: r["bytes_over_full"] for r in rows if r["row"].startswith(f"{kind} delta")}.items())
        report["models"][kind]["breakeven_gbit_by_lr"] = {lr: finite(model.breakeven_gbit(f)) for lr, f in fractions}
    fractions = {r["lr"]: r["bytes_over_full"] for r in rows if r.get("kind") == "delta"}
    for name, full in PREDICTED_MODELS.items():
        buckets = int(-(-full // BUCKET_BYTES))
        for link, gbit in PREDICTED_LINKS.items():
            entry = {"model": name, "link": link, "full_s": round(GPU_ASSUMED.full_push_s(full, gbit, num_buckets=buckets), 3)}
            for lr, fraction in sorted(fractions.items()):
                delta_buckets = int(-(-fraction * full // BUCKET_BYTES))
                delta_s = GPU_ASSUMED.delta_push_s(full, fraction * full, gbit, num_buckets=delta_buckets)
                entry[f"delta_s_lr_{lr:g}"] = round(delta_s, 3)
            report["predictions"].append(entry)
    report["gpu_breakeven_gbit_by_lr"] = {lr: finite(GPU_ASSUMED.breakeven_gbit(f)) for lr, f in sorted(fractions.items())}
    for model in report["models"].values():
        model["max_gbit"] = finite(model["max_gbit"])
    return report


def saved_rows(output: str) -> list[dict]:
    """The rows of one run's output: its final JSON line, else the "ROW" lines it printed."""
    lines = output.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        return json.loads(lines[-1])["rows"]
    return [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]


def finite(value: float) -> float | str:
    """``value`` rounded, or "inf" (JSON has no infinity)."""
    return round(value, 3) if math.isfinite(value) else "inf"


# ---------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round per row, fewer turns")
    parser.add_argument("--rows", default=",".join(ALL_ROWS), help=f"comma-separated: {','.join(ALL_ROWS)}")
    parser.add_argument("--rates", default="1000,10000", help="link rates in Mbit/s")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="AdamW learning rates of the push rows")
    parser.add_argument("--reps", type=int, default=None, help="rounds per row (default 3, --quick 1)")
    parser.add_argument("--turns", type=int, default=None, help="turns per collection run (default 96, --quick 32)")
    parser.add_argument("--fit", nargs="+", metavar="RUN_JSON", help="only fit the cost model to earlier runs' JSON lines")
    args = parser.parse_args()
    if args.fit:  # the last JSON line of each run, or its "ROW" lines
        rows = [row for path in args.fit for row in saved_rows(Path(path).read_text())]
        print(json.dumps(fit_report(rows), indent=1))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still removes its cluster
    reason = namespaces_unavailable()
    if reason:
        sys.exit(f"benchmarks/links.py needs network namespaces: {reason}")
    rows_wanted = args.rows.split(",")
    rates = [int(r) for r in args.rates.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    reps = args.reps or (1 if args.quick else 3)
    turns = args.turns or (32 if args.quick else 96)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    load_before = os.getloadavg()[0]
    started = time.time()
    nodes = [NodeLink(name=FAR, rate_mbit=rates[0], num_cpus=2, object_store_memory=OBJECT_STORE_BYTES)]
    results: list[dict] = []
    with LinkedCluster(
        nodes, head_num_cpus=2, head_resources={"head": 1}, head_object_store_memory=OBJECT_STORE_BYTES
    ) as cluster:
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(weight_sync)
        if __name__ != "__main__":
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        if "link" in rows_wanted:
            results += report(bench_link(cluster, rates, reps))
        if "ray" in rows_wanted:
            results += report(bench_ray(cluster, rates, lrs, reps))
        if "vllm" in rows_wanted:
            try:
                import vllm  # noqa: F401
            except ImportError:
                print("vllm rows skipped: vllm is not installed")
            else:
                results += report(bench_vllm(cluster, rates, lrs, reps))
        if "collect" in rows_wanted:
            results += report(bench_collect(cluster, reps, turns))
    print_table(results)
    summary = {
        "benchmark": "links", "rows": results, "fit": fit_report(results), "reps": reps, "seconds": round(time.time() - started, 1),
        "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    print(json.dumps(summary))


def report(rows: list[dict]) -> list[dict]:
    """Print each row as it is measured (a run cut short keeps what it measured)."""
    for row in rows:
        print("ROW", json.dumps(row), flush=True)
    return rows


def print_table(results: list[dict]) -> None:
    print(f"{'row':<92} {'median s':>9} {'MB':>8} {'vs full':>8} {'Gbit/s':>8}")
    for r in results:
        if "turns_per_s_far" in r:
            print(f"{r['row']:<92} {r['turns_per_s_far']:>6} vs {r['turns_per_s_head']} turns/s: ratio {r['ratio']}")
            continue
        vs_full = r.get("time_over_full", "")
        print(
            f"{r['row']:<92} {r['median_s']:>9} {r['nbytes'] / 1e6:>8.1f} {vs_full!s:>8} "
            f"{r.get('effective_gbit_s', '')!s:>8}"
        )


if __name__ == "__main__":
    main()
