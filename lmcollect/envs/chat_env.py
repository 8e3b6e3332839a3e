"""ChatEnv: a batched, multi-turn chat environment over a prompt dataset and a Task."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from lmcollect.data import keys
from lmcollect.data.history import History
from lmcollect.envs._td import build_batch, read_histories, read_reset_mask
from lmcollect.envs.config import ChatEnvConfig, config_with_overrides
from lmcollect.envs.datasets import PromptDataset
from lmcollect.envs.rewards import RewardFn
from lmcollect.envs.sampling import Draw, GroupSampler, draw_state
from lmcollect.envs.task_states import TaskStates
from lmcollect.envs.tasks.base import SingleTurnTask, Task, TaskReply
from lmcollect.plumbing import RefusesWhenClosed

logger = logging.getLogger(__name__)

_MAX_DIALOG_CHARS = 2000


class RewardError(RuntimeError):
    """A task or reward function raised while scoring one env element."""

    def __init__(self, index: int, history: History, cause: BaseException) -> None:
        dialog = "\n".join(f"[{m.role}] {m.content}" for m in history.messages)
        if len(dialog) > _MAX_DIALOG_CHARS:
            dialog = "..." + dialog[-_MAX_DIALOG_CHARS:]
        super().__init__(
            f"The task/reward function failed on env element {index} with "
            f"{type(cause).__name__}: {cause}\nDialog of element {index}:\n{dialog}"
        )
        self.index = index
        self.history = history


_warned_zero_rewards = False


def _warn_zero_rewards() -> None:
    """Once per process: a ChatEnv built without task or reward_fn scores every turn 0.0."""
    global _warned_zero_rewards
    if not _warned_zero_rewards:
        _warned_zero_rewards = True
        logger.warning(
            "ChatEnv got no reward_fn and no task: every reward will be 0.0. Pass reward_fn=... (e.g. "
            "MathAnswerReward()) or task=...; pass task=SingleTurnTask() to collect unscored turns without this warning."
        )


def _as_dataset(dataset: PromptDataset | Sequence[Mapping[str, Any]]) -> PromptDataset:
    if isinstance(dataset, PromptDataset):
        return dataset.fork()
    return PromptDataset(dataset)


class ChatEnv(RefusesWhenClosed):
    """A batch of ``config.batch_size`` dialogs implementing :class:`~lmcollect.envs.EnvProtocol`.

    ``reset`` opens each dialog with the next dataset prompt (``repeats`` consecutive elements share
    it, see :class:`~lmcollect.envs.sampling.GroupSampler`); ``step`` reads the policy's
    ``("history", "full")``, asks the :class:`Task` for a reply and returns, under ``"next"``, the
    next prompt (the full history plus the task's message), the reward and the done flags.
    Both outputs also hold ``("env", "prompt_id")`` and ``("env", "sample_index")`` (int64 scalars):
    elements with the same prompt_id answered the same draw of the same prompt.

    Groups and partial resets: element ``e`` belongs to group ``e // repeats``. At its k-th reset an
    element takes its group's k-th prompt draw; the first element of the group to get there draws a
    new dataset row (and task seed) that the others pick up at their own k-th reset. So each prompt
    is answered exactly ``repeats`` times with the same task state (e.g. the same secret number),
    even when the group's dialogs end at different turns. A full reset (no ``"_reset"``) discards
    pending draws and gives every group a fresh one.

    ``step`` writes ``"next"`` into the td it is given and returns that td (as torchrl does).

    Prompt order: the env iterates its own cursor over the dataset rows (a fork of a given
    PromptDataset). A plain list of rows becomes ``PromptDataset(rows)``, which **shuffles**: each
    pass over the rows is a fresh permutation drawn from the env's seed (``config.seed`` or
    :meth:`set_seed`), and with ``seed=None`` (the default) a random one, so the order differs from
    run to run. To keep the list's order, pass ``PromptDataset(rows, shuffle=False)``.

    Outside environments: a task's reply may append several role-tagged messages
    (``TaskReply.messages``), an :class:`~lmcollect.envs.tasks.base.OpeningTask` writes each
    dialog's first prompt, and a :class:`~lmcollect.envs.tasks.base.StatefulTask` (whose step
    changes its state) is stepped once per turn, ended on reset and close, and replayed on restore
    (see docs/environments.md).

    Rewards: without ``task`` or ``reward_fn`` every reward is 0.0 (logged once as a warning); pass
    ``reward_fn`` (e.g. :class:`~lmcollect.envs.MathAnswerReward`) or ``task``, or
    ``task=SingleTurnTask()`` to collect unscored turns on purpose.
    """

    _closed_error = "ChatEnv is closed; create a new env."

    def __init__(
        self,
        dataset: PromptDataset | Sequence[Mapping[str, Any]],
        *,
        task: Task | None = None,
        reward_fn: RewardFn | Callable[..., float] | None = None,
        config: ChatEnvConfig | None = None,
        **config_kwargs: Any,
    ) -> None:
        if task is not None and reward_fn is not None:
            raise ValueError("ChatEnv got both task and reward_fn; pass task=SingleTurnTask(reward_fn) or only one.")
        if task is not None and not isinstance(task, Task):
            raise TypeError(f"task must implement start(sample, rng) and respond(state, history), got {task!r}.")
        self.config = config_with_overrides(ChatEnvConfig, config, config_kwargs, owner="ChatEnv")
        self.task: Task = task if task is not None else SingleTurnTask(reward_fn)
        if task is None and reward_fn is None:
            _warn_zero_rewards()
        self._warn_turn_limit()
        b = self.config.batch_size
        self.batch_size = torch.Size([b])
        seed = self.config.seed if self.config.seed is not None else random.SystemRandom().getrandbits(31)
        self._sampler = GroupSampler(
            _as_dataset(dataset), num_groups=self.config.num_groups, repeats=self.config.repeats, seed=seed
        )
        self._seed = seed
        self._draws: list[Draw | None] = [None] * b
        self._states = TaskStates(self.task, b)
        self._prompts: list[History] = [History()] * b
        self._turns = [0] * b
        self._flags = [(False, False, False)] * b  # (done, terminated, truncated)
        self._started = False
        self._closed = False

    def _warn_turn_limit(self) -> None:
        task_turns = getattr(self.task, "max_turns", None)
        if isinstance(task_turns, int) and task_turns > self.config.max_turns:
            logger.warning(
                "The task allows %d turns but ChatEnvConfig.max_turns=%d truncates dialogs earlier; "
                "raise max_turns to let the task end them.",
                task_turns,
                self.config.max_turns,
            )

    # ---- protocol -----------------------------------------------------------------------------
    def reset(self, td: TensorDictBase | None = None) -> TensorDictBase:
        """Start new dialogs: all of them, or those with ``td["_reset"]`` True (shape ``(B, 1)``).

        Rows not reset hold their current prompt and flags. A partial reset before any full one
        resets everything.
        """
        self._check_open()
        mask = read_reset_mask(td, self.config.batch_size)
        if mask is None or not self._started:
            self._sampler.clear()
            mask = [True] * self.config.batch_size
        for i, reset in enumerate(mask):
            if reset:
                self._start(i)
        self._started = True
        elements = range(self.config.batch_size)
        return self._outputs(elements, [0.0] * len(elements), with_reward=False)

    def _start(self, i: int) -> None:
        draw = self._sampler.draw_for(i)
        try:
            self._states.start(i, draw.sample, random.Random(draw.task_seed))
            prompt = self._states.opening(i, draw.sample, system_prompt=self.config.system_prompt)
        except Exception as e:
            raise RuntimeError(
                f"Task.start failed for env element {i} on dataset row {draw.sample_index} "
                f"(prompt {draw.sample['prompt']!r}): {type(e).__name__}: {e}"
            ) from e
        self._draws[i] = draw
        self._prompts[i] = prompt
        self._turns[i] = 0
        self._flags[i] = (False, False, False)

    def step(self, td: TensorDictBase) -> TensorDictBase:
        """Score the policy's ``("history", "full")`` and write ``"next"`` into ``td`` (returned)."""
        elements = range(self.config.batch_size)
        fulls = self._step_inputs(td, len(elements))
        replies = [self._respond(i, full) for i, full in zip(elements, fulls, strict=True)]
        return self._commit(td, elements, fulls, replies)

    async def astep(self, td: TensorDictBase) -> TensorDictBase:
        """:meth:`step` for an event loop: every element's reply is awaited at once.

        An :class:`~lmcollect.envs.tasks.base.AsyncTask` is awaited (``arespond``: a tool call
        waits without blocking the loop); any other task's ``respond`` runs in a worker thread.
        Same checks, same result and same state changes as :meth:`step`.
        """
        elements = range(self.config.batch_size)
        fulls = self._step_inputs(td, len(elements))
        replies = await asyncio.gather(*(self._arespond(i, full) for i, full in zip(elements, fulls, strict=True)))
        return self._commit(td, elements, fulls, list(replies))

    def _step_inputs(self, td: TensorDictBase, batch: int) -> list[History]:
        self._check_open()
        if not self._started:
            raise RuntimeError("ChatEnv.step called before reset(); call env.reset() first.")
        return read_histories(td, keys.HISTORY_FULL, batch)

    def _commit(
        self, td: TensorDictBase, elements: Sequence[int], fulls: list[History], replies: list[TaskReply]
    ) -> TensorDictBase:
        # Nothing is committed before every element has been scored: a failure leaves the env intact.
        max_turns = self.config.max_turns
        rewards: list[float] = []
        for i, full, reply in zip(elements, fulls, replies, strict=True):
            self._turns[i] += 1
            truncated = not reply.done and self._turns[i] >= max_turns
            self._flags[i] = (reply.done or truncated, reply.done, truncated)
            self._prompts[i] = History(full.messages + reply.next_messages, full.tools)
            self._states.committed(i)
            rewards.append(reply.reward)
        td.set("next", self._outputs(elements, rewards, with_reward=True))
        return td

    def _outputs(self, elements: Sequence[int], rewards: Sequence[float], *, with_reward: bool) -> TensorDictBase:
        return build_batch(
            [self._prompts[i] for i in elements],
            rewards,
            [self._flags[i] for i in elements],
            [self._draws[i] for i in elements],
            with_reward=with_reward,
        )

    # ---- one element as an env of its own (GRPO groups across continuous slots) ----------------
    @property
    def group_size(self) -> int:
        """Dialogs that answer each prompt draw (``repeats``): a GRPO group."""
        return self.config.repeats

    def split_elements(self) -> list[ChatEnvElement]:
        """Each element as a batch-1 env (:class:`ChatEnvElement`) that resets and steps on its own.

        The elements keep sharing this env's prompt draws, so the ``repeats`` elements of a group
        still answer the same prompts, each at its own pace. This is how the continuous collector
        runs GRPO groups: one slot per element. Seeding and checkpoints stay with this env.
        """
        return [ChatEnvElement(self, i) for i in range(self.config.batch_size)]

    def reset_element(self, i: int) -> TensorDictBase:
        """Start a new dialog in element ``i`` only (its group's next draw); a batch-1 output."""
        self._check_open()
        self._started = True  # the others stay as they are (before any reset: no dialog)
        self._start(i)
        return self._outputs([i], [0.0], with_reward=False)

    def step_element(self, i: int, td: TensorDictBase) -> TensorDictBase:
        """:meth:`step` of element ``i`` alone (``td`` has batch size 1)."""
        fulls = self._step_inputs(td, 1)
        return self._commit(td, [i], fulls, [self._respond(i, fulls[0])])

    async def astep_element(self, i: int, td: TensorDictBase) -> TensorDictBase:
        """:meth:`astep` of element ``i`` alone (``td`` has batch size 1)."""
        fulls = self._step_inputs(td, 1)
        return self._commit(td, [i], fulls, [await self._arespond(i, fulls[0])])

    def _respond(self, i: int, full: History) -> TaskReply:
        self._check_reply_input(i, full)
        try:
            reply = self._states.respond(i, self._turns[i], full)
        except Exception as e:
            raise RewardError(i, full, e) from e
        return _checked_reply(i, reply)

    async def _arespond(self, i: int, full: History) -> TaskReply:
        self._check_reply_input(i, full)
        try:
            reply = await self._states.arespond(i, self._turns[i], full)
        except Exception as e:
            raise RewardError(i, full, e) from e
        return _checked_reply(i, reply)

    def _check_reply_input(self, i: int, full: History) -> None:
        if self._flags[i][0]:
            raise RuntimeError(
                f"ChatEnv.step: element {i} is done; reset it first (env.reset(td) with td['_reset'][{i}] True)."
            )
        last = full.messages[-1] if full.messages else None
        if last is None or last.role != "assistant":
            raise ValueError(
                f"ChatEnv.step: ('history', 'full') of element {i} must end with an assistant message, "
                f"got {last!r}; pass prompt.append('assistant', response)."
            )

    # ---- extras -------------------------------------------------------------------------------
    @property
    def current_samples(self) -> list[dict[str, Any] | None]:
        """The dataset row each element is answering (None before the first reset)."""
        return [None if d is None else d.sample for d in self._draws]

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Reseed prompt order and task randomness; returns ``seed + 1`` (``seed`` if static_seed).

        Dialogs in flight are dropped: the next reset is a full one.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}.")
        self._seed = seed
        self._sampler.reseed(seed)
        self._started = False
        return seed if static_seed else seed + 1

    def state_dict(self) -> dict[str, Any]:
        """Seed, rng, dataset position, prompt counter, pending group draws and the dialogs in
        flight (each element's draw, history so far, turn count and flags): everything a fresh
        env built the same way needs to continue exactly where this one is."""
        dialogs = [
            None if draw is None else {"draw": draw_state(draw), "prompt": prompt, "turns": turns, "flags": list(flags)}
            for draw, prompt, turns, flags in zip(self._draws, self._prompts, self._turns, self._flags, strict=True)
        ]
        return {"seed": self._seed, "sampler": self._sampler.state_dict(), "started": self._started, "dialogs": dialogs}

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise if :meth:`load_state_dict` would refuse ``state`` (ValueError, or the KeyError /
        TypeError of a malformed field); changes nothing."""
        self._parsed_state(state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: the dialogs in flight continue (task states are rebuilt from
        each draw's row and seed, as at their start, and a
        :class:`~lmcollect.envs.tasks.base.StatefulTask` replays each dialog's recorded assistant
        turns); a state without them makes the next reset a full one. Every field is checked and
        every task state rebuilt before anything changes."""
        seed, started, dialogs = self._parsed_state(state)
        task_states = self._rebuilt_task_states(dialogs)
        self._seed = seed
        self._sampler.load_state_dict(state["sampler"])
        self._started = started
        self._states.replace(task_states)
        for i, dialog in dialogs.items():
            self._draws[i], self._prompts[i], self._turns[i], self._flags[i] = dialog

    def _rebuilt_task_states(self, dialogs: Mapping[int, tuple]) -> dict[int, Any]:
        """Each restored dialog's task state; on a failure, those already built are ended."""
        built: dict[int, Any] = {}
        for i, (draw, prompt, *_) in dialogs.items():
            try:
                built[i] = self._states.rebuilt(draw.sample, random.Random(draw.task_seed), prompt)
            except Exception as e:
                self._states.discard(built.values())
                raise RuntimeError(
                    f"ChatEnv.load_state_dict: rebuilding the task state of dialog {i} (dataset row "
                    f"{draw.sample_index}) failed with {type(e).__name__}: {e}; nothing was restored."
                ) from e
        return built

    def _parsed_state(self, state: Mapping[str, Any]) -> tuple[int, bool, dict[int, tuple]]:
        """(seed, started, slot -> (draw, prompt, turns, flags) of each dialog in flight)."""
        if not isinstance(state, Mapping) or "seed" not in state or "sampler" not in state:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"state must come from ChatEnv.state_dict(), got keys {keys}.")
        dialogs = state.get("dialogs")
        if dialogs is not None and len(dialogs) != self.config.batch_size:
            raise ValueError(
                f"the state holds {len(dialogs)} dialogs, this env has batch_size={self.config.batch_size}; "
                "restore into an env built with the same batch_size."
            )
        seed = int(state["seed"])
        self._sampler.check_state_dict(state["sampler"])
        started = bool(state.get("started", False)) and dialogs is not None
        if not started or dialogs is None:  # started only with dialogs
            return seed, started, {}
        parsed = {}
        for i, dialog in enumerate(dialogs):
            if dialog is None:
                continue
            draw = self._sampler.draw_from_state(dialog["draw"])
            prompt = dialog["prompt"]
            if not isinstance(prompt, History):
                raise ValueError(f"dialog {i}'s prompt is a {type(prompt).__name__}, not a History.")
            done, terminated, truncated = (bool(f) for f in dialog["flags"])
            parsed[i] = (draw, prompt, int(dialog["turns"]), (done, terminated, truncated))
        return seed, started, parsed

    def close(self) -> None:
        """Close the env; a :class:`~lmcollect.envs.tasks.base.StatefulTask`'s dialogs in flight are ended."""
        if not self._closed:
            self._states.end_all()
        self._closed = True

    def __repr__(self) -> str:
        return f"ChatEnv(batch_size={self.config.batch_size}, repeats={self.config.repeats}, task={self.task!r})"


