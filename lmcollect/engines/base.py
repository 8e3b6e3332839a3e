"""One ``load_weights`` for every engine: the version checked, the payload's kind refused by name
where the engine's capabilities lack it, then one method per kind."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from lmcollect.engines.protocol import (
    CORE_ONLY,
    EngineCapabilities,
    check_engine_loads,
    check_version,
    load_refusal,
)
from lmcollect.engines.weight_group import GroupPush
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.delta import WeightDelta
from lmcollect.weights.lora import LoraAdapter
from lmcollect.weights.version import PushVersion, version_index

__all__ = ["EngineBase", "FullWeights", "LoadSource"]

FullWeights = Iterable[tuple[str, torch.Tensor]] | WeightBuckets
"""Full weights: ``(name, tensor)`` pairs, or a sender's packed buckets (read through views)."""
LoadSource = FullWeights | GroupPush | LoraAdapter | WeightDelta
"""Everything ``load_weights`` may be given (see :data:`~lmcollect.engines.protocol.PayloadKind`)."""


class EngineBase:
    """The weight-loading half of an engine: :meth:`load_weights` checks, refuses and dispatches.

    A subclass declares its :attr:`capabilities` and implements the loaders of the payload kinds
    it declares: :meth:`_load_full` (named tensors or :class:`~lmcollect.weights.buckets.WeightBuckets`),
    :meth:`_load_group_push`, :meth:`_load_adapter`, :meth:`_load_delta`. A kind it does not
    declare is refused before its loader runs, with the fix named (one source of truth: the
    capabilities; the loaders left as they are here refuse in the same words). Each loader takes the
    version itself where its load lands (and refuses a stale one there, see
    :func:`~lmcollect.engines.protocol.refuse_stale_push`).

    ``full_load_options``: the keywords ``load_weights`` passes on to :meth:`_load_full` (e.g.
    ``convert_dtype``, ``check_finite``); any other keyword, or one given with another kind, is
    refused naming the ones it takes.
    """

    capabilities: EngineCapabilities = CORE_ONLY
    """What the engine does beyond the core protocol (see :class:`~lmcollect.engines.protocol.EngineCapabilities`)."""
    full_load_options: ClassVar[frozenset[str]] = frozenset()

    def load_weights(self, source: LoadSource, *, version: int | PushVersion, **options: Any) -> list[Any] | None:
        """Load ``source`` and take ``version`` (see :meth:`~lmcollect.engines.protocol.EngineProtocol.load_weights`).

        Checks ``version`` (an int >= -1, or a push's :class:`~lmcollect.weights.version.PushVersion`)
        and refuses a payload kind the engine's :attr:`capabilities` do not list (``TypeError``
        naming the fix), before anything is read; then loads it by kind. Returns None, or the
        workers' reports (a process-group push, the vLLM engine's loads)."""
        check_version(version)
        if version_index(version) < -1:
            raise ValueError(f"version must be >= -1 (-1: before any push), got {version!r}; no weight was changed.")
        kind = check_engine_loads(self, source)
        allowed = self.full_load_options if kind == "full" else frozenset()
        unknown = sorted(set(options) - allowed)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.load_weights got {unknown} with {kind} weights; it takes "
                f"{sorted(self.full_load_options) or 'no keyword but version'} (with full weights only)."
            )
        if isinstance(source, GroupPush):
            return self._load_group_push(source, version)
        if isinstance(source, LoraAdapter):
            return self._load_adapter(source, version)
        if isinstance(source, WeightDelta):
            return self._load_delta(source, version)
        return self._load_full(source, version, options)

    def _load_full(
        self, weights: FullWeights, version: int | PushVersion, options: Mapping[str, Any]
    ) -> list[Any] | None:
        """Check every name, shape and dtype, then load them all (nothing written if any is refused)."""
        raise load_refusal(self, "full")

    def _load_group_push(self, push: GroupPush, version: int | PushVersion) -> list[Any]:
        """The workers receive a trainer's broadcast and reload, inside the load; their reports."""
        raise load_refusal(self, "group_push")

    def _load_adapter(self, adapter: LoraAdapter, version: int | PushVersion) -> list[Any] | None:
        """Merge ``adapter`` into the kept base weights of the layers it adapts."""
        raise load_refusal(self, "lora_adapter")

    def _load_delta(self, delta: WeightDelta, version: int | PushVersion) -> list[Any] | None:
        """Apply ``delta`` to the weights held (its base), verified, or change nothing."""
        raise load_refusal(self, "weight_delta")
