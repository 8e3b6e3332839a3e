"""Progress displays of the CLI: live (rich) on a terminal, a plain line every few seconds otherwise."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol, Self

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

STATUS_COLUMNS = (
    ("turns", "collect/turns", "{:.0f}"),
    ("mean reward", "reward/mean", "{:.3f}"),
    ("version", "policy_version", "{:.0f}"),
    ("turns/s", "collect/turns_per_s", "{:.0f}"),
    ("push s", "timing/weight_sync/push_s", "{:.3f}"),
    ("staleness", "staleness/mean", "{:.2f}"),
    ("kept", "sampling/kept_share", "{:.2f}"),
)
"""(header, metric key, format) of the live table under the bar."""


def training_status(record: Mapping[str, float]) -> Table:
    """Turns collected, mean reward, policy version, turns/s, push seconds and staleness of one step."""
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    for header, _, _ in STATUS_COLUMNS:
        table.add_column(header, justify="right")
    table.add_row(*(fmt.format(record[key]) if key in record else "-" for _, key, fmt in STATUS_COLUMNS))
    return table


PLAIN_INTERVAL_S = 5.0
"""Seconds between two plain progress lines (stdout not a terminal: ``make demo > log``)."""


class StepProgress(Protocol):
    """What the demo's training loop reports to, step by step (a context manager)."""

    def update(self, record: Mapping[str, float]) -> None: ...

    def __enter__(self) -> StepProgress: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def training_progress(total_steps: int, *, console: Console) -> StepProgress:
    """The live display on a terminal (or notebook); plain lines when stdout goes to a file or pipe,
    where a live display would print nothing until the end."""
    if console.is_terminal or console.is_jupyter:
        return TrainingProgress(total_steps, console=console)
    return PlainTrainingProgress(total_steps, console=console)


def step_progress(total_steps: int, *, console: Console, show: bool, log: logging.Logger) -> StepProgress:
    """:func:`training_progress` when ``show``; else nothing on the terminal, each step's record
    logged at debug level on ``log`` (``--no-progress``)."""
    return training_progress(total_steps, console=console) if show else LoggedSteps(log)


class LoggedSteps:
    """Each step's record at debug level on ``log``, and nothing on the terminal."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log

    def update(self, record: Mapping[str, float]) -> None:
        self.log.debug("step %d: %s", record["step"], record)

    def __enter__(self) -> LoggedSteps:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass


def status_line(record: Mapping[str, float], total_steps: int, elapsed_s: float) -> str:
    """``step 12/400  35 s  turns 640  mean reward 0.500 ...`` (the live table's columns, on one line)."""
    parts = [f"step {int(record['step'])}/{total_steps}", f"{elapsed_s:.0f} s"]
    parts += [f"{header} {fmt.format(record[key])}" for header, key, fmt in STATUS_COLUMNS if key in record]
    return "  ".join(parts)


class _PlainLines:
    """Plain lines on ``console`` at most every ``interval_s`` seconds (timed from ``with``), and at
    the end the line still owed: progress for logs, where a live display would print nothing."""

    def __init__(self, console: Console, interval_s: float) -> None:
        self.console, self.interval_s = console, interval_s
        self._start = self._last_print = time.monotonic()

    def _due(self) -> bool:
        return time.monotonic() - self._last_print >= self.interval_s

    def _flush(self) -> None:
        """Print the line still owed, if any (the subclass knows what it owes)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._start = self._last_print = time.monotonic()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._flush()


class PlainTrainingProgress(_PlainLines):
    """One plain line per ``interval_s`` seconds (and the last step's line at the end): for logs."""

    def __init__(self, total_steps: int, *, console: Console, interval_s: float = PLAIN_INTERVAL_S) -> None:
        super().__init__(console, interval_s)
        self.total_steps = total_steps
        self._pending: Mapping[str, float] | None = None

    def update(self, record: Mapping[str, float]) -> None:
        self._pending = record
        if self._due():
            self._print(record)

    def _print(self, record: Mapping[str, float]) -> None:
        now = time.monotonic()
        self.console.print(status_line(record, self.total_steps, now - self._start), highlight=False, soft_wrap=True)
        self._last_print, self._pending = now, None

    def _flush(self) -> None:
        if self._pending is not None:
            self._print(self._pending)


class TrainingProgress:
    """A bar over training steps, the latest step's metrics in a small table under it (a context manager)."""

    def __init__(self, total_steps: int, *, console: Console, description: str = "GRPO") -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self._task = self._progress.add_task(description, total=total_steps)
        self._status = training_status({})
        self._live = Live(get_renderable=self._render, console=console, refresh_per_second=4)

    def _render(self) -> RenderableType:
        return Group(self._progress.get_renderable(), self._status)

    def update(self, record: Mapping[str, float]) -> None:
        """Show one step's metrics (:data:`STATUS_COLUMNS` names the keys it reads)."""
        self._progress.update(self._task, completed=int(record["step"]))
        self._status = training_status(record)

    def __enter__(self) -> TrainingProgress:
        self._live.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._live.stop()
        if not self._live.console.is_interactive:  # the last frame is printed without a line break
            self._live.console.line()


def turns_progress(console: Console) -> Progress | PlainTurnsProgress:
    """A bar over collected turns (``lmcollect collect``); plain lines when stdout is not a terminal."""
    if not (console.is_terminal or console.is_jupyter):
        return PlainTurnsProgress(console)
    return Progress(
        TextColumn("[bold]collect"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
    )


class PlainTurnsProgress(_PlainLines):
    """The part of rich's ``Progress`` that ``lmcollect collect`` uses, as a plain line every few seconds."""

    def __init__(self, console: Console, *, interval_s: float = PLAIN_INTERVAL_S) -> None:
        super().__init__(console, interval_s)
        self._tasks: dict[TaskID, dict[str, Any]] = {}
        self._dirty = False

    def add_task(self, description: str, *, total: float | None = None, **fields: Any) -> TaskID:
        task_id = TaskID(len(self._tasks))
        self._tasks[task_id] = {"description": description, "total": total, "completed": 0, "visible": True, **fields}
        return task_id

    def update(self, task_id: TaskID, **changes: Any) -> None:
        self._tasks[task_id].update(changes)
        self._dirty = True
        if self._due():
            self._print()

    def _print(self) -> None:
        now = time.monotonic()
        for task in self._tasks.values():
            if task["visible"]:
                total = "" if task["total"] is None else f"/{task['total']:.0f}"
                status = f"  {task['status']}" if task.get("status") else ""
                line = f"{task['description']} {task['completed']:.0f}{total}  {now - self._start:.0f} s{status}"
                self.console.print(line, highlight=False, soft_wrap=True)
        self._last_print, self._dirty = now, False

    def _flush(self) -> None:
        if self._dirty:
            self._print()
