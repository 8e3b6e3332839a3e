"""The running batch's key/value cache: left-padded per-layer tensors that rows join and leave."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache


class LeftPaddedKVCache:
    """Keys and values of every running row, one ``[B, heads, T, head_dim]`` pair per layer.

    Rows have different lengths, so each row is left-padded to the longest; :attr:`mask` (``[B, T]``,
    1 for a real position) keeps the padding out of attention. A row joins with the cache of its own
    prefill (:meth:`add_row`), and leaves with :meth:`keep_rows`, which also drops the padding
    columns no remaining row needs. Positions are not stored: the engine passes each row's
    ``position_ids`` (its own token count), so padding never shifts a rotary position.
    """

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    def clear(self) -> None:
        """Drop every row (after a failed step, or when a weight load makes the cache stale)."""
        self.cache = self.mask = None

    def decode_mask(self) -> torch.Tensor:
        """The attention mask of one decoding step: the cached positions plus the new one."""
        assert self.mask is not None, "decode_mask() needs at least one cached row"
        return torch.cat([self.mask, self.mask.new_ones(self.num_rows, 1)], dim=1)

    def add_row(self, row_cache: DynamicCache) -> None:
        """Append one row (the cache of a batch-of-one prefill, no padding) as the last row."""
        row_layers = [(layer.keys, layer.values) for layer in row_cache.layers]
        length = row_layers[0][0].shape[-2]
        row_mask = torch.ones(1, length, dtype=torch.long, device=row_layers[0][0].device)
        if self.cache is None:
            self.cache, self.mask = DynamicCache(ddp_cache_data=row_layers), row_mask
            return
        assert self.mask is not None, "the cache and the mask are set together"
        width = max(self.mask.shape[1], length)
        for layer, (keys, values) in zip(self.cache.layers, row_layers, strict=True):
            layer.keys = torch.cat([_pad_left(layer.keys, width), _pad_left(keys, width)])
            layer.values = torch.cat([_pad_left(layer.values, width), _pad_left(values, width)])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(row_mask, width)])

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), then trim the leading columns that are padding for all."""
        if not rows:
            self.clear()
            return
        if self.cache is None or rows == list(range(self.num_rows)):
            return
        assert self.mask is not None, "the cache and the mask are set together"
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(dim=0).int().argmax())  # first column some row still attends to
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        self.mask = mask[:, start:]


def _pad_left(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """``tensor`` with zeros prepended along the sequence axis (dim -2 for keys/values, -1 for a mask)."""
    seq_dim = -1 if tensor.dim() == 2 else -2
    missing = width - tensor.shape[seq_dim]
    if missing == 0:
        return tensor
    return F.pad(tensor, (missing, 0) if seq_dim == -1 else (0, 0, missing, 0))
