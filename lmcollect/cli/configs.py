"""The typed configs of the CLI's subcommands (one flag per field; the docstring under it is the help).

Kept free of heavy imports: ``lmcollect --help`` builds its parser from these classes alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Backend = Literal["transformers", "vllm"]


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be positive, got {value}.")


@dataclass(kw_only=True)
class DemoConfig:
    """GRPO on a shipped task: Ray collectors fill a buffer while the driver trains and pushes weights."""

    address: str | None = None
    """Ray cluster to attach to (e.g. 'auto'); default: start a local one for this run."""
    model: str | None = None
    """Model folder to train; default: the 'tiny' model, built offline on first use."""
    backend: Backend = "transformers"
    """Inference backend of the collectors ('vllm' needs vLLM installed)."""
    task: str = "comparison"
    """Shipped single-turn task: comparison, addition or arithmetic."""
    num_collectors: int = 2
    """RayLLMCollector actors writing into the shared RayReplayBuffer."""
    cpus_per_collector: float = 0.5
    """Ray CPUs reserved by each collector actor."""
    prompts_per_batch: int = 4
    """Prompts in one collector batch; each is answered group-size times."""
    group_size: int = 8
    """Answers per prompt: the group whose mean reward is each answer's baseline."""
    turns_per_step: int = 64
    """Turns sampled from the buffer for one training step (and new turns awaited before it)."""
    max_steps: int = 400
    """Training steps at most."""
    max_train_s: float = 120.0
    """Stop training after this many seconds (the warm-up is not counted)."""
    max_staleness: int = 2
    """Train on turns generated at most this many policy versions ago (>= 1)."""
    lr: float = 5e-4
    """AdamW learning rate of the GRPO steps."""
    clip_epsilon: float = 0.2
    """PPO clip range of the importance ratio between the trained and the collecting weights."""
    warmup_steps: int = 150
    """Supervised warm-up steps before RL (0: none); on format-only answers where the task has them."""
    warmup_batch_size: int = 64
    """Examples per warm-up step."""
    warmup_lr: float = 1e-3
    """Learning rate of the warm-up."""
    max_new_tokens: int = 4
    """Token budget of one answer."""
    temperature: float = 1.0
    """Sampling temperature of the collectors (and of the before/after evaluation)."""
    num_eval_prompts: int = 128
    """Held-out prompts scored before the warm-up, before RL and after RL."""
    output_dir: str = "runs"
    """Where the run folder (summary.json, metrics.jsonl, training.png) is created."""
    seed: int = 0
    """Seed of prompts, sampling and the warm-up."""
    progress: bool = True
    """Show the live progress display."""

    def __post_init__(self) -> None:
        _check_positive(
            self, "num_collectors", "cpus_per_collector", "prompts_per_batch", "group_size", "turns_per_step",
            "max_steps", "max_train_s", "lr", "max_new_tokens", "num_eval_prompts", "warmup_batch_size", "warmup_lr",
        )
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (a group of one has no baseline), got {self.group_size}.")
        if self.max_staleness < 1:
            raise ValueError(
                f"--max-staleness must be >= 1, got {self.max_staleness}: a batch generated while weights "
                "are pushed is one version old, so 0 would starve the trainer."
            )
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}.")
        if not 0 < self.clip_epsilon < 1:
            raise ValueError(f"--clip-epsilon must be in (0, 1), got {self.clip_epsilon}.")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be positive for RL (sampled answers), got {self.temperature}.")

    @property
    def turns_per_batch(self) -> int:
        """Turns in one collector batch: every answer of ``prompts_per_batch`` prompts."""
        return self.prompts_per_batch * self.group_size


@dataclass(kw_only=True)
class CollectConfig:
    """Collect dialog turns with Ray collectors and write them to parquet or jsonl."""

    model: str | None = None
    """Model folder; default: the 'tiny' model, built offline on first use."""
    prompts: str | None = None
    """Prompt file (.jsonl or .parquet, rows with a 'prompt'); default: prompts of --task."""
    task: str | None = None
    """Shipped task (comparison, addition, arithmetic, guessing): its prompts, or with --prompts its
    scoring of their rows; default: arithmetic, or no scoring (reward 0) with --prompts."""
    num_turns: int = 64
    """Dialog turns to collect (rounded up to whole collector batches)."""
    num_envs: int = 8
    """Dialogs each collector runs side by side."""
    group_size: int = 1
    """Answers per prompt (consecutive dialogs share a prompt)."""
    num_collectors: int = 1
    """RayLLMCollector actors."""
    cpus_per_collector: float = 1.0
    """Ray CPUs reserved by each collector actor."""
    backend: Backend = "transformers"
    """Inference backend ('vllm' needs vLLM installed)."""
    max_new_tokens: int = 32
    """Token budget of one answer."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1: off)."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0: off)."""
    output: str = "rollouts.parquet"
    """Output file: .parquet or .jsonl."""
    address: str | None = None
    """Ray cluster to attach to (e.g. 'auto'); default: start a local one."""
    seed: int = 0
    """Seed of prompt order and sampling."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        _check_positive(self, "num_turns", "num_envs", "group_size", "num_collectors", "cpus_per_collector", "max_new_tokens")
        if self.num_envs % self.group_size:
            raise ValueError(f"--num-envs ({self.num_envs}) must be a multiple of --group-size ({self.group_size}).")
        if not self.output.endswith((".parquet", ".jsonl")):
            raise ValueError(f"--output must end with .parquet or .jsonl, got {self.output!r}.")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"sampling settings out of range: --temperature {self.temperature} (>= 0), "
                f"--top-p {self.top_p} (in (0, 1]), --top-k {self.top_k} (>= 0)."
            )


@dataclass(kw_only=True)
class BenchConfig:
    """Run the benchmarks (collection vs raw engine, weight sync vs memcpy) and print one table of ratios."""

    quick: bool = False
    """A short run: fewer repetitions, the small model only."""
    sizes: str = "small,medium"
    """Model presets to measure, comma-separated (--quick: small)."""
    rows: str = "local,ray"
    """Collection rows to run: local and/or ray."""
    batch_size: int = 16
    """Prompts per collection batch."""
    max_new_tokens: int = 32
    """Tokens per answer in the collection benchmark."""
    only: str = ""
    """Benchmarks to run, comma-separated (collect, weight_sync); empty: all found."""
    output: str = "runs/bench.json"
    """Where the merged JSON rows are written."""

    def __post_init__(self) -> None:
        _check_positive(self, "batch_size", "max_new_tokens")


class UsageError(ValueError):
    """A mistake in the command line or its input files: reported without a traceback, exit status 2."""
