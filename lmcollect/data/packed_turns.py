"""A batch of turns packed for the trip between processes: one byte buffer plus its structure.

Pickling a TensorDict sends each tensor on its own (a batch of 16 turns holds some 460 small
tensors, each with its own serialization overhead both ways); a :class:`PackedTurns` holds every tensor's bytes in one
buffer and the lazy-stack structure as plain Python, and is rebuilt into an equal batch on arrival
(same keys, values, dtypes, shapes, nesting and non-tensor objects): unpickling a
:class:`PackedTurns` gives the batch itself. Batches it cannot describe
(dense batch dimensions, tensors off the CPU) travel consolidated instead (see :func:`pack`).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, TensorDict, TensorDictBase, lazy_stack

__all__ = ["PackedTurns", "pack", "unpack"]

_ALIGN = 8


class _Unpackable(Exception):
    """The batch has a shape this packer does not describe."""


class PackedTurns:
    """A lazy stack of one-turn TensorDicts as (structure, tensor specs, one byte buffer)."""

    def __init__(self, batch: TensorDictBase) -> None:
        self._tensors: list[torch.Tensor] = []
        self._nbytes = 0
        self.specs: list[tuple[torch.dtype, tuple[int, ...], int]] = []  # dtype, shape, byte offset
        self.structure = self._describe(batch)
        self.payload = _concat_bytes(self._tensors)
        del self._tensors

    def _describe(self, td: TensorDictBase) -> Any:
        if td.batch_dims == 0:
            return ("td", self._entries(td))
        if not isinstance(td, LazyStackedTensorDict) or td.stack_dim != 0:
            raise _Unpackable
        return ("stack", [self._describe(part) for part in td.tensordicts])

    def _entries(self, td: TensorDictBase) -> list[tuple[Any, ...]]:
        entries: list[tuple[Any, ...]] = []
        for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
            if isinstance(value, NonTensorData):
                entries.append((key, "obj", value.data))
            elif isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
                entries.append((key, "tensor", len(self.specs)))
                self.specs.append((value.dtype, tuple(value.shape), self._append(_bytes(value))))
            else:
                raise _Unpackable
        return entries

    def _append(self, data: torch.Tensor) -> int:
        """Add ``data`` at the next 8-byte aligned offset (so any dtype can view it); returns the offset."""
        pad = -self._nbytes % _ALIGN
        if pad:
            self._tensors.append(torch.zeros(pad, dtype=torch.uint8))
        offset = self._nbytes + pad
        self._tensors.append(data)
        self._nbytes = offset + data.numel()
        return offset

    def unpack(self) -> TensorDictBase:
        return _rebuild(self.structure, self.specs, self.payload)

    def __reduce__(self) -> tuple:
        # unpickled, it is the batch itself: a receiver (e.g. a hand-driven actor's caller) needs no unpack
        return (_rebuild, (self.structure, self.specs, self.payload))


def _rebuild(structure: Any, specs: list[tuple[torch.dtype, tuple[int, ...], int]], payload: bytes) -> TensorDictBase:
    buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
    views = [_view(buffer, dtype, shape, offset) for dtype, shape, offset in specs]
    return _build(structure, views)


def pack(batch: Any) -> Any:
    """``batch`` ready to be pickled: a :class:`PackedTurns` when it is a lazy stack of one-turn
    TensorDicts on the CPU, else consolidated (one storage), else unchanged (not a TensorDict)."""
    if not isinstance(batch, TensorDictBase):
        return batch
    try:
        return PackedTurns(batch)
    except _Unpackable:
        return batch if batch.is_consolidated() else batch.consolidate()


def unpack(data: Any) -> Any:
    """The batch :func:`pack` packed (anything else unchanged)."""
    return data.unpack() if isinstance(data, PackedTurns) else data


def _is_leaf(cls: type) -> bool:
    return issubclass(cls, NonTensorData) or not issubclass(cls, TensorDictBase)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _concat_bytes(parts: list[torch.Tensor]) -> bytes:
    return torch.cat(parts).numpy().tobytes() if parts else b""


def _view(buffer: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return buffer[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)


def _build(node: Any, views: list[torch.Tensor]) -> TensorDictBase:
    kind, content = node
    if kind == "stack":
        return lazy_stack([_build(child, views) for child in content])
    nested: dict[str, Any] = {}
    for key, what, value in content:
        path = key if isinstance(key, tuple) else (key,)
        target = nested
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = views[value] if what == "tensor" else NonTensorData(value)
    return TensorDict(nested, batch_size=[])
