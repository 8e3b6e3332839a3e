"""Sampling parameters shared by every inference backend, and the generate()-style keywords policies accept."""

from __future__ import annotations

import dataclasses
import numbers
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_TEMPERATURE = 0.01
"""The smallest temperature above 0 (greedy): logits divided by less overflow into NaN log-probs
(vLLM raises smaller ones to the same bound)."""


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
    """The model's end-of-sequence ids are never drawn, so none ends a response, even where they are
    among the request's ``stop_token_ids`` (the policies put them there); other stop ids and stop
    strings still end it, else every response has ``max_new_tokens`` tokens. Every engine does the
    same (the engine contract checks it); log-probs stay raw. Benchmarks use it for equal work."""
    min_new_tokens: int = 0
    """End-of-sequence tokens (and stop strings) cannot end a response before it has this many
    tokens (0: off), as ``min_new_tokens`` in transformers' ``generate``."""
    repetition_penalty: float = 1.0
    """Penalty on tokens already in the prompt or response, as in transformers (> 1 discourages
    repeats; 1.0: off). It changes the sampled distribution, not ``("log_probs", "response")``."""
    stop_strings: tuple[str, ...] = ()
    """End a response as soon as its text contains one of these strings. The token that completes the
    string is the response's last token (kept, like an end-of-sequence token); the next turn's prompt
    then continues from the tokens as generated, as after a response cut by ``max_new_tokens``."""
    sampled_log_probs: bool = False
    """Also store ``("log_probs", "sampled")``: log-probs under the distribution actually sampled
    (after temperature / top-k / top-p; 0 for greedy), next to the raw ones in
    ``("log_probs", "response")``. Raw log-probs are what a trainer's forward pass at temperature 1
    recomputes (the PPO / GRPO ratio); the sampled ones are the behaviour policy for off-policy or
    truncated-importance-sampling corrections of the sampler. TransformersPolicy only (vLLM computes
    one kind of log-prob per engine)."""

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1, hint="the token budget of one response")
        _check_number(
            "temperature",
            self.temperature,
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (smaller ones overflow the logits into NaN)",
            lambda v: v == 0 or v >= MIN_TEMPERATURE,
        )
        _check_number("top_p", self.top_p, "must be in (0, 1] (1 = off)", lambda v: 0 < v <= 1)
        _check_int("top_k", self.top_k, minimum=0, hint="0 = off")
        _check_int("min_new_tokens", self.min_new_tokens, minimum=0, hint="0 = off")
        _check_number("repetition_penalty", self.repetition_penalty, "must be > 0 (1 = off)", lambda v: v > 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens}); "
                "lower min_new_tokens or raise max_new_tokens."
            )
        if isinstance(self.stop_strings, str):  # one string, not its characters
            self.stop_strings = (self.stop_strings,)
        self.stop_strings = tuple(self.stop_strings)
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: Any, *, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} ({hint}), got {value!r}.")


def _check_number(name: str, value: Any, rule: str, ok: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
        raise ValueError(f"{name} {rule}, got {value!r}.")


# generate() keywords with another meaning here, and what to use instead
_UNSUPPORTED = {
    "num_beams": "beam search is not supported (a turn records the log-probs of sampled tokens)",
    "num_return_sequences": "answer a prompt k times with ChatEnv(repeats=k) (GRPO groups)",
    "max_length": "use max_new_tokens (the response budget; prompts have any length)",
    "min_length": "use min_new_tokens",
    "eos_token_id": "set ignore_eos=True to never stop at eos, or stop_strings to stop elsewhere",
}
# None means "off" or "the default" in transformers' generate
_NONE_MEANS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_new_tokens": 0,
    "repetition_penalty": 1.0,
    "stop_strings": (),
}


def supported_generation_options() -> list[str]:
    """The keywords :func:`sampling_from_kwargs` accepts: SamplingConfig's fields and ``do_sample``."""
    return [f.name for f in dataclasses.fields(SamplingConfig)] + ["do_sample"]


