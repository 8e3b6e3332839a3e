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
from lmcollect.data import keys
from lmcollect.envs.protocol import EnvProtocol

# (version written into turns, integer index of that version)
VersionFn = Callable[[], tuple[int | str, int]]

_ENV_NEXT_KEYS = (keys.DONE, keys.REWARD)


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


def check_turn(turn: TensorDictBase, slot: int, policy: object) -> None:
    """One log-prob per response token."""
    num_tokens = turn.get(keys.TOKENS_RESPONSE).shape[-1]
    num_log_probs = turn.get(keys.LOG_PROBS_RESPONSE).shape[-1]
    if num_tokens != num_log_probs:
        raise ValueError(
            f"policy {type(policy).__name__} returned {num_log_probs} {keys.LOG_PROBS_RESPONSE} for "
            f"{num_tokens} {keys.TOKENS_RESPONSE} at env index {slot}; it must return one log-prob per "
            "generated token."
        )


def env_next(stepped: TensorDictBase, env: object, slot_offset: int, num_envs: int) -> TensorDictBase:
    """The ``"next"`` entry of an env step, with the keys the collector reads (named if missing)."""
    nxt = stepped.get("next", None) if stepped is not None else None
    if nxt is None:
        raise ValueError(
            f"env {type(env).__name__} (env indices {slot_offset}..{slot_offset + num_envs - 1}) returned no "
            "'next' entry from step(); write td['next'] = ... with the next observation, reward and done."
        )
    present = nxt.keys(include_nested=True)
    for key in _ENV_NEXT_KEYS:
        if key not in present:
            raise ValueError(
                f"env {type(env).__name__} step() returned no ('next', {key!r}) at env index {slot_offset}"
                f"{'' if num_envs == 1 else f'..{slot_offset + num_envs - 1}'}; every step must set "
                "('next', 'reward') (float, shape [1]) and ('next', 'done') (bool, shape [1])."
            )
    if nxt.batch_size[:1] != torch.Size([num_envs]):
        raise ValueError(
            f"env {type(env).__name__} step() returned 'next' with batch size {tuple(nxt.batch_size)} for "
            f"{num_envs} elements (env indices from {slot_offset}); return one entry per element."
        )
    return nxt


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


def record_turn(
    tracker: TrajectoryTracker,
    turn: TensorDictBase,
    *,
    slot: int,
    version: int | str,
    version_index: int,
    done: bool,
    env_number: int,
    num_envs: int,
) -> CollectedTurn:
    """A finished turn, stamped (:func:`stamp_turn`) and ready for the batcher; a ``done`` turn ends
    its slot's trajectory. ``env_number`` of ``num_envs`` is the env that drew its prompt (group id)."""
    traj_id, step_count, min_version = tracker.stamp(slot, version_index)
    prompt_id = turn.get(keys.ENV_PROMPT_ID, None)
    group_id = -1 if prompt_id is None else tracker.group_id(env_number, num_envs, int(prompt_id))
    stamp_turn(turn, version, version_index, traj_id, step_count, min_version, slot, group_id)
    if done:
        tracker.end(slot, version_index)
    return CollectedTurn(slot=slot, traj_id=traj_id, done=done, td=turn)


def next_observation(turn: TensorDictBase, nxt: TensorDictBase, env: object = None) -> TensorDictBase:
    """The env's next observation plus the dialog's tokens so far (token-exact multi-turn).

    The rewards stay behind: ``"reward"``, or every key in ``env.reward_keys`` when the env names
    them (torchrl envs do, e.g. a reward parser's parts), as torchrl's ``step_mdp`` leaves them.
    """
    obs = nxt.exclude(*(getattr(env, "reward_keys", None) or (keys.REWARD,)))
    if keys.TOKENS_FULL in turn.keys(include_nested=True):
        obs.set(keys.TOKENS_PREFIX, turn.get(keys.TOKENS_FULL))
        obs.set(keys.HISTORY_PREFIX, turn.get(keys.HISTORY_FULL))
    return obs


def stamp_turn(
    turn: TensorDictBase,
    version: int | str,
    version_index: int,
    traj_id: int,
    step_count: int,
    min_version: int,
    slot: int,
    group_id: int,
) -> None:
    turn.set(keys.POLICY_VERSION, torch.tensor(version) if isinstance(version, int) else version)
    _stamp_token_versions(turn, version_index if version != UNTRACKED else UNTRACKED)
    turn.set(keys.TRAJ_IDS, torch.tensor(traj_id))
    turn.set(keys.GROUP_ID, torch.tensor(group_id))
    turn.set(keys.ENV_INDEX, torch.tensor(slot))
    turn.set(keys.TRAJ_MIN_VERSION, torch.tensor(min_version))
    turn.set(keys.TRAJ_MAX_VERSION, torch.tensor(version_index))
    turn.set(keys.STEP_COUNT, torch.tensor(step_count))


UNTRACKED = -1  # the policy version of turns from a collector that does not track versions


def _stamp_token_versions(turn: TensorDictBase, version_index: int) -> None:
    """``("collector", "token_versions")`` on every turn, whatever the policy: as the engine
    recorded them (a continuous engine's tokens may span a push), else the turn's version for
    every response token; -1 everywhere when versions are not tracked."""
    num_tokens = turn.get(keys.LOG_PROBS_RESPONSE).numel()  # one per response token (check_turn)
    present = turn.keys(include_nested=True)
    if version_index == UNTRACKED or keys.TOKEN_VERSIONS not in present:
        turn.set(keys.TOKEN_VERSIONS, torch.full((num_tokens,), version_index, dtype=torch.int64))
    if version_index == UNTRACKED or keys.KV_VERSIONS not in present:  # the engine recomputed: the tokens' own
        turn.set(keys.KV_VERSIONS, turn.get(keys.TOKEN_VERSIONS).clone())
