"""The Task interface ChatEnv drives turn by turn (sync, or async for tools that wait), and the default single-turn task."""

from __future__ import annotations

import asyncio
import math
import numbers
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from lmcollect.data.history import History, Message
from lmcollect.envs.rewards import RewardFn, as_reward_fn

NEXT_ROLES = ("user", "tool", "system")
"""Roles a task may write into the dialog; "assistant" is refused (the model's turns are only what it sampled)."""

MessageLike = Message | Mapping[str, Any] | tuple[str, str]
"""A message a task writes: a :class:`~lmcollect.data.history.Message`, ``{"role", "content"}`` or ``(role, content)``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskReply:
    """What a task answers after an assistant turn."""

    reward: float
    """Reward of this turn."""
    done: bool
    """True when the dialog is over (the env reports it as terminated)."""
    env_message: str | None = None
    """Appended as a "user" message to form the next prompt (also when ``done``), if not None; the
    shorthand of ``messages=[("user", env_message)]``."""
    messages: Sequence[MessageLike] = ()
    """Messages appended, in order, to form the next prompt: role-tagged (``user``, ``tool``,
    ``system``), e.g. a tool result then an observation; stored as a tuple of Messages."""

    def __post_init__(self) -> None:
        if isinstance(self.reward, bool) or not isinstance(self.reward, numbers.Real):
            raise TypeError(f"TaskReply.reward must be a float, got {type(self.reward).__name__}.")
        object.__setattr__(self, "reward", float(self.reward))
        if not math.isfinite(self.reward):
            raise ValueError(f"TaskReply.reward must be finite, got {self.reward}; return a finite float.")
        if self.env_message is not None and not isinstance(self.env_message, str):
            raise TypeError(f"TaskReply.env_message must be a str or None, got {type(self.env_message).__name__}.")
        if self.env_message is not None and self.messages:
            raise ValueError("TaskReply got env_message and messages; pass messages=[('user', text), ...] alone.")
        if isinstance(self.messages, (str, Mapping)) or not isinstance(self.messages, Sequence):
            raise TypeError(f"TaskReply.messages must be a list of messages, got {type(self.messages).__name__}.")
        object.__setattr__(self, "messages", tuple(_as_message(m) for m in self.messages))

    @property
    def next_messages(self) -> tuple[Message, ...]:
        """The messages this reply appends to the dialog (``env_message`` as a user message)."""
        if self.env_message is not None:
            return (Message("user", self.env_message),)
        return self.messages  # type: ignore[return-value]  # normalised to Messages in __post_init__


def _as_message(message: MessageLike) -> Message:
    if isinstance(message, Message):
        role, content = message.role, message.content
    elif isinstance(message, Mapping) and "role" in message and "content" in message:
        role, content = message["role"], message["content"]
    elif isinstance(message, tuple) and len(message) == 2:
        role, content = message
    else:
        raise TypeError(
            f"TaskReply.messages: each message is a Message, {{'role', 'content'}} or (role, content), got {message!r:.80}."
        )
    if role not in NEXT_ROLES:
        raise ValueError(
            f"TaskReply.messages: role {role!r} is not one a task may write; use one of {NEXT_ROLES} "
            "(assistant turns are the model's own)."
        )
    return Message(role, content)


MAX_ANSWER_DIGITS = 30
"""The most digits a number read from a model's reply may have; a longer one counts as no valid number."""


def parse_model_int(digits: str) -> int | None:
    """The integer a model wrote (``"-?\\d+"``), or None past :data:`MAX_ANSWER_DIGITS` digits.

    Never raises: Python refuses to convert a string of over 4300 digits to an int, and a reply
    must never stop collection; the task treats None as a reply without a usable number.
    """
    if len(digits.lstrip("-")) > MAX_ANSWER_DIGITS:
        return None
    return int(digits)


