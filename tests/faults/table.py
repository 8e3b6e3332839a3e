"""The fault table: one row per fault case, written by the pytest worker that ran it, printed at the end.

``make test`` runs pytest workers (pytest-xdist): each appends its rows to a file in the folder
named by ``LMCOLLECT_FAULT_TABLE_DIR`` (set by the controlling process, see tests/conftest.py),
and the controlling process prints them all in its terminal summary.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

TABLE_DIR_ENV = "LMCOLLECT_FAULT_TABLE_DIR"


@dataclass(frozen=True)
class FaultRow:
    fault: str
    injected: str
    outcome: str
    time_to_error_s: float | None
    turns_lost: int | str | None


class FaultTable:
    """Rows of the report: what was broken, how, what followed, how fast, what was lost."""

    def __init__(self) -> None:
        self.rows: list[FaultRow] = []

    def add(
        self, fault: str, injected: str, outcome: str, time_to_error_s: float | None, turns_lost: int | str | None
    ) -> None:
        row = FaultRow(fault, injected, outcome, time_to_error_s, turns_lost)
        self.rows.append(row)
        folder = os.environ.get(TABLE_DIR_ENV)
        if folder:
            with open(Path(folder) / f"rows-{os.getpid()}.jsonl", "a") as rows:
                rows.write(json.dumps(asdict(row)) + "\n")

    def lines(self) -> list[str]:
        out = ["| fault | how injected | outcome | time to error (s) | turns lost |", "|---|---|---|---|---|"]
        for r in self.rows:
            seconds = "-" if r.time_to_error_s is None else f"{r.time_to_error_s:.2f}"
            lost = "-" if r.turns_lost is None else str(r.turns_lost)
            out.append(f"| {r.fault} | {r.injected} | {r.outcome} | {seconds} | {lost} |")
        return out




def read_table(folder: str | Path) -> FaultTable:
    """Every row the workers wrote into ``folder``."""
    table = FaultTable()
    for path in sorted(Path(folder).glob("rows-*.jsonl")):
        table.rows.extend(FaultRow(**json.loads(line)) for line in path.read_text().splitlines())
    return table
