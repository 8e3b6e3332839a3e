"""Soak: two Ray collectors, a trainer pushing weights after every batch, replay-buffer sampling, for M minutes.

Run: .venv/bin/python benchmarks/soak.py --minutes 20 [--warmup-s 60] [--json runs/soak.json]

Two ``RayLLMCollector`` s (the tiny model through transformers, multi-turn guessing games) fill one
``RayReplayBuffer``; the driver is the trainer: it waits for a batch of new turns, samples a batch
from the buffer, takes one clipped policy-gradient step and pushes the weights to both collectors
(``RayRemoteWeightUpdater``), until the time is up. Every few seconds it records the RSS of each
process (trainer, collectors, buffer, and Ray's own daemons when this process started the cluster)
and the object store's use. Before each sample the trainer hands its allocator's free pages back
to the system (glibc ``malloc_trim``): a training step's activations vary in size with the batch,
and glibc keeps what they freed, so without it the trainer's RSS swings by ~100 MiB between
steps and its floor drifts with the batches it happened to see, a leak or not (a CI run saw +9%
with no leak). What is still in use (a leak) survives the trim. At the end it pauses the collectors and accounts for every turn:

* each collector's ``postproc`` is a :class:`TurnLedger`, which checks every turn the collector
  yields against its trajectory (step counts must follow 0, 1, 2, ... per trajectory id: a repeat
  is a duplicate, a jump is a lost turn, a trajectory left unfinished while its slot moved on is a
  lost ending);
* the buffer must have been written exactly the turns the ledgers passed;
* what a collector ran and has not yielded yet (at most one batch) is reported as pending;
* the turns still in the buffer (a ring of the latest ones) must be distinct (trajectory id, step).

Pass/fail: 0 lost, 0 duplicated, RSS growth of the job's processes (trainer, collectors, buffer)
under 5% between the end of the warm-up and the end. Prints a table; the last line is JSON.
``tests/integration/test_soak.py`` runs the same function for 48 s in CI.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ray
import torch
from tensordict import TensorDictBase

from lmcollect.ray import RayReplayBuffer
from lmcollect.ray.group import RayCollectorGroup
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.envs import ChatEnv, GuessingGameTask, guessing_game_dataset
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies import SamplingConfig, TransformersPolicy
from lmcollect.training.grpo import pack_turns, policy_gradient_loss, token_log_probs
from lmcollect.ray import RayRemoteWeightUpdater
from lmcollect.weight_sync import PushConfig

logger = logging.getLogger("soak")

if __name__ != "__main__":  # imported (e.g. by the CI test): Ray actors get this module's code by value
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAX_RSS_GROWTH = 0.05
JOB_PROCESSES = ("trainer", "collector-0", "collector-1", "buffer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoakConfig:
    """One soak run."""

    minutes: float = 2.0
    """How long the trainer trains and pushes (start-up and the final accounting come on top)."""
    warmup_s: float = 30.0
    """RSS growth is measured from the end of this warm-up (the buffer fills, allocators settle)."""
    sample_every_s: float = 5.0
    """Seconds between two RSS / object-store samples."""
    num_envs: int = 4
    """Guessing games each collector plays at once (one policy call answers them all)."""
    turns_per_batch: int = 8
    """Turns per collector batch; the trainer steps once per this many new turns per collector."""
    turns_per_step: int = 16
    """Turns the trainer samples from the buffer for one step."""
    buffer_capacity: int = 256
    """Turns the buffer keeps (a ring: full well before the warm-up ends, so its memory is flat)."""
    max_new_tokens: int = 8
    """Token budget of one answer."""
    model_dir: str | None = None
    """Where the tiny model is built (None: lmcollect's cache)."""
    seed: int = 0
    """Seed of the collectors, the trainer's sampling and the envs."""

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.warmup_s < 0 or self.sample_every_s <= 0:
            raise ValueError("minutes and sample_every_s must be positive and warmup_s >= 0.")
        if self.warmup_s + 6 * self.sample_every_s > self.minutes * 60:
            raise ValueError(
                f"warmup_s={self.warmup_s} leaves fewer than 6 samples in {self.minutes} minutes; "
                "lower warmup_s or sample_every_s, or raise minutes."
            )


# ---------------------------------------------------------------------------------- accounting
class TurnLedger:
    """A collector ``postproc`` that checks every yielded turn against its trajectory, then passes the batch on.

    Turns of one trajectory arrive in step order (one collector yields them), so each trajectory
    needs only its next expected step while it is open: memory stays flat however long it runs.
    """

    def __init__(self) -> None:
        self.turns = 0
        self.duplicated = 0
        self.lost = 0
        self._next_step: dict[int, int] = {}  # open trajectory -> the step it must yield next
        self._open_in_slot: dict[int, int] = {}  # env slot -> its open trajectory

    def __call__(self, batch: TensorDictBase) -> TensorDictBase:
        for turn in flatten_turns(batch):
            self.record(int(turn[keys.TRAJ_IDS]), int(turn[keys.STEP_COUNT]), int(turn[keys.ENV_INDEX]),
                        bool(turn[keys.NEXT_DONE].any()))
        return batch

    def record(self, traj_id: int, step: int, slot: int, done: bool) -> None:
        self.turns += 1
        previous = self._open_in_slot.get(slot)
        if previous is not None and previous != traj_id:  # the slot moved on: its trajectory lost its end
            self.lost += 1
            self._next_step.pop(previous, None)
        expected = self._next_step.get(traj_id, 0)
        if step < expected:
            self.duplicated += 1
        elif step > expected:
            self.lost += step - expected
        self._next_step[traj_id] = max(expected, step + 1)
        if done:
            self._next_step.pop(traj_id, None)
            self._open_in_slot.pop(slot, None)
        else:
            self._open_in_slot[slot] = traj_id

    def summary(self) -> dict[str, int]:
        return {"turns": self.turns, "duplicated": self.duplicated, "lost": self.lost, "open": len(self._next_step)}


def account_turns(turns: Iterable[TensorDictBase]) -> dict[str, int]:
    """turns / duplicated / lost of a set of turns in any order (lost: steps missing before a
    trajectory's last seen step; a trajectory may end early, cut by a fault)."""
    steps: dict[int, list[int]] = {}
    for turn in turns:
        steps.setdefault(int(turn[keys.TRAJ_IDS]), []).append(int(turn[keys.STEP_COUNT]))
    count = sum(len(s) for s in steps.values())
    duplicated = sum(len(s) - len(set(s)) for s in steps.values())
    lost = sum(max(s) + 1 - len(set(s)) for s in steps.values())
    return {"turns": count, "duplicated": duplicated, "lost": lost, "trajectories": len(steps)}


# ---------------------------------------------------------------------------------- the job's pieces
def make_env(num_envs: int, seed: int) -> ChatEnv:
    """Guessing games of up to five turns: trajectories long enough for step accounting to matter."""
    task = GuessingGameTask(low=1, high=20, max_turns=5)
    dataset = guessing_game_dataset(256, seed=seed, low=1, high=20, max_turns=5)
    return ChatEnv(dataset, task=task, batch_size=num_envs, max_turns=5, seed=seed)


def make_policy(model_path: str, max_new_tokens: int) -> TransformersPolicy:
    model, tokenizer = load_model_and_tokenizer(model_path)
    return TransformersPolicy(model, tokenizer, sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0))


