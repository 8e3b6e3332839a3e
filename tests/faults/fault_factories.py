"""Envs, policies and weight senders that break on cue (importable: they travel into Ray actors)."""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDictBase

from lmcollect.data import History, keys
from lmcollect.envs import ChatEnv, GuessingGameTask, binary_search_player, guessing_game_dataset
from lmcollect.testing import ScriptedPolicy
from lmcollect.engines.vllm.worker_ext import VLLMWeightReceiverExtension

ENV_FAULTS = ("raise", "task_raises", "no_done", "no_reward")
POLICY_FAULTS = ("raise", "short_log_probs")
NEVER = 10**9


class InjectedFault(RuntimeError):
    """The error a broken env or policy raises on cue."""


@dataclass(kw_only=True)
class FlakyGuessingTask(GuessingGameTask):
    """The guessing game, whose scoring raises once when ``fail_next`` is set."""

    fail_next: bool = False

    def respond(self, state: Any, history: History) -> Any:
        if self.fail_next:
            self.fail_next = False
            raise InjectedFault("the task's scorer failed (injected)")
        return super().respond(state, history)


class GuessingEnv(ChatEnv):
    """Two multi-turn guessing games at a time (up to five turns each: trajectory ids and step
    counts to account for), whose ``fail_at_step``-th step (1-based) breaks as ``fault`` says:
    "raise" (the step raises), "task_raises" (the task scoring the first element raises, which
    ChatEnv reports naming the element), "no_done" / "no_reward" (the step returns without that key)."""

    def __init__(self, fault: str = "raise", fail_at_step: int = NEVER, batch_size: int = 2) -> None:
        if fault not in ENV_FAULTS:
            raise ValueError(f"fault must be one of {ENV_FAULTS}, got {fault!r}.")
        task = FlakyGuessingTask(low=1, high=20, max_turns=5)
        dataset = guessing_game_dataset(64, seed=0, low=1, high=20, max_turns=5)
        super().__init__(dataset, task=task, batch_size=batch_size, max_turns=5, seed=0)
        self.fault, self.fail_at_step, self.num_steps = fault, fail_at_step, 0

    def step(self, td: TensorDictBase) -> TensorDictBase:
        self.num_steps += 1
        if self.num_steps != self.fail_at_step:
            return super().step(td)
        if self.fault == "raise":
            raise InjectedFault(f"env step {self.num_steps} failed (injected)")
        if self.fault == "task_raises":
            self.task.fail_next = True
            return super().step(td)
        out = super().step(td)
        out.get("next").exclude(keys.DONE if self.fault == "no_done" else keys.REWARD, inplace=True)
        return out


class GuessingPolicy(ScriptedPolicy):
    """The binary-search player, which breaks on its ``fail_at_call``-th call (1-based): "raise",
    or "short_log_probs" (element ``bad_element`` gets one log-prob fewer than it has tokens).
    ``delay_s`` per call makes a batch take long enough to kill an actor in the middle of it."""

    def __init__(self, fault: str = "raise", fail_at_call: int = NEVER, bad_element: int = 1, delay_s: float = 0.0) -> None:
        if fault not in POLICY_FAULTS:
            raise ValueError(f"fault must be one of {POLICY_FAULTS}, got {fault!r}.")
        super().__init__(binary_search_player)
        self.fault, self.fail_at_call, self.bad_element, self.delay_s = fault, fail_at_call, bad_element, delay_s

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        time.sleep(self.delay_s)
        if self.num_calls + 1 == self.fail_at_call and self.fault == "raise":
            self.num_calls += 1
            raise InjectedFault(f"policy call {self.num_calls} failed (injected)")
        out = super().__call__(td)
        if self.num_calls == self.fail_at_call:  # "short_log_probs"
            turn = out[self.bad_element]
            turn.set(keys.LOG_PROBS_RESPONSE, turn.get(keys.LOG_PROBS_RESPONSE)[:-1])
        return out


# ---------------------------------------------------------------------- weight-sync faults
class _DieAfterBroadcasts:
    """Wraps a process group: the process SIGKILLs itself when about to send broadcast number ``n + 1``."""

    def __init__(self, group: Any, num_broadcasts: int) -> None:
        self._group, self._left = group, num_broadcasts

    def broadcast(self, tensor: Any, root: int) -> Any:
        if self._left == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        self._left -= 1
        return self._group.broadcast(tensor, root)


class DyingSender:
    """A ProcessGroupSender in a process of its own (a Ray actor), which can die in the middle of a push."""

    def __init__(self, num_receivers: int, *, timeout_s: float, bucket_size_bytes: int) -> None:
        from lmcollect.transports.process_group import ProcessGroupConfig, ProcessGroupSender

        config = ProcessGroupConfig(num_receivers=num_receivers, timeout_s=timeout_s, bucket_size_bytes=bucket_size_bytes)
        self.sender = ProcessGroupSender(config)

    def connection_info(self) -> dict[str, Any]:
        return self.sender.connection_info()

    def connect(self) -> None:
        self.sender.connect()

    def send(self, weights: Any) -> int:
        """Push ``weights``; returns the number of buffers broadcast."""
        self.sender.send(weights)
        return len(self.sender._sent)

    def send_and_die(self, weights: Any, num_broadcasts: int) -> None:
        """Push ``weights`` but die after ``num_broadcasts`` of its buffers went out."""
        self.sender._group = _DieAfterBroadcasts(self.sender._group, num_broadcasts)
        self.sender.send(weights)


DIE_MID_PUSH_ENV = "LMCOLLECT_FAULT_DIE_MID_PUSH"
"""Names a file: while it exists, a vLLM worker with :class:`DyingReceiverExtension` dies in its next push."""


class DyingReceiverExtension(VLLMWeightReceiverExtension):
    """The lmcollect weight receiver of a vLLM worker, whose process SIGKILLs itself after taking the
    first buffer of a push when the file named by ``$LMCOLLECT_FAULT_DIE_MID_PUSH`` exists. The file
    is removed first, so the worker that comes back after a restart lives."""

    def receive_weights(self, timeout_s: float | None = None, verify: bool = False) -> dict[str, Any]:
        marker = os.environ.get(DIE_MID_PUSH_ENV)
        if marker and os.path.exists(marker) and self._lmcollect_receiver is not None:
            os.remove(marker)
            receiver = self._lmcollect_receiver
            receiver._group = _DieAfterBroadcasts(receiver._group, 1)
        return super().receive_weights(timeout_s, verify)
