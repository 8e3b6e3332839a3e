"""One element of an AgentEnv as a batch-1 env: a run of the agent at a time, its calls as observations, its replies handed back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from lmcollect.agents.openai_format import CallReply, ChatRequest, RequestError, cut_at_stop, history_of, reply_key
from lmcollect.agents.runs import (
    AgentCall,
    AgentRun,
    DialogEndedError,
    Event,
    RunEnded,
    StreamCut,
    answer_call,
    refuse_call,
)
from lmcollect.agents.tool_parsers import ParsedReply
from lmcollect.data import keys
from lmcollect.data.history import History
from lmcollect.data.turns import non_tensor_values
from lmcollect.envs.protocol import DialogFailed
from lmcollect.envs.sampling import Draw

if TYPE_CHECKING:  # the parent imports this module to build its elements
    from lmcollect.agents.env import AgentEnv

logger = logging.getLogger(__name__)

# The keys below are of the env's step output; a collected turn holds them under "next" (like its
# reward): ``turn["next", *TOOL_PARSE_ERROR]``.
TOOL_PARSE_ERROR = ("agent", "tool_parse_error")
"""str: why the tool calls of this step's reply could not be read ("" if they could or there were none)."""
AGENT_ERROR = ("agent", "error")
"""str: the failure that ended the run at this step (``on_agent_error="keep"``), or how its client
left a streamed reply (the dialog ends there, truncated), else ""."""
AGENT_METADATA = ("agent", "metadata")
"""str: JSON of the metadata the agent returned (at its last step), else "{}"."""


