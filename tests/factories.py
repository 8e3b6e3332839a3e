"""Env and policy factories shared by the tests (picklable: they travel into Ray actors)."""
from __future__ import annotations

import functools
import time

import torch

from lmcollect.envs import ChatEnv, GuessingGameTask, binary_search_player, guessing_game_dataset
from lmcollect.testing import ScriptedPolicy

make_guessing_env = functools.partial(
    ChatEnv,
    guessing_game_dataset(64, seed=0, low=1, high=20, max_turns=5),
    task=GuessingGameTask(low=1, high=20, max_turns=5),
    batch_size=2,
    max_turns=5,
    seed=0,
)
"""Two multi-turn guessing-game dialogs at a time."""

make_guesser = functools.partial(ScriptedPolicy, binary_search_player)
"""A deterministic player that always wins within five guesses."""


# ---------------------------------------------------------------------- weight-sync tests
def make_arithmetic_env() -> ChatEnv:
    """Four single-turn arithmetic dialogs at a time."""
    from lmcollect.envs import MathAnswerReward, arithmetic_dataset

    return ChatEnv(arithmetic_dataset(64, seed=0), reward_fn=MathAnswerReward(), batch_size=4, seed=0)


def make_greedy_tiny_policy(model_path: str, max_new_tokens: int = 6):
    """A greedy TransformersPolicy on the model saved at ``model_path``."""
    from lmcollect.models import load_model_and_tokenizer
    from lmcollect.policies import TransformersPolicy

    model, tokenizer = load_model_and_tokenizer(model_path)
    return TransformersPolicy(model, tokenizer, max_new_tokens=max_new_tokens, temperature=0)


class SmallNet(torch.nn.Module):
    """A few small tensors, with tied weights, to push around."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(8)


class SmallModelPolicy(ScriptedPolicy):
    """A scripted answer, a :class:`SmallNet` to update, and an optional delay per policy call."""

    def __init__(self) -> None:
        super().__init__("#### 1")
        self.model = SmallNet()
        self.delay_s = 0.0

    def set_delay(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, td):
        time.sleep(self.delay_s)
        return super().__call__(td)


# ---------------------------------------------------------------------- data-contract tests
def make_grouped_env(seed: int = 0) -> ChatEnv:
    """Four single-turn arithmetic dialogs, two answers per prompt (GRPO groups of two)."""
    from lmcollect.envs import MathAnswerReward, arithmetic_dataset

    return ChatEnv(arithmetic_dataset(64, seed=seed), reward_fn=MathAnswerReward(), batch_size=4, repeats=2, seed=seed)


class SlowEnv(ChatEnv):
    """An env whose every step takes 30 s (a hung tool call)."""

    def step(self, td):
        time.sleep(30)
        return super().step(td)


def make_slow_env() -> ChatEnv:
    from lmcollect.envs import MathAnswerReward, arithmetic_dataset

    return SlowEnv(arithmetic_dataset(8, seed=0), reward_fn=MathAnswerReward(), batch_size=2, seed=0)


class TorchrlShapedEnv:
    """An env written the torchrl way, with no lmcollect base class: dense TensorDicts of batch
    ``(B,)``, torchrl's key names (``"done"`` / ``"terminated"`` / ``"truncated"`` / ``"reward"``
    shaped ``(B, 1)`` under ``"next"``), partial resets through ``"_reset"``. Its prompts are
    lmcollect ``History`` objects (what the shipped policies read). Each dialog asks for "ok" twice.
    """

    def __init__(self, batch_size: int = 2) -> None:
        self.batch_size = torch.Size([batch_size])
        self._turn = [0] * batch_size

    def _flags(self, done: list[bool]) -> dict:
        flag = torch.tensor(done, dtype=torch.bool).unsqueeze(-1)
        return {"done": flag, "terminated": flag.clone(), "truncated": torch.zeros_like(flag)}

    def reset(self, td=None):
        from tensordict import NonTensorStack, TensorDict

        from lmcollect.data.history import History

        n = self.batch_size[0]
        mask = [True] * n if td is None or "_reset" not in td.keys() else td["_reset"].flatten().tolist()
        for i, reset in enumerate(mask):
            if reset:
                self._turn[i] = 0
        prompts = NonTensorStack(*[History.from_text("say ok") for _ in range(n)])
        return TensorDict({"history": {"prompt": prompts}, **self._flags([False] * n)}, batch_size=self.batch_size)

    def step(self, td):
        from tensordict import NonTensorStack, TensorDict

        fulls = [td[i]["history", "full"] for i in range(self.batch_size[0])]
        rewards, done, prompts = [], [], []
        for i, full in enumerate(fulls):
            self._turn[i] += 1
            rewards.append([float(full.messages[-1].content.strip() == "ok")])
            done.append(self._turn[i] >= 2)
            prompts.append(full.append("user", "again"))
        td["next"] = TensorDict(
            {"history": {"prompt": NonTensorStack(*prompts)}, "reward": torch.tensor(rewards), **self._flags(done)},
            batch_size=self.batch_size,
        )
        return td


def make_ok_policy() -> ScriptedPolicy:
    return ScriptedPolicy("ok")


def perturbed_model(model_path, seed: int) -> torch.nn.Module:
    """The model saved at ``model_path`` with seeded noise (std 0.05) added to every parameter."""
    from lmcollect.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(model_path)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model


def sparsely_trained(model_path, seed: int) -> torch.nn.Module:
    """The model with the noise of :func:`perturbed_model` in its last decoder layer only: a change that a
    delta push carries in a fraction of a full push's bytes, and that still moves the answers."""
    from lmcollect.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(model_path)
    noisy = perturbed_model(model_path, seed=seed).state_dict()
    last = f"layers.{model.config.num_hidden_layers - 1}."
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if last in name:
                tensor.copy_(noisy[name])
    return model.eval()


