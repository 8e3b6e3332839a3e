"""A deterministic engine with no model (for tests): scripted tokens, log-probs that reveal the weights.

:class:`ScriptedEngine` implements :class:`~lmcollect.engines.protocol.EngineProtocol` for real
(continuous batching on a decoding thread, pause between steps, weights loaded between steps,
per-token versions), but the "model" is one number: the weight ``tag``. Every generated token's
log-prob is ``-tag`` of the weights held when that token was generated, so a test can check that
each token's recorded version names the weights that produced it. :class:`ByteTokenizer` is a
byte-level tokenizer with a chat template, enough for the collectors' token-exact prompts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcollect.data.history import History
from lmcollect.engines.base import EngineBase, FullWeights
from lmcollect.engines.loop_queue import QueuedAndRunning
from lmcollect.engines.protocol import (
    EngineCapabilities,
    EngineClosedError,
    EngineRequest,
    EngineResult,
    refuse_long_prompt,
    refuse_stale_push,
)
from lmcollect.plumbing import forwarded
from lmcollect.weights.buckets import WeightBuckets
from lmcollect.weights.tensors import expected_metadata
from lmcollect.weights.version import PushVersion, VersionCounter, version_index

__all__ = ["ByteTokenizer", "ScriptedEngine", "ScriptedWeights", "chat_script"]

Script = Callable[[list[int]], list[int]]
"""prompt token ids -> the response's token ids (before the end token)."""


class ByteTokenizer:
    """Token ids are UTF-8 bytes (0-255); 256 is the end token ``<|end|>``, 257 padding.

    The chat template writes ``<|role|>\\ncontent<|end|>\\n`` per message and ``<|assistant|>\\n``
    as the generation prompt (as text: the end token only appears as id 256 when generated).
    """

    eos_token_id = 256
    pad_token_id = 257
    eos_token = "<|end|>"
    name_or_path = "byte-tokenizer"

    def __call__(self, texts: str | list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        if isinstance(texts, str):
            return {"input_ids": list(texts.encode("utf-8"))}
        return {"input_ids": [list(t.encode("utf-8")) for t in texts]}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = False) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(self.eos_token if i == self.eos_token_id else "<|pad|>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool = False, add_generation_prompt: bool = True, **_: Any
    ) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}{self.eos_token}\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def parse_chat(self, text: str) -> History:
        """The History a rendered prompt holds (the trailing generation prompt dropped)."""
        history = History()
        for block in text.split(f"{self.eos_token}\n"):
            if block.startswith("<|") and "|>\n" in block:
                role, content = block[2:].split("|>\n", 1)
                if content or role != "assistant":
                    history = history.append(role, content)
        return history


def chat_script(player: Callable[[History], str], tokenizer: ByteTokenizer | None = None) -> Script:
    """A :data:`Script` answering each prompt with ``player(history)`` (e.g. ``tool_calc_player``)."""
    tokenizer = tokenizer or ByteTokenizer()

    def script(prompt_ids: list[int]) -> list[int]:
        return tokenizer.encode(player(tokenizer.parse_chat(tokenizer.decode(prompt_ids))))

    return script


class ScriptedWeights(torch.nn.Module):
    """The scripted engine's weights: one float ``tag`` (a push sets it, e.g. to the push's version)."""

    def __init__(self) -> None:
        super().__init__()
        self.tag = torch.nn.Parameter(torch.zeros(1), requires_grad=False)


