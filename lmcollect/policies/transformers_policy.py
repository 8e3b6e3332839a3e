"""The lockstep policy over a Hugging Face transformers causal LM (an :class:`EnginePolicy` over a ``TransformersEngine``)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from lmcollect.engines.hf.engine import TransformersEngine
from lmcollect.engines.sampling import eos_token_ids
from lmcollect.plumbing import forwarded
from lmcollect.policies.engine_policy import EnginePolicy

if TYPE_CHECKING:  # transformers is imported by the caller who built the model
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class TransformersPolicy(EnginePolicy):
    """Answers a batch of chat prompts with a transformers model: the lockstep :class:`EnginePolicy`
    over a :class:`~lmcollect.engines.TransformersEngine` it builds (``policy.engine``).

    Each batch is one ``model.generate`` call inside the engine (``generate_batch``: left padding,
    one prefill), so this is as fast as calling ``generate`` yourself; the same engine also serves
    continuous requests (``submit``), so both schedulers share one HF generator.

    Prompts go in as token ids (see :func:`lmcollect.policies.outputs.answer_prompts`): in a
    multi-turn dialog the next prompt starts with the previous turn's tokens exactly as generated.
    The tokens are the truth; ``text`` entries are a rendering of the history.

    Log-probs are those of the raw model (before temperature / top-p / top-k), so they equal a
    plain forward pass on the same tokens, as trainers need for importance ratios. They are
    gathered one decoding step at a time (:class:`~lmcollect.engines.hf.step_log_probs.StepLogProbs`),
    so memory does not grow with batch x length x vocabulary. With
    ``SamplingConfig(sampled_log_probs=True)`` the log-probs of the distribution actually sampled
    are stored too, under ``("log_probs", "sampled")``. Every token records the weight version
    that generated it.

    Generation options (keywords or :class:`SamplingConfig` fields): ``max_new_tokens``,
    ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``min_new_tokens``, ``ignore_eos``,
    ``repetition_penalty``, ``stop_strings``, ``seed``, ``sampled_log_probs``, and ``do_sample``
    (False = greedy). None for temperature / top_p / top_k / min_new_tokens / repetition_penalty /
    stop_strings means off, as in ``generate``; other ``generate`` keywords are refused with a
    TypeError listing these. ``seed`` seeds the stream the rows' own seeds are drawn from
    (:meth:`set_seed` resets it): a row's sample does not depend on the rest of the batch.

    Args:
        model: a causal LM; exposed as ``.model`` (the engine's) for weight updates.
        tokenizer: its tokenizer, with a chat template and pad/eos tokens.
        stop_token_ids: more ids that end a response (kept as its last token), on top of the
            model's eos ids; e.g. to give a random model responses of varied length.
        options: :class:`EnginePolicy`'s ``sampling`` (a :class:`SamplingConfig`), ``seed`` and
            ``timeout_s``, and the generation options above, which override ``sampling``'s fields.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        stop_token_ids: Collection[int] | None = None,
        **options: Any,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token before building the policy.")
        stops = eos_token_ids(model.generation_config.eos_token_id, tokenizer)
        if not stops:
            raise ValueError("neither the model's generation_config nor the tokenizer defines an eos token.")
        # ids that end a response: eos and the extra ones (ignore_eos bans the eos ids only, as every engine does)
        stops += [int(i) for i in stop_token_ids or () if int(i) not in stops]
        super().__init__(TransformersEngine(model, tokenizer), tokenizer=tokenizer, stop_token_ids=stops, **options)

    model = forwarded("engine.model", "The engine's model (pushes load into it in place).")

    def close(self) -> None:
        """Stop the engine's loop thread (the policy answers no more batches)."""
        self.engine.close()

    def __repr__(self) -> str:
        return f"TransformersPolicy({type(self.model).__name__})"
