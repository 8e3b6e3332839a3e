"""`lmcollect demo`: GRPO on a shipped task, Ray collectors filling a buffer while the driver trains.

Run: ``lmcollect demo`` (about 3-4 minutes on 2 CPU cores; ``lmcollect demo --help`` for the knobs).

After a short supervised warm-up (the model starts from random weights), the loop is::

    for step in range(max_steps):
        turns = buffer.sample(turns_per_step, min_policy_version=version - max_staleness)
        learner.train_step(turns)        # clipped policy gradient on group-normalised advantages
        push_weights(model)              # every collector now generates with version + 1

With ``--lora-rank R`` the warm-up still trains every weight (it stands in for pre-training), then RL
trains a LoRA adapter of rank R on the warmed-up base: the collectors get the base once (version 1),
and every later push sends only the adapter, which their engines merge into that base.

Collectors compute each turn's advantage when they write it (a batch holds whole groups), and go
on collecting while the driver trains: collection overlaps training, and the importance ratio
against the log-probs recorded at collection corrects for turns a version or two old.

Dynamic sampling (``--dynamic-sampling``, on by default when the warmed-up policy solves some prompts
and not all): groups whose answers all got the same reward never reach the buffer, and the
collectors generate others in their place. Each step logs the share of groups kept since the step
before (``sampling/kept_share``): it falls as the policy learns to solve whole groups.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from lmcollect.cli.agent_demo import AGENT_TASK, run_agent_demo
from lmcollect.cli.builders import (
    EnvFactory,
    PolicyFactory,
    check_backend,
    collector_placement,
    resolve_model_path,
    resolve_task,
)
from lmcollect.cli.cluster import interrupt_on_sigint
from lmcollect.cli.collection import Collection, background_collection
from lmcollect.cli.configs import DemoConfig, UsageError
from lmcollect.cli.progress import step_progress
from lmcollect.cli.quiet import LIBRARY_LOG, library_logs
from lmcollect.cli.report import (
    PLOT_FILE,
    ROLLOUT_REPORT_FILE,
    decoded_turn_records,
    make_run_dir,
    mean_of,
    plot_training,
    push_cost_rows,
    push_cost_summary,
    run_summary,
    sampling_rows,
    summary_table,
    write_summary,
)
from lmcollect.cli.weight_push import WeightPusher
from lmcollect.collectors import DynamicSampling, SamplingCounts, drop_uniform_rewards
from lmcollect.engines.kv_policy import PushCost
from lmcollect.envs import ShippedTask
from lmcollect.loggers import JsonlLogger, MissingLoggerPackage, MultiLogger, check_available, make_logger
from lmcollect.loggers.jsonl import METRICS_FILE
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import SamplingConfig, TransformersPolicy
from lmcollect.ray.buffer import RayReplayBuffer
from lmcollect.ray.cluster import ray_session
from lmcollect.ray.group import RayCollectorGroup
from lmcollect.training.batch import LEARNER_KEYS, GroupAdvantage, TrainBatch, train_batch_from_turns
from lmcollect.training.evaluate import mean_reward
from lmcollect.training.lora import MISSING_PEFT, count_parameters, peft_available, wrap_lora
from lmcollect.training.trainer import GRPOConfig, GRPOLearner
from lmcollect.training.warmup import WarmupConfig, warm_up
from lmcollect.weights.delta import PushStats

logger = logging.getLogger(__name__)

NUM_TRAIN_PROMPTS = 4096
WAIT_TIMEOUT_S = 120.0
HEALTH_CHECK_S = 2.0
REPORT_STEPS = 4
"""The rollout report (rollouts.html) shows the turns of the last this many training steps."""
AUTO_SAMPLING_REWARDS = (0.05, 0.95)
"""``--dynamic-sampling auto`` turns it on when the mean reward before RL lies in this range: outside
it, nearly every group's answers all get the same reward and would be dropped."""


