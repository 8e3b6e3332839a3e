"""The CLI's terminal shows progress and results: library logs and warnings go to a file, errors
still show, and everything is put back after the command."""

from __future__ import annotations

import io
import logging
import os
import warnings
from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from lmcollect.cli.quiet import library_logs
from lmcollect.ray import cluster


@pytest.fixture
def terminal():
    """A root handler standing for the terminal (what logging.basicConfig adds in `lmcollect`)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    yield stream
    root.removeHandler(handler)


def test_library_chatter_goes_to_the_file_and_errors_still_show(tmp_path: Path, terminal: io.StringIO) -> None:
    ray_logger, hf_logger = logging.getLogger("ray"), logging.getLogger("transformers")
    before = [(lg, list(lg.handlers), lg.propagate) for lg in (ray_logger, hf_logger)]
    path = tmp_path / "run" / "libraries.log"
    vllm_setting = os.environ.get("VLLM_CONFIGURE_LOGGING")
    with library_logs(path, quiet=True) as logs:
        assert logs.path == path
        assert cluster._DRIVER_DEFAULTS == {"log_to_driver": False, "configure_logging": False}  # for init_ray
        assert not hf_logging.is_progress_bar_enabled()
        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"  # a vLLM imported now leaves its loggers to the file
        ray_logger.handlers.clear()  # what ray.init(configure_logging=False) does: records still reach the file
        logging.getLogger("ray._private.worker").warning("ray-warning")
        logging.getLogger("transformers.modeling_utils").warning("hf-warning")
        warnings.warn("python-warning", UserWarning, stacklevel=1)
        logging.getLogger("vllm.engine").error("vllm-error")
        logging.getLogger("lmcollect.cli").warning("our-warning")
    written, shown = path.read_text(), terminal.getvalue()
    for text in ("ray-warning", "hf-warning", "python-warning", "vllm-error"):
        assert text in written, f"{text!r} missing from the log file:\n{written}"
    assert "our-warning" not in written
    assert "vllm-error" in shown and "our-warning" in shown, shown
    for text in ("ray-warning", "hf-warning", "python-warning"):
        assert text not in shown, f"{text!r} reached the terminal:\n{shown}"
    assert [(lg, list(lg.handlers), lg.propagate) for lg in (ray_logger, hf_logger)] == before
    assert hf_logging.is_progress_bar_enabled() and cluster._DRIVER_DEFAULTS == {}
    assert os.environ.get("VLLM_CONFIGURE_LOGGING") == vllm_setting
    logging.getLogger("ray._private.worker").warning("after-the-block")
    assert "after-the-block" not in path.read_text()


def test_verbose_leaves_logging_alone(tmp_path: Path, terminal: io.StringIO) -> None:
    path = tmp_path / "libraries.log"
    handlers = list(logging.getLogger().handlers)
    with library_logs(path, quiet=False) as logs:
        assert logs.path is None and cluster._DRIVER_DEFAULTS == {}
        assert logging.getLogger().handlers == handlers and hf_logging.is_progress_bar_enabled()
    assert not path.exists()
