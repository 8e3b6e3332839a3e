"""A deterministic lockstep policy for tests and examples: the one lockstep policy over a scripted engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensordict import TensorDictBase

from lmcollect.data.history import History
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.policies.engine_policy import EnginePolicy
from lmcollect.testing.scripted_engine import ByteTokenizer, ScriptedEngine, chat_script

# Scripted answers are never cut: a response ends with the end token after its last byte.
SCRIPT_MAX_NEW_TOKENS = 1 << 16


class ScriptedPolicy(EnginePolicy):
    """Answers each prompt with ``respond(history)``: an :class:`EnginePolicy` over a :class:`ScriptedEngine`.

    Tokens are the UTF-8 bytes of the :class:`ByteTokenizer`'s chat rendering (prompt) and of the
    answer followed by the end token (response); every log-prob is zero (the answer is certain)
    until a push sets the engine's ``tag``. Turns come out of the same turn builder as every other
    lockstep policy's (sampling record, per-token versions). Use it to test envs and collectors
    where a real model's randomness would hide bookkeeping bugs.

    Args:
        respond: the answer to every prompt (a string), or a function of the prompt's history.
    """

    def __init__(self, respond: Callable[[History], str] | str = "ok") -> None:
        self.respond = (lambda _h: respond) if isinstance(respond, str) else respond
        self.num_calls = 0
        tokenizer = ByteTokenizer()
        super().__init__(
            self._scripted_engine(tokenizer),
            tokenizer=tokenizer,
            sampling=SamplingConfig(temperature=0.0, max_new_tokens=SCRIPT_MAX_NEW_TOKENS),
        )

    def _scripted_engine(self, tokenizer: ByteTokenizer) -> ScriptedEngine:
        return ScriptedEngine(script=chat_script(self.respond, tokenizer))

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        self.num_calls += 1
        return super().__call__(td)

    def __getstate__(self) -> dict[str, Any]:
        """Travels (to a Ray actor, into a copy) without its engine's thread; the copy starts its own engine."""
        return {name: value for name, value in self.__dict__.items() if name != "engine"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.engine = self._scripted_engine(self.tokenizer)