def corrupted_delta(delta):
    """``delta`` with one bit of its last buffer flipped (the sender's checksums unchanged): a delta
    damaged on its way, which a receiver must refuse after applying it, with nothing changed."""
    from lmcollect.weights.buckets import WeightBuckets
    from lmcollect.weights.delta import WeightDelta

    buffers = [torch.as_tensor(b).clone() for b in delta.arrays.buffers]
    buffers[-1][0] ^= 1
    return WeightDelta(delta.base_version, delta.entries, WeightBuckets(delta.arrays.layout, buffers))


def corrupted_encoding(encoded):
    """An :class:`~lmcollect.weights.delta.EncodedDelta` whose delta is :func:`corrupted_delta`'s."""
    from lmcollect.weights.delta import EncodedDelta

    return EncodedDelta(
        corrupted_delta(encoded.delta), encoded.positions, encoded.values, encoded.numel, encoded.full_nbytes
    )


class CorruptsNextDelta:
    """Mixed into an updater whose ``push_sender`` flips one bit of its next delta while
    ``corrupt_next`` is set (the sender's class decides where: see the delta-sync tests)."""

    @property
    def corrupt_next(self) -> bool:
        return self.push_sender.corrupt_next

    @corrupt_next.setter
    def corrupt_next(self, value: bool) -> None:
        self.push_sender.corrupt_next = value


def all_stacks() -> str:
    """Every live thread's name and stack (what a hung call was waiting on, for the failure message)."""
    import sys
    import threading
    import traceback

    names = {thread.ident: thread.name for thread in threading.enumerate()}
    threads = "\n".join(
        f"--- {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )
    return f"{threads}\n{all_tasks()}"


def all_tasks() -> str:
    """Every pending asyncio task of every running loop, with where it waits (a hang awaiting a future)."""
    import asyncio
    import gc
    import io

    out = io.StringIO()
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]
    for loop in loops:
        for task in list(asyncio.all_tasks(loop)):
            out.write(f"--- task {task.get_name()} on loop {id(loop):x}: {task!r:.300}\n")
            task.print_stack(limit=12, file=out)
    return out.getvalue()


def run_in_thread(fn, timeout_s: float = 30.0):
    """Start ``fn`` in a thread; the returned function joins it (at most ``timeout_s``) and re-raises its error."""
    import threading

    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # designed: handed to the joining test
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()

    def join():
        thread.join(timeout_s)
        assert not thread.is_alive(), f"the receiver thread hung ({timeout_s} s); every thread's stack:\n{all_stacks()}"
        if "error" in result:
            raise result["error"]
        return result.get("value")

    return join


# ---------------------------------------------------------------------- continuous collection
def make_tool_env():
    """One calculator-tool dialog at a time (a continuous collector's slot env; set_seed sets slots apart)."""
    from lmcollect.envs import ToolCalcTask, tool_calc_dataset

    return ChatEnv(tool_calc_dataset(64, seed=0), task=ToolCalcTask(max_latency_s=0.01), batch_size=1, max_turns=5, seed=0)


def make_group_tool_env():
    """GRPO groups of 4 calculator-tool dialogs per prompt draw (4 continuous slots: one per element)."""
    from lmcollect.envs import ToolCalcTask, tool_calc_dataset

    task = ToolCalcTask(max_latency_s=0.01)
    return ChatEnv(tool_calc_dataset(64, seed=0), task=task, batch_size=4, repeats=4, max_turns=5, seed=0)


class EveryOtherGroup:
    """A group filter keeping the 1st, 3rd, 5th... group it judges and dropping the others as "every_other"
    (a deterministic share of drops whatever the rewards; picklable, so it travels into a collector's actor)."""

    def __init__(self) -> None:
        self.judged = 0

    def __call__(self, rewards):
        self.judged += 1
        return None if self.judged % 2 else "every_other"


def make_tool_engine():
    """A scripted engine playing the tool task right (no model; log-probs reveal the pushed tag)."""
    from lmcollect.testing.scripted_engine import ScriptedEngine, chat_script
    from lmcollect.envs import tool_calc_player

    return ScriptedEngine(script=chat_script(tool_calc_player), token_delay_s=0.001)


