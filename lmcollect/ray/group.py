"""Several RayLLMCollectors with distinct seeds and worker indices, started and stopped together."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from lmcollect.collectors.shared.group_filter import SamplingCounts, total_counts
from lmcollect.plumbing import ShutsDownOnExit
from lmcollect.ray.collector import RayLLMCollector

logger = logging.getLogger(__name__)


class RayCollectorGroup(ShutsDownOnExit):
    """K collectors, typically writing into one :class:`~lmcollect.buffers.RayReplayBuffer`.

    Collector ``i`` gets ``worker_idx = i`` (so trajectory ids never collide across collectors)
    and seed ``seed + i * seed_stride``. ``remote_configs`` optionally gives each collector its
    own actor options, e.g. a custom resource to place it on a given node.

    Example::

        buffer = RayReplayBuffer(capacity=100_000)
        with RayCollectorGroup(2, env=make_env, policy_factory=make_policy, replay_buffer=buffer,
                               dialog_turns_per_batch=32, num_cpus=0.5) as group:
            group.start()
            ...  # train from buffer.sample(...)
    """

    def __init__(
        self,
        num_collectors: int,
        *,
        seed: int = 0,
        seed_stride: int = 1000,
        remote_configs: Sequence[dict[str, Any] | None] | None = None,
        **collector_kwargs: Any,
    ) -> None:
        if num_collectors <= 0:
            raise ValueError(f"num_collectors must be positive, got {num_collectors}.")
        if remote_configs is not None and len(remote_configs) != num_collectors:
            raise ValueError(
                f"remote_configs has {len(remote_configs)} entries for num_collectors={num_collectors}; "
                "give one (or None) per collector."
            )
        self.collectors: list[RayLLMCollector] = []
        try:
            for i in range(num_collectors):
                remote_config = (
                    remote_configs[i] if remote_configs is not None else collector_kwargs.get("remote_config")
                )
                kwargs = {**collector_kwargs, "remote_config": remote_config}
                collector = RayLLMCollector(**kwargs)
                collector.worker_idx = i
                collector.set_seed(seed + i * seed_stride)
                self.collectors.append(collector)
        except BaseException:
            self.shutdown()
            raise

    def start(self) -> None:
        for collector in self.collectors:
            collector.start()

    def shutdown(self) -> None:
        """Shut every collector down (each one even if another fails). Safe to call twice."""
        for collector in self.collectors:
            try:
                collector.shutdown()
            except Exception:  # designed: one dead collector must not keep the others running
                logger.exception("shutting down collector %s failed", collector)

    def sampling_counts(self) -> SamplingCounts | None:
        """Dynamic sampling's counts of every collector added up (None without ``dynamic_sampling``)."""
        return total_counts([collector.sampling_counts for collector in self.collectors])

    def __len__(self) -> int:
        return len(self.collectors)

    def __iter__(self) -> Iterator[RayLLMCollector]:
        return iter(self.collectors)

    def __getitem__(self, index: int) -> RayLLMCollector:
        return self.collectors[index]
