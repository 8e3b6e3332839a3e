"""The record of one finished turn, the same for both collectors: checks, stamps and the next observation.

A turn's content (history, text, tokens, masks, log-probs, sampling, engine-reported token
versions) is built by :func:`lmcollect.policies.outputs.turn_of`, under either scheduler. What the
collector adds is built here, once: :func:`record_turn` stamps the trajectory, group, env index,
step and versions (:func:`stamp_turn`), and :func:`next_observation` carries the dialog's tokens to
its next turn. The lockstep env runner and the continuous dialog tasks both call these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from lmcollect.collectors.shared.batcher import CollectedTurn
from lmcollect.collectors.shared.trajectories import TrajectoryTracker
from lmcollect.data import keys

# (version written into turns, integer index of that version)
VersionFn = Callable[[], tuple[int | str, int]]
_ENV_NEXT_KEYS = (keys.DONE, keys.REWARD)


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