def run_demo(config: DemoConfig) -> int:
    if config.env is None and config.task == AGENT_TASK:  # an agent program through the OpenAI-compatible endpoint
        _check_logger(config.logger)
        return run_agent_demo(config)
    task = _single_turn_task(config.env or config.task, flag="--task" if config.env is None else "--env")
    check_backend(config.backend)
    _check_logger(config.logger)
    _check_lora(config.lora_rank)
    model_path = resolve_model_path(config.model)
    console = Console()
    run_dir = make_run_dir(config.output_dir, "demo")
    console.print(f"[bold]lmcollect demo[/]: GRPO on '{task.name}' ({task.description}); run folder {run_dir}")
    if config.logger in LOGGER_DIRS:
        console.print(f"{config.logger} logs in {run_dir / LOGGER_DIRS[config.logger]}")
    torch.manual_seed(config.seed)
    with library_logs(run_dir / LIBRARY_LOG) as logs:
        model, tokenizer = load_model_and_tokenizer(model_path)
        with ray_session(config.address), _torch_threads(_trainer_threads(config)):
            logs.note_ray_logs()
            demo = DemoRun(config, task, model, tokenizer, model_path=model_path, run_dir=run_dir, console=console)
            with interrupt_on_sigint():  # after Ray and the loggers are up: see its docstring
                summary = demo.run()
    console.print(summary_table(_table_rows(summary), title=f"lmcollect demo: {run_dir}"))
    if summary["files"]["report"] is not None:
        console.print(
            f"rollouts of the last training steps: {run_dir / summary['files']['report']} (open it in a browser)"
        )
    logs.print_where(console)
    return 130 if summary["interrupted"] else 0


def _trainer_threads(config: DemoConfig) -> int:
    """Torch threads of the trainer: the cores the collectors leave (at least one; each uses one or more)."""
    collector_threads = config.num_collectors * max(1, math.floor(config.cpus_per_collector))
    return max(1, (os.cpu_count() or 1) - collector_threads)


