"""The continuous collector: every dialog advances on its own against an engine, with bounded policy lag."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

import torch
from tensordict import TensorDictBase

from lmcollect.collectors.continuous.dialog_tasks import DialogTasks, EngineSide, Slot
from lmcollect.collectors.continuous.group_flow import GroupFlow
from lmcollect.collectors.continuous.state import ContinuousStateMixin
from lmcollect.collectors.continuous.turn_flow import TurnFlow
from lmcollect.collectors.shared.config import CollectionConfig, collection_config, takes_collection_config
from lmcollect.collectors.shared.group_filter import GroupTally, as_dynamic_sampling
from lmcollect.collectors.shared.shell import CollectorShell
from lmcollect.collectors.shared.trajectories import TrajectoryTracker, id_base, random_namespace
from lmcollect.collectors.shared.versioning import PolicyVersion, make_policy_version
from lmcollect.collectors.shared.weights import WeightReceiverMixin
from lmcollect.data.turns import stack_turns
from lmcollect.engines.kv_policy import KVPolicy, configure_kv_policy
from lmcollect.engines.protocol import EngineProtocol
from lmcollect.engines.sampling import SamplingConfig
from lmcollect.envs.registry import as_env
from lmcollect.plumbing import forwarded

logger = logging.getLogger(__name__)

DEFAULT_DIALOGS_IN_FLIGHT = 8


class ContinuousLLMCollector(CollectorShell, ContinuousStateMixin, WeightReceiverMixin):
    """Collects dialog turns with every dialog as its own task: no barrier between dialogs.

    Each env slot runs one dialog at a time on a background asyncio loop: build the turn's
    token-exact prompt, submit it to ``engine`` (an :class:`~lmcollect.engines.EngineProtocol`:
    continuous batching, so requests join and leave the running batch), await the result, step the
    env (``await env.astep(...)`` for an :class:`~lmcollect.envs.AsyncEnvProtocol` such as
    :class:`~lmcollect.envs.ChatEnv`, so a tool call waits without holding a thread; any other env
    in a thread pool), then the next turn. A slow response or tool call delays only its own dialog.
    Finished turns go into batches (or ``replay_buffer``) as they finish.

    Turns have exactly :class:`~lmcollect.collectors.LLMCollector`'s layout (same keys and ids),
    plus ``("collector", "token_versions")`` (int64, one per response token): the version index of
    the weights that generated each token. A push lands between two decoding steps, so a turn that
    spans it has tokens of two versions; ``policy_version`` is the version when the turn started
    (never newer than any of its tokens).

    Slots and envs: a slot runs one dialog at a time. ``env`` is a list of envs or a callable
    building one (called until there are ``max_dialogs_in_flight`` slots; the envs are then
    alike: call :meth:`set_seed` to give env ``i`` its own seed, as ``LLMCollector`` seeds its
    envs). An env of batch size 1 is one slot; a larger env must split into batch-1 elements
    (``split_elements()``, as :class:`~lmcollect.envs.ChatEnv` does), one slot each.

    GRPO groups across slots: with ``ChatEnv(repeats=k, batch_size=k)`` (any env that declares
    ``group_size > 1``) the ``k`` elements of a group answer the same prompt draws, each as its own
    dialog in its own slot, at its own pace, sharing ``("collector", "group_id")``. A group's turns
    leave together: a batch holds ``max(1, dialog_turns_per_batch // k)`` whole groups with every
    turn of their dialogs (so ``dialog_turns_per_batch`` counts dialogs: exactly that many turns for
    single-turn tasks), and the replay buffer gets only whole groups, so
    ``GroupAdvantage(group_size=k)`` (single-turn) or ``GroupAdvantage()`` (multi-turn) normalises
    every group. ``max_policy_lag`` then holds per group: a group admitted under version ``v`` leaves
    by version ``v + max_policy_lag`` (see :mod:`lmcollect.collectors.continuous.group_flow`);
    ``total_dialog_turns`` counts turns run, as everywhere: a group counts ``k`` when admitted and one
    per later turn, groups are admitted while that count is below it, then only to fill the last
    batch, and groups under way finish (the overshoot bound: "Turn budget" in docs/collectors.md);
    ``max_buffered_turns`` is divided by ``k`` into groups.
    At :meth:`shutdown` the turns of groups not complete go to :attr:`leftover_turns` (never to the
    buffer).

    Staleness and memory: with ``max_policy_lag=k`` a turn starts only while
    ``started < (k + v + 1) * dialog_turns_per_batch`` (AReaL's rule; ``v`` counts the versions
    since the collector began, at most one per batch consumed), and a batch leaves only when every
    turn left behind can still leave within ``k`` versions (see
    :mod:`lmcollect.collectors.continuous.turn_flow`). So, when the trainer pushes once per batch, no consumed
    turn is more than ``k`` versions behind the collector and nothing is discarded; iterating
    ``k + 1`` batches without a push raises an error saying so (``start()`` waits for the push).
    Turns started and not consumed never exceed ``max_buffered_turns`` (default: turns per batch
    plus slots; with ``max_policy_lag``, ``(k + 1)`` batches): a consumer that stops reading stops
    generation.

    Args:
        env: a list of batch-1 envs (one per slot) or a callable building one.
        engine: the inference engine (see :class:`~lmcollect.engines.EngineProtocol`), or a
            callable building it; yours to close (:meth:`shutdown` leaves it running).
        tokenizer: builds the prompts' token ids (the engine's tokenizer; chat template, decode).
        sampling: sampling settings of every request (default ``SamplingConfig()``).
        stop_token_ids: ids that end a response (default: the tokenizer's eos).
        dialog_turns_per_batch: turns per batch (exactly).
        total_dialog_turns: env dialog turns to run in the collector's life, as torchrl counts them
            (see :attr:`turns_counted`); -1 runs forever.
        yield_only_last_steps: yield only the last turn of completed trajectories.
        yield_completed_trajectories: yield only whole completed trajectories.
        postproc: applied to every batch before it is yielded or written.
        replay_buffer: write batches there; iteration then yields None.
        flatten_data: batches are always flat ``(N,)`` here (False is refused).
        weight_updater: a :class:`~lmcollect.weight_sync.WeightUpdaterBase` or a constructor.
        track_policy_version: True (int versions) or a :class:`PolicyVersion`.
        max_policy_lag: ``k``: no consumed turn is more than k versions behind (None: unbounded).
        max_dialogs_in_flight: env slots (dialogs run at once); default: the list's length, or 8.
        max_buffered_turns: turns started and not consumed beyond which no turn starts (default
            ``dialog_turns_per_batch + max_dialogs_in_flight``; with ``max_policy_lag=k``,
            ``(k + 1) * dialog_turns_per_batch``, or the smaller of the two when both are given).
        verbose: log progress at INFO level.
        kv_policy: what a push does to the keys/values the engine holds: ``"recompute"`` (the default,
            exact: every token after a push is the new weights' forward pass over its whole context,
            at the price of prefilling every running dialog again) or ``"keep"`` (running requests go
            on over their keys/values and a dialog reuses its own cached prefix; each token records in
            ``("collector", "kv_versions")`` the oldest version that computed its context). The engine
            takes it (``TransformersEngine``, ``VLLMEngine``, routers and Ray engines over them); one
            that cannot keep refuses ``"keep"``. :meth:`push_costs` says what each push cost.
        dynamic_sampling: with GRPO groups, drop the complete groups a filter rejects and admit
            others in their place (see :mod:`lmcollect.collectors.continuous.group_flow`); counts in
            :attr:`sampling_counts` and :attr:`last_batch_counts`.

    Example::

        collector = ContinuousLLMCollector(make_env, engine=engine, tokenizer=tokenizer,
                                           dialog_turns_per_batch=64, max_dialogs_in_flight=32,
                                           max_policy_lag=1, track_policy_version=True)
        for batch in collector:
            train_step(model, batch)
            collector.update_policy_weights_(model)   # lands between two decoding steps
    """

    @takes_collection_config
    def __init__(
        self,
        env: Any,
        *,
        engine: EngineProtocol | Callable[[], EngineProtocol],
        tokenizer: Any,
        sampling: SamplingConfig | None = None,
        stop_token_ids: Collection[int] | None = None,
        weight_updater: Any | None = None,
        max_policy_lag: int | None = None,
        max_dialogs_in_flight: int | None = None,
        max_buffered_turns: int | None = None,
        kv_policy: KVPolicy = "recompute",
        **collection: Any,
    ) -> None:
        if collection.get("flatten_data") is False:
            raise ValueError(
                "ContinuousLLMCollector batches are flat (N,) turns in finish order: dialogs do not advance in "
                "lockstep, so there is no (num_envs, T) shape. Leave flatten_data=None."
            )
        engine = _built_engine(engine)
        _check_limits(max_policy_lag, max_dialogs_in_flight, max_buffered_turns)
        self.kv_policy = configure_kv_policy(engine, kv_policy)
        config = collection_config("ContinuousLLMCollector", collection, flatten_data=True)
        self._init_shell(config, thread_name="lmcollect-continuous-writer")
        self.engine = engine
        self.policy = engine  # what the weight-receiving side resets and reports (get_policy_model)
        self.envs, slots = _build_slot_envs(env, max_dialogs_in_flight)
        self.group_size = _group_size(self.envs)
        self.max_policy_lag = max_policy_lag
        self._policy_version = _policy_version_for(engine, config.track_policy_version, max_policy_lag)
        self._tracker = TrajectoryTracker(len(slots), first_id=id_base(random_namespace()))
        self._flow = _flow(
            config, len(slots), self.group_size, max_policy_lag, max_buffered_turns, self.version_index()
        )
        stop_ids = list(stop_token_ids) if stop_token_ids is not None else [tokenizer.eos_token_id]
        side = EngineSide(
            engine=engine, tokenizer=tokenizer, sampling=sampling or SamplingConfig(), stop_token_ids=stop_ids
        )
        self._tasks = DialogTasks(
            slots,
            engine_side=side,
            flow=self._flow,
            tracker=self._tracker,
            version_fn=self._version,
        )
        self._init_output_state()
        self._init_weight_sync(weight_updater, on_loaded=self._wake_after_load)

    def _init_output_state(self) -> None:
        self._batches = 0
        self._unwritten = 0  # batches start()'s writer took and has not written yet
        self._written = threading.Condition()
        self.leftover_turns: TensorDictBase | None = None
        """After :meth:`shutdown` without a replay buffer: the finished turns no batch took."""

    # ------------------------------------------------------------------ properties
    @property
    def max_dialogs_in_flight(self) -> int:
        return len(self._tasks.slots)

    turns_run = forwarded("_tasks.turns_run", "Turns finished so far (including turns not yet yielded).")
    turns_yielded = forwarded("_flow.num_consumed", "Turns (batch rows) that left in batches so far.")
    turns_counted = forwarded(
        "_flow.num_counted",
        "Turns run for the rows that left so far (with ``yield_only_last_steps``, every turn of each "
        'trajectory): what ``total_dialog_turns`` counts (see "Turn budget" in docs/collectors.md).',
    )
    num_buffered_turns = forwarded(
        "_flow.num_buffered_turns",
        "Finished turns not yet yielded (trajectory modes: with the turns of dialogs under way).",
    )
    num_in_flight = forwarded("_flow.num_in_flight", "Turns started and not finished.")
    num_prefix_mismatches = forwarded(
        "_tasks.num_prefix_mismatches",
        "Turns whose prompt reused their dialog's recorded tokens where the chat template tokenizes the same "
        "conversation otherwise (each such turn has ``('collector', 'prefix_mismatch')`` True).",
    )
    num_failed_dialogs = forwarded(
        "_tasks.num_failed_dialogs",
        "Dialogs an env ended with :class:`~lmcollect.envs.DialogFailed`: dropped and logged, collection went on.",
    )

    def _sampling_tally(self) -> GroupTally | None:
        return self._flow.tally

    # ------------------------------------------------------------------ iteration
    def _finished(self) -> bool:
        """The turn budget is spent and no batch is left to take."""
        if self._shut_down:
            return True
        return self.total_dialog_turns != -1 and self._tasks.call(_exhausted(self._flow))

    @property
    def rollout(self) -> Callable[[], TensorDictBase | None]:
        """The function that collects one batch."""
        return lambda: self._collect_output(background=False)

    def next(self) -> TensorDictBase | None:
        """The next batch (None when a replay buffer is used: the batch went there)."""
        self._raise_if_unusable()
        batch = self._collect_output(background=False)
        if batch is None:
            raise StopIteration(
                f"the collector has run total_dialog_turns={self.total_dialog_turns} turns "
                f"({self.turns_run} run); build a new collector or raise total_dialog_turns."
            )
        if self.replay_buffer is not None:
            self.replay_buffer.extend(batch)
            return None
        return batch

    def _collect_output(self, *, background: bool) -> TensorDictBase | None:
        """The next batch after postproc (a postproc returning None holds a batch back: collect on)."""
        while True:
            batch = self._next_raw_batch(background=background)
            if batch is None:
                return None
            batch = self._postprocess(batch)
            if batch is not None:
                return batch

    def _next_raw_batch(self, *, background: bool, on_pop: Callable[[], None] | None = None) -> TensorDictBase | None:
        self._tasks.ensure_running()
        batch = self._tasks.call(self._tasks.next_batch(background=background, on_pop=on_pop))
        if batch is not None:
            self._batches += 1
            if self.verbose:
                logger.info("batch %d: %d turns run of %s", self._batches, self.turns_run, self.total_dialog_turns)
                if self._flow.tally is not None:
                    logger.info("batch %d: %s", self._batches, self._flow.tally.last_batch)
        return batch

    def _postprocess(self, batch: TensorDictBase) -> TensorDictBase | None:
        return self.postproc(batch) if self.postproc is not None else batch

    # ------------------------------------------------------------------ background writing
    def _run_in_background(self) -> None:
        while True:
            batch = self._next_raw_batch(background=True, on_pop=self._taking_batch)
            if batch is None:
                return
            try:
                batch = self._postprocess(batch)
                if batch is not None:
                    self._write_to_buffer(batch)
            finally:
                self._batch_written()

    def _taking_batch(self) -> None:
        with self._written:
            self._unwritten += 1

    def _batch_written(self) -> None:
        with self._written:
            self._unwritten = max(0, self._unwritten - 1)
            self._written.notify_all()

    def pause_begin(self, timeout_s: float = 600.0) -> None:
        """Stop admitting turns, wait for the turns under way, and for a batch being written."""
        self._tasks.call(self._tasks.pause(), timeout_s)
        with self._written:  # a batch taken before the pause is in the buffer when we return
            if not self._written.wait_for(lambda: self._unwritten == 0, timeout_s):
                raise TimeoutError(
                    f"the batch being written did not reach the replay buffer within timeout_s={timeout_s}."
                )
        self._raise_background_error()

    def pause_end(self) -> None:
        if not self._shut_down:
            self._tasks.call(self._tasks.resume())

    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Let the turns under way finish (up to ``timeout`` s), stop, and keep every finished turn.

        With a replay buffer the finished turns no batch took are written to it (after ``postproc``;
        in trajectory modes only whole trajectories); otherwise they are left in :attr:`leftover_turns`.
        No dialog is left half-written: a turn either finished (env stepped, turn kept) or never ran.
        Safe to call twice.
        """
        super().shutdown(timeout)

    def _stop_scheduler(self, timeout: float | None) -> None:
        self._tasks.call(self._tasks.stop(timeout))
        self._join_background(timeout)
        self._keep_leftovers(*self._tasks.call(_drain(self._flow)))
        self._tasks.close()

    def _keep_leftovers(self, turns: TensorDictBase | None, incomplete: TensorDictBase | None) -> None:
        """Finished turns no batch took: to the buffer (after postproc) or :attr:`leftover_turns`;
        turns of incomplete groups always to :attr:`leftover_turns` (the buffer gets whole groups)."""
        if turns is not None and self.replay_buffer is not None:
            batch = self._postprocess(turns)
            if batch is not None:
                self.replay_buffer.extend(batch)
            turns = None
        kept = [td for td in (turns, incomplete) if td is not None]
        if kept:
            self.leftover_turns = kept[0] if len(kept) == 1 else stack_turns([*kept[0].unbind(0), *kept[1].unbind(0)])

    # ------------------------------------------------------------------ weights
    def _wake_after_load(self) -> None:
        """After a load into the engine: the lag rule may admit turns under the new version."""
        if not self._shut_down:
            self._tasks.wake()

    # ------------------------------------------------------------------ attribute access
    def getattr_env(self, attr: str) -> Any:
        return [getattr(env, attr) for env in self.envs]

    def getattr_policy(self, attr: str) -> Any:
        return getattr(self.engine, attr)


async def _exhausted(flow: TurnFlow | GroupFlow) -> bool:
    return flow.exhausted()


async def _drain(flow: TurnFlow | GroupFlow) -> tuple[TensorDictBase | None, TensorDictBase | None]:
    return flow.drain(), flow.drain_incomplete()


def _flow(
    config: CollectionConfig,
    num_slots: int,
    group_size: int,
    max_policy_lag: int | None,
    max_buffered_turns: int | None,
    base_version: int,
) -> TurnFlow | GroupFlow:
    """The admission and release rules: per turn, or per GRPO group when the envs declare groups."""
    max_turns = None if config.total_dialog_turns == -1 else config.total_dialog_turns
    if group_size == 1:
        if config.dynamic_sampling is not None:
            raise ValueError(
                "dynamic_sampling filters whole GRPO groups, but the envs have none (group_size=1); build them "
                "with repeats, e.g. ChatEnv(..., repeats=4, batch_size=4), or drop dynamic_sampling."
            )
        return TurnFlow(
            mode=config.mode,
            num_slots=num_slots,
            turns_per_batch=config.dialog_turns_per_batch,
            capacity=_capacity(config.dialog_turns_per_batch, num_slots, max_policy_lag, max_buffered_turns),
            max_policy_lag=max_policy_lag,
            max_turns=max_turns,
            base_version=base_version,
        )
    if config.mode != "steps":
        raise ValueError(
            f"the envs have GRPO groups (group_size={group_size}): batches hold whole groups of whole dialogs "
            "already; drop yield_completed_trajectories / yield_only_last_steps."
        )
    per_batch = max(1, config.dialog_turns_per_batch // group_size)
    buffered = None if max_buffered_turns is None else max(1, max_buffered_turns // group_size)
    return GroupFlow(
        group_size=group_size,
        turns_per_batch=config.dialog_turns_per_batch,
        capacity=_capacity(per_batch, num_slots // group_size, max_policy_lag, buffered),
        max_policy_lag=max_policy_lag,
        max_turns=max_turns,
        base_version=base_version,
        sampling=as_dynamic_sampling(config.dynamic_sampling),  # typed: the config holds it normalised already
    )


def _capacity(per_batch: int, num_slots: int, max_policy_lag: int | None, max_buffered: int | None) -> int:
    """Units (turns, or groups) started and not consumed beyond which none starts."""
    if max_policy_lag is not None:
        lag_bound = (max_policy_lag + 1) * per_batch
        return lag_bound if max_buffered is None else min(lag_bound, max_buffered)
    return max_buffered if max_buffered is not None else per_batch + num_slots


def _check_optional_int(name: str, value: Any, *, minimum: int, hint: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
        raise ValueError(f"{name} must be an int >= {minimum} or None, got {value!r} ({hint}).")


def _build_slot_envs(env: Any, max_dialogs_in_flight: int | None) -> tuple[list[Any], list[Slot]]:
    """The envs (as given or built) and one slot per dialog run at once (an env's elements: a slot each)."""
    if isinstance(env, (list, tuple)):
        envs = [as_env(e) for e in env]
        slots = _slots_of(envs)
        if max_dialogs_in_flight is not None and max_dialogs_in_flight != len(slots):
            raise ValueError(
                f"max_dialogs_in_flight={max_dialogs_in_flight} but env lists {len(slots)} slots (one per env "
                "element); drop max_dialogs_in_flight or pass that many envs."
            )
    elif callable(env) and not hasattr(env, "batch_size"):
        wanted = max_dialogs_in_flight or DEFAULT_DIALOGS_IN_FLIGHT
        envs = [as_env(env)]
        size = _env_size(envs[0])
        if wanted % size:
            raise ValueError(
                f"the env has batch_size {size} (one slot per element) but max_dialogs_in_flight={wanted} is not "
                f"a multiple of it; pass max_dialogs_in_flight={size * max(1, round(wanted / size))}."
            )
        envs += [as_env(env) for _ in range(wanted // size - 1)]
        slots = _slots_of(envs)
    else:
        raise TypeError(
            "env must be a list of envs or a callable building one, got "
            f"{type(env).__name__}; each dialog runs on its own, so every slot needs its own env (or env element)."
        )
    if not envs:
        raise ValueError("env is an empty list; pass one env per slot.")
    return envs, slots


def _env_size(env: Any) -> int:
    return int(torch.Size(env.batch_size).numel())


def _slots_of(envs: list[Any]) -> list[Slot]:
    slots: list[Slot] = []
    for i, built in enumerate(envs):
        size = _env_size(built)
        if size == 1 and getattr(built, "group_size", 1) == 1:
            slots.append(Slot(built, parent=i))
            continue
        split = getattr(built, "split_elements", None)
        if split is None:
            raise ValueError(
                f"env {i} has batch_size {tuple(built.batch_size)}; each slot runs one dialog, so build envs with "
                "batch_size=1 (e.g. ChatEnv(..., batch_size=1)) and set max_dialogs_in_flight, or give the env "
                "split_elements() (batch-1 views of its elements), as ChatEnv has."
            )
        slots += [Slot(element, parent=i) for element in split()]
    return slots


def _group_size(envs: list[Any]) -> int:
    """Dialogs per GRPO group (1: no groups); every env must declare the same."""
    sizes = {int(getattr(env, "group_size", 1)) for env in envs}
    if len(sizes) > 1:
        raise ValueError(
            f"the envs declare different group sizes {sorted(sizes)}; build every env with the same repeats."
        )
    return sizes.pop()


def _built_engine(engine: EngineProtocol | Callable[[], EngineProtocol]) -> EngineProtocol:
    """The engine, built first when a factory was given (inside a Ray actor: no model travels)."""
    if not isinstance(engine, EngineProtocol) and callable(engine):
        engine = engine()
    if not isinstance(engine, EngineProtocol):
        raise TypeError(f"engine must implement lmcollect.engines.EngineProtocol, got {type(engine).__name__}.")
    return engine


def _policy_version_for(
    engine: EngineProtocol, track_policy_version: bool | PolicyVersion, max_policy_lag: int | None
) -> PolicyVersion | None:
    version = make_policy_version(track_policy_version, engine=engine)
    if max_policy_lag is not None and version is None:
        raise ValueError(
            "max_policy_lag counts policy versions: pass track_policy_version=True with it (or drop max_policy_lag)."
        )
    return version


def _check_limits(
    max_policy_lag: int | None, max_dialogs_in_flight: int | None, max_buffered_turns: int | None
) -> None:
    _check_optional_int("max_policy_lag", max_policy_lag, minimum=0, hint="e.g. max_policy_lag=1")
    _check_optional_int("max_dialogs_in_flight", max_dialogs_in_flight, minimum=1, hint="e.g. 16")
    _check_optional_int("max_buffered_turns", max_buffered_turns, minimum=1, hint="e.g. 2 * dialog_turns_per_batch")
