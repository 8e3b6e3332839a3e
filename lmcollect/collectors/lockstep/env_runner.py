"""Runs one batched env against a policy: one policy call and one env step per turn."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field

import torch
from tensordict import TensorDict, TensorDictBase, lazy_stack

from lmcollect.collectors.lockstep.rwlock import ReadWriteLock
from lmcollect.collectors.shared.batcher import CollectedTurn
from lmcollect.collectors.shared.trajectories import TrajectoryTracker
from lmcollect.collectors.shared.turn_record import VersionFn, check_turn, env_next, next_observation, record_turn
from lmcollect.data import keys
from lmcollect.envs.protocol import EnvProtocol


def check_policy_output(out: TensorDictBase, policy: object, num_envs: int) -> None:
    """The keys and batch size the collector reads from a policy call (cheap: every turn)."""
    present = out.keys(include_nested=True)
    missing = [k for k in keys.POLICY_OUTPUT_KEYS if k not in present]
    if missing:
        raise ValueError(
            f"policy {type(policy).__name__} returned no {missing}; a policy must add "
            f"{list(keys.POLICY_OUTPUT_KEYS)} to its input (see lmcollect.policies.PolicyProtocol)."
        )
    if out.batch_size[:1] != torch.Size([num_envs]):
        raise ValueError(
            f"policy {type(policy).__name__} returned batch size {tuple(out.batch_size)} for {num_envs} env "
            "elements; return one entry per element of its input."
        )


@dataclass(eq=False, repr=False)
class EnvRunner:
    """Owns one env's current observations and turns each step into :class:`CollectedTurn` s.

    ``slot_offset`` numbers this env's elements within the collector, and ``env_number`` /
    ``num_env_runners`` the env among the collector's envs (several run side by side with
    ``async_envs``); group ids depend on both.
    """

    env: EnvProtocol
    policy: Callable[[TensorDictBase], TensorDictBase]
    _: KW_ONLY
    tracker: TrajectoryTracker
    version_fn: VersionFn
    policy_lock: ReadWriteLock
    slot_offset: int = 0
    env_number: int = 0
    num_env_runners: int = 1
    num_envs: int = field(init=False)
    """Elements of the env's batch."""
    _obs: list[TensorDictBase] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.num_envs = int(torch.Size(self.env.batch_size).numel())

    def reset(self, index: list[int] | None = None) -> None:
        """Start new dialogs in every element, or only in ``index`` (local element indices)."""
        if index is None or self._obs is None:
            self._obs = list(self.env.reset().unbind(0))
            index = list(range(self.num_envs))
        else:
            self._reset_rows(self._obs, index)
        _, version_index = self.version_fn()
        for i in index:
            self.tracker.end(self.slot_offset + i, version_index)

    def observations(self) -> list[TensorDictBase] | None:
        """Each element's current observation (None before the first reset)."""
        return None if self._obs is None else list(self._obs)

    def set_observations(self, observations: list[TensorDictBase] | None) -> None:
        """Continue from :meth:`observations` of a runner over an env restored to the same point."""
        if observations is not None and len(observations) != self.num_envs:
            raise ValueError(f"got {len(observations)} observations for an env with {self.num_envs} elements.")
        self._obs = None if observations is None else list(observations)

    def _reset_rows(self, obs: list[TensorDictBase], index: list[int]) -> None:
        mask = torch.zeros(self.num_envs, 1, dtype=torch.bool)
        mask[index] = True
        fresh = self.env.reset(TensorDict({keys.RESET: mask}, batch_size=[self.num_envs]))
        for i in index:
            obs[i] = fresh[i]

    def step(self) -> list[CollectedTurn]:
        """One policy call and one env step for every element; the turns in element order."""
        if self._obs is None:
            self.reset()
        assert self._obs is not None, "reset() sets the observations"
        with self.policy_lock.read():  # weights never change under a running policy call
            version, version_index = self.version_fn()
            with self._named_errors(f"policy {type(self.policy).__name__}"):
                out = self.policy(lazy_stack(self._obs))
        check_policy_output(out, self.policy, self.num_envs)
        for i in range(self.num_envs):  # before the env steps: a rejected output must not advance its dialogs
            check_turn(out[i], self.slot_offset + i, self.policy)
        with self._named_errors(f"env {type(self.env).__name__}.step"):
            stepped = self.env.step(out)
        nxt = env_next(stepped, self.env, self.slot_offset, self.num_envs)
        turns, done_rows, next_obs = [], [], list(self._obs)
        for i in range(self.num_envs):
            turn, nxt_i = out[i], nxt[i]
            turn.set("next", nxt_i)
            done = bool(nxt_i.get(keys.DONE).any())
            collected = record_turn(
                self.tracker,
                turn,
                slot=self.slot_offset + i,
                version=version,
                version_index=version_index,
                done=done,
                env_number=self.env_number,
                num_envs=self.num_env_runners,
            )
            turns.append(collected)
            if done:
                done_rows.append(i)
            else:
                next_obs[i] = next_observation(turn, nxt_i, self.env)
        self._obs = next_obs
        if done_rows:
            self._reset_rows(next_obs, done_rows)
        return turns

    @contextlib.contextmanager
    def _named_errors(self, what: str) -> Iterator[None]:
        """An error keeps its type and gains a note naming who raised it and for which env indices."""
        try:
            yield
        except Exception as exc:
            last = self.slot_offset + self.num_envs - 1
            exc.add_note(f"raised by {what} at env indices {self.slot_offset}..{last} (lmcollect collector)")
            raise
