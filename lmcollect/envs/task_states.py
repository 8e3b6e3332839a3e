"""Each ChatEnv element's task state: started, stepped once per turn, ended, rebuilt on restore."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from lmcollect.data.history import History, Message
from lmcollect.envs.datasets import row_to_history
from lmcollect.envs.tasks.base import OpeningTask, StatefulTask, Task, TaskReply, respond_async

logger = logging.getLogger(__name__)


class TaskStates:
    """The task states of a batch of dialogs, and what a :class:`StatefulTask` is promised.

    A plain :class:`Task` keeps its state unchanged, so ``respond`` may be called again and a
    restore only calls ``start``. A :class:`StatefulTask` is stepped once per assistant turn (a
    retried step gets the recorded reply), ended before its element starts again, and replayed
    from the recorded dialog on restore (see :class:`StatefulTask`).
    """

    def __init__(self, task: Task, batch_size: int) -> None:
        self.task = task
        self.stateful = isinstance(task, StatefulTask)
        self._states: list[Any] = [None] * batch_size
        self._started = [False] * batch_size
        self._stepped: list[tuple[int, History, TaskReply] | None] = [None] * batch_size

    def __getitem__(self, i: int) -> Any:
        return self._states[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def start(self, i: int, sample: Mapping[str, Any], rng: random.Random) -> None:
        """End element ``i``'s dialog (stateful tasks) and start a new one on ``sample``."""
        self._end(i)  # first: a server may allow only so many sessions
        self._states[i], self._started[i], self._stepped[i] = self.task.start(sample, rng), True, None

    def opening(self, i: int, sample: Mapping[str, Any], *, system_prompt: str | None) -> History:
        """The first prompt of element ``i``'s dialog: the task's (:class:`OpeningTask`) or the row's."""
        if not isinstance(self.task, OpeningTask):
            return row_to_history(sample, system_prompt=system_prompt)
        prompt = self.task.opening_prompt(self._states[i], sample)
        return opening_history(prompt, system_prompt=system_prompt)

    def respond(self, i: int, turn: int, full: History) -> TaskReply:
        recorded = self._recorded(i, turn, full)
        if recorded is not None:
            return recorded
        return self._record(i, turn, full, self.task.respond(self._states[i], full))

    async def arespond(self, i: int, turn: int, full: History) -> TaskReply:
        recorded = self._recorded(i, turn, full)
        if recorded is not None:
            return recorded
        return self._record(i, turn, full, await respond_async(self.task, self._states[i], full))

    def committed(self, i: int) -> None:
        """Element ``i``'s turn is committed: its next call is a new turn."""
        self._stepped[i] = None

    def _recorded(self, i: int, turn: int, full: History) -> TaskReply | None:
        stepped = self._stepped[i]
        if not self.stateful or stepped is None or stepped[0] != turn:
            return None
        if stepped[1] != full:
            raise RuntimeError(
                f"ChatEnv.step: element {i}'s stateful task already stepped turn {turn + 1} with another reply; "
                f"an environment step cannot be taken back: reset element {i} to start a new dialog."
            )
        return stepped[2]

    def _record(self, i: int, turn: int, full: History, reply: TaskReply) -> TaskReply:
        if self.stateful and isinstance(reply, TaskReply):
            self._stepped[i] = (turn, full, reply)
        return reply

    def rebuilt(self, sample: Mapping[str, Any], rng: random.Random, prompt: History) -> Any:
        """A task state for a restored dialog: ``start``, then (stateful tasks) one ``respond`` per
        recorded assistant turn of ``prompt``, the replies dropped."""
        state = self.task.start(sample, rng)
        if self.stateful:
            for k, message in enumerate(prompt.messages):
                if message.role == "assistant":
                    self.task.respond(state, History(prompt.messages[: k + 1], prompt.tools))
        return state

    def replace(self, states: Mapping[int, Any]) -> None:
        """Put restored states in place (the dialogs they replace are ended)."""
        for i, state in states.items():
            self._end(i)
            self._states[i], self._started[i], self._stepped[i] = state, True, None

    def end_all(self) -> None:
        for i in range(len(self._states)):
            self._end(i)

    def discard(self, states: Iterable[Any]) -> None:
        """End states built but never put in place (a restore that failed half-way)."""
        for state in states:
            self._end_state(state, "a restored dialog")

    def _end(self, i: int) -> None:
        if not (self.stateful and self._started[i]):
            return
        self._started[i] = False
        state, self._states[i] = self._states[i], None
        self._end_state(state, f"env element {i}")

    def _end_state(self, state: Any, where: str) -> None:
        if not self.stateful:
            return
        try:
            self.task.end(state)  # type: ignore[attr-defined]  # stateful: a StatefulTask
        except Exception as e:  # a session of a dead server: the next dialog must start all the same
            logger.warning("Task.end failed for %s (%s: %s); going on", where, type(e).__name__, e)


def opening_history(
    prompt: History | str | Sequence[Mapping[str, str]], *, system_prompt: str | None = None
) -> History:
    """An :class:`OpeningTask`'s prompt as a History, ``system_prompt`` first unless it has a system message."""
    if not isinstance(prompt, (History, str, Sequence)) or (not isinstance(prompt, (History, str)) and not prompt):
        raise TypeError(
            f"Task.opening_prompt must return a str, a non-empty list of {{'role', 'content'}} dicts or a History, "
            f"got {type(prompt).__name__}."
        )
    if not isinstance(prompt, History):
        return row_to_history({"prompt": prompt}, system_prompt=system_prompt)
    if not prompt.messages:
        raise ValueError("Task.opening_prompt returned an empty History; return at least one message.")
    if system_prompt and prompt.messages[0].role != "system":
        return History((Message("system", system_prompt), *prompt.messages), prompt.tools)
    return prompt
