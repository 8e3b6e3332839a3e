"""Helpers to move between one-turn TensorDicts and (possibly nested) lazy-stacked batches."""

from __future__ import annotations

from collections.abc import Sequence

from tensordict import (
    LazyStackedTensorDict,
    NonTensorData,
    NonTensorStack,
    TensorDictBase,
    is_tensor_collection,
    lazy_stack,
)


def flatten_turns(batch: TensorDictBase) -> list[TensorDictBase]:
    """Every one-turn TensorDict (empty batch size) in ``batch``, in row-major order."""
    if batch.batch_dims == 0:
        return [batch]
    lazy_rows = isinstance(batch, LazyStackedTensorDict) and batch.stack_dim == 0
    parts = batch.tensordicts if lazy_rows else batch.unbind(0)
    out: list[TensorDictBase] = []
    for part in parts:
        out.extend(flatten_turns(part))
    return out


def stack_turns(turns: Sequence[TensorDictBase]) -> TensorDictBase:
    """A flat lazy stack of one-turn TensorDicts (shape ``(len(turns),)``)."""
    if not turns:
        raise ValueError("cannot stack an empty list of turns")
    return lazy_stack(list(turns))


def stack_rows(rows: Sequence[Sequence[TensorDictBase]]) -> TensorDictBase:
    """A 2-D lazy stack, shape ``(len(rows), len(rows[0]))``, of equal-length rows of turns."""
    return lazy_stack([stack_turns(row) for row in rows])


def non_tensor_values(td: TensorDictBase, key: str | tuple[str, ...]) -> list:
    """The Python objects stored under ``key`` for each element of a 1-D batch ``td``."""
    if td.batch_dims == 0:
        return [_unwrap(td.get(key))]
    if isinstance(td, LazyStackedTensorDict) and td.stack_dim == 0:
        return [_unwrap(part.get(key)) for part in td.tensordicts]
    values = td.get(key)
    return [_unwrap(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]


def _unwrap(value: object) -> object:
    return value.data if isinstance(value, NonTensorData) else value


def _is_leaf(cls: type) -> bool:
    # tensors and non-tensor data (History, str) are leaves; only TensorDicts are nodes
    return issubclass(cls, (NonTensorData, NonTensorStack)) or not is_tensor_collection(cls)


def leaf_keys(td: TensorDictBase) -> list[tuple[str, ...] | str]:
    """Every leaf key of ``td``, non-tensor leaves (histories, strings) included."""
    return list(td.keys(include_nested=True, leaves_only=True, is_leaf=_is_leaf))
