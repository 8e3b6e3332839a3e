"""Live progress displays of the CLI (rich): training steps with their metrics, collected turns."""
from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


STATUS_COLUMNS = (
    ("turns", "collect/turns", "{:.0f}"),
    ("mean reward", "reward/mean", "{:.3f}"),
    ("version", "policy_version", "{:.0f}"),
    ("turns/s", "collect/turns_per_s", "{:.0f}"),
    ("push s", "timing/weight_sync/push_s", "{:.3f}"),
    ("staleness", "staleness/mean", "{:.2f}"),
)
"""(header, metric key, format) of the live table under the bar."""


def training_status(record: Mapping[str, float]) -> Table:
    """Turns collected, mean reward, policy version, turns/s, push seconds and staleness of one step."""
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    for header, _, _ in STATUS_COLUMNS:
        table.add_column(header, justify="right")
    table.add_row(*(fmt.format(record[key]) if key in record else "-" for _, key, fmt in STATUS_COLUMNS))
    return table


class TrainingProgress:
    """A bar over training steps, the latest step's metrics in a small table under it (a context manager)."""

    def __init__(self, total_steps: int, *, console: Console, description: str = "GRPO") -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._live.stop()
        if not self._live.console.is_interactive:  # the last frame is printed without a line break
            self._live.console.line()


def turns_progress(console: Console) -> Progress:
    """A bar over collected turns (``lmcollect collect``)."""
    return Progress(
        TextColumn("[bold]collect"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
    )
