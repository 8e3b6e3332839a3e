"""What the CLI prints is for people: progress and results. Library chatter goes to a log file.

:func:`library_logs` holds, for the length of a command:

- the loggers of the libraries lmcollect drives (Ray, vLLM, transformers, torch, ...) and Python's
  ``warnings`` write to a log file in the run's folder instead of the terminal; errors still reach
  the terminal as well;
- transformers' progress bars (``Loading weights``) are off;
- Ray workers' output is not forwarded to this process (``log_to_driver=False``): it stays in
  Ray's session logs, whose folder the log file names.

``lmcollect -v ...`` keeps everything on the terminal, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcollect.ray.cluster import ray_driver_defaults, ray_logs_dir

LIBRARY_LOG = "libraries.log"
"""The log file's name in a run folder."""

LIBRARY_LOGGERS = (
    "ray", "vllm", "transformers", "torch", "tensordict", "peft", "huggingface_hub", "filelock", "urllib3",
    "py.warnings", "httpx", "httpx2", "httpcore", "openai", "uvicorn", "fastapi",
)  # fmt: skip
"""Loggers (and their children) sent to the log file."""

VLLM_CONFIGURE_LOGGING = "VLLM_CONFIGURE_LOGGING"
"""vLLM's switch for the handler it puts on its loggers when imported."""


@dataclass
class LibraryLogs:
    """What :func:`library_logs` set up: ``path``, the log file (None when nothing was redirected)."""

    path: Path | None

    def note_ray_logs(self) -> str | None:
        """Write where Ray keeps its workers' output into the log file, and return that folder."""
        folder = ray_logs_dir()
        if folder is not None and self.path is not None:
            logging.getLogger("ray").info("Ray workers' output (not forwarded to the terminal): %s", folder)
        return folder

    def print_where(self, console: Any) -> None:
        """Tell the terminal (a rich ``Console``) where the library logs went; nothing under ``-v``."""
        if self.path is not None:
            console.print(f"library and Ray worker logs: {self.path}")


@contextlib.contextmanager
def library_logs(path: Path, *, quiet: bool | None = None) -> Iterator[LibraryLogs]:
    """Send library logs to ``path`` inside the block (see the module docstring); put the loggers
    back as they were after it. ``quiet=False`` changes nothing; None (the default): quiet unless
    ``lmcollect -v`` (:func:`quiet_terminal`).

    The library loggers lose their own handlers and pass their records up to the root logger, where
    one handler writes them to the file and the root's other handlers (the terminal) let only their
    errors through. Records travel up by name, so this holds even when a library resets its logger's
    handlers (``ray.init`` does)."""
    if not (quiet_terminal() if quiet is None else quiet):
        yield LibraryLogs(path=None)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_file.addFilter(_from_libraries)
    added = None
    if not root.handlers:  # nothing would print the errors (no logging.basicConfig)
        added = logging.StreamHandler(sys.stderr)
        root.addHandler(added)
    terminal = list(root.handlers)
    saved = [_hand_up(logging.getLogger(name)) for name in LIBRARY_LOGGERS]
    for handler in terminal:
        handler.addFilter(_library_errors_only)
    root.addHandler(to_file)
    logging.captureWarnings(True)
    progress_bars = _transformers_progress_bars(False)
    # a vLLM imported in the block would put its own terminal handler on "vllm": leave its loggers to us
    vllm_logging = os.environ.get(VLLM_CONFIGURE_LOGGING)
    os.environ[VLLM_CONFIGURE_LOGGING] = "0"
    try:
        # whoever starts Ray in the block: no forwarding of the workers' output, and no terminal
        # handler of Ray's own on "ray" (configure_logging=False)
        with ray_driver_defaults(log_to_driver=False, configure_logging=False):
            yield LibraryLogs(path=path)
    finally:
        if vllm_logging is None:
            os.environ.pop(VLLM_CONFIGURE_LOGGING, None)
        else:
            os.environ[VLLM_CONFIGURE_LOGGING] = vllm_logging
        _transformers_progress_bars(progress_bars)
        logging.captureWarnings(False)
        root.removeHandler(to_file)
        to_file.close()
        for handler in terminal:
            handler.removeFilter(_library_errors_only)
        if added is not None:
            root.removeHandler(added)
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate


def _is_library(name: str) -> bool:
    return any(name == library or name.startswith(library + ".") for library in LIBRARY_LOGGERS)


def _from_libraries(record: logging.LogRecord) -> bool:
    return _is_library(record.name)


def _library_errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or not _is_library(record.name)


def _hand_up(logger: logging.Logger) -> tuple[logging.Logger, list[logging.Handler], bool]:
    """``logger`` without handlers of its own, passing its records up; returns what to restore."""
    saved = (logger, list(logger.handlers), logger.propagate)
    logger.handlers = []
    logger.propagate = True
    return saved


def _transformers_progress_bars(enabled: bool) -> bool:
    """Turn transformers' progress bars on or off; return whether they were on."""
    from transformers.utils import logging as hf_logging

    was_enabled = bool(hf_logging.is_progress_bar_enabled())
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    return was_enabled


def quiet_terminal() -> bool:
    """False under ``lmcollect -v`` (the root logger at INFO or below): libraries then print as they do."""
    return logging.getLogger().getEffectiveLevel() > logging.INFO
