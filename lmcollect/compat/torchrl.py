"""torchrl interop: torchrl LLM envs run by lmcollect's collectors, lmcollect batches read by torchrl's losses.

Two small adapters, for code that already uses torchrl (tested with torchrl 0.14.1, ``make test-torchrl``):

* :class:`TorchrlEnv` drives a torchrl LLM env (a ``ChatEnv`` in history mode, with its transforms:
  ``DataLoadingPrimer``, reward parsers, ``StepCounter``, ...) as an lmcollect env. The collectors
  wrap a torchrl env in it themselves (this module registers the ``"torchrl"`` ecosystem in
  :mod:`lmcollect.envs.registry`), so ``LLMCollector(torchrl_env, policy=...)`` works as it is, and
  ``"torchrl:GSM8KEnv"`` names the class of ``torchrl.envs.llm`` to build (``make_env(name, **kwargs)``).
  The env runs unchanged: only the chat histories are translated at its edge (torchrl's ``History``
  tensorclass in and out of the env, lmcollect's :class:`~lmcollect.data.History` for the policy),
  and every other entry (rewards and their shapes, ``step_count``, dataset fields) passes as the
  env wrote it.
* :func:`to_torchrl_loss_batch` gives an lmcollect batch the two entries torchrl's LLM losses
  (``GRPOLoss`` and its kin) read that lmcollect does not record: ``("log_probs", "full")`` and a
  ``"advantage"`` shaped as torchrl's ``MCAdvantage`` writes it.

torchrl's replay buffers need nothing: ``ReplayBuffer(storage=LazyStackStorage(n)).extend(batch)``
stores lmcollect turns as they are (a collector given such a buffer writes into it).
Nothing here imports torchrl until a torchrl env is stepped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDictBase

from lmcollect.data import keys
from lmcollect.data.history import ROLES, History
from lmcollect.data.turns import flatten_turns, non_tensor_values, stack_turns
from lmcollect.envs.registry import register_ecosystem

LOG_PROBS_FULL = ("log_probs", "full")
"""What torchrl's losses read as the log-probs of the sampling policy: one per token of ``tokens.full``."""
ADVANTAGE = "advantage"

# torchrl marks padding messages in a stack of histories with this role; they are no messages
_PLACEHOLDER_ROLE = "<none>"


def is_torchrl_env(env: object) -> bool:
    """Whether ``env`` is a torchrl env (an ``EnvBase``), told without importing torchrl."""
    return any(cls.__name__ == "EnvBase" and cls.__module__.startswith("torchrl.") for cls in type(env).__mro__)


class TorchrlEnv:
    """A torchrl LLM env of batch size ``(B,)`` in history mode, as an lmcollect env (see the module docstring).

    ``reset`` and ``step`` call the torchrl env's own; partial resets pass the collector's
    ``"_reset"`` mask on, as torchrl's collectors do. Observations hold the env's entries with
    ``("history", "prompt")`` as lmcollect histories; ``step`` hands the env the entries it wrote
    plus ``history`` as torchrl's ``ChatHistory`` (prompt, response, full), and returns the env's
    ``"next"`` entry translated the same way. ``set_seed`` and ``close`` are the env's.

    Args:
        env: the torchrl env (``ChatEnv`` or a ``TransformedEnv`` over one, ``input_mode="history"``).
    """

    def __init__(self, env: Any) -> None:
        if not is_torchrl_env(env):
            raise TypeError(f"env must be a torchrl EnvBase (e.g. a torchrl ChatEnv), got {type(env).__name__}.")
        base = getattr(env, "base_env", env)
        mode = getattr(base, "input_mode", "history")
        if mode != "history":
            raise ValueError(
                f"the torchrl env has input_mode={mode!r}; lmcollect's policies read chat histories, so build the "
                "ChatEnv with input_mode='history'."
            )
        self.batch_size = torch.Size(env.batch_size)
        if len(self.batch_size) != 1:
            raise ValueError(
                f"the torchrl env has batch_size {tuple(self.batch_size)}; lmcollect envs are batched along one "
                "dimension: build it with batch_size=(B,)."
            )
        self.env = env
        self._env_keys: set[str] = set()  # the top-level entries the env wrote: handed back to its step

    @property
    def reward_keys(self) -> list:
        """The env's reward entries (the collector leaves them out of the next observation, as torchrl does)."""
        return list(self.env.reward_keys)

    def reset(self, td: TensorDictBase | None = None) -> TensorDictBase:
        return self._from_torchrl(self.env.reset() if td is None else self.env.reset(td))

    def step(self, td: TensorDictBase) -> TensorDictBase:
        stepped = self.env.step(self._to_torchrl(td))
        td.set("next", self._from_torchrl(stepped.get("next")))
        return td

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        return self.env.set_seed(seed, static_seed=static_seed)

    def close(self) -> None:
        self.env.close()

    def _from_torchrl(self, out: TensorDictBase) -> TensorDictBase:
        """The env's output with its prompts as lmcollect histories."""
        prompts = out.get(keys.HISTORY_PROMPT, None)
        if prompts is None:
            raise ValueError(
                f"the torchrl env {type(self.env).__name__} wrote no ('history', 'prompt'); lmcollect's policies "
                "need it: use a ChatEnv in history mode."
            )
        converted = out.exclude("history")
        # its top-level entries (iterating a TensorDict would go over its batch, not its keys)
        self._env_keys.update(k for k in converted.keys() if isinstance(k, str))  # noqa: SIM118
        rows = [to_lmcollect_history(prompts[i]) for i in range(self.batch_size[0])]
        converted.set(keys.HISTORY_PROMPT, NonTensorStack(*rows))
        return converted

    def _to_torchrl(self, td: TensorDictBase) -> TensorDictBase:
        """The policy output as the torchrl env reads it: its own entries and a ``ChatHistory``."""
        from torchrl.modules.llm.policies import ChatHistory  # only when a torchrl env is stepped

        inp = td.select(*self._env_keys, strict=False)
        histories = {
            name: to_torchrl_history(non_tensor_values(td, key))
            for name, key in (
                ("prompt", keys.HISTORY_PROMPT),
                ("response", keys.HISTORY_RESPONSE),
                ("full", keys.HISTORY_FULL),
            )
        }
        inp.set("history", ChatHistory(**histories, batch_size=self.batch_size))
        return inp


