"""`lmcollect demo --task agent`: GRPO on an agent program that calls the model through the OpenAI-compatible endpoint.

Run: ``lmcollect demo --task agent`` (a few minutes on 2 CPU cores; the budget flags of ``lmcollect
demo`` apply: ``--max-steps``, ``--max-train-s``, ``--warmup-steps``, ...).

The agent is :func:`lmcollect.agents.compare_agent.compare_agent`, written with the ``openai``
client: it asks "Which is larger, 3 or 7?" offering a ``compare`` tool, runs the model's tool
call, sends the result back and scores the model's answer. Everything runs in this process: a
``ContinuousLLMCollector`` over an :class:`~lmcollect.agents.AgentEnv` (GRPO groups of
``--group-size`` runs per question) and a ``TransformersEngine``, so the loop is::

    for step in range(max_steps):
        batch = collector.next()                  # whole groups of whole agent runs, each call one turn
        learner.train_step(train_batch_from_turns(batch))
        collector.update_policy_weights_(model)   # the agents' next calls see the new weights

After a supervised warm-up on the format (the call ``call: compare``, read by the pluggable
``CompactCallParser``; then one of the two numbers at random), RL has to learn to answer with what
the tool said.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from lmcollect.agents import AgentEnv
from lmcollect.agents.compare_agent import (
    MAX_CALL_TOKENS,
    CompactCallParser,
    compare_agent,
    compare_rows,
    warmup_rows,
)
from lmcollect.cli.builders import resolve_model_path
from lmcollect.cli.configs import DemoConfig, UsageError
from lmcollect.cli.progress import step_progress
from lmcollect.cli.quiet import LIBRARY_LOG, library_logs
from lmcollect.cli.report import (
    PLOT_FILE,
    make_run_dir,
    mean_of,
    plot_training,
    push_cost_rows,
    push_cost_summary,
    run_summary,
    summary_table,
    write_summary,
)
from lmcollect.collectors import ContinuousLLMCollector
from lmcollect.data import keys
from lmcollect.data.turns import flatten_turns
from lmcollect.engines import TransformersEngine
from lmcollect.engines.kv_policy import PushCost
from lmcollect.envs import PromptDataset
from lmcollect.loggers import JsonlLogger, MultiLogger, make_logger
from lmcollect.loggers.jsonl import METRICS_FILE
from lmcollect.models import load_model_and_tokenizer
from lmcollect.policies import SamplingConfig
from lmcollect.training.batch import GroupAdvantage, train_batch_from_turns
from lmcollect.training.trainer import GRPOConfig, GRPOLearner
from lmcollect.training.warmup import WarmupConfig, warm_up

logger = logging.getLogger(__name__)

AGENT_TASK = "agent"
"""``--task agent``: this demo."""
NUM_TRAIN_PROMPTS = 4096


def run_agent_demo(config: DemoConfig) -> int:
    _check_config(config)
    model_path = resolve_model_path(config.model)
    console = Console()
    run_dir = make_run_dir(config.output_dir, "demo-agent")
    console.print(
        f"[bold]lmcollect demo --task agent[/]: GRPO on an OpenAI-client agent with a compare tool; run folder {run_dir}"
    )
    torch.manual_seed(config.seed)
    with library_logs(run_dir / LIBRARY_LOG) as logs:
        model, tokenizer = load_model_and_tokenizer(model_path)
        summary = AgentDemoRun(config, model, tokenizer, model_path=model_path, run_dir=run_dir, console=console).run()
    console.print(summary_table(_table_rows(summary), title=f"lmcollect demo --task agent: {run_dir}"))
    logs.print_where(console)
    return 130 if summary["interrupted"] else 0


def _check_config(config: DemoConfig) -> None:
    if config.backend != "transformers":
        raise UsageError("--task agent runs a TransformersEngine in this process; use --backend transformers.")
    if config.lora_rank:
        raise UsageError("--task agent trains every weight; drop --lora-rank (LoRA is shown by the default demo).")


class AgentDemoRun:
    """One agent demo run: warm-up, the GRPO loop over agent runs, evaluations, and what happened (summary.json)."""

    def __init__(
        self, config: DemoConfig, model: Any, tokenizer: Any, *, model_path: Path, run_dir: Path, console: Console
    ) -> None:
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.model_path, self.run_dir, self.console = model_path, run_dir, console
        self.metrics = JsonlLogger(run_dir)
        extra = [] if config.logger == "jsonl" else [make_logger(config.logger, run_dir, asdict(config))]
        self.logger = MultiLogger([self.metrics, *extra])
        self.rows = compare_rows(NUM_TRAIN_PROMPTS, seed=config.seed)
        self.eval_rows = compare_rows(config.num_eval_prompts, seed=config.seed + 1)
        self.rewards: dict[str, float] = {}
        self.timings_s: dict[str, float] = {}
        self.agents: dict[str, int] = {}
        self.push_costs: list[PushCost] = []  # what the pushes cost the engine (read at shutdown)
        self.interrupted = False
        self.version = 0

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            self._phases()
        except KeyboardInterrupt:
            self.interrupted = True
            self.console.print("[yellow]interrupted: the run folder keeps what was written[/]")
        finally:
            self.timings_s["total"] = time.perf_counter() - started
            plot = plot_training(self.metrics.records, self.run_dir / PLOT_FILE)
            summary = self._summary(plot is not None)
            write_summary(self.run_dir, summary)
            self.logger.close()
        return summary

    def _phases(self) -> None:
        self.rewards["initial"] = self._evaluate()
        if self.config.warmup_steps:
            self.console.print(
                f"supervised warm-up before RL: {self.config.warmup_steps} steps on the format (the call, "
                "then either number: right only by chance)"
            )
            with _timed(self.timings_s, "warmup"):
                warmup = WarmupConfig(
                    num_steps=self.config.warmup_steps,
                    batch_size=self.config.warmup_batch_size,
                    lr=self.config.warmup_lr,
                    seed=self.config.seed,
                )
                warm_up(self.model, self.tokenizer, warmup_rows(self.rows, seed=self.config.seed), warmup)
        self.rewards["before_rl"] = self._evaluate()
        self.console.print(
            f"mean reward {self.rewards['initial']:.3f} at init, {self.rewards['before_rl']:.3f} before RL"
        )
        with _timed(self.timings_s, "rl"):
            self._train()
        self.rewards["final"] = self._evaluate()
        self.console.print(
            f"mean reward {self.rewards['before_rl']:.3f} before RL, {self.rewards['final']:.3f} after RL"
        )

    def _sampling(self) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=MAX_CALL_TOKENS, temperature=self.config.temperature)

    def _collector(self, engine: TransformersEngine) -> ContinuousLLMCollector:
        """Groups of ``group_size`` agent runs per question; a batch holds ``prompts_per_batch`` whole groups."""
        config = self.config
        dialogs = config.prompts_per_batch * config.group_size
        env = AgentEnv(
            self.rows,
            compare_agent,
            batch_size=2 * dialogs,
            repeats=config.group_size,
            seed=config.seed,
            tool_parser=CompactCallParser(),
        )
        return ContinuousLLMCollector(
            [env],
            engine=engine,
            tokenizer=self.tokenizer,
            sampling=self._sampling(),
            dialog_turns_per_batch=dialogs,
            postproc=GroupAdvantage(per_dialog=True),
            max_policy_lag=config.max_staleness,
            track_policy_version=True,
        )

    def _train(self) -> None:
        """The RL loop: a batch of whole groups, one GRPO step, a push."""
        config = self.config
        learner = GRPOLearner(self.model, GRPOConfig(lr=config.rl_lr, clip_epsilon=config.clip_epsilon))
        engine = TransformersEngine(copy.deepcopy(self.model), self.tokenizer)  # the trainer's weights come by push
        collector = self._collector(engine)
        try:
            collector.update_policy_weights_(self.model)  # version 1: the warmed-up weights
            self.version = 1
            with step_progress(
                self.config.max_steps, console=self.console, show=self.config.progress, log=logger
            ) as progress:
                self._steps(collector, learner, progress)
        finally:
            collector.shutdown()
            self.push_costs = collector.push_costs()  # each push's timeline, as the engine recorded it
            engine.close()
            stats = collector.envs[0].stats
            self.agents = {
                "runs_finished": stats.runs_finished,
                "runs_failed": stats.runs_failed,
                "calls": stats.calls,
                "tool_calls": stats.tool_calls,
                "tool_parse_errors": stats.tool_parse_errors,
                "prefix_mismatches": collector.num_prefix_mismatches,
            }

    def _steps(self, collector: ContinuousLLMCollector, learner: GRPOLearner, progress: Any) -> None:
        config, start, turns = self.config, time.perf_counter(), 0
        for step in range(1, config.max_steps + 1):
            if time.perf_counter() - start > config.max_train_s:
                break
            laps: dict[str, float] = {}
            with _timed(laps, "timing/collect_s"):
                batch = collector.next()
            trained = train_batch_from_turns(batch, pad_token_id=self.tokenizer.pad_token_id)
            with _timed(laps, "timing/train_s"):
                metrics = learner.train_step(trained)
            with _timed(laps, "timing/weight_sync/push_s"):
                collector.update_policy_weights_(self.model)
            self.version += 1
            turns += int(trained.rewards.numel())
            elapsed = time.perf_counter() - start
            record = {
                "step": step,
                "time_s": elapsed,
                "policy_version": self.version,
                "reward/mean": _dialog_reward(batch),
                "collect/turns": turns,
                "collect/turns_per_s": turns / elapsed,
                "staleness/mean": float((self.version - 1 - trained.policy_versions).float().mean()),
                "staleness/max": float((self.version - 1 - trained.policy_versions).max()),
                **metrics,
                **laps,
            }
            self.logger.log({k: v for k, v in record.items() if k != "step"}, step=step)
            progress.update(record)

    def _evaluate(self) -> float:
        """Mean reward of one agent run per held-out question, on the weights trained now."""
        rows = PromptDataset(self.eval_rows, shuffle=False)
        num = len(self.eval_rows)
        with TransformersEngine(self.model, self.tokenizer) as engine:
            env = AgentEnv(
                rows, compare_agent, batch_size=min(32, num), seed=self.config.seed, tool_parser=CompactCallParser()
            )
            collector = ContinuousLLMCollector(
                [env],
                engine=engine,
                tokenizer=self.tokenizer,
                sampling=self._sampling(),
                dialog_turns_per_batch=num,
                total_dialog_turns=num,
                yield_only_last_steps=True,
            )
            with collector:
                batch = collector.next()
        assert batch is not None, "no replay buffer: next() returns the batch"
        return float(batch.get(keys.NEXT_REWARD).sum()) / num

    def _summary(self, plotted: bool) -> dict[str, Any]:
        records = self.metrics.records
        return {
            **run_summary(
                task=AGENT_TASK,
                model=str(self.model_path),
                interrupted=self.interrupted,
                records=records,
                version=self.version,
                rewards=self.rewards,
            ),
            "weight_push_s": mean_of(records, "timing/weight_sync/push_s"),
            "push_cost": push_cost_summary(self.push_costs),
            "agents": self.agents,
            "timings_s": self.timings_s,
            "files": {"metrics": METRICS_FILE, "plot": PLOT_FILE if plotted else None},
            "config": asdict(self.config),
        }


def _dialog_reward(batch: Any) -> float:
    """Mean reward per agent run of the batch (a run's reward is on its last turn)."""
    turns = flatten_turns(batch)
    runs = {int(turn.get(keys.TRAJ_IDS)) for turn in turns}
    return float(sum(float(turn.get(keys.NEXT_REWARD).sum()) for turn in turns)) / max(1, len(runs))


@contextlib.contextmanager
def _timed(into: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        into[name] = time.perf_counter() - start


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _table_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    reward, train, agents = summary["reward"], summary["train_reward"], summary["agents"]
    return [
        (
            "mean reward at init / before RL / after RL",
            " / ".join(_fmt(reward.get(k)) for k in ("initial", "before_rl", "final")),
        ),
        ("train reward, first / last 10 steps", f"{_fmt(train['first_10_steps'])} / {_fmt(train['last_10_steps'])}"),
        ("training steps / final policy version", f"{summary['steps']} / {summary['policy_version']}"),
        (
            "agent runs finished / failed, model calls, tool calls",
            f"{agents.get('runs_finished', 0)} / {agents.get('runs_failed', 0)}, {agents.get('calls', 0)}, "
            f"{agents.get('tool_calls', 0)}",
        ),
        ("weight push s (mean)", _fmt(summary["weight_push_s"])),
        *push_cost_rows(summary["push_cost"]),
        (
            "warm-up s / RL s / total s",
            " / ".join(_fmt(summary["timings_s"].get(k), ".0f") for k in ("warmup", "rl", "total")),
        ),
        ("interrupted", str(summary["interrupted"])),
    ]