class AgentEnvElement:
    """Element ``index`` of an :class:`AgentEnv` as a batch-1 env: one run at a time, one turn per call.

    Built by :meth:`AgentEnv.split_elements`. Implements :class:`~lmcollect.envs.AsyncEnvProtocol`
    (``astep`` awaits the agent's next call without holding a thread).
    """

    def __init__(self, parent: AgentEnv, index: int) -> None:
        self.parent = parent
        self.index = index
        self.batch_size = torch.Size([1])
        self._run: AgentRun | None = None
        self._draw: Draw | None = None
        self._call: AgentCall | None = None  # the call whose reply the collector generates now
        self._answered: AgentCall | None = None  # the call answered last (its client may have left its stream)
        self._request: ChatRequest | None = None
        self._last: TensorDictBase | None = None
        self._parse_error = ""  # of the reply handed out last (recorded in the step's output)

    # ------------------------------------------------------------------ protocol
    def reset(self, td: TensorDictBase | None = None) -> TensorDictBase:
        """A new run on this element's next row draw; returns its first call (blocks until it comes)."""
        self.end("the collector started a new dialog in its slot")
        draw = self.parent.draw_for(self.index)
        self._draw, self._run = draw, self.parent.start_run(self.index, draw)
        event = _wait(self._run.next_event(), self.parent.config.agent_timeout_s, self._run.dialog)
        if isinstance(event, AgentCall):
            return lazy_stack([self._take_call(event, reward=None)])
        assert isinstance(event, RunEnded), "a run's first event is a call or its end (no reply to cut yet)"
        self._fail(event, where="before its first model call")
        raise AssertionError("_fail raises")  # for the type checker

    def step(self, td: TensorDictBase) -> TensorDictBase:
        td.set("next", lazy_stack([self.step_turn(td[0])]))
        return td

    async def astep(self, td: TensorDictBase) -> TensorDictBase:
        td.set("next", lazy_stack([await self.astep_turn(td[0])]))
        return td

    def step_turn(self, turn: TensorDictBase) -> TensorDictBase:
        """The ``"next"`` of one turn (batch size ()): reply, then wait for the run's next event."""
        run = self._answer(turn)
        return self._next_of(_wait(run.next_event(), self.parent.config.agent_timeout_s, run.dialog), turn)

    async def astep_turn(self, turn: TensorDictBase) -> TensorDictBase:
        run = self._answer(turn)
        future = run.next_event()
        await asyncio.wait({asyncio.wrap_future(future)}, timeout=self.parent.config.agent_timeout_s)
        return self._next_of(_taken(future, self.parent.config.agent_timeout_s, run.dialog), turn)

    def last_output(self) -> TensorDictBase:
        """The element's latest output (batch size ()), for a batched reset that leaves it as it is."""
        if self._last is None:
            raise RuntimeError(f"element {self.index} of the AgentEnv has not started a run; reset it first.")
        return self._last

    def refuse_turn(self, error: ValueError) -> DialogFailed:
        """The collector refused the waiting call's turn before generating it (its ``max_tokens``
        below the collector's ``min_new_tokens``, a prompt longer than the model's context): the call
        gets HTTP 400 with ``error``, the run ends, and its dialog fails (dropped, collection goes on)."""
        run, call, draw = self._run, self._call, self._draw
        assert run is not None and draw is not None, "a turn comes from a run"
        self._call = None
        if call is not None:
            refuse_call(call, RequestError(f"this call was refused (nothing was recorded): {error}"))
        broken = self.parent.run_failed()
        self.end("its call was refused")
        message = f"{run.dialog}: call {run.num_calls - 1} was refused with HTTP 400: {error}"
        raise_it = broken or self.parent.config.on_agent_error == "raise"
        failure = DialogFailed(message, prompt_id=draw.prompt_id, raise_to_consumer=raise_it)
        failure.__cause__ = error
        return failure

    def end(self, reason: str) -> None:
        """End the run under way (its call waiting for a reply is refused with HTTP 409)."""
        run, call, self._call = self._run, self._call, None
        if call is not None and run is not None:
            refuse_call(call, DialogEndedError(f"{run.dialog} has ended ({reason}); this call was not recorded."))
        if run is not None and not run.ended:
            self.parent.end_run(run, reason)

    # ------------------------------------------------------------------ one step
    def _answer(self, turn: TensorDictBase) -> AgentRun:
        """Hand the turn's reply to the waiting call (parsing its tool calls); the run."""
        run, call, request = self._run, self._call, self._request
        if run is None or call is None or request is None:
            raise RuntimeError(f"element {self.index} of the AgentEnv has no call to answer; reset it first.")
        self._call, self._answered = None, call
        text = str(non_tensor_values(turn, keys.TEXT_RESPONSE)[0])
        content, stop = cut_at_stop(text, request.stop)
        num_tokens = turn.get(keys.TOKENS_RESPONSE).numel()
        budget = int(turn.get(keys.SAMPLING_MAX_NEW_TOKENS))
        reply = self._parse(content, run) if request.parse_tool_calls else ParsedReply(content=content)
        run.replies[reply_key(reply.content, reply.tool_calls)] = text
        self.parent.count(calls=1, tool_calls=len(reply.tool_calls), tool_parse_errors=int(bool(reply.error)))
        self._parse_error = reply.error
        answer = CallReply(
            reply=reply,
            finish_reason="stop" if stop is not None or num_tokens < budget else "length",
            stop=stop,
            prompt_tokens=turn.get(keys.TOKENS_PROMPT).numel(),
            completion_tokens=num_tokens,
        )
        answer_call(call, answer)
        return run

    def _parse(self, content: str, run: AgentRun) -> ParsedReply:
        number = run.num_calls
        try:
            reply = self.parent.parser.parse(content, call_id=lambda k: f"call_{run.key[:8]}_{number}_{k}")
        except Exception as exc:  # designed: a parser must not raise (ToolParser); one that does fails no dialog
            reply = ParsedReply(content=content, error=f"the tool parser raised {type(exc).__name__}: {exc}")
        if reply.error:
            logger.info("%s, call %d: malformed tool call returned as text: %s", run.dialog, number, reply.error)
        return reply

    def _next_of(self, event: Event, turn: TensorDictBase) -> TensorDictBase:
        """The step's ``"next"``: the run's next call, or its end."""
        run = self._run
        assert run is not None, "a step follows a reset"
        parse_error = self._parse_error
        cut = run.cut_reason(self._answered)
        if isinstance(event, StreamCut):
            return self._end_cut(event, turn, cut or event.reason, parse_error)
        if cut is not None:
            return self._end_cut(event, turn, cut, parse_error)
        if isinstance(event, AgentCall):
            if run.num_calls < self.parent.config.max_calls:
                previous = non_tensor_values(turn, keys.HISTORY_FULL)[0]
                return self._take_call(event, reward=run.take_reward(), parse_error=parse_error, previous=previous)
            return self._truncate(event, turn, parse_error)
        full = non_tensor_values(turn, keys.HISTORY_FULL)[0]
        if event.result is not None:
            self.parent.run_finished()
            self.end("the agent returned")
            metadata = event.result.metadata_text
            reward = run.take_reward() + event.result.reward
            return self._output(
                full, reward=reward, flags=(True, True, False), parse_error=parse_error, metadata=metadata
            )
        where = f"after its call {run.num_calls - 1}"
        if self.parent.config.on_agent_error != "keep" or isinstance(event.error, DialogEndedError):
            self._fail(event, where=where)
        if self.parent.run_failed():  # kept, but max_failures_in_a_row say the agent itself is broken
            self._fail(event, where=where, counted=True)
        error = f"{type(event.error).__name__}: {event.error}"
        logger.warning(
            "%s failed; its dialog ends at this turn with reward %s: %s",
            run.dialog,
            self.parent.config.failure_reward,
            error,
        )
        self.end("the agent failed")
        reward = run.take_reward() + self.parent.config.failure_reward
        return self._output(full, reward=reward, flags=(True, True, False), parse_error=parse_error, error=error)

    def _end_cut(self, event: Event, turn: TensorDictBase, reason: str, parse_error: str) -> TensorDictBase:
        """The client left the streamed reply of this turn: the dialog ends here, truncated, the reason
        recorded (whatever the run did next: a call it made is refused, its end is not used)."""
        run = self._run
        assert run is not None, "a step follows a reset"
        if isinstance(event, AgentCall):
            refuse_call(event, DialogEndedError(f"{run.dialog} has ended (its client left a streamed reply)."))
        self.parent.count(streams_cut=1)
        logger.info("%s: %s; its dialog ends at this turn, truncated", run.dialog, reason)
        self.end("its client left a streamed reply")
        full = non_tensor_values(turn, keys.HISTORY_FULL)[0]
        return self._output(
            full, reward=run.take_reward(), flags=(True, False, True), parse_error=parse_error, error=reason
        )

    def _truncate(self, call: AgentCall, turn: TensorDictBase, parse_error: str) -> TensorDictBase:
        run = self._run
        assert run is not None, "a step follows a reset"
        limit = self.parent.config.max_calls
        refuse_call(call, DialogEndedError(f"{run.dialog} reached max_calls={limit}; this call was not recorded."))
        self.parent.count(runs_truncated=1)
        self.end(f"it reached max_calls={limit}")
        full = non_tensor_values(turn, keys.HISTORY_FULL)[0]
        return self._output(full, reward=run.take_reward(), flags=(True, False, True), parse_error=parse_error)

    def _take_call(
        self, call: AgentCall, *, reward: float | None, parse_error: str = "", previous: History | None = None
    ) -> TensorDictBase:
        """The observation of a call: its conversation, ids and what it asks of the sampling.

        ``previous`` is the conversation of the run's previous turn, reply included: a call that does
        not extend it (the agent rewrote earlier messages) is rendered whole by the chat template,
        counted in ``stats.calls_rewritten`` and logged (its prompt does not start with the recorded tokens).
        """
        run = self._run
        assert run is not None, "a call comes from a run"
        self._call, self._request = call, call.request
        run.num_calls += 1
        history = history_of(call.request, run.replies, self.parent.parser)
        if previous is not None and history.messages[: len(previous.messages)] != previous.messages:
            self.parent.count(calls_rewritten=1)
            logger.info(
                "%s, call %d: the conversation does not extend the previous call's (earlier messages were "
                "rewritten): rendered whole, counted in stats.calls_rewritten",
                run.dialog,
                run.num_calls - 1,
            )
        overrides = call.request.sampling_overrides(agent_sampling=self.parent.config.agent_sampling)
        return self._output(
            history, reward=reward, flags=(False, False, False), parse_error=parse_error, overrides=overrides
        )

    def _fail(self, event: RunEnded, *, where: str, counted: bool = False) -> None:
        """Raise the run's failure as a :class:`DialogFailed`: dropped by the collector, or raised to the
        consumer (``on_agent_error="raise"``, or ``max_failures_in_a_row`` failures in a row)."""
        run, draw = self._run, self._draw
        assert run is not None and draw is not None, "a failure comes from a run"
        cause = event.error if event.error is not None else RuntimeError("the agent returned without calling the model")
        if isinstance(cause, DialogEndedError):  # the env ended the run itself (closing): no failure of the agent's
            raise DialogFailed(f"{run.dialog} was ended: {cause}", prompt_id=draw.prompt_id) from cause
        broken = self.parent.stats.failures_in_a_row >= self.parent.config.max_failures_in_a_row
        if not counted:
            broken = self.parent.run_failed()
        self.end("the agent failed")
        message = f"{run.dialog} failed {where}: {type(cause).__name__}: {cause}"
        if event.result is not None:
            message = f"{run.dialog} returned without calling the model: nothing to record"
        if broken:
            message += (
                f" ({self.parent.config.max_failures_in_a_row} runs failed in a row, none returned a reward: "
                "is the agent itself broken? see AgentEnvConfig.max_failures_in_a_row)"
            )
        raise_it = broken or self.parent.config.on_agent_error == "raise"
        raise DialogFailed(message, prompt_id=draw.prompt_id, raise_to_consumer=raise_it) from cause

    def _output(
        self,
        history: History,
        *,
        reward: float | None,
        flags: tuple[bool, bool, bool],
        parse_error: str = "",
        error: str = "",
        metadata: str = "{}",
        overrides: dict[str, Any] | None = None,
    ) -> TensorDictBase:
        """One output (batch size ()): ChatEnv's keys, the agent's records and the next call's sampling."""
        draw = self._draw
        assert draw is not None, "an output follows a draw"
        entries: dict[str, Any] = {
            "history": {"prompt": history},
            keys.DONE: torch.tensor([flags[0]]),
            keys.TERMINATED: torch.tensor([flags[1]]),
            keys.TRUNCATED: torch.tensor([flags[2]]),
            "env": {"prompt_id": torch.tensor(draw.prompt_id), "sample_index": torch.tensor(draw.sample_index)},
            "agent": {"tool_parse_error": parse_error, "error": error, "metadata": metadata},
            "sampling": {"overrides": json.dumps(overrides or {})},
        }
        if reward is not None:
            entries[keys.REWARD] = torch.tensor([reward], dtype=torch.float32)
        self._last = TensorDict(entries, batch_size=[])
        return self._last


def _wait(future: concurrent.futures.Future, timeout_s: float, dialog: str) -> Event:
    """The run's next event, or its failure after ``timeout_s`` (blocking: a reset runs in a thread)."""
    concurrent.futures.wait([future], timeout_s)
    return _taken(future, timeout_s, dialog)


def _taken(future: concurrent.futures.Future, timeout_s: float, dialog: str) -> Event:
    """The event of ``future`` if it came, else the run's failure after ``timeout_s``. Cancelling
    makes the run queue a later event instead; an event that came between the wait's end and the
    cancel is taken (never lost: its call would wait for a reply forever)."""
    if future.cancel():
        return RunEnded(error=_timeout(dialog, timeout_s))
    return future.result()


def _timeout(dialog: str, timeout_s: float) -> TimeoutError:
    return TimeoutError(
        f"{dialog} made no model call and returned nothing for agent_timeout_s={timeout_s} s; raise "
        "AgentEnvConfig.agent_timeout_s if its tools are that slow."
    )
