"""skyrl-gym: its text environments (``make(id, extras=row)``, ``init``, ``step(text)``) as lmcollect tasks, its ids as ``"skyrl-gym:<id>"``.

skyrl-gym (``pip install 'lmcollect[skyrl-gym]'``) builds one environment per dataset row:
``skyrl_gym.make("gsm8k", extras=row)`` reads the row's ``reward_spec``/``extra_info``, ``init(prompt)``
gives the first messages, and ``step(reply_text)`` gives the observations (messages), the reward and
``done``. :class:`SkyrlGymTask` runs exactly that inside a :class:`~lmcollect.envs.ChatEnv`:

* one skyrl-gym env per dialog, made and ``init``-ed in ``start``, stepped once per assistant turn
  (a :class:`~lmcollect.envs.tasks.base.StatefulTask`: a retried batch step replays the recorded
  reply, a restore replays the recorded turns), ``close``-d when the dialog ends;
* its observations are appended as role-tagged messages; lmcollect keeps the chat template, the
  tokens, the log-probs and the versions (the env only sees and returns text);
* a step that returns ``postprocessed_action`` is refused: it would rewrite the model's reply after
  its tokens were sampled, and the recorded tokens would no longer be what the env scored.

Names: ``make_env("skyrl-gym:gsm8k", rows=rows, batch_size=8, repeats=4)``; the part after the
colon is the skyrl-gym id (``gsm8k``, ``gsm8k_multi_turn``, or any id you registered with
``skyrl_gym.register``); rows are skyrl-gym dataset rows (``prompt``, ``reward_spec``, ``extra_info``).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcollect.compat.extras import import_extra
from lmcollect.data.history import History
from lmcollect.envs.chat_env import ChatEnv
from lmcollect.envs.datasets import PromptDataset
from lmcollect.envs.registry import register_ecosystem
from lmcollect.envs.tasks.base import TaskReply

ECOSYSTEM = "skyrl-gym"


def _skyrl_gym() -> Any:
    return import_extra("skyrl_gym", extra="skyrl-gym", who="skyrl-gym envs")


def _registered(env_id: str) -> Any:
    """skyrl_gym, once ``env_id`` is known to be registered in it."""
    skyrl_gym = _skyrl_gym()
    if env_id not in skyrl_gym.registry:
        known = ", ".join(sorted(skyrl_gym.registry))
        raise ValueError(f"skyrl-gym has no env {env_id!r}; registered: {known} (skyrl_gym.register adds one).")
    return skyrl_gym


@dataclass
class SkyrlGymDialog:
    """One dialog's skyrl-gym env and the messages its ``init`` returned."""

    env: Any
    """The skyrl-gym env (``BaseTextEnv``) of this dialog."""
    opening: list[dict[str, Any]]
    """``init``'s observation: the first prompt."""


@dataclass(frozen=True)
class SkyrlGymTask:
    """A skyrl-gym env per dialog: ``make(env_id, env_config, extras=row)``, ``init(row["prompt"])``, ``step(reply)``.

    ``env_id=None`` takes each row's ``"env_class"`` (skyrl-gym datasets name their env there).
    Picklable (it goes to collector actors with the env); skyrl-gym is imported where it runs.
    """

    env_id: str | None = None
    """The skyrl-gym id (``"gsm8k"``); None: each row's ``"env_class"``."""
    env_config: Mapping[str, Any] = field(default_factory=dict)
    """Passed to ``make`` as ``env_config`` (what skyrl-gym's own config gives an env)."""
    max_turns: int = 1
    """Assistant turns per dialog at most (ChatEnv truncates after that many)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be an int >= 1, got {self.max_turns!r}.")

    def start(self, sample: Mapping[str, Any], rng: random.Random) -> SkyrlGymDialog:
        env_id = self.env_id if self.env_id is not None else sample.get("env_class")
        if not isinstance(env_id, str):
            raise ValueError(
                "SkyrlGymTask: pass env_id='gsm8k' (or another skyrl-gym id), or give each row an 'env_class'."
            )
        if "prompt" not in sample:
            raise KeyError(f"a skyrl-gym row needs 'prompt' (the messages init() receives); got {sorted(sample)}.")
        env = _registered(env_id).make(env_id, env_config=dict(self.env_config), extras=dict(sample))
        opening, _info = env.init(sample["prompt"])
        return SkyrlGymDialog(env, list(opening))

    def opening_prompt(self, state: SkyrlGymDialog, sample: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
        return state.opening

    def respond(self, state: SkyrlGymDialog, history: History) -> TaskReply:
        reply = history.last("assistant")
        out = state.env.step("" if reply is None else reply.content)
        if out.get("postprocessed_action") is not None:
            raise ValueError(
                f"skyrl-gym env {type(state.env).__name__} returned a postprocessed_action: it rewrites the model's "
                "reply after its tokens were sampled, which lmcollect refuses (the recorded tokens must be what the env "
                "scored); make the env leave the reply as sampled and return its changes as observations."
            )
        observations = [{"role": m["role"], "content": m["content"]} for m in out["observations"] or ()]
        return TaskReply(reward=float(out["reward"]), done=bool(out["done"]), messages=observations)

    def end(self, state: SkyrlGymDialog) -> None:
        state.env.close()


def skyrl_gym_env(
    env_id: str | None,
    *,
    rows: PromptDataset | Sequence[Mapping[str, Any]] | None = None,
    batch_size: int = 1,
    repeats: int = 1,
    max_turns: int = 1,
    env_config: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> ChatEnv:
    """A :class:`ChatEnv` whose dialogs are skyrl-gym envs ``env_id`` (None: each row's ``env_class``) on ``rows``.

    ``rows``: skyrl-gym dataset rows (``prompt`` messages, ``reward_spec``, ``extra_info``); ``repeats``
    dialogs per row make the GRPO groups; ``max_turns`` bounds each dialog.
    """
    if rows is None:
        raise ValueError(
            f"skyrl_gym_env({env_id!r}): pass rows=[{{'prompt': [...], 'reward_spec': {{'ground_truth': ...}}}}, ...] "
            "(skyrl-gym dataset rows; PromptDataset.from_hf reads a parquet file of them)."
        )
    if env_id is not None:
        _registered(env_id)
    task = SkyrlGymTask(env_id, dict(env_config or {}), max_turns)
    return ChatEnv(rows, task=task, batch_size=batch_size, repeats=repeats, max_turns=max_turns, seed=seed)


register_ecosystem(ECOSYSTEM, build=skyrl_gym_env)