@runtime_checkable
class Task(Protocol):
    """A (possibly multi-turn) dialog task.

    ``start(sample, rng)`` begins a dialog for a dataset row and returns an opaque state (e.g. a
    secret number drawn from ``rng``). After each assistant turn, ``respond(state, history)`` is
    called with the full history (ending with the assistant message) and returns a
    :class:`TaskReply`. ``respond`` must not mutate ``state`` (ChatEnv may call it again with the
    same state if another element of the batch failed); derive progress from ``history`` instead,
    or, for an environment whose step changes its state, make it a :class:`StatefulTask`. A task
    that writes the first prompt itself (from the row, or an environment's reset) is an :class:`OpeningTask`.
    A task whose reply waits on something (a tool, a judge) may also define ``async arespond``:
    see :class:`AsyncTask`.
    """

    def start(self, sample: Mapping[str, Any], rng: random.Random) -> Any: ...

    def respond(self, state: Any, history: History) -> TaskReply: ...


@runtime_checkable
class AsyncTask(Task, Protocol):
    """A :class:`Task` whose reply may wait (a tool call, a sandbox, a judge) without blocking others.

    ``async arespond(state, history)`` returns the same :class:`TaskReply` as ``respond`` and
    awaits where ``respond`` would block (e.g. ``await asyncio.sleep(latency)`` instead of
    ``time.sleep``). The continuous collector awaits it on its event loop (through
    :meth:`ChatEnv.astep <lmcollect.envs.ChatEnv.astep>`), so many dialogs wait at once; the
    synchronous ``ChatEnv.step`` keeps calling ``respond``, which must stay a blocking
    equivalent. A task without ``arespond`` is awaited by running ``respond`` in a worker thread
    (see :func:`respond_async`).
    """

    async def arespond(self, state: Any, history: History) -> TaskReply: ...


@runtime_checkable
class OpeningTask(Task, Protocol):
    """A :class:`Task` that writes the first prompt of each dialog itself.

    ``opening_prompt(state, sample)`` is called right after ``start`` and returns the opening
    prompt: a str (one user message), a list of ``{"role", "content"}`` messages or a
    :class:`~lmcollect.data.history.History` (its tools are offered to the model). It replaces the
    row's ``"prompt"`` (``ChatEnvConfig.system_prompt`` is still put first, unless the prompt has a
    system message). An outside environment's ``reset``/``init`` observation becomes the prompt this way.
    """

    def opening_prompt(self, state: Any, sample: Mapping[str, Any]) -> History | str | Sequence[Mapping[str, str]]: ...


@runtime_checkable
class StatefulTask(Task, Protocol):
    """A :class:`Task` whose ``respond`` changes ``state`` (an outside environment's ``step``).

    Defining ``end(state)`` marks a task as stateful; ChatEnv then keeps these promises:

    - **each assistant turn is stepped once**: if a batch step fails on another element and is
      retried with the same dialogs, an element already stepped gets its recorded reply back
      (``respond`` is not called twice); a *different* reply for a turn already stepped is refused;
    - **reset ends the dialog**: ``end(state)`` is called on the old state (to release a session)
      before ``start`` opens the next; ``close()`` ends every dialog in flight;
    - **a restore replays**: ``start`` on the saved draw, then ``respond`` once per recorded
      assistant turn (the replies are dropped: the recorded history is what the model saw), so a
      deterministic environment is back where it was; a checkpoint stores no task state.
    """

    def end(self, state: Any) -> None: ...


async def respond_async(task: Task, state: Any, history: History) -> TaskReply:
    """``await task.arespond(...)`` for an :class:`AsyncTask`; otherwise ``task.respond`` in a thread."""
    if isinstance(task, AsyncTask):
        return await task.arespond(state, history)
    return await asyncio.to_thread(task.respond, state, history)


def _zero_reward(history: History, sample: Mapping[str, Any]) -> float:
    return 0.0


@dataclass
class SingleTurnTask:
    """One assistant turn, scored by ``reward_fn(history, sample)``; the dialog then ends."""

    reward_fn: RewardFn | Callable[..., float] | None = None
    """``fn(history, sample)`` or ``fn(history)``; None gives reward 0.0."""
    _fn: RewardFn = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._fn = _zero_reward if self.reward_fn is None else as_reward_fn(self.reward_fn)

    def start(self, sample: Mapping[str, Any], rng: random.Random) -> Mapping[str, Any]:
        return sample

    def respond(self, state: Mapping[str, Any], history: History) -> TaskReply:
        return TaskReply(reward=float(self._fn(history, state)), done=True)
