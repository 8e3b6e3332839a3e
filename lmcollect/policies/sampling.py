"""Sampling parameters shared by every inference backend."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class SamplingConfig:
    """How a policy samples its answers."""

    max_new_tokens: int = 32
    """Token budget of one response."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 disables it)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 disables it)."""
    seed: int | None = None
    """Seed of the sampling RNG (None: leave the RNG as it is)."""
    ignore_eos: bool = False
    """Always generate ``max_new_tokens`` tokens (benchmarks use it for equal work)."""
    sampled_log_probs: bool = False
    """Also store ``("log_probs", "sampled")``: log-probs under the distribution actually sampled
    (after temperature / top-k / top-p; 0 for greedy), next to the raw ones in
    ``("log_probs", "response")``. Raw log-probs are what a trainer's forward pass at temperature 1
    recomputes (the PPO / GRPO ratio); the sampled ones are the behaviour policy for off-policy or
    truncated-importance-sampling corrections of the sampler. TransformersPolicy only (vLLM computes
    one kind of log-prob per engine)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