def sampling_from_kwargs(sampling: SamplingConfig | None, options: Mapping[str, Any], *, owner: str) -> SamplingConfig:
    """``sampling`` (or the defaults) with ``options`` applied, taking them as ``generate()`` takes them.

    ``do_sample=False`` means greedy (temperature 0); ``do_sample=True`` needs a temperature > 0.
    None for temperature / top_p / top_k / min_new_tokens / repetition_penalty / stop_strings means
    off (their neutral value), as in transformers. An unknown keyword is a TypeError naming the
    supported ones (``owner`` names the class in the message).
    """
    options = dict(options)
    unknown = sorted(set(options) - set(supported_generation_options()))
    if unknown:
        hints = "".join(f" {name}: {_UNSUPPORTED[name]}." for name in unknown if name in _UNSUPPORTED)
        raise TypeError(
            f"{owner} got unsupported generation option(s) {unknown}.{hints} "
            f"Supported: {', '.join(supported_generation_options())}."
        )
    for name, neutral in _NONE_MEANS.items():
        if name in options and options[name] is None:
            options[name] = neutral
    do_sample = options.pop("do_sample", None)
    values = {**(vars(sampling) if sampling is not None else {}), **options}
    if do_sample is False:
        if values.get("temperature", 1.0) not in (0, 1.0) and "temperature" in options:
            raise ValueError(
                f"do_sample=False means greedy decoding, but temperature={options['temperature']} was passed; "
                "drop one of them."
            )
        values["temperature"] = 0.0
    elif do_sample is True and values.get("temperature", 1.0) == 0:
        raise ValueError(
            "do_sample=True needs temperature > 0 (temperature 0 means greedy); pass e.g. temperature=1.0."
        )
    return SamplingConfig(**values)


MAX_REQUEST_SEED = 2**63
"""Request seeds are drawn from ``[0, 2**63)``: they fit an int64 in torch, vLLM and JSON alike."""


class RequestSeeds:
    """The per-request sampling seeds of a policy, drawn from one seeded stream.

    Each request gets its own seed, so repeated prompts still get different samples, and a result
    does not depend on how requests are batched or spread over replicas. Unseeded (the default),
    requests carry no seed. A collector saves and restores the stream (``state`` / ``set_state``).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._stream: random.Random | None = None if seed is None else random.Random(seed)

    def seed(self, seed: int) -> None:
        """Draw from ``seed`` from now on."""
        self._stream = random.Random(seed)

    def draw(self, num_requests: int, *, greedy: bool) -> list[int] | None:
        """One seed per request (None when unseeded, or greedy: nothing to seed)."""
        if self._stream is None or greedy:
            return None
        return [self._stream.randrange(MAX_REQUEST_SEED) for _ in range(num_requests)]

    def state(self) -> list | None:
        """The stream's state (None: unseeded)."""
        return None if self._stream is None else list(self._stream.getstate())

    def set_state(self, state: list | None) -> None:
        """Restore :meth:`state` (a malformed one raises and changes nothing)."""
        self._stream = None if state is None else random_from_state(state)

    @staticmethod
    def check_state(state: list | None) -> None:
        """Raise if :meth:`set_state` would refuse ``state``."""
        if state is not None:
            random_from_state(state)


def eos_token_ids(generation_eos: int | Sequence[int] | None, tokenizer: Any) -> list[int]:
    """The ids that end a response: the generation config's ``eos_token_id`` (one id or several)
    plus the tokenizer's eos. Every backend stops on these (HF, vLLM, the served engine)."""
    ids = [generation_eos] if isinstance(generation_eos, int) else [int(i) for i in generation_eos or ()]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def random_from_state(state: Any) -> random.Random:
    """A ``random.Random`` at ``state`` (``list(rng.getstate())``, as :class:`RequestSeeds` saves it)."""
    version, internal, gauss = state
    rng = random.Random()
    rng.setstate((version, tuple(internal), gauss))
    return rng