def _checked_reply(i: int, reply: object) -> TaskReply:
    if not isinstance(reply, TaskReply):
        raise TypeError(f"Task.respond must return a TaskReply, got {type(reply).__name__} for element {i}.")
    return reply


class ChatEnvElement:
    """Element ``index`` of a :class:`ChatEnv` as a batch-1 env: it resets and steps on its own.

    Built by :meth:`ChatEnv.split_elements`. Its dialogs draw prompts from the parent's groups (the
    ``repeats`` elements of a group answer the same draws), its state lives in the parent, so seed
    and checkpoint the parent. Implements :class:`~lmcollect.envs.AsyncEnvProtocol`.
    """

    def __init__(self, parent: ChatEnv, index: int) -> None:
        self.parent = parent
        self.index = index
        self.batch_size = torch.Size([1])

    def reset(self, td: TensorDictBase | None = None) -> TensorDictBase:
        """A new dialog in this element (``td``'s reset mask, if any, is this element's)."""
        return self.parent.reset_element(self.index)

    def step(self, td: TensorDictBase) -> TensorDictBase:
        return self.parent.step_element(self.index, td)

    async def astep(self, td: TensorDictBase) -> TensorDictBase:
        return await self.parent.astep_element(self.index, td)

    def __repr__(self) -> str:
        return f"ChatEnvElement({self.index} of {self.parent!r})"
