"""A thread-safe ring-buffer replay buffer of dialog turns."""
from __future__ import annotations

import threading

import torch
from tensordict import TensorDictBase

from lmcollect.data.turns import flatten_turns, stack_turns


class ReplayBuffer:
    """Stores up to ``capacity`` dialog turns; the oldest are overwritten first.

    Turns are kept as one-turn TensorDicts (tokens have different lengths), and
    :meth:`sample` returns a flat lazy stack of them. Safe to extend from a collector thread
    while the trainer samples.

    Args:
        capacity: the number of turns kept.
        seed: seed of the sampling generator (None: nondeterministic).
    """

    def __init__(self, *, capacity: int, seed: int | None = None) -> None:
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"ReplayBuffer capacity must be a positive int, got {capacity!r}.")
        self.capacity = capacity
        self._storage: list[TensorDictBase] = []
        self._cursor = 0
        self._write_count = 0
        self._lock = threading.Lock()
        self._generator = torch.Generator()
        if seed is not None:
            self._generator.manual_seed(seed)
        else:
            self._generator.seed()

    def extend(self, data: TensorDictBase) -> int:
        """Write every turn of ``data`` (any batch shape); returns how many were written."""
        turns = flatten_turns(data)
        with self._lock:
            for turn in turns:
                self._write(turn)
        return len(turns)

    def add(self, turn: TensorDictBase) -> int:
        """Write one turn; returns its index in the storage."""
        if turn.batch_dims != 0:
            raise ValueError(f"add() takes one turn (empty batch size), got {turn.batch_size}; use extend().")
        with self._lock:
            return self._write(turn)

    def _write(self, turn: TensorDictBase) -> int:
        index = self._cursor
        if len(self._storage) < self.capacity:
            self._storage.append(turn)
        else:
            self._storage[index] = turn
        self._cursor = (index + 1) % self.capacity
        self._write_count += 1
        return index

    def sample(self, batch_size: int, *, replace: bool = True) -> TensorDictBase:
        """``batch_size`` turns drawn uniformly, with or without replacement."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}.")
        with self._lock:
            size = len(self._storage)
            if size == 0:
                raise RuntimeError("cannot sample from an empty ReplayBuffer; extend it first.")
            if not replace and batch_size > size:
                raise ValueError(
                    f"batch_size={batch_size} > {size} stored turns with replace=False; "
                    "lower batch_size or pass replace=True."
                )
            if replace:
                idx = torch.randint(size, (batch_size,), generator=self._generator)
            else:
                idx = torch.randperm(size, generator=self._generator)[:batch_size]
            turns = [self._storage[i] for i in idx.tolist()]
        return stack_turns(turns)

    def __len__(self) -> int:
        return len(self._storage)

    @property
    def write_count(self) -> int:
        """Turns written since creation (or the last :meth:`empty`)."""
        return self._write_count

    def empty(self) -> None:
        with self._lock:
            self._storage.clear()
            self._cursor = 0
            self._write_count = 0

    def state_dict(self) -> dict:
        with self._lock:
            return {
                "capacity": self.capacity,
                "storage": list(self._storage),
                "cursor": self._cursor,
                "write_count": self._write_count,
                "generator": self._generator.get_state(),
            }

    def load_state_dict(self, state: dict) -> None:
        if state["capacity"] != self.capacity:
            raise ValueError(
                f"state_dict capacity {state['capacity']} != this buffer's {self.capacity}; "
                "create the buffer with the same capacity."
            )
        with self._lock:
            self._storage = list(state["storage"])
            self._cursor = state["cursor"]
            self._write_count = state["write_count"]
            self._generator.set_state(state["generator"])