@contextlib.contextmanager
def _torch_threads(num_threads: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


LOGGER_DIRS = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Where each extra logger writes inside the run folder (metrics.jsonl is always written)."""


def _check_logger(kind: str) -> None:
    try:
        check_available(kind)
    except MissingLoggerPackage as exc:
        raise UsageError(f"--logger {kind}: {exc}") from exc


def _check_lora(rank: int) -> None:
    if rank and not peft_available():
        raise UsageError(f"--lora-rank {rank}: {MISSING_PEFT}; or --lora-rank 0 for full fine-tuning.")


def _single_turn_task(name: str, *, flag: str) -> ShippedTask:
    task = resolve_task(name, flag=flag)
    if task.max_turns != 1 or not task.has_reference_answers:
        raise UsageError(
            f"{flag} {name}: the demo trains on single-turn tasks with reference answers (comparison, addition, "
            f"arithmetic, or a reasoning-gym generator that has them), or on an agent program (--task {AGENT_TASK})."
        )
    return task


class DemoRun:
    """One demo run: collectors, buffer, learner, and what has happened so far (for summary.json)."""

    def __init__(
        self,
        config: DemoConfig,
        task: ShippedTask,
        model: Any,
        tokenizer: Any,
        *,
        model_path: Path,
        run_dir: Path,
        console: Console,
    ) -> None:
        self.config, self.task, self.model, self.tokenizer = config, task, model, tokenizer
        self.model_path, self.run_dir, self.console = model_path, run_dir, console
        self.metrics = JsonlLogger(run_dir)  # metrics.jsonl: always written, kept after Ctrl-C
        extra = [] if config.logger == "jsonl" else [make_logger(config.logger, run_dir, asdict(config))]
        self.logger = MultiLogger([self.metrics, *extra])
        self.version = 0  # the trainer's weights; every collector has them after a push
        self.rewards: dict[str, float] = {}
        self.timings_s: dict[str, float] = {}
        self.interrupted = False
        self.eval_rows = task.make_rows(config.num_eval_prompts, seed=config.seed + 1)
        self.buffer: RayReplayBuffer | None = None
        self.group: RayCollectorGroup | None = None
        self.collection: Collection | None = None
        self.recent_turns: deque[Any] = deque(maxlen=REPORT_STEPS)  # for rollouts.html
        self.pushes: dict[str, PushStats | None] = {"initial": None, "last": None}  # version 1, the latest
        self.push_costs: list[PushCost] = []  # what the pushes cost every collector's engine (read at shutdown)
        self.files: dict[str, str | None] = {"metrics": METRICS_FILE, "plot": None, "report": None}
        self.sampling_on = False  # dynamic sampling, decided once the warmed-up policy is scored
        self.sampling_total: SamplingCounts | None = None  # every collector's counts, at the last look

    def run(self) -> dict[str, Any]:
        """All phases; Ctrl-C stops them, and the collectors are shut down in any case."""
        started = time.perf_counter()
        try:
            self.buffer = RayReplayBuffer(capacity=8 * self.config.turns_per_step, seed=self.config.seed)
            self._run_phases()
        except KeyboardInterrupt:
            self.interrupted = True
            self.console.print(
                "[yellow]interrupted: shutting the collectors down; the run folder keeps what was written[/]"
            )
        finally:
            collectors = self._shut_down()
            self.timings_s["total"] = time.perf_counter() - started
            try:
                self._write_plot()
                self._write_rollout_report()
                summary = self._summary(collectors)
                write_summary(self.run_dir, summary)
            finally:
                self.logger.close()
        return summary

    def _write_plot(self) -> None:
        """training.png, also handed to the logger."""
        records = self.metrics.records
        plot = plot_training(records, self.run_dir / PLOT_FILE)
        if plot is not None:
            self.files["plot"] = PLOT_FILE
            self.logger.log_image("training", plot, step=records[-1]["step"])

    def _write_rollout_report(self) -> None:
        """rollouts.html: the turns of the last training steps, tokens coloured by log-prob."""
        if not self.recent_turns:
            return
        try:
            from lmcollect.viewer import write_rollout_report

            records = decoded_turn_records(self.recent_turns, self.tokenizer)
            title = f"lmcollect demo {self.run_dir.name}: turns of the last {len(self.recent_turns)} training steps"
            write_rollout_report(records, self.run_dir / ROLLOUT_REPORT_FILE, title=title, tokenizer=self.tokenizer)
        except Exception:  # designed: the report is an extra; metrics, plot and summary must still be written
            logger.exception("could not write %s; the run's other files are complete", ROLLOUT_REPORT_FILE)
            return
        self.files["report"] = ROLLOUT_REPORT_FILE

    def _run_phases(self) -> None:
        self.rewards["initial"] = self._evaluate()
        if self.config.warmup_steps:
            self.console.print(
                f"supervised warm-up before RL: {self.config.warmup_steps} steps on {self._warmup_kind()}"
            )
            self._timed("warmup", self._warm_up)
        self.rewards["before_rl"] = self._evaluate()
        self.console.print(
            f"mean reward {self.rewards['initial']:.3f} at init, {self.rewards['before_rl']:.3f} before RL"
        )
        self.sampling_on = self._dynamic_sampling_on()
        self._timed("setup", self._start_collectors)  # the filter depends on the policy's reward before RL
        assert self.group is not None, "_start_collectors() builds them"
        push_weights = WeightPusher(list(self.group), self.config.backend)
        self.pushes["initial"] = push_weights(self.model)  # version 1: the warmed-up weights, in full
        self.version = 1
        trained = self._rl_model()
        self.collection = background_collection(list(self.group), self.config.backend)
        self.collection.start()
        self._timed("rl", lambda: self._train(trained, push_weights))
        self.rewards["final"] = self._evaluate()
        self.console.print(
            f"mean reward {self.rewards['before_rl']:.3f} before RL, {self.rewards['final']:.3f} after RL"
        )

    def _rl_model(self) -> torch.nn.Module:
        """What RL trains and pushes: the model itself, or (``--lora-rank``) a peft LoRA adapter on it.

        With an adapter, ``self.model`` computes with it too (peft adapts its layers in place), so the
        evaluation after RL scores the adapted model; the push of the peft model sends the adapter only.
        """
        rank = self.config.lora_rank
        if not rank:
            return self.model
        peft_model = wrap_lora(self.model, rank)
        trainable, total = count_parameters(peft_model)
        self.console.print(
            f"RL trains a LoRA adapter of rank {rank} on every linear layer of the decoder blocks: "
            f"{trainable:,} of {total:,} parameters ({100 * trainable / total:.1f}%), lr {self.config.lora_lr:g}; "
            "each push sends the adapter only"
        )
        return peft_model

    def _train(self, trained: torch.nn.Module, push_weights: WeightPusher) -> None:
        """The RL loop: wait for fresh turns, one GRPO step, push the new weights to every collector."""
        config = self.config
        assert self.buffer is not None, "run() builds the buffer first"
        learner = GRPOLearner(trained, GRPOConfig(lr=config.rl_lr, clip_epsilon=config.clip_epsilon))
        throughput = _Throughput(self.buffer.write_count)
        start = time.perf_counter()
        with step_progress(
            self.config.max_steps, console=self.console, show=self.config.progress, log=logger
        ) as progress:
            for step in range(1, config.max_steps + 1):
                if time.perf_counter() - start > config.max_train_s:
                    break
                clock = _Stopwatch()
                with clock.lap("timing/wait_s"):
                    self._wait_for_turns(throughput.written + config.turns_per_step)
                with clock.lap("timing/sample_s"):
                    batch = self._sample_batch()
                with clock.lap("timing/train_s"):
                    metrics = learner.train_step(batch)
                with clock.lap("timing/weight_sync/push_s"):
                    pushed = self.pushes["last"] = push_weights(trained)
                self.version += 1
                sampled = self._sampling_since_last_step()
                record = {
                    "step": step,
                    "time_s": time.perf_counter() - start,
                    "policy_version": self.version,
                    "reward/mean": float(batch.rewards.mean()),
                    **throughput.update(self.buffer.write_count),
                    **_staleness(self.version - 1, batch),
                    **metrics,
                    **clock.laps,
                    **({"weight_sync/push_bytes": pushed.nbytes} if pushed is not None else {}),
                    **sampled,
                }
                self.logger.log({k: v for k, v in record.items() if k != "step"}, step=step)
                progress.update(record)

    def _sample_batch(self) -> TrainBatch:
        """``turns_per_step`` turns generated at most ``max_staleness`` versions ago, packed for the learner."""
        min_version = max(0, self.version - self.config.max_staleness)
        assert self.buffer is not None, "run() builds the buffer first"
        turns = self.buffer.sample(self.config.turns_per_step, min_policy_version=min_version)
        self.recent_turns.append(turns)
        return train_batch_from_turns(turns, pad_token_id=self.tokenizer.pad_token_id)

    def _wait_for_turns(self, target: int) -> None:
        """Block until the buffer has had ``target`` writes (collectors are checked every few seconds)."""
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        next_check = time.monotonic() + HEALTH_CHECK_S
        assert self.buffer is not None and self.collection is not None, "_run_phases() starts them first"
        while self.buffer.write_count < target:
            now = time.monotonic()
            if now > next_check:
                # is_running() re-raises the error that stopped a collector, if one did
                if not self.collection.is_running():
                    raise RuntimeError("every collector has stopped collecting; see the log above for why.")
                next_check = now + HEALTH_CHECK_S
            if now > deadline:
                raise RuntimeError(f"no {target} buffer writes after {WAIT_TIMEOUT_S:.0f} s; are the collectors stuck?")
            time.sleep(0.01)

    # ------------------------------------------------------------------ dynamic sampling
    def _dynamic_sampling_on(self) -> bool:
        mode, reward = self.config.dynamic_sampling, self.rewards["before_rl"]
        low, high = AUTO_SAMPLING_REWARDS
        on = mode == "on" or (mode == "auto" and low <= reward <= high)
        if on:
            self.console.print(
                "dynamic sampling: groups whose answers all got the same reward are dropped, others generated instead"
            )
        elif mode == "auto":
            self.console.print(
                f"dynamic sampling off: the mean reward before RL, {reward:.3f}, is outside [{low}, {high}] "
                "(nearly every group would be dropped); --dynamic-sampling on forces it"
            )
        return on

    def _sampling_since_last_step(self) -> dict[str, float]:
        """Dynamic sampling's counts since the step before, summed over the collectors (logger keys)."""
        if not self.sampling_on:
            return {}
        assert self.group is not None, "_start_collectors() builds them"
        total = self.group.sampling_counts()
        if total is None:
            return {}
        since = total.minus(self.sampling_total or SamplingCounts())
        self.sampling_total = total
        return since.as_metrics()

    def _sampling_summary(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        total = self.sampling_total
        return {
            "mode": self.config.dynamic_sampling,
            "on": self.sampling_on,
            "counts": None if total is None else total.to_state(),
            "kept_share": {
                "first_10_steps": _mean_where(records[:10], "sampling/kept_share"),
                "last_10_steps": _mean_where(records[-10:], "sampling/kept_share"),
            },
        }

    # ------------------------------------------------------------------ pieces
    def _start_collectors(self) -> None:
        self.group = self._build_collectors()

    def _build_collectors(self) -> RayCollectorGroup:
        config = self.config
        sampling = SamplingConfig(max_new_tokens=config.max_new_tokens, temperature=config.temperature)
        remote_config, engine_kwargs = collector_placement(config.backend, config.num_collectors)
        return RayCollectorGroup(
            config.num_collectors,
            seed=config.seed,
            env=EnvFactory(
                task_name=self.task.name,
                rows=self.task.make_rows(NUM_TRAIN_PROMPTS, seed=config.seed),
                num_envs=config.turns_per_batch,
                repeats=config.group_size,
                seed=config.seed,
            ),
            policy_factory=PolicyFactory(
                backend=config.backend, model_path=str(self.model_path), sampling=sampling, engine_kwargs=engine_kwargs
            ),
            replay_buffer=self.buffer,
            dialog_turns_per_batch=config.turns_per_batch,
            # complete groups only (group ids are unique across both collectors); incomplete ones wait
            postproc=GroupAdvantage(group_size=config.group_size, keep_keys=LEARNER_KEYS),
            dynamic_sampling=DynamicSampling(group_filter=drop_uniform_rewards()) if self.sampling_on else None,
            track_policy_version=True,
            remote_config=remote_config,
            num_cpus=config.cpus_per_collector,
        )

    def _warmup_kind(self) -> str:
        if self.task.format_answer is None:
            return "reference answers"
        return "format-only answers (right only by chance: they teach the reply format, RL has to learn the task)"

    def _warm_up(self) -> None:
        config = self.config
        rows = self.task.make_rows(NUM_TRAIN_PROMPTS, seed=config.seed)
        if self.task.format_answer is not None:  # teach the reply's format, leave the task itself to RL
            rng = random.Random(config.seed)
            rows = [{**row, "answer": self.task.format_answer(row, rng)} for row in rows]
        warmup = WarmupConfig(
            num_steps=config.warmup_steps, batch_size=config.warmup_batch_size, lr=config.warmup_lr, seed=config.seed
        )
        warm_up(self.model, self.tokenizer, rows, warmup)

    def _evaluate(self) -> float:
        sampling = SamplingConfig(max_new_tokens=self.config.max_new_tokens, temperature=self.config.temperature)
        policy = TransformersPolicy(self.model, self.tokenizer, sampling=sampling)
        try:
            return mean_reward(policy, self.eval_rows, self.task.make_task(), seed=self.config.seed)
        finally:
            policy.close()

    def _timed(self, name: str, fn: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            fn()
        finally:
            self.timings_s[name] = time.perf_counter() - start

    def _shut_down(self) -> list[dict[str, Any]]:
        """Shut every collector and the buffer down; each collector's last version and state."""
        collectors = []
        if self.collection is not None:
            self.collection.stop()
        if self.group is not None:
            versions = [_policy_version_or_none(c) for c in self.group]
            self.push_costs = [cost for c in self.group for cost in _push_costs_or_none(c)]
            if self.sampling_on:
                self.sampling_total = _sampling_counts_or(self.group, self.sampling_total)
            self.group.shutdown()
            collectors = [
                {"policy_version": v, "shut_down": not c.is_initialized()}
                for v, c in zip(versions, self.group, strict=True)
            ]
        if self.buffer is not None:
            self.buffer.shutdown()
        return collectors

    def _summary(self, collectors: list[dict[str, Any]]) -> dict[str, Any]:
        records = self.metrics.records
        return {
            **run_summary(
                task=self.task.name,
                model=str(self.model_path),
                interrupted=self.interrupted,
                records=records,
                version=self.version,
                rewards=self.rewards,
            ),
            "turns_per_s": mean_of(records, "collect/turns_per_s"),
            "weight_push_s": {
                "mean": mean_of(records, "timing/weight_sync/push_s"),
                "max": _max(records, "timing/weight_sync/push_s"),
            },
            "weight_push_bytes": _push_bytes(self.pushes),
            "staleness": {"mean": mean_of(records, "staleness/mean"), "max": _max(records, "staleness/max")},
            "push_cost": push_cost_summary(self.push_costs),
            "dynamic_sampling": self._sampling_summary(records),
            "timings_s": self.timings_s,
            "collectors": collectors,
            "files": {**self.files, "logger": LOGGER_DIRS.get(self.config.logger)},
            "config": asdict(self.config),
        }


def _push_costs_or_none(collector: Any) -> list[PushCost]:
    """A collector's ``push_costs()``, or none when it cannot answer (it failed: its error is shown elsewhere)."""
    try:
        return collector.push_costs()
    except Exception:  # designed: the summary of a run whose collector died must still be written
        logger.warning("could not read a collector's push costs", exc_info=True)
        return []


def _push_bytes(pushes: dict[str, PushStats | None]) -> dict[str, Any]:
    """Bytes of the first push (version 1, full) and of the latest one, and the latest one's kind."""
    initial, last = pushes["initial"], pushes["last"]
    return {
        "initial": None if initial is None else initial.nbytes,
        "per_step": None if last is None else last.nbytes,
        "kind": None if last is None else last.kind,
    }


class _Stopwatch:
    """Seconds spent in named phases of one step."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}

    @contextlib.contextmanager
    def lap(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.laps[name] = time.perf_counter() - start


class _Throughput:
    """Turns written to the buffer so far, and per second since the previous step."""

    def __init__(self, written: int) -> None:
        self.written, self._time = written, time.perf_counter()

    def update(self, written: int) -> dict[str, float]:
        now = time.perf_counter()
        rate = (written - self.written) / (now - self._time)
        self.written, self._time = written, now
        return {"collect/turns": written, "collect/turns_per_s": rate}


def _staleness(trainer_version: int, batch: TrainBatch) -> dict[str, float]:
    """How many versions behind the trained weights the batch's turns were generated (0: the same)."""
    behind = (trainer_version - batch.policy_versions).float()
    return {"staleness/mean": float(behind.mean()), "staleness/max": float(behind.max())}


def _policy_version_or_none(collector: Any) -> int | None:
    try:
        return collector.policy_version
    except Exception:  # designed: a dead collector reports nothing, the others must still shut down
        logger.exception("could not read a collector's policy version")
        return None


def _sampling_counts_or(group: RayCollectorGroup, last: SamplingCounts | None) -> SamplingCounts | None:
    try:
        return group.sampling_counts()
    except Exception:  # designed: a dead collector reports nothing; the summary keeps the last counts read
        logger.exception("could not read the collectors' dynamic sampling counts")
        return last


def _mean_where(records: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the records that have it (a step in which no group was judged has none)."""
    return mean_of([r for r in records if key in r], key)


def _max(records: list[dict[str, Any]], key: str) -> float | None:
    return max((r[key] for r in records), default=None)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _fmt_bytes(nbytes: int | None) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _push_kind(summary: dict[str, Any]) -> str:
    """`` (LoRA rank 8)`` / `` (full)`` after the per-step push bytes."""
    kind, rank = summary["weight_push_bytes"]["kind"], summary["config"]["lora_rank"]
    if kind is None:
        return ""
    return f" (LoRA rank {rank})" if kind == "lora" else f" ({kind})"


def _table_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    reward, train = summary["reward"], summary["train_reward"]
    push, pushed, staleness = summary["weight_push_s"], summary["weight_push_bytes"], summary["staleness"]
    cost = summary["push_cost"]
    return [
        (
            "mean reward at init / before RL / after RL",
            f"{_fmt(reward.get('initial'))} / {_fmt(reward.get('before_rl'))} / {_fmt(reward.get('final'))}",
        ),
        ("train reward, first / last 10 steps", f"{_fmt(train['first_10_steps'])} / {_fmt(train['last_10_steps'])}"),
        ("training steps / final policy version", f"{summary['steps']} / {summary['policy_version']}"),
        ("turns collected, turns/s", f"{summary['turns_collected']}, {_fmt(summary['turns_per_s'], '.1f')}"),
        ("weight push s (mean / max)", f"{_fmt(push['mean'])} / {_fmt(push['max'])}"),
        (
            "weight push bytes: first (full) / per step",
            f"{_fmt_bytes(pushed['initial'])} / {_fmt_bytes(pushed['per_step'])}{_push_kind(summary)}",
        ),
        ("staleness in versions (mean / max)", f"{_fmt(staleness['mean'], '.2f')} / {_fmt(staleness['max'], '.0f')}"),
        *sampling_rows(summary["dynamic_sampling"]),
        *push_cost_rows(cost),
        (
            "warm-up s / RL s / total s",
            " / ".join(_fmt(summary["timings_s"].get(k), ".0f") for k in ("warmup", "rl", "total")),
        ),
        (
            "collectors shut down",
            f"{sum(c['shut_down'] for c in summary['collectors'])} of {len(summary['collectors'])}",
        ),
        ("interrupted", str(summary["interrupted"])),
    ]