def make_tiny_transformers_engine(model_path: str):
    """A TransformersEngine over the model saved at ``model_path`` (built inside an engine actor)."""
    from lmcollect.engines import TransformersEngine
    from lmcollect.models import load_model_and_tokenizer

    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer(model_path)
    return TransformersEngine(model, tokenizer)


def make_guessing_slot_env():
    """One guessing-game dialog (up to four turns): a continuous collector's slot env for a real model."""
    from lmcollect.envs import GuessingGameTask

    return ChatEnv(guessing_game_dataset(16, seed=0), task=GuessingGameTask(), batch_size=1, max_turns=4, seed=0)


def make_tiny_vllm_engine(model_path: str, engine_kwargs: dict):
    """A VLLMEngine over the model saved at ``model_path`` (built inside a collector's actor)."""
    from lmcollect.engines.vllm.engine import VLLMEngine

    return VLLMEngine(model_path, engine_kwargs=engine_kwargs, timeout_s=120.0)


# ---------------------------------------------------------------------- turn-budget tests
class UnevenEnv:
    """Wraps an env: every step first sleeps a random time of up to ``max_delay_s`` (its own seeded stream)."""

    def __init__(self, env: ChatEnv, seed: int, max_delay_s: float) -> None:
        import random

        self.env, self.batch_size = env, env.batch_size
        self._rng, self._max_delay_s = random.Random(seed), max_delay_s

    def reset(self, *args, **kwargs):
        return self.env.reset(*args, **kwargs)

    def step(self, td):
        time.sleep(self._rng.uniform(0.0, self._max_delay_s))
        return self.env.step(td)


def make_uneven_guessing_env(seed: int, batch_size: int = 1) -> UnevenEnv:
    """One of several guessing-game envs whose steps take uneven times (up to ``4 * (seed + 1)`` ms)."""
    env = ChatEnv(
        guessing_game_dataset(32, seed=seed), task=GuessingGameTask(), batch_size=batch_size, max_turns=5, seed=seed
    )
    return UnevenEnv(env, seed=seed, max_delay_s=0.004 * (seed + 1))


def make_three_turn_env(seed: int = 0, batch_size: int = 1) -> ChatEnv:
    """Guessing-game dialogs of exactly three turns with :func:`make_silent_player` (it never names a number)."""
    rows = guessing_game_dataset(32, seed=seed, max_turns=3)
    return ChatEnv(rows, task=GuessingGameTask(max_turns=3), batch_size=batch_size, max_turns=3, seed=seed)


def make_silent_player() -> ScriptedPolicy:
    """A player that never names a number: every guessing-game dialog runs to its last turn."""
    return ScriptedPolicy("I would rather not say.")


# ---------------------------------------------------------------------- security: bounded calls
class HungActor:
    """A deadlocked actor body: the calls the replay-buffer and weight-mailbox clients make never return."""

    def __init__(self) -> None:
        import threading

        self._never = threading.Event()

    def _hang(self, *args, **kwargs) -> None:
        self._never.wait()

    sample = extend = latest = _hang


def make_engine_that_hangs_on_pause():
    """A scripted engine whose ``pause`` never returns (a deadlocked engine, for bounded-call tests)."""
    import threading

    from lmcollect.testing.scripted_engine import ScriptedEngine

    class HangsOnPause(ScriptedEngine):
        def pause(self) -> None:
            threading.Event().wait()

    return HangsOnPause()


def make_holdable_tiny_engine(model_path: str):
    """:func:`make_tiny_transformers_engine` whose decoding can be held on cue from another process
    (for the engine contract through a Ray actor): ``arm_hold(step, hold_s)`` makes the ``step``-th
    forward pass from then on wait ``hold_s`` seconds, and ``hold_reached()`` tells whether it began."""
    import threading
    import time as time_module

    engine = make_tiny_transformers_engine(model_path)
    state = {"calls": 0, "step": 0, "hold_s": 0.0, "reached": threading.Event()}

    def hook(*_args) -> None:
        state["calls"] += 1
        if state["calls"] == state["step"]:
            state["reached"].set()
            time_module.sleep(state["hold_s"])

    def arm_hold(step: int, hold_s: float) -> None:
        state.update(calls=0, step=step, hold_s=hold_s, reached=threading.Event())

    engine.model.register_forward_hook(hook)
    engine.arm_hold = arm_hold
    engine.hold_reached = lambda: state["reached"].is_set()
    return engine


def trained_lora(
    model_path, *, seed: int, rank: int = 4, targets=("q_proj", "v_proj"), steps: int = 3, base=None, **config
):
    """A peft LoRA model on ``base`` (default: the perturbed base ``perturbed_model(model_path, seed=1)``),
    trained ``steps`` AdamW steps on seeded random tokens so its adapter is not the identity."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), **config)
    model = get_peft_model(base if base is not None else perturbed_model(model_path, seed=1), lora_config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(3, 1000, (2, 12), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def merged_copy(peft_model) -> torch.nn.Module:
    """What the peft model computes, as a plain model: its adapter merged into a copy of the base."""
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()
