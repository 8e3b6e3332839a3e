"""The lockstep policy over a vLLM engine: prompts tokenized here, token ids in, tokens and raw log-probs out."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from lmcollect.engines.protocol import EngineProtocol
from lmcollect.engines.sampling import SamplingConfig, sampling_from_kwargs
from lmcollect.engines.vllm.common import LOGPROBS_MODE, checkpoint_eos_token_ids
from lmcollect.policies.engine_policy import EnginePolicy


class VLLMPolicy(EnginePolicy):
    """Answers a batch of chat prompts with vLLM: the lockstep :class:`EnginePolicy` over a vLLM engine.

    Prompt token ids are built here exactly as ``TransformersPolicy`` builds them (a multi-turn
    dialog's next prompt starts with the previous turn's tokens as generated, see
    :func:`lmcollect.policies.outputs.answer_prompts`) and sent to vLLM as token ids, so both see
    identical prompt tokens. The tokens are the truth; ``text`` entries are a rendering.
    Log-probs are those of the raw model (vLLM's ``logprobs_mode="raw_logprobs"``), and every token
    records the weight version that generated it. ``SamplingConfig(sampled_log_probs=True)`` is
    refused: vLLM (0.32) picks one log-prob mode per engine, not per request, so it cannot return
    the raw and the sampled log-probs together. Weights live in the engine: a collector loads
    pushes into ``policy.engine`` (``load_weights``, or a ``vLLMUpdater``'s broadcast into its workers).

    Args:
        model_path: a local Hugging Face model folder (weights, config and tokenizer).
        sampling: sampling parameters; keyword arguments override its fields.
        engine_kwargs: ``vllm.EngineArgs`` for the in-process engine the policy builds (a
            :class:`~lmcollect.engines.vllm.engine.VLLMEngine`, closed by :meth:`close`).
        engine: an already built engine instead (yours to close): a ``VLLMEngine``, replicas in Ray
            actors (``lmcollect.ray.VLLMReplicas``), a server (``VLLMServerEngine``), or any
            :class:`~lmcollect.engines.EngineProtocol` engine serving this model; exclusive with ``engine_kwargs``.
        stop_token_ids: more ids that end a response (kept as its last token), on top of the
            model's eos ids; e.g. to give a random model responses of varied length.
        timeout_s: how long one batch may take before a ``TimeoutError`` (None: no limit).

    Example::

        policy = VLLMPolicy(path, temperature=0.0, engine_kwargs={"kv_cache_memory_bytes": 1 << 30})
        td = policy(env.reset())
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        sampling: SamplingConfig | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        engine: EngineProtocol | None = None,
        stop_token_ids: Collection[int] | None = None,
        timeout_s: float | None = None,
        **sampling_kwargs: Any,
    ) -> None:
        if engine is not None and engine_kwargs is not None:
            raise ValueError("pass either engine or engine_kwargs, not both: engine_kwargs only build a new engine.")
        sampling = sampling_from_kwargs(sampling, sampling_kwargs, owner=type(self).__name__)
        if sampling.sampled_log_probs:
            raise ValueError(
                "VLLMPolicy cannot store sampled log-probs (sampled_log_probs=True): vLLM sets logprobs_mode per "
                f"engine and this policy's engines return {LOGPROBS_MODE!r}, which ('log_probs', 'response') "
                "needs. Use TransformersPolicy for sampled log-probs, or set sampled_log_probs=False."
            )
        self.model_path = str(model_path)
        engine_kwargs = dict(engine_kwargs or {})
        tokenizer = AutoTokenizer.from_pretrained(engine_kwargs.get("tokenizer", self.model_path))
        stops = engine_stop_token_ids(self.model_path, tokenizer)
        stops += [int(i) for i in stop_token_ids or () if int(i) not in stops]
        self._owns_engine = engine is None
        if engine is None:
            if sampling.seed is not None:
                engine_kwargs.setdefault("seed", sampling.seed)
            from lmcollect.engines.vllm.engine import VLLMEngine  # imports vLLM's config helpers

            engine = VLLMEngine(model_path, engine_kwargs=engine_kwargs)
        super().__init__(
            engine,
            tokenizer=tokenizer,
            sampling=sampling,
            stop_token_ids=stops,
            seed=sampling.seed,
            timeout_s=timeout_s,
        )

    def close(self) -> None:
        """Close the engine this policy built (an engine passed in stays open: it is the caller's)."""
        if self._owns_engine:
            self.engine.close()


def engine_stop_token_ids(model_path: str | Path, tokenizer: Any) -> list[int]:
    """The ids vLLM stops at: the generation config's eos ids plus the tokenizer's eos."""
    return checkpoint_eos_token_ids(model_path, tokenizer)
