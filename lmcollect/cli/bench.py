"""`lmcollect bench`: run the benchmark scripts of ``benchmarks/``, one table of ratios, one JSON file.

Run: ``lmcollect bench --quick`` (a few minutes), or ``lmcollect bench`` for the full set.

Each script is imported from the source checkout; its ``run(...)`` gives its rows, or, for a
script without one, its ``main()`` runs and the JSON line it prints last is read. Rows are
brought to one shape (benchmark, row, metric, value, target, met) and written with the date and
the machine, plus a markdown table for the README.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.table import Table

from lmcollect.cli.configs import BenchConfig, UsageError
from lmcollect.cli.quiet import library_logs
from lmcollect.files import write_text_atomically

logger = logging.getLogger(__name__)

BENCHMARKS = (
    "collect",
    "weight_sync",
    "push_latency",
    "memory",
    "startup",
    "agentic",
    "dynamic_sampling",
    "kv_fidelity",
)


def run_bench(config: BenchConfig) -> int:
    names = _selected(config.only)
    benchmarks_dir()  # without a source checkout: its one-line error before anything starts
    console = Console()
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    output = Path(config.output)
    log_path = output.with_name(output.stem + "-libraries.log")
    with library_logs(log_path) as logs:
        for name in names:
            module = _load(name)
            if module is None:
                console.print(f"[yellow]benchmarks/{name}.py not found: skipped[/]")
                continue
            console.print(f"running benchmarks/{name}.py{' --quick' if config.quick else ''} ...")
            try:
                rows += [normalize_row(name, row) for row in _rows_of(module, config)]
            except Exception as exc:  # designed: one broken benchmark must not lose the others' rows
                logger.exception("benchmarks/%s.py failed", name)
                failed.append(name)
                rows.append(normalize_row(name, {"row": f"FAILED: {type(exc).__name__}: {exc}"[:200]}))
            logs.note_ray_logs()
    report = {"date": time.strftime("%Y-%m-%d"), "machine": machine_description(), "quick": config.quick, "rows": rows}
    output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(output, json.dumps(report, indent=2) + "\n")
    write_text_atomically(output.with_suffix(".md"), markdown_table(report))
    console.print(_rich_table(rows, title=f"lmcollect bench, {report['date']}, {report['machine']}"))
    console.print(f"wrote {output} and {output.with_suffix('.md')}")
    logs.print_where(console)
    return 1 if failed else 0


def _selected(only: str) -> list[str]:
    names = [n.strip() for n in only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        raise UsageError(f"--only: unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}.")
    return names


def benchmarks_dir() -> Path:
    """``benchmarks/`` next to the ``lmcollect`` package (a source checkout or an editable install).

    The scripts are not in the wheel (they import each other and the checkout's layout): an installed
    package has no checkout around it, which ``pyproject.toml`` beside ``benchmarks/`` tells apart
    (site-packages may hold some other distribution's top-level ``benchmarks``).
    """
    root = Path(__file__).resolve().parents[2]  # lmcollect/cli/bench.py -> the checkout
    path = root / "benchmarks"
    if not (path.is_dir() and (root / "pyproject.toml").is_file()):
        raise UsageError(
            "lmcollect bench needs a source checkout (its benchmarks/ scripts are not installed with the package): "
            "git clone the lmcollect repository, then run `make bench` in it."
        )
    return path


def _load(name: str) -> ModuleType | None:
    path = benchmarks_dir() / f"{name}.py"
    return _load_path(path) if path.is_file() else None


def _load_path(path: Path) -> ModuleType:
    from lmcollect.ray.cluster import pickle_by_value  # imports Ray: only when a script is loaded

    spec = importlib.util.spec_from_file_location(f"lmcollect_benchmarks_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the benchmark script {path}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: the script may look itself up (e.g. for pickling)
    spec.loader.exec_module(module)
    pickle_by_value(module)  # Ray workers cannot import it by name: its classes travel by value
    return module


def _rows_of(module: ModuleType, config: BenchConfig) -> list[dict[str, Any]]:
    if hasattr(module, "run"):
        options: dict[str, Any] = {"quick": config.quick}
        if module.__name__.endswith("_collect"):  # these options are the collection benchmark's
            options.update(
                sizes=config.sizes, rows=config.rows, batch_size=config.batch_size, max_new_tokens=config.max_new_tokens
            )
        accepted = inspect.signature(module.run).parameters
        result = module.run(**{k: v for k, v in options.items() if k in accepted})
    else:
        result = _json_of_main(module, ["--quick"] if config.quick else ["--rows", "all"])
    return result["rows"] if isinstance(result, dict) else list(result)


def _json_of_main(module: ModuleType, argv: list[str]) -> Any:
    """Run a script's ``main()`` with ``argv``; the JSON line it printed last."""
    stdout, saved_argv = io.StringIO(), sys.argv
    sys.argv = [module.__file__ or module.__name__, *argv]
    try:
        with contextlib.redirect_stdout(stdout):
            module.main()
    finally:
        sys.argv = saved_argv
    lines = [line for line in stdout.getvalue().splitlines() if line.strip()]
    logger.info("%s printed:\n%s", module.__file__, "\n".join(lines[:-1]))
    if not lines:
        raise RuntimeError(f"{module.__file__} printed nothing; its last line should be JSON.")
    return json.loads(lines[-1])


def normalize_row(benchmark: str, row: dict[str, Any]) -> dict[str, Any]:
    """A row with benchmark, row, metric, value, target and met (the script's own fields kept)."""
    if "metric" in row and "value" in row:
        return {"benchmark": benchmark, **row}
    if row.get("x_memcpy") is not None or row.get("s_per_gb") is not None:  # weight-sync rows
        per_gb = row.get("s_per_gb")
        return {
            "benchmark": benchmark,
            **row,
            "metric": "push s / memcpy s" + (f" ({per_gb:.3f} s/GB)" if per_gb is not None else ""),
            "value": row.get("x_memcpy") if row.get("x_memcpy") is not None else 1.0,
            "target": "",
            "met": None,
        }
    return {"benchmark": benchmark, "metric": "", "value": None, "target": "", "met": None, **row}


def machine_description() -> str:
    try:
        import torch  # imported here: only to name the accelerator

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no torch"
    return f"{platform.machine()} {os.cpu_count()} CPU cores, {gpu}, {platform.system()} {platform.release()}"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "" if value is None else str(value)


def markdown_table(report: dict[str, Any]) -> str:
    lines = [
        f"Latest run: {report['date']} on {report['machine']}{' (--quick)' if report['quick'] else ''}.",
        "",
        "| benchmark | row | metric | value | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        cells = (r["benchmark"], r["row"], r["metric"], _fmt(r["value"]), _fmt(r["target"]), _fmt(r["met"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _rich_table(rows: list[dict[str, Any]], *, title: str) -> Table:
    table = Table(title=title)
    for column in ("benchmark", "row", "metric", "value", "target", "met"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for r in rows:
        table.add_row(*(_fmt(r[c]) for c in ("benchmark", "row", "metric", "value", "target", "met")))
    return table
