"""`lmcollect collect`: rollouts from Ray collectors, written to parquet or jsonl (no training).

Run: ``lmcollect collect --task arithmetic --num-turns 256 --output rollouts.parquet``, or
``lmcollect collect --model PATH --prompts prompts.jsonl --num-collectors 2``. Read the output
back with ``pandas.read_parquet(path)``, ``pandas.read_json(path, lines=True, dtype=False)``
(``dtype=False`` keeps a response such as "9" a string) or
``datasets.load_dataset("parquet", data_files=path)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from lmcollect.cli.builders import (
    EnvFactory,
    PolicyFactory,
    check_backend,
    collector_placement,
    load_prompt_rows,
    resolve_model_path,
    resolve_task,
)
from lmcollect.cli.configs import CollectConfig, UsageError
from lmcollect.cli.progress import turns_progress
from lmcollect.cli.quiet import library_logs
from lmcollect.cli.rollouts import batch_records, write_records
from lmcollect.envs import ShippedTask
from lmcollect.policies import SamplingConfig
from lmcollect.ray.cluster import ray_session
from lmcollect.ray.group import RayCollectorGroup

DEFAULT_TASK = "arithmetic"
NUM_GENERATED_PROMPTS = 4096


def run_collect(config: CollectConfig) -> int:
    env_factory = _env_factory(config)
    check_backend(config.backend)
    model_path = resolve_model_path(config.model)
    console = Console()
    with (
        library_logs(Path(f"{config.output}.log")) as logs,
        ray_session(config.address),
        _collectors(config, env_factory, model_path) as group,
    ):
        logs.note_ray_logs()
        start = time.perf_counter()
        records = _collect(group, config, console)
        elapsed = time.perf_counter() - start
    path = write_records(records, Path(config.output))
    mean_reward = sum(r["reward"] for r in records) / len(records)
    rate = len(records) / elapsed
    console.print(
        f"wrote {len(records)} turns to {path} (collected at {rate:.1f} turns/s, mean reward {mean_reward:.3f})"
    )
    logs.print_where(console)
    return 0


def _env_factory(config: CollectConfig) -> EnvFactory:
    """The envs' prompts and scoring; checks --task and --prompts before anything starts."""
    task: ShippedTask | None
    name, flag = (config.task, "--task") if config.env is None else (config.env, "--env")
    if config.prompts is None:
        task = resolve_task(name or DEFAULT_TASK, flag=flag)
        rows = task.make_rows(NUM_GENERATED_PROMPTS, seed=config.seed)
    else:
        task = resolve_task(name, flag=flag) if name is not None else None
        rows = load_prompt_rows(config.prompts)
        if task is not None and task.has_reference_answers:
            _check_answers(rows, config.prompts, task.name)
    task_name = None if task is None else task.name
    return EnvFactory(
        task_name=task_name, rows=rows, num_envs=config.num_envs, repeats=config.group_size, seed=config.seed
    )


def _check_answers(rows: list[dict[str, Any]], path: str, task_name: str) -> None:
    missing = next((i for i, row in enumerate(rows, start=1) if "answer" not in row), None)
    if missing is not None:
        raise UsageError(
            f"--prompts {path}: row {missing} has no 'answer' for --task {task_name} to score; add one or drop --task."
        )


def _collectors(config: CollectConfig, env_factory: EnvFactory, model_path: Path) -> RayCollectorGroup:
    sampling = SamplingConfig(
        max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k
    )
    batches_per_collector = math.ceil(config.num_turns / (config.num_envs * config.num_collectors))
    remote_config, engine_kwargs = collector_placement(config.backend, config.num_collectors)
    return RayCollectorGroup(
        config.num_collectors,
        seed=config.seed,
        env=env_factory,
        policy_factory=PolicyFactory(
            backend=config.backend, model_path=str(model_path), sampling=sampling, engine_kwargs=engine_kwargs
        ),
        remote_config=remote_config,
        dialog_turns_per_batch=config.num_envs,
        total_dialog_turns=batches_per_collector * config.num_envs,
        yield_completed_trajectories=True,  # multi-turn tasks: only whole dialogs are written
        track_policy_version=True,
        sync_iter=False,  # each actor collects its next batch while the driver converts this one
        num_cpus=config.cpus_per_collector,
    )


def _collect(group: RayCollectorGroup, config: CollectConfig, console: Console) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    with turns_progress(console) as progress:
        bar = progress.add_task("collect", total=config.num_turns, status="")
        progress.update(bar, visible=config.progress)
        for batch in _round_robin(group):
            records.extend(batch_records(batch))
            mean_reward = sum(r["reward"] for r in records) / len(records)
            progress.update(bar, completed=min(len(records), config.num_turns), status=f"mean reward {mean_reward:.3f}")
    return records


def _round_robin(group: RayCollectorGroup) -> Iterator[Any]:
    """Batches from every collector in turn, until each has run its total."""
    iterators = [iter(collector) for collector in group]
    while iterators:
        for iterator in list(iterators):
            batch = next(iterator, None)
            if batch is None:
                iterators.remove(iterator)
            else:
                yield batch
