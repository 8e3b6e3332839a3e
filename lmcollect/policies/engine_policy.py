"""EnginePolicy: a lockstep policy over any :class:`~lmcollect.engines.EngineProtocol` engine.

The synchronous :class:`~lmcollect.collectors.LLMCollector` takes a policy that answers a whole
batch per call. Over an engine that is the continuous collector's request path with a batch
barrier: every row's request is submitted at once (the engine batches them as they come), and the
call returns when the last one has answered. So ``LLMCollector(env, policy=EnginePolicy(engine,
tokenizer=...))`` and ``ContinuousLLMCollector(envs, engine=engine, ...)`` run the same engine, the
same prompts and the same turn layout; only the barrier differs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from lmcollect.engines.protocol import BatchGenerating, EngineProtocol, EngineRequest
from lmcollect.engines.sampling import RequestSeeds, SamplingConfig, sampling_from_kwargs
from lmcollect.policies.outputs import Generation, answer_prompts, generate_triples

__all__ = ["EnginePolicy"]


class EnginePolicy:
    """A batch policy (``td -> td``) whose rows are requests to ``engine``, awaited together.

    Args:
        engine: the engine (yours to close).
        tokenizer: builds the token-exact prompts (chat template, decode).
        sampling: sampling settings of every request (default ``SamplingConfig()``); keyword
            arguments named like its fields (or ``generate``'s, e.g. ``do_sample``) override them.
        stop_token_ids: ids that end a response (default: the tokenizer's eos).
        seed: seeds each request (drawn from one generator seeded with it; :meth:`set_seed` resets
            it); None: ``sampling.seed``, and if that is None too, sampling is unseeded.
        timeout_s: how long one batch may take before a ``TimeoutError`` (None: no limit).

    Weights: the collector loads pushes into ``engine`` (through ``load_weights`` or, for vLLM,
    a ``vLLMUpdater``'s broadcast into its workers) while no batch runs.
    """

    def __init__(
        self,
        engine: EngineProtocol,
        *,
        tokenizer: Any,
        sampling: SamplingConfig | None = None,
        stop_token_ids: Collection[int] | None = None,
        seed: int | None = None,
        timeout_s: float | None = None,
        **sampling_kwargs: Any,
    ) -> None:
        if not isinstance(engine, EngineProtocol):
            raise TypeError(f"engine must implement lmcollect.engines.EngineProtocol, got {type(engine).__name__}.")
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling_from_kwargs(sampling, sampling_kwargs, owner=type(self).__name__)
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids is not None else [tokenizer.eos_token_id]
        self.timeout_s = timeout_s
        self._request_seeds = RequestSeeds(seed if seed is not None else self.sampling.seed)

    def set_seed(self, seed: int) -> None:
        """Seed the requests' seeds (the same seed and weights give the same batches)."""
        self._request_seeds.seed(seed)

    def rng_state(self) -> list | None:
        """The per-request seed stream's state (saved by a collector's ``state_dict``)."""
        return self._request_seeds.state()

    def set_rng_state(self, state: list | None) -> None:
        """Restore :meth:`rng_state` (None: unseeded)."""
        self._request_seeds.set_state(state)

    def check_rng_state(self, state: list | None) -> None:
        """Raise if :meth:`set_rng_state` would refuse ``state`` (a collector checks a state before loading it)."""
        self._request_seeds.check_state(state)

    def reset_prefix_cache(self) -> None:
        """Forget the engine's cached prefixes (the collector calls it after every weight load)."""
        self.engine.reset_prefix_cache()

    def generate_responses(self, prompt_ids: list[list[int]]) -> list[Generation]:
        """Every prompt's response, awaited together (the batch barrier).

        An engine that answers a whole batch at once (:class:`~lmcollect.engines.BatchGenerating`,
        e.g. a ``TransformersEngine``'s one ``model.generate`` call) gets the batch in one call; any
        other gets every prompt submitted at once and is waited on for all of them.
        """
        requests = self._requests(prompt_ids)
        if isinstance(self.engine, BatchGenerating):
            results = self.engine.generate_batch(requests, timeout_s=self.timeout_s)
        else:
            futures = [self.engine.submit(request) for request in requests]
            results = [future.result(timeout=self.timeout_s) for future in futures]
        return [
            Generation(r.tokens, r.log_probs, r.sampled_log_probs, r.token_versions, r.kv_versions) for r in results
        ]

    def _requests(self, prompt_ids: list[list[int]]) -> list[EngineRequest]:
        drawn = self._request_seeds.draw(len(prompt_ids), greedy=self.sampling.greedy)
        seeds: list[int | None] = list(drawn) if drawn else [None] * len(prompt_ids)
        stops = tuple(self.stop_token_ids)
        return [
            EngineRequest(
                prompt_ids=ids, sampling=self.sampling, stop_token_ids=stops, seed=seeds[row], request_id=f"row-{row}"
            )
            for row, ids in enumerate(prompt_ids)
        ]

    def generate(
        self, prompts: Sequence[Sequence[int]] | Sequence[str]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Prompt tokens, response tokens and raw response log-probs for each prompt (token-id
        lists, or strings tokenized without special tokens)."""
        return generate_triples(self.tokenizer, self.generate_responses, prompts)

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        return answer_prompts(
            td, self.tokenizer, self.generate_responses, sampling=self.sampling, stop_token_ids=self.stop_token_ids
        )

    def __repr__(self) -> str:
        return f"EnginePolicy({type(self.engine).__name__})"
