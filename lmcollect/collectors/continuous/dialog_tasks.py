"""Every dialog as its own asyncio task on a background loop: admit, generate, step the env, record.

:class:`DialogTasks` owns one task per env slot. A slot's task loops: wait for admission
(:class:`~lmcollect.collectors.continuous.turn_flow.TurnFlow`), start a dialog if it has none, build the turn's
token-exact prompt, submit it to the engine and await the result, step the env (awaited with
``astep``, else in a thread pool), stamp the turn's ids and hand it to the flow. No slot waits for
another. All bookkeeping happens on the loop's thread; other threads reach it through :meth:`call`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from lmcollect.collectors.continuous.engine_turns import prompt_of, request_of, sampling_of, turn_from_result
from lmcollect.collectors.continuous.group_flow import GroupFlow
from lmcollect.collectors.continuous.turn_flow import TurnFlow
from lmcollect.collectors.shared.batcher import CollectedTurn
from lmcollect.collectors.shared.trajectories import TrajectoryTracker
from lmcollect.collectors.shared.turn_record import VersionFn, check_turn, env_next, next_observation, record_turn
from lmcollect.data import keys
from lmcollect.engines.protocol import EngineProtocol, EngineResult, PromptTooLongError
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.envs.protocol import AsyncEnvProtocol, DialogFailed, RefusesTurns
from lmcollect.plumbing import LoopThread, forwarded

logger = logging.getLogger(__name__)

T = TypeVar("T")
_RECHECK_S = 0.1  # a waiting consumer re-reads the version this often (a push does not notify the loop)


@dataclass
class Slot:
    """One env slot: a batch-1 env and the observation of its dialog under way (None: none).

    ``parent`` is the index of the env the slot's env is an element of (its own index when the
    slot holds a whole env): group ids are unique per parent env. ``fresh``: the dialog was reset
    and has run no turn yet (with groups, a slot resets before its group is admitted).
    """

    env: Any
    parent: int = 0
    obs: TensorDictBase | None = None
    was_reset: bool = False
    fresh: bool = False
    kv_floor: int | None = None
    """The oldest weight version that computed a key/value of this dialog's turns so far (None: no
    turn yet): a later turn's prompt may reuse those keys/values under ``kv_policy="keep"``."""


@dataclass(kw_only=True)
class EngineSide:
    """How turns are generated: the engine, the tokenizer that builds prompts, sampling and stop ids."""

    engine: EngineProtocol
    tokenizer: Any
    sampling: SamplingConfig
    stop_token_ids: Collection[int]


