"""Hugging Face ``datasets`` as prompt rows: a ``datasets.Dataset`` or local dataset files, columns renamed to lmcollect's."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # datasets is an optional extra
    from datasets import Dataset


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            "Hugging Face datasets are read with the datasets package: pip install 'lmcollect[datasets]'."
        ) from exc
    return datasets


def rows_from_hf(dataset: Dataset, *, columns: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The rows of a ``datasets.Dataset``, each column renamed by ``columns`` (``{dataset column: row key}``,
    e.g. ``{"question": "prompt", "solution": "answer"}``); columns not named keep their names."""
    datasets = _datasets()
    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(
            f"dataset is a DatasetDict with splits {sorted(dataset)}; pass one split, e.g. dataset['train']."
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"dataset must be a datasets.Dataset, got {type(dataset).__name__}.")
    columns = dict(columns or {})
    missing = sorted(set(columns) - set(dataset.column_names))
    if missing:
        raise ValueError(f"columns names {missing}, which the dataset lacks; its columns: {dataset.column_names}.")
    renamed = [columns.get(name, name) for name in dataset.column_names]
    if len(set(renamed)) != len(renamed):
        raise ValueError(f"columns {columns} gives two columns the same name ({renamed}); rename or drop one.")
    return [{columns.get(key, key): value for key, value in row.items()} for row in dataset.to_list()]


def as_hf_dataset(source: Any) -> Dataset:
    """``source`` if it is a ``datasets.Dataset``; local dataset files (a path, a list of paths or a
    ``data_files`` mapping) read with :func:`load_hf_files` otherwise."""
    datasets = _datasets()
    if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):  # a DatasetDict is refused by rows_from_hf
        return source
    if isinstance(source, (str, os.PathLike)):
        return load_hf_files(os.fspath(source))
    is_paths = isinstance(source, (list, tuple)) and source and all(isinstance(p, (str, os.PathLike)) for p in source)
    if is_paths or isinstance(source, Mapping):
        return load_hf_files([os.fspath(p) for p in source] if is_paths else source)
    return source


def load_hf_files(
    data_files: str | Sequence[str] | Mapping[str, Any], *, file_format: str | None = None, split: str = "train"
) -> Dataset:
    """Local dataset files (``.jsonl``/``.json``, ``.parquet``, ``.csv``, ...) read by ``datasets.load_dataset``
    (no download): ``file_format`` defaults to what the first file's extension says."""
    datasets = _datasets()
    if file_format is None:
        first = data_files if isinstance(data_files, str) else next(iter(_flat(data_files)), "")
        file_format = _FORMATS.get(str(first).rsplit(".", 1)[-1].lower())
        if file_format is None:
            raise ValueError(f"cannot tell the format of {first!r}; pass file_format ('json', 'parquet', 'csv').")
    return datasets.load_dataset(file_format, data_files=data_files, split=split)


_FORMATS = {"jsonl": "json", "json": "json", "parquet": "parquet", "pq": "parquet", "csv": "csv", "arrow": "arrow"}


def _flat(data_files: Sequence[str] | Mapping[str, Any]) -> list[str]:
    if isinstance(data_files, Mapping):
        return [f for files in data_files.values() for f in ([files] if isinstance(files, str) else files)]
    return list(data_files)
