"""Runs one batched env against a policy: one policy call and one env step per turn."""
from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from lmcollect.collectors.batcher import CollectedTurn
from lmcollect.collectors.rwlock import ReadWriteLock
from lmcollect.collectors.trajectories import TrajectoryTracker
from lmcollect.data import keys

# (version written into turns, integer index of that version)
VersionFn = Callable[[], tuple[int | str, int]]


def check_policy_output(out: TensorDictBase, policy: object) -> None:
    present = out.keys(include_nested=True)
    missing = [k for k in keys.POLICY_OUTPUT_KEYS if k not in present]
    if missing:
        raise ValueError(
            f"policy {type(policy).__name__} returned no {missing}; a policy must add "
            f"{list(keys.POLICY_OUTPUT_KEYS)} to its input (see lmcollect.policies.PolicyProtocol)."
        )


class EnvRunner:
    """Owns one env's current observations and turns each step into :class:`CollectedTurn` s.

    ``slot_offset`` numbers this env's elements within the collector (several envs run side by
    side with ``async_envs``).
    """

    def __init__(
        self,
        env: object,
        policy: Callable[[TensorDictBase], TensorDictBase],
        *,
        tracker: TrajectoryTracker,
        version_fn: VersionFn,
        policy_lock: ReadWriteLock,
        slot_offset: int = 0,
    ) -> None:
        self.env = env
        self.policy = policy
        self.tracker = tracker
        self.version_fn = version_fn
        self.policy_lock = policy_lock
        self.slot_offset = slot_offset
        self.num_envs = int(torch.Size(env.batch_size).numel())
        self._obs: list[TensorDictBase] | None = None
        self._checked = False

    def reset(self, index: list[int] | None = None) -> None:
        """Start new dialogs in every element, or only in ``index`` (local element indices)."""
        if index is None or self._obs is None:
            self._obs = list(self.env.reset().unbind(0))
            index = list(range(self.num_envs))
        else:
            self._reset_rows(index)
        _, version_index = self.version_fn()
        for i in index:
            self.tracker.end(self.slot_offset + i, version_index)

    def _reset_rows(self, index: list[int]) -> None:
        mask = torch.zeros(self.num_envs, 1, dtype=torch.bool)
        mask[index] = True
        fresh = self.env.reset(TensorDict({keys.RESET: mask}, batch_size=[self.num_envs]))
        for i in index:
            self._obs[i] = fresh[i]

    def step(self) -> list[CollectedTurn]:
        """One policy call and one env step for every element; the turns in element order."""
        if self._obs is None:
            self.reset()
        with self.policy_lock.read():  # weights never change under a running policy call
            version, version_index = self.version_fn()
            out = self.policy(lazy_stack(self._obs))
        if not self._checked:
            check_policy_output(out, self.policy)
            self._checked = True
        stepped = self.env.step(out)
        nxt = stepped.get("next")
        turns, done_rows, next_obs = [], [], list(self._obs)
        for i in range(self.num_envs):
            turn = out[i]
            nxt_i = nxt[i]
            turn.set("next", nxt_i)
            done = bool(nxt_i.get(keys.DONE).any())
            slot = self.slot_offset + i
            traj_id, step_count, min_version = self.tracker.stamp(slot, version_index)
            _stamp(turn, version, version_index, traj_id, step_count, min_version, slot)
            turns.append(CollectedTurn(slot=slot, traj_id=traj_id, done=done, td=turn))
            if done:
                done_rows.append(i)
                self.tracker.end(slot, version_index)
            else:
                next_obs[i] = _next_observation(turn, nxt_i)
        self._obs = next_obs
        if done_rows:
            self._reset_rows(done_rows)
        return turns


def _next_observation(turn: TensorDictBase, nxt: TensorDictBase) -> TensorDictBase:
    """The env's next observation plus the dialog's tokens so far (token-exact multi-turn)."""
    obs = nxt.exclude(keys.REWARD)
    if keys.TOKENS_FULL in turn.keys(include_nested=True):
        obs.set(keys.TOKENS_PREFIX, turn.get(keys.TOKENS_FULL))
        obs.set(keys.HISTORY_PREFIX, turn.get(keys.HISTORY_FULL))
    return obs


def _stamp(
    turn: TensorDictBase,
    version: int | str,
    version_index: int,
    traj_id: int,
    step_count: int,
    min_version: int,
    slot: int,
) -> None:
    turn.set(keys.POLICY_VERSION, torch.tensor(version) if isinstance(version, int) else version)
    turn.set(keys.TRAJ_IDS, torch.tensor(traj_id))
    turn.set(keys.ENV_INDEX, torch.tensor(slot))
    turn.set(keys.TRAJ_MIN_VERSION, torch.tensor(min_version))
    turn.set(keys.TRAJ_MAX_VERSION, torch.tensor(version_index))
    turn.set(keys.STEP_COUNT, torch.tensor(step_count))