class DialogTasks:
    """One asyncio task per env slot, admission and release through a :class:`TurnFlow`."""

    def __init__(
        self,
        slots: list[Slot],
        *,
        engine_side: EngineSide,
        flow: TurnFlow | GroupFlow,
        tracker: TrajectoryTracker,
        version_fn: VersionFn,
    ) -> None:
        self.slots = slots
        self.num_parents = 1 + max(slot.parent for slot in slots)
        self.engine_side = engine_side
        self.flow = flow
        self.grouped = isinstance(flow, GroupFlow)
        self.tracker = tracker
        self.version_fn = version_fn
        self.turns_run = 0
        self.num_prefix_mismatches = 0
        """Turns whose prompt reused recorded tokens that the chat template tokenizes otherwise."""
        self.num_failed_dialogs = 0
        """Dialogs an env ended with :class:`~lmcollect.envs.DialogFailed` (dropped, collection went on)."""
        self._runner = LoopThread("lmcollect-dialogs")
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="lmcollect-env")
        self._cond = self.call(_make_condition())
        self._tasks: list[asyncio.Task] = []
        self._paused = False
        self._stopping = False
        self._resetting = 0  # grouped: slots resetting their env outside a turn
        self._errors: list[BaseException] = []

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self._runner.call(coro, timeout_s)

    # ------------------------------------------------------------------ control (any thread)
    def ensure_running(self) -> None:
        """Start the slots' tasks (once)."""
        if not self._tasks:
            self.call(self._start_tasks())

    async def _start_tasks(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._run_slot(i), name=f"dialog-slot-{i}") for i in range(len(self.slots))
            ]

    async def next_batch(self, *, background: bool, on_pop: Callable[[], None] | None = None) -> TensorDictBase | None:
        """The next batch once one may leave; None when the turn budget is spent (or on shutdown).

        ``background`` (start()'s writer): wait through pauses and for pushes. Otherwise (the
        iterating caller) a pause or a stall waiting for a push raises, since no batch would come.
        ``on_pop`` runs on the loop as the batch leaves (before any pause can complete).
        """
        async with self._cond:
            while True:
                self._raise_error()
                if self._paused and not background:
                    raise RuntimeError(
                        "next() was called inside collector.pause(): no turn starts while paused, so no batch "
                        "would come; iterate after the pause ends."
                    )
                if not self._paused:
                    index = self.version_fn()[1]
                    if self.flow.ready(index):
                        batch = self.flow.pop(index)
                        if on_pop is not None:
                            on_pop()
                        self._cond.notify_all()
                        return batch
                    if self.flow.exhausted():
                        return None
                    if not background and self.flow.stalled(index):
                        raise RuntimeError(_STALLED.format(k=self.flow.max_policy_lag, v=index))
                if self._stopping:
                    return None
                await _wait(self._cond, _RECHECK_S)
                self._cond.notify_all()  # the version may have moved: slots re-check admission too

    def wake(self) -> None:
        """Have the slots re-check admission (after a push changed the version); returns at once."""
        asyncio.run_coroutine_threadsafe(self._notify(), self._runner.loop)

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def pause(self) -> None:
        """Admit no turn; return once every turn under way has finished (and is kept)."""
        async with self._cond:
            self._paused = True
            self._cond.notify_all()
            await self._cond.wait_for(lambda: self.flow.num_in_flight == 0 and self._resetting == 0)

    async def resume(self) -> None:
        async with self._cond:
            self._paused = False
            self._cond.notify_all()

    async def stop(self, timeout_s: float | None) -> None:
        """Let the turns under way finish (up to ``timeout_s``), then end every slot's task."""
        await self._drain(timeout_s)
        async with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _drain(self, timeout_s: float | None) -> None:
        try:
            await asyncio.wait_for(self.pause(), timeout_s)
        except TimeoutError:
            logger.warning(
                "shutdown: %d turns were still generating after %s s; they are dropped (their dialogs are not advanced).",
                self.flow.num_in_flight,
                timeout_s,
            )

    def close(self) -> None:
        self._runner.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    paused = forwarded("_paused", "Whether admission is paused (from :meth:`pause` until :meth:`resume`).")

    @property
    def started(self) -> bool:
        """Whether the slots' tasks were started (collection began)."""
        return bool(self._tasks)

    def _raise_error(self) -> None:
        if self._errors:
            error = self._errors.pop(0)
            self._cond.notify_all()  # admission resumes once every error has been raised
            raise error

    # ------------------------------------------------------------------ one slot
    async def _run_slot(self, i: int) -> None:
        slot = self.slots[i]
        while True:
            if self.grouped and slot.obs is None and not await self._open_dialog(i, slot):
                return
            async with self._cond:
                # read the slot each time: set_seed / load_state_dict may change its dialog while it waits
                await self._cond.wait_for(lambda: self._stopping or self._may_start(i, slot))
                if self._stopping:
                    return
                if self.grouped and slot.obs is None:
                    continue  # reset / set_seed cut the dialog it was about to start
                new_dialog = slot.obs is None or slot.fresh
                version, index = self.version_fn()
                self.flow.start_turn(index, new_dialog=new_dialog, group=self._group_of(i, slot))
                slot.fresh = False
            try:
                turn = await self._run_turn(i, slot, version, index)
            except Exception as exc:  # designed: this dialog is dropped; the consumer's next() raises it
                async with self._cond:
                    self.flow.abandon_turn(index, end_dialog=True)
                    self._drop_dialog(i, slot, index)
                    self._report(i, exc, "in dialog slot")
                continue
            async with self._cond:
                self.flow.finish_turn(index, turn)
                self.turns_run += 1
                self._cond.notify_all()

    async def _open_dialog(self, i: int, slot: Slot) -> bool:
        """Grouped: reset the slot's env now, so its group is known before admission (False: stopping)."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._stopping or not (self._paused or self._errors))
            if self._stopping:
                return False
            self._resetting += 1
        try:
            obs = await self._new_dialog(i, slot, self.version_fn()[1])
        except Exception as exc:  # designed: the consumer's next() raises it; the slot tries again
            async with self._cond:
                self._resetting -= 1
                prompt_id = exc.prompt_id if isinstance(exc, DialogFailed) else None
                if prompt_id is not None:  # its group will wait for one dialog fewer
                    self.flow.assign(i, self.tracker.group_id(slot.parent, self.num_parents, prompt_id))
                    self.flow.drop_dialog(i)
                self._report(i, exc, "resetting dialog slot")
            return True
        async with self._cond:
            self._resetting -= 1
            slot.obs, slot.fresh = obs, True
            group = self._group_of(i, slot)
            assert group is not None  # grouped, with an observation
            self.flow.assign(i, group)
            self._cond.notify_all()
        return True

    def _report(self, i: int, exc: Exception, where: str) -> None:
        """A dialog's error (under the lock): a :class:`DialogFailed` is logged and counted, any other
        error (or one to raise) raised by the consumer's next ``next()`` (admission waits until it is)."""
        if isinstance(exc, DialogFailed):
            self.num_failed_dialogs += 1
        if isinstance(exc, DialogFailed) and not exc.raise_to_consumer:
            logger.warning("dialog slot %d: the dialog failed and was dropped: %s", i, exc)
        else:
            exc.add_note(f"raised {where} {i} (env index {i}) of a ContinuousLLMCollector")
            self._errors.append(exc)
        self._cond.notify_all()

    def _group_of(self, i: int, slot: Slot) -> int | None:
        """The collector-wide group id of the slot's dialog (grouped envs only)."""
        if not self.grouped or slot.obs is None:
            return None
        prompt_id = slot.obs.get(keys.ENV_PROMPT_ID, None)
        if prompt_id is None:
            raise ValueError(
                f"slot {i}'s env declares groups (group_size > 1) but its reset() output has no "
                f"{keys.ENV_PROMPT_ID}; write the prompt draw's id there (dialogs of one draw share it)."
            )
        return self.tracker.group_id(slot.parent, self.num_parents, int(prompt_id))

    def _may_start(self, i: int, slot: Slot) -> bool:
        if self._paused or self._errors:
            return False
        if self.grouped and slot.obs is None:
            return True  # cut while waiting: go back and reset
        return self.flow.may_start(
            new_dialog=slot.obs is None or slot.fresh,
            version_index=self.version_fn()[1],
            group=self._group_of(i, slot),
        )

    def _drop_dialog(self, i: int, slot: Slot, index: int) -> None:
        dropped = self.flow.drop_dialog(i)
        if dropped:
            logger.info("slot %d: dropped %d turns of a trajectory that failed", i, dropped)
        slot.obs, slot.fresh = None, False
        self.tracker.end(i, index)

    async def _run_turn(self, i: int, slot: Slot, version: int | str, index: int) -> CollectedTurn:
        if slot.obs is None:
            slot.obs = await self._new_dialog(i, slot, index)
        obs, side = slot.obs, self.engine_side
        traj_id = self.tracker.traj_id(i)
        prompt = prompt_of(obs, side.tokenizer, side.stop_token_ids)
        try:
            sampling = sampling_of(obs, side.sampling)
            request = request_of(
                prompt,
                sampling=sampling,
                stop_token_ids=side.stop_token_ids,
                request_id=str(traj_id),
                affinity=str(traj_id),
                context_kv_version=slot.kv_floor,
            )
            submitted = side.engine.submit(request)
        except ValueError as exc:  # designed: the turn's sampling or prompt was refused before generation
            raise _refused_turn(slot.env, exc, i, traj_id)  # noqa: B904 - the ValueError is its cause or itself
        try:
            result = await asyncio.wrap_future(submitted)
        except PromptTooLongError as exc:  # refused by an engine elsewhere (a Ray actor's own submit)
            raise _refused_turn(slot.env, exc, i, traj_id)  # noqa: B904 - the error is its cause or itself
        slot.kv_floor = _kv_floor(slot.kv_floor, result)
        turn = turn_from_result(obs, prompt, result, tokenizer=side.tokenizer, sampling=sampling)
        check_turn(turn, i, side.engine)
        if prompt.prefix_mismatch:
            self._count_prefix_mismatch(i)
        nxt = await self._step_env(i, slot.env, turn)
        done = bool(nxt.get(keys.DONE).any())
        collected = record_turn(
            self.tracker,
            turn,
            slot=i,
            version=version,
            version_index=index,
            done=done,
            env_number=slot.parent,
            num_envs=self.num_parents,
        )
        slot.obs = None if done else next_observation(turn, nxt, slot.env)
        return collected

    def _count_prefix_mismatch(self, i: int) -> None:
        self.num_prefix_mismatches += 1
        if self.num_prefix_mismatches == 1:
            logger.info(
                "slot %d: a prompt reused its dialog's recorded tokens, which the chat template tokenizes "
                "otherwise; the turn keeps the recorded ones (%s, counted in num_prefix_mismatches).",
                i,
                keys.PREFIX_MISMATCH,
            )

    async def _new_dialog(self, i: int, slot: Slot, index: int) -> TensorDictBase:
        if slot.was_reset:
            mask = TensorDict({keys.RESET: torch.ones(1, 1, dtype=torch.bool)}, batch_size=[1])
            fresh = await self._in_thread(slot.env.reset, mask)
        else:
            fresh = await self._in_thread(slot.env.reset)
        slot.was_reset = True
        slot.kv_floor = None
        self.tracker.end(i, index)
        return fresh.unbind(0)[0]

    async def _step_env(self, i: int, env: Any, turn: TensorDictBase) -> TensorDictBase:
        td = lazy_stack([turn])
        stepped = await env.astep(td) if isinstance(env, AsyncEnvProtocol) else await self._in_thread(env.step, td)
        nxt = env_next(stepped, env, i, 1)[0]
        turn.set("next", nxt)
        return nxt

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