def to_lmcollect_history(history: Any) -> History:
    """One torchrl ``History`` (a dialog: batch size ``(n,)``) as an lmcollect :class:`~lmcollect.data.History`."""
    roles, contents = _listed(history.role), _listed(history.content)
    messages = [(r, c) for r, c in zip(roles, contents, strict=True) if r != _PLACEHOLDER_ROLE]
    unknown = sorted({r for r, _ in messages if r not in ROLES})
    if unknown:
        raise ValueError(
            f"the torchrl history has messages of role {unknown}; lmcollect histories take {ROLES}. Map those "
            "roles in the env (e.g. a transform) before the policy reads them."
        )
    return History.from_dicts({"role": r, "content": c} for r, c in messages)


def to_torchrl_history(histories: Iterable[History]) -> Any:
    """lmcollect histories as one torchrl ``History`` stack (batch size ``(B, -1)``)."""
    from torchrl.data.llm import History as TorchrlHistory  # only when a torchrl env is stepped

    return TorchrlHistory.from_chats([history.to_dicts() for history in histories])


def _listed(values: Any) -> list:
    if isinstance(values, str):
        return [values]
    return list(values.tolist() if hasattr(values, "tolist") else values)


def to_torchrl_loss_batch(batch: TensorDictBase) -> TensorDictBase:
    """The turns of ``batch`` (flat lazy stack) with what torchrl's LLM losses read and lmcollect does not record.

    * ``("log_probs", "full")``: one value per token of ``("tokens", "full")``: NaN over the
      prompt, which was not sampled (torchrl's own generate path writes NaN there too, so no
      masking strategy lets a prompt token into the importance ratio), then the recorded
      ``("log_probs", "response")``.
    * ``"advantage"``: a turn's scalar advantage (e.g. from
      :class:`~lmcollect.training.GroupAdvantage`) as shape ``(1, 1)``, the shape torchrl's
      ``MCAdvantage`` writes (``GRPOLoss`` broadcasts it over the tokens); a turn without one
      is left as it is.

    The tokens, masks (``("masks", "all_attention_mask" / "all_assistant_mask")``) and
    ``("tokens", "prompt")`` are lmcollect's, under torchrl's names already. The turns are shallow
    copies: ``batch`` is not changed.
    """
    out = []
    for index, turn in enumerate(flatten_turns(batch)):
        turn = turn.copy()
        response = turn.get(keys.LOG_PROBS_RESPONSE)
        num_prompt = turn.get(keys.TOKENS_PROMPT).numel()
        if num_prompt + response.numel() != turn.get(keys.TOKENS_FULL).numel():
            raise ValueError(
                f"turn {index}: tokens.full has {turn.get(keys.TOKENS_FULL).numel()} tokens, not the "
                f"{num_prompt} of tokens.prompt plus the {response.numel()} log-probs of the response; pass turns "
                "as lmcollect's collectors write them."
            )
        prompt_part = torch.full((num_prompt,), float("nan"), dtype=response.dtype)
        turn.set(LOG_PROBS_FULL, torch.cat([prompt_part, response]))
        advantage = turn.get(ADVANTAGE, None)
        if advantage is not None and advantage.numel() == 1:
            turn.set(ADVANTAGE, advantage.float().reshape(1, 1))
        out.append(turn)
    return stack_turns(out)


def build_torchrl_env(name: str, **kwargs: Any) -> TorchrlEnv:
    """``make_env("torchrl:<name>", **kwargs)``: the class ``name`` of ``torchrl.envs.llm`` built with
    ``kwargs`` (``input_mode="history"``), as an lmcollect env."""
    try:
        import torchrl.envs.llm as torchrl_llm_envs  # optional: imported only when a torchrl env is named
    except ImportError as exc:
        raise ImportError(f"the env 'torchrl:{name}' needs torchrl; pip install torchrl.") from exc
    env_class = getattr(torchrl_llm_envs, name, None)
    if not isinstance(env_class, type):
        raise ValueError(
            f"unknown env 'torchrl:{name}': torchrl.envs.llm has no class {name!r} (e.g. 'torchrl:GSM8KEnv')."
        )
    return TorchrlEnv(env_class(**kwargs))


register_ecosystem("torchrl", recognizes=is_torchrl_env, wrap=TorchrlEnv, build=build_torchrl_env)
