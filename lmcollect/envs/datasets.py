"""Prompt datasets: rows with a "prompt", read from memory, JSONL or Parquet, iterated forever."""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmcollect.data.history import History, Message

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
PathOrPaths = PathLike | Sequence[PathLike]


def _check_prompt(prompt: Any, where: str) -> None:
    if isinstance(prompt, str):
        return
    if (
        isinstance(prompt, Sequence)
        and prompt
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt
        )
    ):
        return
    raise ValueError(
        f"{where}: 'prompt' must be a str or a non-empty list of {{'role', 'content'}} dicts, "
        f"got {type(prompt).__name__}; fix the row."
    )


def _normalize_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise TypeError(f"{where}: each row must be a dict with a 'prompt' key, got {type(row).__name__}.")
    if "prompt" not in row:
        raise ValueError(f"{where}: row has no 'prompt' key (keys: {sorted(row)}); add one.")
    _check_prompt(row["prompt"], where)
    out = dict(row)
    if not isinstance(out["prompt"], str):  # Parquet gives numpy arrays / tuples: store plain lists
        out["prompt"] = [{"role": m["role"], "content": m["content"]} for m in out["prompt"]]
    return out


def row_to_history(row: Mapping[str, Any], *, system_prompt: str | None = None) -> History:
    """The opening :class:`History` of a dataset row.

    A str prompt becomes ``[system?, user]``; a message list is used as is, with ``system_prompt``
    prepended unless the list already starts with a system message.
    """
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return History.from_text(prompt, system_prompt=system_prompt)
    history = History.from_dicts(prompt)
    if system_prompt and history.messages[0].role != "system":
        history = History((Message("system", system_prompt), *history.messages))
    return history


def _as_paths(paths: PathOrPaths) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg}); fix or remove it.") from e
            rows.append(_normalize_row(row, f"{path}:{lineno}"))
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # imported lazily: only Parquet users pay for it

    table = pq.read_table(path)
    return [_normalize_row(row, f"{path} row {i}") for i, row in enumerate(table.to_pylist())]


RowReader = Callable[[Path], list[dict[str, Any]]]
"""Reads the rows of one file."""

_READERS_BY_SUFFIX: dict[str, RowReader] = {
    ".jsonl": _read_jsonl,
    ".json": _read_jsonl,
    ".parquet": _read_parquet,
    ".pq": _read_parquet,
}


def _read_by_suffix(path: Path) -> list[dict[str, Any]]:
    suffix = path.suffix.lower()
    if suffix not in _READERS_BY_SUFFIX:
        raise ValueError(f"paths: cannot read {path} (suffix {suffix!r}); use .jsonl or .parquet files.")
    return _READERS_BY_SUFFIX[suffix](path)


