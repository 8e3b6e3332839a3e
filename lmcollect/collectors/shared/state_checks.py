"""Checks on a collector state before any of it is loaded, so that a restore is all or nothing.

A state usually comes from a checkpoint folder, which is not trusted (hand-edited, corrupted, or
written by someone else): ``load_state_dict`` runs every check first and changes nothing when
one fails, and ``load_checkpoint`` checks every collector and the replay buffer before it loads
any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase

from lmcollect.weights.version import PushVersion

Check = Callable[[], object]

# what parsing a malformed state raises: each becomes one ValueError naming the part
_MALFORMED = (KeyError, TypeError, ValueError, IndexError, AttributeError)


def check_parts(parts: Sequence[tuple[str, Check | None]]) -> None:
    """Run each ``(part, check)`` (None: nothing to check); the first that fails raises one
    ValueError naming its part."""
    for part, check in parts:
        if check is None:
            continue
        try:
            check()
        except _MALFORMED as exc:  # designed: an untrusted state
            cause = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"this collector state was refused at {part!r}, nothing was changed: {cause}") from exc


def check_state_mapping(state: Any) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(f"a collector state is a dict from state_dict(), got {type(state).__name__}.")
    return state


def push_version_of(data: Any) -> PushVersion | None:
    """The push version a state records (None: none)."""
    return None if data is None else PushVersion(int(data["index"]), str(data["uuid"]))


def check_counts(state: Mapping[str, Any], names: Sequence[str], *, required: bool = False) -> None:
    """Each of ``names`` in ``state`` is an int >= 0 (absent: allowed unless ``required``)."""
    for name in names:
        if name not in state and not required:
            continue
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r:.40} is not a count (an int >= 0).")


def check_env_states(envs: Sequence[Any], states: Any, *, strict: bool = False) -> None:
    """Each env's saved state, checked by the env's own ``check_state_dict`` where it has one (lmcollect's
    ``ChatEnv`` does; an env without one is checked only by its ``load_state_dict``, as it loads)."""
    if not isinstance(states, list):
        raise TypeError(f"env_state_dict is a {type(states).__name__}, not a list of env states.")
    if strict and len(states) != len(envs):
        raise ValueError(f"the state holds {len(states)} env states, this collector has {len(envs)} envs.")
    for env, env_state in zip(envs, states, strict=False):
        check = getattr(env, "check_state_dict", None)
        if env_state is not None and callable(check):
            check(env_state)


def check_observations(observations: Any, num_envs: int) -> None:
    """One runner's saved observations: None, or one TensorDict per env element."""
    if observations is None:
        return
    if not isinstance(observations, list) or len(observations) != num_envs:
        raise ValueError(f"an env runner's observations are not a list of {num_envs} (its elements).")
    if not all(isinstance(obs, TensorDictBase) for obs in observations):
        raise ValueError("an env runner's observations are not all TensorDicts.")


def check_rng(rng: Any, policy: Any) -> None:
    """The RNG states of a state: torch's (a generator state of this torch), and the policy's."""
    if rng is None:
        return
    state, expected = rng["torch"], torch.get_rng_state()
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != expected.shape:
        raise ValueError("rng['torch'] is not a torch RNG state of this torch version.")
    policy_state = rng.get("policy")
    if policy_state is not None:
        if not callable(getattr(policy, "set_rng_state", None)):
            raise ValueError(f"the state holds a policy RNG state; this policy ({type(policy).__name__}) takes none.")
        check = getattr(policy, "check_rng_state", None)  # a policy that can tell checks its own format
        if callable(check):
            check(policy_state)


def state_of(obj: Any) -> Any:
    """``obj.state_dict()`` if it has one (an env's state in a collector's checkpoint), else None."""
    state_dict = getattr(obj, "state_dict", None)
    return state_dict() if callable(state_dict) else None