@dataclass(eq=False)  # identity: a request is a dict key while it runs
class _Running:
    request: EngineRequest
    future: Future
    script: list[int] | None
    """The scripted response ids; None: the tag's digits, read at each step."""
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class ScriptedEngine(QueuedAndRunning, EngineBase):
    """An :class:`~lmcollect.engines.protocol.EngineProtocol` engine that decodes a script.

    A decoding thread runs steps while requests are in flight: each step appends one token to every
    running request (continuous batching: submitted requests join at the next step), then sleeps
    ``token_delay_s``. A request's tokens are ``script(prompt_ids)`` followed by the end token, cut
    at ``max_new_tokens`` (finish ``"length"``), at a ``stop_token_ids`` id or as soon as the text
    holds one of ``sampling.stop_strings`` (the token that ends it kept, as in every engine). Without a
    script, every token is the digit ``tag % 10`` of the weights held at that step, ``num_tokens``
    of them. ``ignore_eos``: the end token is never drawn (that digit comes instead), so only the
    request's other stop ids end a response before ``max_new_tokens``. Every token's log-prob is ``-tag`` and its version the engine's :attr:`version`, both
    read under the step lock, so a push that lands mid-response shows up token by token.

    Args:
        script: prompt ids -> response ids (see :func:`chat_script`); None: the tag's digits.
        num_tokens: response length without a script.
        token_delay_s: sleep after each decoding step (lets pushes land mid-generation).
        eos_token_id: the end token (ByteTokenizer's by default).
        max_context_tokens: the "model's" context: a prompt of this many tokens or more is refused at
            submit, as every engine refuses it (None: no bound).
    """

    capabilities = EngineCapabilities(has_version_counter=True)
    """Full weights only (its one ``tag`` tensor), and a version counter."""

    def __init__(
        self,
        *,
        script: Script | None = None,
        num_tokens: int = 4,
        token_delay_s: float = 0.0,
        eos_token_id: int = ByteTokenizer.eos_token_id,
        max_context_tokens: int | None = None,
    ) -> None:
        if token_delay_s < 0:
            raise ValueError(f"token_delay_s must be >= 0, got {token_delay_s}.")
        if max_context_tokens is not None and max_context_tokens < 2:
            raise ValueError(
                f"max_context_tokens must be None or >= 2 (a prompt and a token), got {max_context_tokens}."
            )
        self.max_context_tokens = max_context_tokens
        self.model = ScriptedWeights()
        self.script = script
        self.num_tokens = num_tokens
        self.token_delay_s = token_delay_s
        self.eos_token_id = eos_token_id
        self.num_steps = 0
        self.num_prefix_cache_resets = 0
        self._counter = VersionCounter(start=-1)
        self._queued: list[_Running] = []
        self._running: list[_Running] = []
        self._step_lock = threading.Lock()  # held for one decoding step, and by load_weights
        self._wake = threading.Condition()
        self._paused = False
        self._stepping = False
        self._closed = False
        self._hold: tuple[int, float, threading.Event] | None = None  # (step number, seconds, reached)
        self._thread = threading.Thread(target=self._decode_loop, name="scripted-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ EngineProtocol
    def submit(self, request: EngineRequest) -> Future[EngineResult]:
        refuse_long_prompt(request, self.max_context_tokens, "ScriptedEngine")
        future: Future[EngineResult] = Future()
        future.set_running_or_notify_cancel()  # running from now on: a caller's cancel() cannot race our set_result
        with self._wake:
            if self._closed:
                raise EngineClosedError("this ScriptedEngine is closed; build a new one.")
            script = None if self.script is None else list(self.script(list(request.prompt_ids)))
            self._queued.append(_Running(request, future, script))
            self._wake.notify_all()
        return future

    def pause(self) -> None:
        with self._wake:
            self._paused = True
            while self._stepping:
                self._wake.wait()

    def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._wake.notify_all()

    def _load_full(self, weights: FullWeights, version: int | PushVersion, options: Mapping[str, Any]) -> None:
        """Its one ``tag`` tensor, written between two decoding steps (adapters and deltas are
        refused by name: its capabilities list neither)."""
        tensors = weights.tensors() if isinstance(weights, WeightBuckets) else dict(weights)
        expected = dict(self.model.named_parameters())
        if set(tensors) != set(expected) or any(tensors[k].shape != v.shape for k, v in expected.items()):
            raise ValueError(
                f"ScriptedEngine takes exactly {{'tag': shape (1,)}}, got "
                f"{ {k: tuple(v.shape) for k, v in tensors.items()} }; no weight was changed."
            )
        with self._step_lock:  # between two decoding steps
            refuse_stale_push(version_index(version), self._counter.index, "ScriptedEngine")
            self.model.tag.data.copy_(tensors["tag"])
            self._counter.take(version)
            self.num_prefix_cache_resets += 1  # a load forgets cached prefixes (EngineProtocol.load_weights)

    def weight_metadata(self) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
        """The model's distinct tensors (name -> (dtype, shape)) and tied aliases."""
        return expected_metadata(self.model)

    def set_version(self, version: int) -> None:
        with self._step_lock:
            self._counter.take(int(version))

    def reset_prefix_cache(self) -> None:
        self.num_prefix_cache_resets += 1

    def hold_step(self, step: int, hold_s: float) -> threading.Event:
        """Hold the ``step``-th decoding step from now for ``hold_s`` seconds (inside it: a load or a
        pause waits for it); the event is set once that step is reached. How a test lands a push
        mid-generation on cue."""
        reached = threading.Event()
        with self._wake:
            self._hold = (self.num_steps + step, hold_s, reached)
        return reached

    version = forwarded("_counter.index", "The version of the weights loaded now (-1 before any push).")
    version_counter = forwarded(
        "_counter", "The counter of :attr:`version` (a collector driving this engine reads it)."
    )

    def close(self) -> None:
        with self._wake:
            self._closed = True
            pending, self._queued, self._running = self._queued + self._running, [], []
            self._wake.notify_all()
        for item in pending:
            item.future.set_exception(EngineClosedError("the ScriptedEngine was closed before this request finished."))
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ decoding
    def _decode_loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (self._paused or not (self._queued or self._running)):
                    self._wake.wait()
                if self._closed:
                    return
                self._running.extend(self._queued)
                self._queued.clear()
                running = list(self._running)
                self._stepping = True
            finished = self._step(running)
            with self._wake:
                self._running = [r for r in self._running if r not in finished]
                self._stepping = False
                self._wake.notify_all()
            for item, result in finished.items():
                item.future.set_result(result)
            if self.token_delay_s:
                time.sleep(self.token_delay_s)

    def _step(self, running: list[_Running]) -> dict[_Running, EngineResult]:
        finished: dict[_Running, EngineResult] = {}
        with self._step_lock:
            self.num_steps += 1
            self._hold_if_asked()
            tag, version = float(self.model.tag.item()), self._counter.index
            for item in running:
                token = self._next_token(item, tag)
                item.tokens.append(token)
                item.log_probs.append(-tag)
                item.versions.append(version)
                reason = self._finish_reason(item, token)
                if reason is not None:
                    finished[item] = EngineResult(
                        tokens=torch.tensor(item.tokens, dtype=torch.int64),
                        log_probs=torch.tensor(item.log_probs, dtype=torch.float32),
                        token_versions=torch.tensor(item.versions, dtype=torch.int64),
                        finish_reason=reason,
                    )
        return finished

    def _hold_if_asked(self) -> None:
        with self._wake:
            hold = self._hold
            if hold is None or hold[0] != self.num_steps:
                return
            self._hold = None
        _, hold_s, reached = hold
        reached.set()
        time.sleep(hold_s)

    def _next_token(self, item: _Running, tag: float) -> int:
        position, digit = len(item.tokens), ord("0") + int(tag) % 10
        if item.script is None:
            token = digit if position < self.num_tokens else self.eos_token_id
        else:
            token = item.script[position] if position < len(item.script) else self.eos_token_id
        # ignore_eos: the end token is never drawn (as in every engine); the tag's digit comes instead
        return digit if token == self.eos_token_id and item.request.sampling.ignore_eos else token

    def _finish_reason(self, item: _Running, token: int) -> str | None:
        sampling = item.request.sampling
        if token == self.eos_token_id or token in item.request.stop_token_ids:  # never eos under ignore_eos
            return "stop"
        if sampling.stop_strings and len(item.tokens) >= sampling.min_new_tokens and _ends_with_stop(item):
            return "stop"  # the token that completed a stop string is kept, as in every engine
        if len(item.tokens) >= sampling.max_new_tokens:
            return "length"
        return None


def _ends_with_stop(item: _Running) -> bool:
    """Whether the response's text now ends in a stop string (byte ids: a string of n characters
    spans at most 4n tokens, so only that tail is decoded)."""
    stops = item.request.sampling.stop_strings
    window = 4 * max(len(stop) for stop in stops)
    text = _BYTES.decode(item.tokens[-window:])  # a byte token completes a string at the text's end
    return any(text.endswith(stop) for stop in stops)


_BYTES = ByteTokenizer()
