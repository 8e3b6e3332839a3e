"""LocalWeightUpdater: pushes weights into an in-process collector's policy."""

from __future__ import annotations

from typing import Any

from lmcollect.weight_sync.base import WeightUpdaterBase
from lmcollect.weight_sync.sender import InProcessSender
from lmcollect.weights.push_config import PushConfig, push_config_or_default, with_keywords
from lmcollect.weights.tensors import (
    WeightDict,
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
        config: how it pushes (:class:`~lmcollect.weights.push_config.PushConfig`): an in-process
            push reads ``convert_dtype`` (cast floating tensors to the model's dtype instead of
            rejecting them) and ``allow_non_finite`` (push weights holding NaN or infinite values;
            False, the default: such a push is refused before anything changes); the options of
            pushes that travel (delta, buckets, Ray, process group) are refused.
        convert_dtype, allow_non_finite: the same fields as keywords (None: the config's); a
            keyword that disagrees with ``config`` is a ValueError.

    Example::

        collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=8,
                                 weight_updater=LocalWeightUpdater(trainer_model))
        for batch in collector:
            train_step(trainer_model, batch)
            collector.update_policy_weights_()  # pushes trainer_model's current weights
    """

    def __init__(
        self,
        policy_weights: Any = None,
        *,
        config: PushConfig | None = None,
        convert_dtype: bool | None = None,
        allow_non_finite: bool | None = None,
    ) -> None:
        super().__init__()
        self._policy_weights = policy_weights
        self.config = with_keywords(
            push_config_or_default(config, updater="LocalWeightUpdater"),
            updater="LocalWeightUpdater",
            convert_dtype=convert_dtype,
            allow_non_finite=allow_non_finite,
        )
        self.config.check_for("in process", updater="LocalWeightUpdater")

    @property
    def convert_dtype(self) -> bool:
        """Cast floating tensors to the model's dtype instead of rejecting them (``config.convert_dtype``)."""
        return self.config.convert_dtype

    @property
    def allow_non_finite(self) -> bool:
        """Push weights holding NaN or infinite values (``config.allow_non_finite``)."""
        return self.config.allow_non_finite

    @classmethod
    def from_policy(cls, policy: Any) -> LocalWeightUpdater:
        """An updater with no default weights: in-process collectors need no setup."""
        return cls()

    def all_worker_ids(self) -> list[int]:
        return [0]

    def _get_server_weights(self) -> WeightDict | None:
        return None if self._policy_weights is None else to_weight_dict(self._policy_weights)

    def _make_sender(self) -> InProcessSender:
        return InProcessSender(self._target, self.config)

    def _sync_weights_with_worker(self, *, worker_id: int, server_weights: WeightDict, version: PushVersion) -> None:
        """Load ``server_weights`` into the collector as ``version`` (checked by the sender before)."""
        sender = self.push_sender
        assert isinstance(sender, InProcessSender), "_make_sender builds it"
        sender.load(server_weights, version)
