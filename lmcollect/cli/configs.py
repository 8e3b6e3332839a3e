"""The typed configs of the CLI's subcommands (one flag per field; the docstring under it is the help).

Kept free of heavy imports: ``lmcollect --help`` builds its parser from these classes alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lmcollect.loggers.base import LoggerKind

Backend = Literal["transformers", "vllm"]


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not value > 0 or value == math.inf:  # also refuses nan and inf
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be positive, got {value}.")


LORA_LR = 2e-3
"""The demo's GRPO learning rate with --lora-rank > 0: 4x the full fine-tuning one (--lr). Tuned with
``lmcollect demo --lora-rank 8`` (tiny model, comparison): at 2e-3 the adapter learns step for step as
fast as full fine-tuning at 5e-4; at 5e-4 it learns more slowly, at 5e-3 it stalls near 0.83 mean
reward, at 1e-2 it collapses to 0."""


def _check_env_name(env: str | None, task: str | None, *, default_task: str | None) -> None:
    """``--env`` is 'ecosystem:name' and replaces ``--task`` (left at its default)."""
    if env is None:
        return
    ecosystem, colon, name = env.partition(":")
    if not (ecosystem and colon and name):
        raise ValueError(
            f"--env is 'ecosystem:name' (e.g. reasoning-gym:basic_arithmetic, lmcollect:{default_task or 'arithmetic'}), "
            f"got {env!r}."
        )
    if task != default_task:
        raise ValueError(f"--env {env} and --task {task} both name the environment; pass one of them.")


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
    """Shipped single-turn task: comparison, addition or arithmetic; or 'agent': an OpenAI-client agent with a
    compare tool, collected through the agent endpoint in this process (no Ray; --backend transformers)."""
    env: str | None = None
    """An environment by its 'ecosystem:name', in place of --task: lmcollect:comparison, or a single-turn
    env of an installed ecosystem, e.g. reasoning-gym:basic_arithmetic (pip install 'lmcollect[reasoning-gym]')."""
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
    """AdamW learning rate of the GRPO steps (with --lora-rank > 0: --lora-lr instead)."""
    lora_rank: int = 0
    """LoRA rank of the RL phase (0: full fine-tuning). > 0: the GRPO steps train only a peft LoRA adapter
    on every linear layer of the decoder blocks (alpha 2 x rank) and each push sends only the adapter,
    which the collectors merge into the warmed-up base; needs pip install 'lmcollect[lora]'."""
    lora_lr: float = LORA_LR
    """AdamW learning rate of the GRPO steps with --lora-rank > 0 (LoRA wants a larger one than --lr)."""
    clip_epsilon: float = 0.2
    """PPO clip range of the importance ratio between the trained and the collecting weights."""
    dynamic_sampling: Literal["auto", "on", "off"] = "auto"
    """Drop groups whose answers all got the same reward (they teach nothing) and refill the batches
    (DAPO's dynamic sampling). auto: on when the mean reward before RL is between 0.05 and 0.95 (at 0
    or 1 nearly every group would be dropped)."""
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
    """Show the live progress display (a plain line every few seconds when stdout is not a terminal)."""
    logger: LoggerKind = "jsonl"
    """Experiment logger: jsonl (metrics.jsonl only), tensorboard or wandb (offline unless WANDB_MODE says
    otherwise); metrics.jsonl is always written, the others need pip install 'lmcollect[loggers]'."""

    def __post_init__(self) -> None:
        _check_positive(
            self,
            "num_collectors",
            "cpus_per_collector",
            "prompts_per_batch",
            "group_size",
            "turns_per_step",
            "max_steps",
            "max_train_s",
            "lr",
            "lora_lr",
            "max_new_tokens",
            "num_eval_prompts",
            "warmup_batch_size",
            "warmup_lr",
        )
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2 (a group of one has no baseline), got {self.group_size}.")
        if self.max_staleness < 1:
            raise ValueError(
                f"--max-staleness must be >= 1, got {self.max_staleness}: a batch generated while weights "
                "are pushed is one version old, so 0 would starve the trainer."
            )
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(
                f"--lora-rank must be an integer >= 0 (0: full fine-tuning, > 0: a LoRA adapter of that rank), "
                f"got {self.lora_rank!r}."
            )
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}.")
        if not 0 < self.clip_epsilon < 1:
            raise ValueError(f"--clip-epsilon must be in (0, 1), got {self.clip_epsilon}.")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be positive for RL (sampled answers), got {self.temperature}.")
        _check_env_name(self.env, self.task, default_task="comparison")

    @property
    def turns_per_batch(self) -> int:
        """Turns in one collector batch: every answer of ``prompts_per_batch`` prompts."""
        return self.prompts_per_batch * self.group_size

    @property
    def rl_lr(self) -> float:
        """Learning rate of the GRPO steps: ``lora_lr`` when training a LoRA adapter, else ``lr``."""
        return self.lora_lr if self.lora_rank else self.lr


@dataclass(kw_only=True)
class CollectConfig:
    """Collect dialog turns with Ray collectors and write them to parquet or jsonl."""

    model: str | None = None
    """Model folder; default: the 'tiny' model, built offline on first use."""
    prompts: str | None = None
    """Prompt file (.jsonl or .parquet, rows with a 'prompt'); default: prompts of --task."""
    task: str | None = None
    """Shipped task (comparison, addition, arithmetic, guessing, tool_calc): its prompts, or with --prompts its
    scoring of their rows; default: arithmetic, or no scoring (reward 0) with --prompts."""
    env: str | None = None
    """An environment by its 'ecosystem:name', in place of --task: its prompts (or --prompts' rows) and its
    scoring, e.g. lmcollect:guessing or reasoning-gym:leg_counting (pip install 'lmcollect[reasoning-gym]')."""
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
        _check_positive(
            self, "num_turns", "num_envs", "group_size", "num_collectors", "cpus_per_collector", "max_new_tokens"
        )
        if self.num_envs % self.group_size:
            raise ValueError(f"--num-envs ({self.num_envs}) must be a multiple of --group-size ({self.group_size}).")
        _check_env_name(self.env, self.task, default_task=None)
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
    rows: str = "local,ray,vllm"
    """Collection rows to run: local, ray (with the overlap row) and/or vllm (skipped without vLLM)."""
    batch_size: int = 16
    """Prompts per collection batch."""
    max_new_tokens: int = 32
    """Tokens per answer in the collection benchmark."""
    only: str = ""
    """Benchmarks to run, comma-separated (collect, weight_sync, memory, startup, agentic); empty: all found."""
    output: str = "runs/bench.json"
    """Where the merged JSON rows are written (the markdown table goes beside it, with ``.md``)."""

    def __post_init__(self) -> None:
        _check_positive(self, "batch_size", "max_new_tokens")
        if Path(self.output).suffix.lower() == ".md":  # the table is written to the same name with .md
            table = Path(self.output).with_suffix(".md")
            raise ValueError(
                f"--output {self.output} names the JSON rows file, and the markdown table written beside it "
                f"({table}) would replace it; use e.g. --output {Path(self.output).with_suffix('.json')}."
            )


class UsageError(ValueError):
    """A mistake in the command line or its input files: reported without a traceback, exit status 2."""


# ------------------------------------------------------------------------------------ config files
def read_config_file(path: str | Path, config_cls: type, *, command: str) -> dict[str, Any]:
    """The fields a TOML file sets for ``config_cls`` (``lmcollect <command> --config FILE``).

    Keys are the field names (``max_steps``, or the flag's spelling ``max-steps``); an unknown key, a
    key given twice or a value of the wrong type is a :class:`UsageError` naming the key and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--config {path}: no such file.")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML: {exc}.") from exc
    hints = typing.get_type_hints(config_cls)
    names = [f.name for f in dataclasses.fields(config_cls)]
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in names:
            raise UsageError(
                f"--config {path}: unknown key {key!r} for `lmcollect {command}`; valid keys: {', '.join(names)}."
            )
        if name in values:
            raise UsageError(
                f"--config {path}: {name!r} is set twice (as {name} and {name.replace('_', '-')}); keep one."
            )
        values[name] = _checked_value(value, hints[name], where=f"--config {path}: {key}")
    return values


def _checked_value(value: Any, annotation: Any, *, where: str) -> Any:
    """``value`` as the field type ``annotation`` wants it, or a UsageError saying what to write."""
    choices = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        if value in choices:
            return value
        raise UsageError(f"{where} must be one of {', '.join(map(json.dumps, choices))}, got {_describe(value)}.")
    if choices:  # X | None: the file sets X (TOML has no null; leave the key out for None)
        return _checked_value(value, choices[0], where=where)
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a quoted string"}[annotation]
    ok = isinstance(value, annotation) and (annotation is bool or not isinstance(value, bool))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise UsageError(f"{where} must be {expected}, got {_describe(value)}.")
    if annotation is float and not math.isfinite(value):  # TOML has nan and inf; no setting takes them
        raise UsageError(f"{where} must be a finite number, got {value}.")
    return value


def config_to_toml(config: Any, *, command: str, docs: Mapping[str, str] | None = None) -> str:
    """``config`` as a TOML file ``--config`` reads back, each field under its help text as a comment.

    Fields that are None (unset: the command picks a default) are written commented out.
    """
    docs = docs or {}
    first_line = (type(config).__doc__ or "").strip().splitlines()[0]
    lines = [
        f"# lmcollect {command}: {first_line}",
        f"# Run: lmcollect {command} --config FILE (flags given as well override these values).",
    ]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        lines.append("")
        lines.extend("# " + line.strip() if line.strip() else "#" for line in docs.get(field.name, "").splitlines())
        lines.append(f"# {field.name} =" if value is None else f"{field.name} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    """One TOML value (bool, int, float or str)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    raise TypeError(f"no TOML form for {type(value).__name__} values (config fields are bool, int, float or str).")


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, (bool, int, float, str)):
        return _toml(value)
    return f"a {type(value).__name__}"  # TOML dates and times
