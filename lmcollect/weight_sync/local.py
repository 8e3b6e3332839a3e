"""LocalWeightUpdater: pushes weights into an in-process collector's policy."""

from __future__ import annotations

from typing import Any

from lmcollect.weight_sync.base import WeightUpdaterBase
from lmcollect.weight_sync.loader import LoadOptions
from lmcollect.weights.tensors import (
    WeightDict,
    narrowest_held_dtypes,
    non_finite_problems,
    raise_if_problems,
    to_weight_dict,
)
from lmcollect.weights.version import PushVersion


class LocalWeightUpdater(WeightUpdaterBase[int]):
    """Loads weights into the collector it is registered with, in this process.

    The collector checks every name, shape and dtype first, then (under its policy write lock,
    so no turn runs meanwhile) copies the weights into its model in place, resets the policy's
    prefix cache and takes the push's version (see :meth:`WeightUpdaterBase.push_weights`).

    Args:
        policy_weights: what ``push_weights()`` pushes when given nothing: an ``nn.Module``, a
            TensorDict (module) or a dict, read at push time (so it follows training).
        convert_dtype: cast floating tensors to the model's dtype instead of rejecting them.
        allow_non_finite: push weights holding NaN or infinite values; False (the default):
            such a push is refused before anything changes.

    Example::

        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=8,
                                 weight_updater=LocalWeightUpdater(trainer_model))
        for batch in collector:
            train_step(trainer_model, batch)
            collector.update_policy_weights_()  # pushes trainer_model's current weights
    """

    def __init__(
        self, policy_weights: Any = None, *, convert_dtype: bool = False, allow_non_finite: bool = False
    ) -> None:
        super().__init__()
        self._policy_weights = policy_weights
        self.convert_dtype = convert_dtype
        self.allow_non_finite = allow_non_finite

    @classmethod
    def from_policy(cls, policy: Any) -> LocalWeightUpdater:
        """An updater with no default weights: in-process collectors need no setup."""
        return cls()

    def all_worker_ids(self) -> list[int]:
        return [0]

    def _get_server_weights(self) -> WeightDict | None:
        return None if self._policy_weights is None else to_weight_dict(self._policy_weights)

    def _validate(self, weights: WeightDict, worker_ids: list[int]) -> None:
        """Refuse NaN/Inf here (as the model will hold the values, with ``convert_dtype``); names,
        shapes and dtypes are checked by the collector as it loads."""
        if self.allow_non_finite:
            return
        held = None
        if self.convert_dtype and self._weight_target is not None:
            held = narrowest_held_dtypes(weights, [self._weight_target.metadata()])
        raise_if_problems(non_finite_problems(weights, dtypes=held))

    def _sync_weights_with_worker(self, *, worker_id: int, server_weights: WeightDict, version: PushVersion) -> None:
        # NaN/Inf: refused (or allowed) by _validate already
        options = LoadOptions(version=version, convert_dtype=self.convert_dtype, allow_non_finite=True)
        self._target().load(server_weights, options)
