"""The policy protocol: a callable that answers every prompt of a batch."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tensordict import TensorDictBase


@runtime_checkable
class PolicyProtocol(Protocol):
    """``policy(td) -> td`` where ``td`` has batch ``(B,)`` and holds ``("history", "prompt")``.

    The returned TensorDict (batch ``(B,)``, usually a lazy stack of per-element TensorDicts since
    lengths differ) holds the input entries plus at least the keys in
    :data:`lmcollect.data.keys.POLICY_OUTPUT_KEYS`: ``("history", "response")``,
    ``("history", "full")``, ``("tokens", "response")`` and ``("log_probs", "response")``; the
    shipped policies also fill ``text``, ``tokens`` prompt/full and ``masks``.
    """

    def __call__(self, td: TensorDictBase) -> TensorDictBase: ...