class PromptDataset:
    """A list of prompt rows iterated in a seeded, shuffled order, cycling forever.

    Each row is a dict with ``"prompt"`` (a str, or a list of ``{"role", "content"}`` messages)
    and any other fields (e.g. ``"answer"``) that reward functions and tasks may read. Each pass
    over the data (an epoch) uses a fresh permutation derived from ``(seed, epoch)``, so the order
    is reproducible and resumable through :meth:`state_dict`.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]], *, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
            raise TypeError(
                f"rows must be a list of dicts, got {type(rows).__name__}; "
                "use PromptDataset.from_jsonl / from_parquet / from_files for files."
            )
        if len(rows) == 0:
            raise ValueError(
                "PromptDataset got an empty dataset (0 rows); pass at least one row like "
                "{'prompt': 'What is 1 + 1?', 'answer': '2'}."
            )
        self._rows = [_normalize_row(r, f"row {i}") for i, r in enumerate(rows)]
        self.shuffle = shuffle
        self._seed = int(seed)
        self._epoch = 0
        self._index = 0
        self._order = self._permutation()

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_jsonl(cls, paths: PathOrPaths, *, seed: int = 0, shuffle: bool = True) -> PromptDataset:
        """Rows from one or more JSON-lines files (blank lines are skipped)."""
        return cls._from_paths(paths, _read_jsonl, seed=seed, shuffle=shuffle)

    @classmethod
    def from_parquet(cls, paths: PathOrPaths, *, seed: int = 0, shuffle: bool = True) -> PromptDataset:
        """Rows from one or more Parquet files (one row per record)."""
        return cls._from_paths(paths, _read_parquet, seed=seed, shuffle=shuffle)

    @classmethod
    def from_files(cls, paths: PathOrPaths, *, seed: int = 0, shuffle: bool = True) -> PromptDataset:
        """Rows from ``.jsonl`` / ``.json`` (JSON lines) and ``.parquet`` files, by extension."""
        return cls._from_paths(paths, _read_by_suffix, seed=seed, shuffle=shuffle)

    @classmethod
    def from_hf(
        cls,
        dataset: Any,
        *,
        columns: Mapping[str, str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
    ) -> PromptDataset:
        """Rows of a Hugging Face ``datasets.Dataset`` (the ``datasets`` extra), or of local dataset files
        (a path, a list of paths or a ``data_files`` mapping, read by ``datasets.load_dataset``).

        ``columns`` renames the dataset's columns (``{"question": "prompt", "solution": "answer"}``);
        the order is this class's seeded shuffle and the position is in :meth:`state_dict`, as for any rows.
        """
        from lmcollect.envs import hf_datasets  # the optional datasets package is imported only here

        rows = hf_datasets.rows_from_hf(hf_datasets.as_hf_dataset(dataset), columns=columns)
        return cls(rows, seed=seed, shuffle=shuffle)

    @classmethod
    def _from_paths(cls, paths: PathOrPaths, read: RowReader, *, seed: int, shuffle: bool) -> PromptDataset:
        """The rows ``read`` finds in each of ``paths``, in order."""
        rows = [row for p in _as_paths(paths) for row in read(p)]
        if not rows:
            raise ValueError(f"PromptDataset got an empty dataset: no rows in {paths}; pass files with rows.")
        logger.info("Loaded %d prompt rows from %s", len(rows), paths)
        return cls(rows, seed=seed, shuffle=shuffle)

    # ---- access -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self._rows[index]

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self._rows

    @property
    def seed(self) -> int:
        return self._seed

    def _permutation(self) -> list[int]:
        order = list(range(len(self._rows)))
        if self.shuffle:
            random.Random(self._seed * 1_000_003 + self._epoch).shuffle(order)
        return order

    def next_index(self) -> int:
        """The dataset index of the next row in the seeded order (advances the cursor)."""
        if self._index >= len(self._order):
            self._epoch += 1
            self._index = 0
            self._order = self._permutation()
        idx = self._order[self._index]
        self._index += 1
        return idx

    def next_row(self) -> dict[str, Any]:
        """The next row (advances the cursor; never stops: epochs follow each other)."""
        return self._rows[self.next_index()]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yields rows forever (do not ``list()`` it); shares the cursor with :meth:`next_row`."""
        while True:
            yield self.next_row()

    def set_seed(self, seed: int) -> None:
        """Restart the iteration at epoch 0 with a new seed."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}.")
        self._seed, self._epoch, self._index = seed, 0, 0
        self._order = self._permutation()

    def fork(self) -> PromptDataset:
        """A dataset sharing these rows but with its own cursor (same seed and position)."""
        new = object.__new__(PromptDataset)
        new._rows, new.shuffle = self._rows, self.shuffle
        new._seed, new._epoch, new._index, new._order = self._seed, self._epoch, self._index, self._order
        return new

    def state_dict(self) -> dict[str, int]:
        return {"seed": self._seed, "epoch": self._epoch, "index": self._index}

    def check_state_dict(self, state: Mapping[str, int]) -> None:
        """Raise ValueError if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        self._parsed_state(state)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._seed, self._epoch, self._index = self._parsed_state(state)
        self._order = self._permutation()

    def _parsed_state(self, state: Mapping[str, int]) -> tuple[int, int, int]:
        missing = {"seed", "epoch", "index"} - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}; pass a dict from PromptDataset.state_dict().")
        seed, epoch, index = (_state_int(state, key) for key in ("seed", "epoch", "index"))
        if epoch < 0 or not 0 <= index <= len(self._rows):
            raise ValueError(f"dataset state epoch={epoch}, index={index} is outside this dataset of {len(self)} rows.")
        return seed, epoch, index

    def __repr__(self) -> str:
        return f"PromptDataset(num_rows={len(self)}, seed={self._seed}, shuffle={self.shuffle})"


def _state_int(state: Mapping[str, Any], key: str) -> int:
    """``state[key]``, an int (not a bool): ValueError otherwise."""
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"state[{key!r}] must be an int, got {value!r:.40}.")
    return value