class Trainer:
    """One clipped policy-gradient step per batch of sampled turns (advantage: reward - batch mean)."""

    def __init__(self, model_path: str, seed: int) -> None:
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_model_and_tokenizer(model_path)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, batch: TensorDictBase) -> None:
        turns = flatten_turns(batch)
        packed = pack_turns(
            [t[keys.TOKENS_PROMPT] for t in turns],
            [t[keys.TOKENS_RESPONSE] for t in turns],
            [t[keys.LOG_PROBS_RESPONSE] for t in turns],
            pad_token_id=self.tokenizer.pad_token_id,
        )
        rewards = torch.stack([t[keys.NEXT_REWARD].float().sum() for t in turns])
        self.model.train()
        loss, _ = policy_gradient_loss(token_log_probs(self.model, packed), packed, rewards - rewards.mean())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.model.eval()


class Sampler:
    """RSS of every watched process and the object store's use, every ``every_s`` seconds."""

    def __init__(self, pids: dict[str, int], every_s: float) -> None:
        self.pids = pids
        self.every_s = every_s
        self.rows: list[dict[str, Any]] = []
        self._start = time.monotonic()
        self._next = self._start
        self._ray_state = _ray_state()

    def maybe_sample(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        _release_free_heap()
        row: dict[str, Any] = {"t_s": round(now - self._start, 1)}
        for name, pid in self.pids.items():
            rss_mb = _rss_mb(pid)
            if rss_mb is not None:  # a process that exited is reported as missing
                row[f"rss_mb/{name}"] = round(rss_mb, 1)
        row.update(_object_store_use(self._ray_state))
        self.rows.append(row)


def _release_free_heap() -> None:
    """Return this process's free heap pages to the system (glibc ``malloc_trim(0)``; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): RSS then includes what the allocator keeps
        return
    libc.malloc_trim(0)


def _rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MiB, as ``ps`` reports it (Linux ``/proc``; None once it exited)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _ray_state() -> Any:
    from ray._private import internal_api  # Ray has no public call for the store's bytes in use

    return internal_api.get_state_from_address(ray.get_runtime_context().gcs_address)


def _object_store_use(state: Any) -> dict[str, float]:
    from ray._private import internal_api

    stats = internal_api.get_memory_info_reply(state, timeout_seconds=10).store_stats
    return {"object_store/used_mb": round(stats.object_store_bytes_used / 2**20, 2), "object_store/objects": stats.num_local_objects}


def _ray_daemon_pids() -> dict[str, int]:
    """raylet and GCS of a cluster this process started (none when it attached to one)."""
    node = getattr(ray._private.worker, "_global_node", None)  # Ray exposes no public handle to them
    processes = getattr(node, "all_processes", None) or {}
    return {name: infos[0].process.pid for name in ("raylet", "gcs_server") if (infos := processes.get(name))}


def _wait_for_writes(buffer: RayReplayBuffer, group: RayCollectorGroup, target: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    next_check = time.monotonic() + 5.0
    while buffer.write_count < target:
        now = time.monotonic()
        if now > next_check:  # is_running() re-raises what stopped a collector
            if not all(c.is_running() for c in group):
                raise RuntimeError("a collector stopped collecting during the soak")
            next_check = now + 5.0
        if now > deadline:
            raise RuntimeError(f"the buffer did not reach {target} writes within {timeout_s:.0f} s")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------- the run
def run_soak(config: SoakConfig) -> dict[str, Any]:
    """Run the soak (Ray must be running, or a local cluster is started); returns the report."""
    model_path = str(get_model_path(ModelSpec(size="tiny"), cache_dir=config.model_dir))
    load_start = os.getloadavg()
    buffer = RayReplayBuffer(capacity=config.buffer_capacity, seed=config.seed)
    group = RayCollectorGroup(
        2,
        seed=config.seed,
        env=functools.partial(make_env, config.num_envs, config.seed),
        policy_factory=functools.partial(make_policy, model_path, config.max_new_tokens),
        replay_buffer=buffer,
        dialog_turns_per_batch=config.turns_per_batch,
        postproc=TurnLedger(),
        track_policy_version=True,
        num_cpus=0.5,
    )
    try:
        trainer = Trainer(model_path, config.seed)
        updater = RayRemoteWeightUpdater(trainer.model, list(group), config=PushConfig(timeout_s=120))
        pids = {"trainer": os.getpid(), **{f"collector-{i}": c.process_info()["pid"] for i, c in enumerate(group)}}
        pids["buffer"] = ray.get(buffer.actor.__ray_call__.remote(lambda _: os.getpid()))
        sampler = Sampler({**pids, **_ray_daemon_pids()}, config.sample_every_s)
        with _torch_threads(1):  # the collectors have the other core
            train = _train(config, trainer, updater, buffer, group, sampler)
        accounting = _account(group, buffer)
    finally:
        group.shutdown()
        buffer.shutdown()
    report = {
        "benchmark": "soak",
        "config": dataclasses.asdict(config),
        **train,
        **accounting,
        "rss": _rss_growth(sampler.rows, config.warmup_s),
        "object_store": _object_store_summary(sampler.rows),
        "samples": sampler.rows,
        "loadavg": {"start": load_start, "end": os.getloadavg()},
    }
    report["problems"] = soak_problems(report)
    return report


def _train(config: SoakConfig, trainer: Trainer, updater: RayRemoteWeightUpdater, buffer: RayReplayBuffer,
           group: RayCollectorGroup, sampler: Sampler) -> dict[str, Any]:
    group.start()
    push_s: list[float] = []
    staleness: Counter[int] = Counter()
    written = 0
    end = time.monotonic() + config.minutes * 60
    while time.monotonic() < end:
        written += config.turns_per_batch * len(group)  # one batch from each collector per step
        _wait_for_writes(buffer, group, written)
        batch = buffer.sample(config.turns_per_step)
        staleness.update((updater.version - batch[keys.POLICY_VERSION].reshape(-1)).tolist())
        trainer.step(batch)
        start = time.perf_counter()
        updater.push_weights()
        push_s.append(time.perf_counter() - start)
        sampler.maybe_sample()
    return {
        "train_steps": len(push_s),
        "pushes": {"count": len(push_s), "p50_s": _quantile(push_s, 0.5), "p99_s": _quantile(push_s, 0.99)},
        "staleness": _staleness_summary(staleness),
    }


def _account(group: RayCollectorGroup, buffer: RayReplayBuffer) -> dict[str, Any]:
    """With every collector paused (no turn runs, every yielded batch written), account for each turn."""
    with contextlib.ExitStack() as paused:
        for collector in group:
            paused.enter_context(collector.pause())
        ledgers = [c.cascade_execute("postproc.summary") for c in group]
        turns_run = [c.turns_run for c in group]
        write_count = buffer.write_count
        kept = account_turns(flatten_turns(buffer.sample(len(buffer), replace=False)))  # a ring: ends overwritten
    yielded = sum(ledger["turns"] for ledger in ledgers)
    return {
        "turns": {
            "collected": sum(turns_run),
            "yielded": yielded,
            "written": write_count,
            "pending": sum(turns_run) - yielded,  # run, not yet yielded: at most one batch per collector
            "lost": sum(ledger["lost"] for ledger in ledgers) + max(0, yielded - write_count),
            "duplicated": sum(ledger["duplicated"] for ledger in ledgers) + max(0, write_count - yielded),
            "in_buffer": {"turns": kept["turns"], "duplicated": kept["duplicated"]},
            "per_collector": [{**ledger, "run": run} for ledger, run in zip(ledgers, turns_run)],
        }
    }


def soak_problems(report: dict[str, Any], max_rss_growth: float = MAX_RSS_GROWTH) -> list[str]:
    """What makes the soak fail (empty: it passed)."""
    turns, config = report["turns"], report["config"]
    problems = []
    if turns["lost"] or turns["duplicated"]:
        problems.append(f"{turns['lost']} turn(s) lost and {turns['duplicated']} duplicated")
    if turns["in_buffer"]["duplicated"]:
        problems.append(f"the buffer holds {turns['in_buffer']['duplicated']} duplicated turn(s)")
    if not 0 <= turns["pending"] <= config["turns_per_batch"] * len(turns["per_collector"]):
        problems.append(f"{turns['pending']} turns run but not yielded: more than one batch per collector")
    for name in JOB_PROCESSES:
        growth = report["rss"].get(name, {}).get("growth")
        if growth is None:
            problems.append(f"no RSS samples of {name} after the warm-up")
        elif growth > max_rss_growth:
            problems.append(f"RSS of {name} grew {growth:.1%} after the warm-up (limit {max_rss_growth:.0%})")
    if report["train_steps"] == 0:
        problems.append("the trainer took no step")
    return problems


# ---------------------------------------------------------------------------------- summaries
def _rss_growth(rows: list[dict[str, Any]], warmup_s: float) -> dict[str, dict[str, float | None]]:
    """Per process: the RSS floor (lowest sample) of the first and of the last third after the warm-up, and its growth.

    A process's RSS swings with every step (a training step's tensors come and go), so one sample,
    or a median of a few, says little. The floor does not swing: a leak raises it, a transient
    allocation does not.
    """
    after = [row for row in rows if row["t_s"] >= warmup_s]
    out: dict[str, dict[str, float | None]] = {}
    names = sorted({key.split("/", 1)[1] for row in rows for key in row if key.startswith("rss_mb/")})
    for name in names:
        values = [row[f"rss_mb/{name}"] for row in after if f"rss_mb/{name}" in row]
        third = len(values) // 3
        if third < 2:
            out[name] = {"start_mb": None, "end_mb": None, "growth": None}
            continue
        start, end = min(values[:third]), min(values[-third:])
        out[name] = {"start_mb": start, "end_mb": end, "max_mb": max(values), "growth": (end - start) / start}
    return out


def _object_store_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    used = [row["object_store/used_mb"] for row in rows if "object_store/used_mb" in row]
    return {"max_used_mb": max(used, default=0.0), "last_used_mb": used[-1] if used else 0.0}


def _staleness_summary(counts: Counter[int]) -> dict[str, float]:
    values = sorted(counts.elements())
    if not values:
        return {"mean": 0.0, "p50": 0.0, "max": 0.0}
    return {"mean": statistics.fmean(values), "p50": float(_quantile(values, 0.5)), "max": float(values[-1])}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@contextlib.contextmanager
def _torch_threads(num_threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def format_report(report: dict[str, Any]) -> str:
    turns, pushes, stale = report["turns"], report["pushes"], report["staleness"]
    lines = [
        f"soak: {report['config']['minutes']} min, {report['train_steps']} trainer steps, load average "
        f"{report['loadavg']['start'][0]:.1f} -> {report['loadavg']['end'][0]:.1f} (2 cores)",
        f"turns: {turns['collected']} collected = {turns['written']} written + {turns['pending']} pending; "
        f"lost {turns['lost']}, duplicated {turns['duplicated']}; buffer window {turns['in_buffer']}",
        f"pushes: {pushes['count']}, p50 {pushes['p50_s'] * 1e3:.1f} ms, p99 {pushes['p99_s'] * 1e3:.1f} ms",
        f"staleness (trainer version - turn version at sampling): mean {stale['mean']:.2f}, p50 {stale['p50']:.0f}, max {stale['max']:.0f}",
        f"object store: max {report['object_store']['max_used_mb']:.1f} MiB, last {report['object_store']['last_used_mb']:.1f} MiB",
        "| process | RSS floor after warm-up (MiB) | RSS floor at end (MiB) | growth |",
        "|---|---|---|---|",
    ]
    for name, rss in report["rss"].items():
        growth = "-" if rss["growth"] is None else f"{rss['growth']:+.1%}"
        lines.append(f"| {name} | {rss['start_mb']} | {rss['end_mb']} | {growth} |")
    lines.append("PASS" if not report["problems"] else "FAIL: " + "; ".join(report["problems"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the report (with every sample) here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    repo_root = str(Path(__file__).resolve().parents[1])
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": repo_root}})
    report = run_soak(SoakConfig(minutes=args.minutes, warmup_s=args.warmup_s, sample_every_s=args.sample_every_s))
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}))
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    main()
