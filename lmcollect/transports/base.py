"""The weight-sync scheme interface: a sender on the trainer side, a receiver in each collector."""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable
from typing import Any

from lmcollect.weights.tensors import WeightDict


class WeightSender(abc.ABC):
    """Publishes weights to the receivers of one mechanism (trainer side)."""

    @abc.abstractmethod
    def send(self, weights: Any) -> None:
        """Publish ``weights`` (a module, TensorDict or dict); returns when receivers can take them."""

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract: a sender may hold nothing
        """Release what the sender holds (connections, buffers); a no-op unless a sender overrides it."""


class WeightReceiver(abc.ABC):
    """Takes weights for one model of a collector (collector side).

    A collector registers receivers with ``register_scheme_receiver({model_id: receiver})``;
    ``collector.receive_weights()`` then pulls from each one and loads what arrives through the
    collector (checked, in place, under its policy lock, one version bump).
    """

    timeout_s: float | None = None
    """How long ``receive_weights()`` waits for new weights (None: the mechanism's default)."""

    def __init__(self) -> None:
        self.model_id: str | None = None
        self._context_ref: weakref.ref | None = None

    def init_on_receiver(self, *, model_id: str, context: Any) -> None:
        """Called by ``register_scheme_receiver``: the model id served and the collector."""
        self.model_id = model_id
        self._context_ref = weakref.ref(context)

    def __getstate__(self) -> dict[str, Any]:
        # receivers travel to collector actors by pickle; the collector link is set again there
        state = self.__dict__.copy()
        state["_context_ref"] = None
        return state

    @property
    def context(self) -> Any:
        """The collector this receiver serves (None before registration or once it is gone)."""
        return None if self._context_ref is None else self._context_ref()

    @abc.abstractmethod
    def receive(self, timeout_s: float | None = None) -> WeightDict | None:
        """New weights (tensors the caller may read until the next receive), or None if none came."""

    def receive_into(self, apply: Callable[[WeightDict], None], *, timeout_s: float | None = None) -> bool:
        """Receive and hand the weights to ``apply`` (the collector's loader); False if none came."""
        weights = self.receive(timeout_s=timeout_s)
        if weights is None:
            return False
        apply(weights)
        return True

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract: a receiver may hold nothing
        """Release what the receiver holds; a no-op unless a receiver overrides it."""
