"""The local LLM collector: runs chat envs against a policy and yields batches of dialog turns."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase

from lmcollect.collectors.lockstep.env_runner import EnvRunner
from lmcollect.collectors.lockstep.group_gate import lockstep_gate
from lmcollect.collectors.lockstep.runners import AsyncRunners, SyncRunners
from lmcollect.collectors.lockstep.rwlock import ReadWriteLock
from lmcollect.collectors.shared.batcher import Batcher
from lmcollect.collectors.shared.config import collection_config, takes_collection_config
from lmcollect.collectors.shared.group_filter import (
    GroupTally,
    as_dynamic_sampling,
    missing_filter_state,
)
from lmcollect.collectors.shared.shell import CollectorShell
from lmcollect.collectors.shared.state_checks import (
    check_counts,
    check_env_states,
    check_observations,
    check_parts,
    check_rng,
    check_state_mapping,
    push_version_of,
    state_of,
)
from lmcollect.collectors.shared.trajectories import TrajectoryTracker, id_base, random_namespace
from lmcollect.collectors.shared.versioning import make_policy_version
from lmcollect.collectors.shared.weights import WeightReceiverMixin
from lmcollect.engines.protocol import engine_of
from lmcollect.envs.registry import as_env
from lmcollect.weight_sync.loader import LoadOptions
from lmcollect.weights.version import PushVersion

logger = logging.getLogger(__name__)

Policy = Callable[[TensorDictBase], TensorDictBase]


class LLMCollector(CollectorShell, WeightReceiverMixin):
    """Collects dialog turns from chat envs with an LLM policy, in this process.

    Iterate over it for batches (a lazy-stacked TensorDict per batch; see ``lmcollect.data.keys``
    for the layout), or give it a ``replay_buffer`` and call :meth:`start` to fill it from a
    background thread. Arguments follow torchrl's ``LLMCollector``:

    Args:
        env: an env (see :class:`lmcollect.envs.EnvProtocol`) or a callable that builds one. With
            ``async_envs=True``: an :class:`~lmcollect.envs.AsyncEnvPool` or a list of envs /
            constructors, each stepped in its own thread.
        policy: a callable ``td -> td`` (see :class:`lmcollect.policies.PolicyProtocol`).
        policy_factory: a callable building the policy (exclusive with ``policy``).
        dialog_turns_per_batch: turns per batch (at least; exactly with ``yield_only_last_steps``).
        total_dialog_turns: env dialog turns to run in the collector's life, in whole batches (see
            :attr:`turns_counted`; as torchrl counts them, with ``yield_only_last_steps`` the
            intermediate turns left out count too); -1 runs forever.
        yield_only_last_steps: yield only the last turn of completed trajectories.
        yield_completed_trajectories: yield only whole completed trajectories.
        postproc: applied to every batch before it is yielded or written.
        async_envs: step several envs concurrently, one thread each.
        replay_buffer: write batches there; iteration then yields None.
        reset_at_each_iter: start new dialogs at the beginning of every batch.
        flatten_data: return batches flat ``(N,)`` instead of ``(num_envs, T)``.
        weight_updater: a :class:`~lmcollect.weight_sync.WeightUpdaterBase` or a constructor.
        track_policy_version: True (int versions) or a :class:`PolicyVersion`.
        verbose: log progress at INFO level.
        dynamic_sampling: with grouped envs (``repeats=k``), batches of ``dialog_turns_per_batch // k``
            whole groups that a filter kept, flat (see :mod:`lmcollect.collectors.lockstep.group_gate`).
    """

    @takes_collection_config
    def __init__(
        self,
        env: Any,
        *,
        policy: Policy | None = None,
        policy_factory: Callable[[], Policy] | None = None,
        async_envs: bool | None = None,
        reset_at_each_iter: bool = False,
        weight_updater: Any | None = None,
        **collection: Any,
    ) -> None:
        flat = {"flatten_data": True} if collection.get("dynamic_sampling") is not None else {}  # whole groups
        self._init_shell(collection_config("LLMCollector", collection, **flat), thread_name="lmcollect-collector")
        self.policy = _build_policy(policy, policy_factory)
        self.envs = _build_envs(env, bool(async_envs))
        self.env = self.envs[0] if len(self.envs) == 1 and not async_envs else env
        self.reset_at_each_iter = reset_at_each_iter
        self._policy_version = make_policy_version(self.config.track_policy_version, engine=engine_of(self.policy))
        self._policy_lock = ReadWriteLock(knob="collector.weight_lock_timeout_s")
        self._runners, num_slots = self._build_runners(bool(async_envs))
        self._batcher = Batcher(
            mode=self.config.mode,
            num_slots=num_slots,
            turns_per_batch=self.config.dialog_turns_per_batch,
            flatten=self.config.flatten,
        )
        # with dynamic sampling, turns go to the gate instead of the batcher: batches of whole kept groups
        self._gate = lockstep_gate(
            as_dynamic_sampling(self.config.dynamic_sampling),  # typed: the config holds it normalised already
            group_size=_group_size(self.envs),
            turns_per_batch=self.config.dialog_turns_per_batch,
            mode=self.config.mode,
            flatten_data=collection.get("flatten_data"),
        )
        self._turns_run = 0
        self._turns_yielded = 0
        self._turns_counted = 0
        self._batches = 0
        self._lock = threading.RLock()  # one batch at a time (iterator vs start() thread)
        self._stop = threading.Event()
        self._pause_requested = threading.Event()
        self._paused = threading.Event()
        self._init_weight_sync(weight_updater, hold=self._policy_lock.write)

    # ------------------------------------------------------------------ construction
    def _build_runners(self, async_envs: bool) -> tuple[SyncRunners | AsyncRunners, int]:
        sizes = [int(torch.Size(env.batch_size).numel()) for env in self.envs]
        # ids of this collector's trajectories and groups: a random block until worker_idx is set
        self._tracker = TrajectoryTracker(sum(sizes), first_id=id_base(random_namespace()))
        self._steps_taken = [0] * len(self.envs)  # steps of each env whose turns reached the batcher
        runners, offset = [], 0
        for number, (env, size) in enumerate(zip(self.envs, sizes, strict=True)):
            runners.append(
                EnvRunner(
                    env,
                    self.policy,
                    tracker=self._tracker,
                    version_fn=self._version,
                    policy_lock=self._policy_lock,
                    slot_offset=offset,
                    env_number=number,
                    num_env_runners=len(self.envs),
                )
            )
            offset += size
        self._runner_of_slot = [n for n, size in enumerate(sizes) for _ in range(size)]
        group = AsyncRunners(runners, may_step=self._may_step) if async_envs else SyncRunners(runners)
        return group, offset

    # ------------------------------------------------------------------ properties
    @property
    def turns_run(self) -> int:
        """Dialog turns run so far (including turns not yet yielded)."""
        return self._turns_run

    @property
    def weight_lock_timeout_s(self) -> float:
        """Longest a weight load waits for the policy calls under way, or a policy call for a load
        (default 600 s); past it a :class:`~lmcollect.collectors.lockstep.rwlock.LockTimeoutError` names this knob."""
        return self._policy_lock.timeout_s

    @weight_lock_timeout_s.setter
    def weight_lock_timeout_s(self, value: float) -> None:
        if not value > 0:
            raise ValueError(f"weight_lock_timeout_s must be positive, got {value!r}.")
        self._policy_lock.timeout_s = float(value)

    @property
    def turns_yielded(self) -> int:
        """Turns (batch rows) yielded or written to the replay buffer so far."""
        return self._turns_yielded

    @property
    def turns_counted(self) -> int:
        """Turns run for the batches yielded (or written) so far: what ``total_dialog_turns`` counts.

        Their rows, and with ``yield_only_last_steps`` every turn of each yielded trajectory (its
        intermediate turns ran and were left out), as torchrl counts. A finite collector yields
        whole batches until this reaches ``total_dialog_turns``: in steps mode exactly
        ``ceil(total / B) * B`` turns (``B`` the turns of one batch), with
        ``yield_completed_trajectories`` at least ``total`` (the last batch takes every trajectory
        completed by then), and with ``yield_only_last_steps`` full batches of last steps until
        their trajectories' turns reach ``total``. Only turns of dialogs under way at the end (and
        in last-steps mode completed trajectories no batch took) stay in the collector
        (:attr:`num_buffered_turns`; kept by :meth:`state_dict`).
        """
        return self._turns_counted

    @property
    def num_buffered_turns(self) -> int:
        """Turns run and not yet counted (carried to the next batches): ``turns_run - turns_counted``
        less the turns ``reset()`` dropped. With ``yield_only_last_steps`` they include the
        intermediate turns of the completed trajectories waiting for a batch; with dynamic sampling,
        the turns of the groups its gate holds."""
        held = 0 if self._gate is None else self._gate.num_buffered_turns
        return self._batcher.num_uncounted_turns + held

    def _sampling_tally(self) -> GroupTally | None:
        return None if self._gate is None else self._gate.tally

    @property
    def rollout(self) -> Callable[[], TensorDictBase]:
        """The function that collects one batch."""
        return self._collect_batch

    # ------------------------------------------------------------------ collection
    def _finished(self) -> bool:
        return self.total_dialog_turns != -1 and self._turns_counted >= self.total_dialog_turns

    def _budget_left(self) -> int | None:
        """Turns still to count (None: endless)."""
        return None if self.total_dialog_turns == -1 else self.total_dialog_turns - self._turns_counted

    def _may_step(self, index: int, steps_started: int) -> bool:
        """Whether env ``index`` (async_envs) may start a step: only for turns a batch will take."""
        budget = self._budget_left()
        if self.config.mode != "steps":  # trajectory modes: until the completed trajectories cover the budget
            # a finite collector also waits until the batcher has this env's last step: it sees every turn run
            return budget is None or (steps_started == self._steps_taken[index] and not self._batcher.covers(budget))
        runner = self._runners.runners[index]
        pending = self._batcher.num_pending_steps(runner.slot_offset) + steps_started - self._steps_taken[index]
        per_slot = self._batcher.steps_per_slot
        if pending >= _RUN_AHEAD_BATCHES * per_slot:
            return False  # the batch under way and the next one are covered: wait for the slow envs
        if budget is None:
            return True
        batch_rows = self._batcher.batch_rows
        assert batch_rows is not None, "steps mode: every batch has the same rows"
        batches_left = -(-budget // batch_rows)
        return pending < batches_left * per_slot

    def _last_batch_due(self) -> bool:
        """Trajectories mode: the completed trajectories cover the budget; they all go out now."""
        budget = self._budget_left()
        if self.config.mode != "trajectories" or budget is None:
            return False
        return self._batcher.covers(budget)

    def _add_turns(self, turns: list) -> None:
        steps = [0] * len(self._steps_taken)
        for turn in turns:
            if self._gate is not None:
                self._gate.add(turn.td)
            else:
                self._batcher.add(turn)
            self._turns_run += 1
            steps[self._runner_of_slot[turn.slot]] += 1
        for index, count in enumerate(steps):  # after the batcher has them: _may_step never undercounts
            self._steps_taken[index] += count // self._runners.runners[index].num_envs

    def _halt(self) -> None:
        """Stop the env threads; turns of steps that were under way join the batcher (none is lost)."""
        self._runners.stop_stepping()
        self._add_turns(self._runners.take_pending())

    def _collect_batch(self) -> TensorDictBase:
        with self._lock:
            if self.reset_at_each_iter and self._batches > 0:
                self.reset()
        while True:
            # a pause waits outside the lock: a paused collector can be checkpointed, reseeded, reset
            self._wait_if_paused()
            with self._lock:  # one turn at a time (iterator vs start() thread vs control calls)
                if self._batch_ready():
                    self._halt()
                    batch, run = self._pop_batch()
                    self._batches += 1
                    self._turns_yielded += batch.batch_size.numel()
                    self._turns_counted += run
                    break
                self._add_turns(self._runners.next_turns())
        if self.verbose:
            logger.info("batch %d: %d turns counted of %s", self._batches, self._turns_counted, self.total_dialog_turns)
            if self._gate is not None:
                logger.info("batch %d: %s", self._batches, self._gate.tally.last_batch)
        return self.postproc(batch) if self.postproc is not None else batch

    def _batch_ready(self) -> bool:
        """Whether a batch may leave (with dynamic sampling: G kept groups wait; the gate raises once
        its filter has dropped too many groups in a row)."""
        return self._gate.ready() if self._gate is not None else self._batcher.ready()

    def _pop_batch(self) -> tuple[TensorDictBase, int]:
        """The next batch and the turns it counts toward the budget (with dynamic sampling: its rows;
        the dropped groups' turns are in :attr:`sampling_counts`)."""
        if self._gate is None:
            return self._batcher.pop_counted(take_all=self._last_batch_due())
        batch = self._gate.pop()
        return batch, batch.batch_size.numel()

    def _collect_output(self) -> TensorDictBase | None:
        """The next batch after ``postproc``; a postproc may hold a whole batch back (return None),
        e.g. :class:`~lmcollect.training.GroupAdvantage` waiting for incomplete groups: collect on."""
        batch = self._collect_batch()
        while batch is None and not self._finished() and not self._stop.is_set():
            batch = self._collect_batch()
        return batch

    def next(self) -> TensorDictBase | None:
        """The next batch (None when a replay buffer is used: the batch went there)."""
        self._raise_if_unusable()
        if self._finished():
            raise StopIteration(
                f"the collector has run total_dialog_turns={self.total_dialog_turns} turns "
                f"({self._turns_counted} counted, {self._turns_yielded} yielded); build a new collector or raise "
                "total_dialog_turns."
            )
        batch = self._collect_output()
        if self.replay_buffer is not None:
            if batch is not None:
                self.replay_buffer.extend(batch)
            return None
        if batch is None:
            raise StopIteration(f"postproc held back every turn of the last batches ({self._turns_run} turns run).")
        return batch

    # ------------------------------------------------------------------ background collection
    def _before_start(self) -> None:
        self._stop.clear()

    def _run_in_background(self) -> None:
        try:
            while not self._stop.is_set() and not self._finished():
                batch = self._collect_output()
                if batch is not None:
                    self._write_to_buffer(batch)
        except _Stopped:
            pass
        finally:
            with self._lock:
                self._halt()

    def _wait_if_paused(self) -> None:
        if self._background is None or threading.current_thread() is not self._background:
            return  # only start()'s thread pauses; the iterating caller is never inside pause()
        if self._stop.is_set():
            raise _Stopped
        if not self._pause_requested.is_set():
            return
        with self._lock:
            self._halt()
        self._paused.set()
        while self._pause_requested.is_set() and not self._stop.is_set():
            time.sleep(0.005)
        self._paused.clear()
        if self._stop.is_set():
            raise _Stopped

    def pause_begin(self, timeout_s: float = 600.0) -> None:
        """First half of :meth:`pause` (for callers that cannot use a context manager, e.g. Ray).

        Returns once the background thread is paused, at once if it is not running (finished
        its budget, or never started), and raises the error that stopped it if it crashed.
        """
        self._pause_requested.set()
        deadline = time.monotonic() + timeout_s
        while not self._paused.wait(0.05):
            if self._background is None or not self._background.is_alive():
                self._raise_background_error()
                return
            if time.monotonic() > deadline:
                self._pause_requested.clear()
                raise TimeoutError(f"the collector did not pause within timeout_s={timeout_s}.")

    def _raise_background_error(self) -> None:
        if self._background_error is not None:
            self._pause_requested.clear()
        super()._raise_background_error()

    def pause_end(self) -> None:
        self._pause_requested.clear()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop background collection (waiting for the batch under way, at most ``timeout`` s) and
        close the envs. Safe to call twice."""
        super().shutdown(timeout)

    def _stop_scheduler(self, timeout: float | None) -> None:
        self._stop.set()
        self._pause_requested.clear()
        self._join_background(timeout)
        self._runners.close()

    # ------------------------------------------------------------------ envs, seeds, state
    def reset(self, index: list[int] | int | None = None, **kwargs: Any) -> None:
        """Start new dialogs in every env slot, or in the slots in ``index``."""
        with self._lock:
            self._halt()
            if self._gate is not None:
                self._gate.drop_incomplete()  # their cut dialogs would never let them complete
            slots = _as_index_list(index)
            for runner in self._runners.runners:
                local = (
                    None
                    if slots is None
                    else [s - runner.slot_offset for s in slots if 0 <= s - runner.slot_offset < runner.num_envs]
                )
                if local == []:
                    continue
                for s in range(runner.num_envs) if local is None else local:
                    dropped = self._batcher.drop_pending(runner.slot_offset + s)
                    if dropped:
                        logger.info(
                            "reset dropped %d turns of an unfinished trajectory in slot %d",
                            dropped,
                            runner.slot_offset + s,
                        )
                runner.reset(local)

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the envs (seed, seed+1, ...) and the policy; returns the last env's seed.

        Waits for the batch under way (the collector's lock): no turn runs while reseeding.
        """
        with self._lock:
            return self._set_seed(seed, static_seed)

    def _set_seed(self, seed: int, static_seed: bool) -> int:
        out_seed = seed
        for env in self.envs:
            set_env_seed = getattr(env, "set_seed", None)
            if callable(set_env_seed):
                out_seed = set_env_seed(out_seed, static_seed=static_seed)
        set_policy_seed = getattr(self.policy, "set_seed", None)
        if callable(set_policy_seed):
            set_policy_seed(seed)
        else:
            torch.manual_seed(seed)
        self.reset()  # dialogs restart from the seeded state
        return out_seed

    def state_dict(self) -> OrderedDict:
        """Everything needed to continue exactly from here in a fresh collector built the same way.

        Counters and the turn budget used, the policy version and weights, the envs' state with
        their dialogs in flight, each env slot's current observation (with the dialog's tokens so
        far), the turns run but not yet yielded, trajectory/group id counters, and the RNG states
        (torch's, which TransformersPolicy samples from, and the policy's own if it has one).
        Taken between turns: waits for the batch under way.
        """
        with self._lock:
            self._halt()
            state: OrderedDict = OrderedDict()
            state["layout"] = self.layout()
            state["env_state_dict"] = [state_of(env) for env in self.envs]
            state.update(self.weight_loader.state())  # policy_state_dict, lora_adapter
            state["turns_run"] = self._turns_run
            state["turns_yielded"] = self._turns_yielded
            state["turns_counted"] = self._turns_counted
            state["batches"] = self._batches
            state["policy_version"] = None if self._policy_version is None else self._policy_version.state_dict()
            state["trajectories"] = self._tracker.state_dict()
            state["observations"] = [runner.observations() for runner in self._runners.runners]
            state["pending_turns"] = self._batcher.state_dict()
            if self._gate is not None:
                state["group_gate"] = self._gate.state_dict()
            state["rng"] = {"torch": torch.get_rng_state(), "policy": _rng_of(self.policy)}
            return state

    def layout(self) -> dict[str, Any]:
        """What a state from :meth:`state_dict` only fits: the same batching and the same env slots."""
        return {
            "mode": self.config.mode,
            "flatten": self.config.flatten,
            "dialog_turns_per_batch": self.dialog_turns_per_batch,
            "env_batch_sizes": [runner.num_envs for runner in self._runners.runners],
        }

    def _check_layout(self, layout: dict[str, Any] | None) -> None:
        if layout is None:
            return
        mine = self.layout()
        wrong = [f"{k}={layout.get(k)!r} (this collector: {v!r})" for k, v in mine.items() if layout.get(k) != v]
        if wrong:
            raise ValueError(
                "this state comes from a collector with another configuration: "
                + "; ".join(wrong)
                + ". Restore it into a collector built with the same envs and batching arguments."
            )

    def load_state_dict(self, state_dict: OrderedDict, **kwargs: Any) -> None:
        """Restore what :meth:`state_dict` returned, all or nothing: every part is checked first
        (:meth:`check_state_dict`), and a refused state raises ValueError with nothing changed.

        The weights load like a push (checked first, under the policy write lock, prefix cache
        reset) and the collector takes the state's version (never an older one than it holds;
        an untracked collector stays untracked). ``convert_dtype=True`` casts the weights to the
        model's dtypes; ``allow_non_finite=True`` loads weights holding NaN or Inf.
        """
        with self._lock:
            self._load_state_dict(state_dict, **kwargs)

    def check_state_dict(self, state_dict: OrderedDict, **kwargs: Any) -> None:
        """Raise ValueError if :meth:`load_state_dict` would refuse ``state_dict``; changes nothing.

        Checks the layout, the version (not older than the one held), the weights (names, shapes,
        dtypes, NaN/Inf), every env's state (envs with a ``check_state_dict``), the counters, the
        trajectory ids, the RNG states, the observations and the turns not yet yielded."""
        with self._lock:
            self._check_state(state_dict, **kwargs)

    def _check_state(self, state: Any, **kwargs: Any) -> None:
        state = check_state_mapping(state)
        version, observations = state.get("policy_version"), state.get("observations")
        runners = self._runners.runners
        check_parts(
            [
                ("layout", lambda: self._check_layout(state.get("layout"))),
                ("policy_version", lambda: self._check_state_version(push_version_of(version))),
                ("policy_state_dict", lambda: self._check_state_weights(state.get("policy_state_dict"), **kwargs)),
                ("env_state_dict", lambda: check_env_states(self.envs, state.get("env_state_dict", []))),
                ("counters", lambda: check_counts(state, ("turns_run", "turns_yielded", "batches"))),
                ("trajectories", None if "trajectories" not in state else lambda: self._tracker.check_state_dict(state["trajectories"])),
                ("rng", lambda: check_rng(state.get("rng"), self.policy)),
                ("observations", None if observations is None else lambda: self._check_observations(observations, runners)),
                ("dynamic_sampling", lambda: self._check_gate_state(state)),
                ("pending_turns", None if observations is None else lambda: self._batcher.check_state_dict(state["pending_turns"])),
            ]
        )  # fmt: skip

    def _check_state_weights(self, policy_state: Any, **kwargs: Any) -> None:
        model = self.get_policy_model()
        if policy_state is not None and (hasattr(model, "load_state_dict") or self.weight_loader.engine() is not None):
            self.weight_loader.check_loadable(
                policy_state,
                convert_dtype=bool(kwargs.get("convert_dtype", False)),
                allow_non_finite=bool(kwargs.get("allow_non_finite", False)),
            )

    def _check_state_version(self, pushed: PushVersion | None) -> None:
        if pushed is not None:
            self.weight_loader.check_version(pushed)

    def _check_gate_state(self, state: Any) -> None:
        """A state restores only into a collector with dynamic sampling set the same way (on or off)."""
        if ("group_gate" in state) != (self._gate is not None):
            raise missing_filter_state("LLMCollector")

    @staticmethod
    def _check_observations(observations: Any, runners: list[Any]) -> None:
        if not isinstance(observations, list) or len(observations) != len(runners):
            raise ValueError(
                f"the state holds observations of {len(observations)} env runners, this collector has {len(runners)}."
            )
        for runner, saved in zip(runners, observations, strict=True):
            check_observations(saved, runner.num_envs)

    def _load_state_dict(self, state_dict: OrderedDict, **kwargs: Any) -> None:
        self._check_state(state_dict, **kwargs)  # every part, before anything changes
        self._halt()  # env threads stop first; turns of the replaced state still under way go with it
        pushed = push_version_of(state_dict.get("policy_version"))
        policy_state = state_dict.get("policy_state_dict")
        model = self.get_policy_model()
        if policy_state is not None and (hasattr(model, "load_state_dict") or self.weight_loader.engine() is not None):
            self.weight_loader.restore(
                state_dict,
                LoadOptions(
                    version=pushed,
                    convert_dtype=bool(kwargs.get("convert_dtype", False)),
                    allow_non_finite=bool(kwargs.get("allow_non_finite", False)),
                ),
            )
        elif pushed is not None and self._policy_version is not None:
            self.weight_loader.take_version(pushed)
        for env, env_state in zip(self.envs, state_dict.get("env_state_dict", []), strict=False):
            if env_state is not None:
                env.load_state_dict(env_state)
        self._turns_run = state_dict.get("turns_run", self._turns_run)
        self._batches = state_dict.get("batches", self._batches)
        if "trajectories" in state_dict:
            self._tracker.load_state_dict(state_dict["trajectories"])
        rng = state_dict.get("rng")
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            if rng.get("policy") is not None:
                self.policy.set_rng_state(rng["policy"])
        if state_dict.get("observations") is None:
            self._turns_yielded = state_dict.get("turns_yielded", self._turns_run)
            self._turns_counted = state_dict.get("turns_counted", self._turns_yielded)
            self.reset()  # an older state without dialogs in flight: they restart from the env state
            return
        for runner, observations in zip(self._runners.runners, state_dict["observations"], strict=False):
            runner.set_observations(observations)
        self._batcher.load_state_dict(state_dict["pending_turns"])
        if self._gate is not None:
            self._gate.load_state_dict(state_dict["group_gate"])
        # a state from before turns_yielded was saved: every turn run and not pending was yielded
        self._turns_yielded = state_dict.get("turns_yielded", self._turns_run - self._batcher.num_buffered_turns)
        # a state from before turns_counted was saved: it counted the rows yielded
        self._turns_counted = state_dict.get("turns_counted", self._turns_yielded)

    # ------------------------------------------------------------------ attribute access
    def getattr_env(self, attr: str) -> Any:
        """An attribute of the env (of each env with async_envs)."""
        if len(self.envs) == 1:
            return getattr(self.envs[0], attr)
        return [getattr(env, attr) for env in self.envs]

    def getattr_policy(self, attr: str) -> Any:
        return getattr(self.policy, attr)


# async_envs, steps mode: an env thread runs at most this many batches ahead of the one being taken
_RUN_AHEAD_BATCHES = 2


class _Stopped(Exception):
    """Raised inside the background thread to unwind when shutdown() is called."""


def _as_index_list(index: list[int] | int | torch.Tensor | None) -> list[int] | None:
    if index is None:
        return None
    if isinstance(index, torch.Tensor):
        return index.flatten().tolist() if index.dtype != torch.bool else index.flatten().nonzero().flatten().tolist()
    return [index] if isinstance(index, int) else list(index)


def _group_size(envs: list[Any]) -> int:
    """Dialogs per GRPO group of the envs (1: no groups)."""
    return max(int(getattr(env, "group_size", 1)) for env in envs)


def _rng_of(policy: Any) -> Any:
    rng_state = getattr(policy, "rng_state", None)
    return rng_state() if callable(rng_state) else None


def _build_policy(policy: Policy | None, policy_factory: Callable[[], Policy] | None) -> Policy:
    if policy is not None and policy_factory is not None:
        raise TypeError("pass either policy or policy_factory, not both.")
    if policy is None:
        if policy_factory is None:
            raise TypeError("a policy is needed: pass policy=... or policy_factory=... .")
        policy = policy_factory()
    if not callable(policy):
        raise TypeError(f"policy must be callable (td -> td), got {type(policy).__name__}.")
    return policy


def _build_envs(env: Any, async_envs: bool) -> list[Any]:
    if async_envs:
        if hasattr(env, "envs") and hasattr(env, "num_envs"):  # an AsyncEnvPool
            return list(env.envs)
        if isinstance(env, (list, tuple)):
            return [as_env(e) for e in env]
        raise TypeError(
            "with async_envs=True, env must be an AsyncEnvPool or a list of envs / env constructors, "
            f"got {type(env).__name__}."
        )
    if isinstance(env, (list, tuple)):
        raise TypeError("a list of envs needs async_envs=True (each env then steps in its own thread).")
    return [as_env(env)]