_STALLED = (
    "max_policy_lag={k}: the batches already taken are the last ones version {v} may produce, and no "
    "turn is running. Push new weights (collector.update_policy_weights_(...)) before the next batch, "
    "raise max_policy_lag, or pass max_policy_lag=None for no lag bound."
)


def _refused_turn(env: Any, error: ValueError, slot: int, traj_id: int) -> Exception:
    """The error of a turn refused before generation: the env's own :class:`DialogFailed` when it
    answers a waiting party (an agent's call gets HTTP 400), else ``error`` naming the dialog."""
    if isinstance(env, RefusesTurns):
        return env.refuse_turn(error)
    error.add_note(f"the turn of dialog slot {slot} (trajectory {traj_id}) was refused before generation")
    return error


def _kv_floor(floor: int | None, result: EngineResult) -> int | None:
    """The dialog's oldest key/value version after a turn with ``result`` (its tokens' keys/values join the context)."""
    versions = result.kv_versions if result.kv_versions is not None else result.token_versions
    if versions.numel() == 0:
        return floor
    oldest = int(versions.min())
    return oldest if floor is None else min(floor, oldest)


async def _make_condition() -> asyncio.Condition:
    return asyncio.Condition()  # bound to the loop it is created on


async def _wait(cond: asyncio.Condition, timeout_s: float) -> None:
    """``cond.wait()`` for at most ``timeout_s`` (the lock is held again either way)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(cond.wait(), timeout_s)
