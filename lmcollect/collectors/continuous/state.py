"""Seeds, resets and checkpoints of the continuous collector (taken while no turn is in flight)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tensordict import TensorDictBase

from lmcollect.collectors.continuous.dialog_tasks import DialogTasks
from lmcollect.collectors.continuous.group_flow import GroupFlow
from lmcollect.collectors.continuous.turn_flow import TurnFlow
from lmcollect.collectors.shared.config import CollectionConfig
from lmcollect.collectors.shared.group_filter import missing_filter_state
from lmcollect.collectors.shared.state_checks import (
    check_counts,
    check_env_states,
    check_parts,
    check_state_mapping,
    push_version_of,
    state_of,
)
from lmcollect.collectors.shared.trajectories import TrajectoryTracker
from lmcollect.collectors.shared.versioning import PolicyVersion
from lmcollect.weight_sync.loader import LoadOptions, WeightLoader


class ContinuousStateMixin:
    """``set_seed``, ``reset``, ``state_dict`` / ``load_state_dict`` of :class:`ContinuousLLMCollector`.

    Each runs with the collector paused (every dialog between two turns), pausing it for the call
    when the caller has not.
    """

    envs: list[Any]
    _tasks: DialogTasks
    _flow: TurnFlow | GroupFlow
    _tracker: TrajectoryTracker
    _policy_version: PolicyVersion | None
    _batches: int
    config: CollectionConfig
    max_policy_lag: int | None

    if TYPE_CHECKING:  # defined by the collector's other bases (CollectorShell, WeightReceiverMixin)

        def pause(self, timeout_s: float = 600.0) -> contextlib.AbstractContextManager[None]: ...

        weight_loader: WeightLoader

        engine: Any

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed slot envs ``seed, seed+1, ...`` (as LLMCollector seeds its envs); new dialogs in every slot.

        Waits for the turns under way; dialogs under way are dropped (in trajectory modes with their turns).
        """
        with self._paused_here():
            out_seed = seed
            for env in self.envs:
                set_env_seed = getattr(env, "set_seed", None)
                if callable(set_env_seed):
                    out_seed = set_env_seed(out_seed, static_seed=static_seed)
            self._tasks.call(_restart_dialogs(self._tasks, None, full_reset=True))
            return out_seed

    def reset(self, index: list[int] | int | None = None, **kwargs: Any) -> None:
        """Start new dialogs in every slot, or in the slots in ``index`` (waits for the turns under way;
        in trajectory modes the unfinished trajectories' turns are dropped)."""
        slots = None if index is None else ([index] if isinstance(index, int) else list(index))
        with self._paused_here():
            self._tasks.call(_restart_dialogs(self._tasks, slots, full_reset=False))

    @contextlib.contextmanager
    def _paused_here(self) -> Iterator[None]:
        """Paused for the block (nested in a caller's pause: stays paused after it)."""
        if self._tasks.paused:
            yield
            return
        with self.pause():
            yield

    def state_dict(self) -> OrderedDict:
        """The collector's state, taken with no turn in flight (call it inside ``with collector.pause():``).

        Counters, policy version and engine weights (when the engine exposes a ``model``), every
        slot's env state and dialog under way, the finished turns not yet yielded and the id
        counters. A collector built the same way continues from it with the same dialogs and
        loses no finished turn; which dialog finishes its turn first depends on timing, so later
        batches are not bitwise those of an uninterrupted run.
        """
        if self._flow.num_in_flight or (self._tasks.started and not self._tasks.paused):
            raise RuntimeError(
                "state_dict() needs every dialog between two turns: call it inside `with collector.pause():`."
            )
        return self._tasks.call(self._snapshot())

    async def _snapshot(self) -> OrderedDict:
        state: OrderedDict = OrderedDict()
        state["layout"] = self.layout()
        state["env_state_dict"] = [state_of(env) for env in self.envs]
        state.update(self.weight_loader.state())  # policy_state_dict, lora_adapter
        state["turns_run"] = self._tasks.turns_run
        state["batches"] = self._batches
        state["policy_version"] = None if self._policy_version is None else self._policy_version.state_dict()
        state["trajectories"] = self._tracker.state_dict()
        state["observations"] = [{"obs": s.obs, "was_reset": s.was_reset, "fresh": s.fresh} for s in self._tasks.slots]
        state["pending_turns"] = self._flow.state_dict()
        return state

    def layout(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode,
            "dialog_turns_per_batch": self.config.dialog_turns_per_batch,
            "max_dialogs_in_flight": len(self._tasks.slots),
            "max_policy_lag": self.max_policy_lag,
        }

    def load_state_dict(self, state_dict: OrderedDict, **kwargs: Any) -> None:
        """Restore :meth:`state_dict` (before collecting, or inside ``with collector.pause():``), all
        or nothing: every part is checked first (:meth:`check_state_dict`), and a refused state
        raises ValueError with nothing changed. ``allow_non_finite=True`` loads weights holding NaN or Inf."""
        self.check_state_dict(state_dict, **kwargs)
        pushed = push_version_of(state_dict.get("policy_version"))
        if state_dict.get("policy_state_dict") is not None:
            self.weight_loader.restore(
                state_dict, LoadOptions(version=pushed, allow_non_finite=bool(kwargs.get("allow_non_finite", False)))
            )
        elif pushed is not None and self._policy_version is not None:
            self.weight_loader.check_version(pushed)
            self._policy_version.set(pushed)
        with self._paused_here():
            self._tasks.call(self._restore(state_dict))

    def check_state_dict(self, state_dict: OrderedDict, **kwargs: Any) -> None:
        """Raise ValueError if :meth:`load_state_dict` would refuse ``state_dict``; changes nothing.

        Checks the layout, the version (not older than the one held), the weights as the engine
        takes them (names, shapes, dtypes, NaN/Inf), every env's state (envs with a
        ``check_state_dict``), the counters, the trajectory ids, every slot's dialog and the
        finished turns not yet yielded."""
        state = check_state_mapping(state_dict)
        version, weights = state.get("policy_version"), state.get("policy_state_dict")
        allow_non_finite = bool(kwargs.get("allow_non_finite", False))
        check_parts(
            [
                ("layout", lambda: self._check_layout(state["layout"])),
                ("policy_version", lambda: self.weight_loader.check_version(push_version_of(version))),
                ("policy_state_dict", None if weights is None else lambda: self.weight_loader.check_loadable(
                    weights, convert_dtype=False, allow_non_finite=allow_non_finite)),
                ("env_state_dict", lambda: check_env_states(self.envs, state["env_state_dict"], strict=True)),
                ("counters", lambda: check_counts(state, ("turns_run", "batches"), required=True)),
                ("trajectories", lambda: self._tracker.check_state_dict(state["trajectories"])),
                ("observations", lambda: self._check_slots(state["observations"])),
                ("dynamic_sampling", lambda: self._check_filter_state(state["pending_turns"])),
                ("pending_turns", lambda: self._flow.check_state_dict(state["pending_turns"])),
            ]
        )  # fmt: skip

    def _check_filter_state(self, pending: Any) -> None:
        """A state restores only into a collector with dynamic sampling set the same way (on or off)."""
        if isinstance(pending, dict) and ("sampling" in pending) != (self._flow.tally is not None):
            raise missing_filter_state("ContinuousLLMCollector")

    def _check_layout(self, layout: Any) -> None:
        wrong = [
            f"{k}={layout.get(k)!r} (this collector: {v!r})" for k, v in self.layout().items() if layout.get(k) != v
        ]
        if wrong:
            raise ValueError("this state comes from a collector with another configuration: " + "; ".join(wrong) + ".")

    def _check_slots(self, saved: Any) -> None:
        """Every slot's saved dialog: its observation (None between dialogs) and flags."""
        if not isinstance(saved, list) or len(saved) != len(self._tasks.slots):
            raise ValueError(
                f"the state holds dialogs of {len(saved)} slots, this collector has {len(self._tasks.slots)}."
            )
        for slot in saved:
            if slot["obs"] is not None and not isinstance(slot["obs"], TensorDictBase):
                raise ValueError(f"a slot's observation is a {type(slot['obs']).__name__}, not a TensorDict.")

    async def _restore(self, state: OrderedDict) -> None:
        for env, env_state in zip(self.envs, state["env_state_dict"], strict=True):
            if env_state is not None:
                env.load_state_dict(env_state)
        self._tasks.turns_run = int(state["turns_run"])
        self._batches = int(state["batches"])
        self._tracker.load_state_dict(state["trajectories"])
        for slot, saved in zip(self._tasks.slots, state["observations"], strict=True):
            slot.obs, slot.was_reset, slot.fresh = saved["obs"], bool(saved["was_reset"]), bool(saved.get("fresh"))
        self._flow.load_state_dict(state["pending_turns"])
        self._flow.num_dialogs_running = sum(slot.obs is not None for slot in self._tasks.slots)


async def _restart_dialogs(tasks: DialogTasks, slots: list[int] | None, *, full_reset: bool) -> None:
    index = tasks.version_fn()[1]
    for i, slot in enumerate(tasks.slots):
        if slots is not None and i not in slots:
            continue
        if slot.obs is not None:
            tasks.flow.num_dialogs_running -= 1
            tasks.flow.drop_dialog(i)
        slot.obs, slot.fresh = None, False
        slot.was_reset = slot.was_reset and not full_reset  # a reseeded env starts with a full reset
        tasks.tracker.end(i, index)
