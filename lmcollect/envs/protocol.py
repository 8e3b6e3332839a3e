"""The environment protocol the collectors rely on (torchrl-style, no subclassing needed)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from tensordict import TensorDictBase


@runtime_checkable
class EnvProtocol(Protocol):
    """A batched chat environment of ``batch_size == (B,)`` elements.

    ``reset(td=None)`` starts a dialog in every element and returns a TensorDict of batch size
    ``(B,)`` holding ``("history", "prompt")`` (a :class:`~lmcollect.data.History` per element) and
    ``"done"``, ``"terminated"``, ``"truncated"`` (bool, shape ``(B, 1)``, all False). If ``td``
    holds a bool ``"_reset"`` mask of shape ``(B, 1)``, only the masked elements start a new dialog;
    the collector reads only those rows of the result.

    ``step(td)`` receives the policy output (batch ``(B,)``, at least ``("history", "full")``) and
    returns a TensorDict whose ``"next"`` entry has batch ``(B,)`` and holds ``("history", "prompt")``
    (the prompt of the next turn, e.g. the full history plus the env's reply), ``"reward"`` (float,
    ``(B, 1)``) and ``"done"`` / ``"terminated"`` / ``"truncated"`` (bool, ``(B, 1)``).

    Optional: ``set_seed(seed, static_seed=False) -> int``, ``state_dict()``, ``load_state_dict()``,
    ``close()``. An env with GRPO groups also declares ``group_size`` (dialogs per prompt draw) and
    ``split_elements()`` (its elements as batch-1 envs that reset and step on their own, still
    drawing prompts group by group), as :class:`~lmcollect.envs.ChatEnv` does: the continuous
    collector then runs one element per slot and keeps each group together.
    """

    batch_size: torch.Size

    def reset(self, td: TensorDictBase | None = None) -> TensorDictBase: ...

    def step(self, td: TensorDictBase) -> TensorDictBase: ...


@runtime_checkable
class AsyncEnvProtocol(EnvProtocol, Protocol):
    """An env whose step may also be awaited: ``async astep(td)``, same input, result and effect as ``step``.

    The continuous collector awaits ``astep`` on its event loop, so an env waiting on a tool does
    not hold a thread; envs without it are stepped in a thread pool. :class:`~lmcollect.envs.ChatEnv`
    implements it (awaiting an :class:`~lmcollect.envs.tasks.base.AsyncTask`'s ``arespond``).
    """

    async def astep(self, td: TensorDictBase) -> TensorDictBase: ...


class DialogFailed(RuntimeError):
    """An env raises it from ``reset`` or ``step`` to end one dialog without stopping collection.

    The continuous collector then drops the dialog as it drops any dialog that failed (the turn
    under way is dropped; in trajectory modes and GRPO groups the dialog's finished turns too, its
    group completing with one dialog fewer), logs the error as a warning and counts it in
    ``num_failed_dialogs``, but does not raise it to the consumer: collection of the other dialogs
    goes on. Any other error from an env (and a ``DialogFailed`` with ``raise_to_consumer=True``)
    is raised by the consumer's next ``next()``.

    ``prompt_id``: the group draw (``("env", "prompt_id")``) the dialog was to answer when a
    ``reset`` fails, so the collector knows its GRPO group waits for one dialog fewer.
    """

    def __init__(self, message: str, *, prompt_id: int | None = None, raise_to_consumer: bool = False) -> None:
        super().__init__(message)
        self.prompt_id = prompt_id
        self.raise_to_consumer = raise_to_consumer


@runtime_checkable
class RefusesTurns(Protocol):
    """An env whose dialog waits for each reply somewhere else (an agent's HTTP call), told when the
    collector refuses a turn before generating it (its sampling or its prompt, e.g. longer than the
    model's context: a ``ValueError`` from the sampling check or ``engine.submit``).

    ``refuse_turn(error)`` answers the waiting party with ``error`` and returns the
    :class:`DialogFailed` that ends the dialog (the collector raises it: dropped, collection goes on).
    Without it, the collector raises ``error`` to the consumer, naming the dialog.
    """

    def refuse_turn(self, error: ValueError) -> DialogFailed: ...
