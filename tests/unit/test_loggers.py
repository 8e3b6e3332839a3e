"""lmcollect.loggers: what each kind writes, read back from its own files (JSON lines, TensorBoard events, a W&B run)."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from lmcollect.cli.report import plot_training
from lmcollect.loggers import LOGGER_KINDS, JsonlLogger, MissingLoggerPackage, MultiLogger, make_logger
from lmcollect.loggers import base as logger_base

STEPS = [
    {"reward/mean": 0.25, "collect/turns_per_s": 10.0, "timing/weight_sync/push_s": 0.01},
    {"reward/mean": 0.5, "collect/turns_per_s": 12.0, "timing/weight_sync/push_s": 0.02},
    {"reward/mean": 0.75, "collect/turns_per_s": 11.0, "timing/weight_sync/push_s": 0.03},
]
CONFIG = {"lr": 5e-4, "task": "comparison"}


def _log_run(kind: str, run_dir: Path) -> Path:
    """Three steps and the training plot, as the demo logs them; returns the PNG."""
    records = [{"step": step, **metrics} for step, metrics in enumerate(STEPS, start=1)]
    png = plot_training(records, run_dir / "training.png")
    with make_logger(kind, run_dir, CONFIG) as logger:
        for step, metrics in enumerate(STEPS, start=1):
            logger.log(metrics, step=step)
        logger.log_image("training", png, step=len(STEPS))
    return png


def test_jsonl_logger_writes_one_line_per_step(tmp_path: Path) -> None:
    png = _log_run("jsonl", tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": step, **metrics} for step, metrics in enumerate(STEPS, start=1)]
    assert list(lines[0]) == ["step", *STEPS[0]]  # step first, as the demo's file always had it
    assert json.loads((tmp_path / "images.jsonl").read_text()) == {"step": 3, "name": "training", "path": str(png)}
    assert json.loads((tmp_path / "config.json").read_text()) == CONFIG


def test_jsonl_logger_refuses_a_conflicting_step(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path)
    logger.log({"step": 4, "loss": 1.0}, step=4)  # the same step twice is fine
    with pytest.raises(ValueError, match=r"metrics\['step'\] is 5 but step=6"):
        logger.log({"step": 5}, step=6)
    assert logger.records == [{"step": 4, "loss": 1.0}]


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    png = _log_run("tensorboard", tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert set(STEPS[0]) <= set(tags["scalars"])
    for key in STEPS[0]:
        assert [(e.step, pytest.approx(e.value)) for e in events.Scalars(key)] == [
            (step, metrics[key]) for step, metrics in enumerate(STEPS, start=1)
        ]
    (image,) = events.Images("training")
    from PIL import Image

    with Image.open(png) as plot:
        assert (image.step, image.width, image.height) == (3, plot.width, plot.height)
    assert "config" in "".join(tags["tensors"])  # add_text stores the config as a text tensor


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of a W&B ``.wandb`` file (a LevelDB-style log: 32 KiB blocks of
    ``crc32, length, type`` chunks after a 7-byte ``:W&B`` header; wandb ships no Python reader)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    chunks: list[bytes] = []
    records, partial = [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # zero padding to the end of the block
            pos += left - 7 - length
            continue
        partial = chunk if kind in (1, 2) else partial + chunk  # full, first / middle, last
        if kind in (1, 4):
            chunks.append(partial)
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def _complete_wandb_records(run_file: Path, timeout_s: float = 30.0) -> list:
    """The run file's records once it holds the run's exit record: wandb-core (0.31) can still be
    writing the file for a moment after ``run.finish()`` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_wandb_offline_run_reads_back(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default: no network here
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_run("wandb", tmp_path)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("*.wandb")
    records = _complete_wandb_records(run_file)
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
    for step, metrics in enumerate(STEPS, start=1):
        assert {key: history[step][key] for key in metrics} == pytest.approx(metrics)
    assert history[3]["training/_type"] == "image-file"
    assert (run_dir / "files" / history[3]["training/path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert {key: config[key] for key in CONFIG} == CONFIG


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_package_names_the_pip_extra(tmp_path: Path, monkeypatch, kind: str) -> None:
    monkeypatch.setitem(logger_base.REQUIRED_PACKAGES, kind, "lmcollect_no_such_package")
    with pytest.raises(MissingLoggerPackage, match=r"pip install 'lmcollect\[loggers\]'"):
        make_logger(kind, tmp_path)
    assert not (tmp_path / kind).exists()


def test_the_demo_refuses_a_logger_it_cannot_import(tmp_path: Path, monkeypatch, capsys) -> None:
    """Before any Ray or model work: exit 2 naming --logger and the extra."""
    from lmcollect.cli.main import main

    monkeypatch.setitem(logger_base.REQUIRED_PACKAGES, "tensorboard", "lmcollect_no_such_package")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--logger", "tensorboard", "--output-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--logger tensorboard: the tensorboard logger needs the 'lmcollect_no_such_package' package" in err
    assert "pip install 'lmcollect[loggers]'" in err
    assert not list(tmp_path.iterdir())  # no run folder was made


def test_unknown_kinds_and_options_are_refused(tmp_path: Path) -> None:
    assert LOGGER_KINDS == ("jsonl", "tensorboard", "wandb")
    with pytest.raises(ValueError, match="unknown logger 'mlflow'; use one of jsonl, tensorboard, wandb"):
        make_logger("mlflow", tmp_path)
    with pytest.raises(TypeError, match="the jsonl logger takes no options"):
        make_logger("jsonl", tmp_path, project="x")


def test_multi_logger_closes_every_logger_and_raises_the_first_failure(tmp_path: Path) -> None:
    events: list[str] = []

    class Recording:
        def __init__(self, name: str, fail_close: bool) -> None:
            self.name, self.fail_close = name, fail_close

        def log(self, metrics, step):
            events.append(f"{self.name} log {step}")

        def log_image(self, name, path, step):
            events.append(f"{self.name} image {step}")

        def close(self):
            events.append(f"{self.name} close")
            if self.fail_close:
                raise OSError("disk full")

    logger = MultiLogger([Recording("broken", True), Recording("fine", False)])
    logger.log({"x": 1.0}, step=1)
    logger.log_image("plot", tmp_path / "plot.png", step=1)
    with pytest.raises(OSError, match="disk full"):
        logger.close()
    assert events == ["broken log 1", "fine log 1", "broken image 1", "fine image 1", "broken close", "fine close"]
