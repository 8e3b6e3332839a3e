"""The base weights an in-process engine keeps under its LoRA merges, following the one base rule."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lmcollect.weights.lora import LoraAdapter, check_merge, max_magnitude


class KeptBase:
    """The base weights of the layers adapters touch, kept by an engine so adapters replace each
    other (the base rule of docs/weight-sync.md, "LoRA": a full push, whatever its values, is a new
    base; adapters replace each other on top of the current base).

    :meth:`merge_into` takes the copy at the first adapter push after a new base and writes
    ``base + scaling * B @ A`` into the model's tensors in place. Any other write into those
    tensors (a full or delta push, by any path, even of the very values the merge wrote) gives the
    model a new base: the copy is taken again. :meth:`forget` says so explicitly.

    A write is told from the merge's own by the tensors' storage and version counter (every
    in-place write bumps it), so a push costs no pass over the weights. An inference tensor has no
    version counter: its values are compared with what the last merge wrote instead.
    """

    def __init__(self) -> None:
        self._base: dict[str, torch.Tensor] = {}
        self._absmax: dict[str, float] = {}  # name -> largest magnitude of its base (the merge's bound)
        self._last: LoraAdapter | None = None  # the adapter of the last merge
        self._stamps: dict[str, tuple[int, int | None]] = {}  # name -> _stamp() after the last merge

    def merge_into(
        self, adapter: LoraAdapter, targets: Mapping[str, torch.Tensor], *, receiver: str = "the model"
    ) -> None:
        """Write the weights of ``adapter`` into the model's ``targets`` (name -> tensor), in place:
        its layers as ``base + scaling * B @ A``, and the layers an earlier adapter touched and this
        one does not back to their base. A merge that would not be finite in the weights' dtype is
        refused (ValueError, see :func:`~lmcollect.weights.lora.check_merge`) before any write."""
        if not self._holds_last_merge(targets):
            self.forget()
        new = [name for name in adapter.layers if name not in self._base]  # their base: the model's now
        absmax = {**self._absmax, **{name: max_magnitude(targets[name]) for name in new}}
        bases = {name: self._base.get(name, targets[name]) for name in adapter.layers}
        check_merge(adapter, bases, receiver=receiver, base_absmax=absmax)
        for name in new:
            self._base[name] = targets[name].detach().clone()
            self._absmax[name] = absmax[name]
        for name, base in self._base.items():
            layer = adapter.layers.get(name)
            if layer is None:
                targets[name].copy_(base)
            else:
                layer.merge_into(base, targets[name])
        self._last = adapter.cloned()  # its tensors may be the trainer's, which train on
        self._stamps = {name: _stamp(targets[name]) for name in self._base}

    def held(self, targets: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], LoraAdapter] | None:
        """The kept base (name -> tensor, copies) and the adapter merged on top of it, while the
        model's ``targets`` still hold that merge; None when they hold a base (no adapter merged)."""
        if self._last is None or not self._holds_last_merge(targets):
            return None
        return {name: t.clone() for name, t in self._base.items()}, self._last

    def _holds_last_merge(self, targets: Mapping[str, torch.Tensor]) -> bool:
        for name, stamp in self._stamps.items():
            now = _stamp(targets[name])
            if now != stamp:
                return False
            if stamp[1] is None and not torch.equal(targets[name], self._written(name)):
                return False
        return True

    def _written(self, name: str) -> torch.Tensor:
        """What the last merge wrote into ``name``."""
        layer = self._last.layers.get(name) if self._last is not None else None
        return layer.merged(self._base[name]) if layer is not None else self._base[name]

    def forget(self) -> None:
        """The model got new base weights: take the copy again at the next adapter push."""
        self._base.clear()
        self._absmax.clear()
        self._last = None
        self._stamps = {}

    @property
    def names(self) -> set[str]:
        """The weights whose base is kept now."""
        return set(self._base)


def _stamp(tensor: torch.Tensor) -> tuple[int, int | None]:
    """Where ``tensor``'s data is and its version counter (None for an inference tensor, which has
    none: its values are then compared)."""
    return tensor.data_ptr(), None if tensor.is_inference() else tensor._version
