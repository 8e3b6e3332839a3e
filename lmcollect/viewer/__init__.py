"""Self-contained HTML reports of collected rollouts: a sortable table of dialogs, tokens coloured by log-prob."""

from lmcollect.viewer.dialogs import Dialog, TokenDecoder, Turn, group_dialogs, read_rollout_records
from lmcollect.viewer.report import render_report, write_rollout_report

__all__ = [
    "Dialog",
    "TokenDecoder",
    "Turn",
    "group_dialogs",
    "read_rollout_records",
    "render_report",
    "write_rollout_report",
]
