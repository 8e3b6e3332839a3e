"""The collection config every collector shares, and the check of its batching arguments (pure logic)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tensordict import TensorDictBase

from lmcollect.collectors.shared.batcher import BatchMode
from lmcollect.collectors.shared.group_filter import DynamicSampling, GroupFilter, as_dynamic_sampling
from lmcollect.collectors.shared.versioning import PolicyVersion
from lmcollect.plumbing import forwarded

C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, kw_only=True)
class CollectionConfig:
    """What every collector is told about its batches and their way out: ``LLMCollector``,
    ``ContinuousLLMCollector``, ``RayLLMCollector`` and ``RayContinuousLLMCollector`` take these
    fields as keyword arguments of the same names, build this config from them (checked once,
    here) and expose it as ``collector.config``."""

    dialog_turns_per_batch: int
    """Turns per batch (at least; exactly with ``yield_only_last_steps`` and in the continuous collector)."""
    total_dialog_turns: int = -1
    """Env dialog turns to run in the collector's life, in whole batches, as torchrl counts them (with
    ``yield_only_last_steps`` the intermediate turns left out count too; docs/collectors.md, "Turn
    budget"); -1 runs forever."""
    yield_only_last_steps: bool | None = None
    """Yield only the last turn of completed trajectories."""
    yield_completed_trajectories: bool | None = None
    """Yield only whole completed trajectories (defaults to ``yield_only_last_steps``)."""
    flatten_data: bool | None = None
    """Batches flat ``(N,)`` instead of ``(num_envs, T)`` (trajectory modes are always flat); None:
    flat when a ``replay_buffer`` is given, as in torchrl."""
    postproc: Callable[[TensorDictBase], TensorDictBase] | None = None
    """Applied to every batch before it is yielded or written (returning None holds it back)."""
    replay_buffer: Any | None = None
    """Write batches there; iteration then yields None."""
    track_policy_version: bool | PolicyVersion = False
    """True (int versions) or a :class:`PolicyVersion`."""
    verbose: bool = False
    """Log progress at INFO level."""
    dynamic_sampling: DynamicSampling | GroupFilter | None = None
    """Drop complete GRPO groups a filter rejects and refill batches with new ones (DAPO's dynamic
    sampling; envs with groups only): a :class:`~lmcollect.collectors.shared.group_filter.DynamicSampling`,
    or a bare filter such as ``drop_uniform_rewards()`` (its defaults). Counted in ``sampling_counts``."""
    mode: BatchMode = field(init=False)
    """Derived: ``"steps"``, ``"trajectories"`` or ``"last_steps"``."""
    flatten: bool = field(init=False)
    """Derived: whether batches are flat."""

    def __post_init__(self) -> None:
        mode, flatten = resolve_batching(
            dialog_turns_per_batch=self.dialog_turns_per_batch,
            total_dialog_turns=self.total_dialog_turns,
            yield_only_last_steps=self.yield_only_last_steps,
            yield_completed_trajectories=self.yield_completed_trajectories,
            flatten_data=self.flatten_data,
            has_replay_buffer=self.replay_buffer is not None,
        )
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "flatten", flatten)
        object.__setattr__(self, "dynamic_sampling", as_dynamic_sampling(self.dynamic_sampling))

    def arguments(self) -> dict[str, Any]:
        """The fields as constructor keyword arguments."""
        return {name: getattr(self, name) for name in field_names(type(self))}


def takes_collection_config(init: F) -> F:
    """For a collector's ``__init__(self, env, *, <its own arguments>, **collection)``: its signature
    (what ``help`` and ``inspect`` show, and what a Ray collector takes) lists its own arguments, then
    :class:`CollectionConfig`'s fields as keyword-only arguments with their defaults and types."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    shared = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
            annotation=f.type,
        )
        for f in dataclasses.fields(CollectionConfig)
        if f.init
    ]
    init.__signature__ = inspect.Signature([*own, *shared])  # type: ignore[attr-defined]
    return init


def collection_config(owner: str, collection: Mapping[str, Any], **overrides: Any) -> CollectionConfig:
    """The :class:`CollectionConfig` of ``owner``'s ``**collection`` arguments; a name that is
    neither one of ``owner``'s arguments nor a config field raises a TypeError naming it."""
    unknown = sorted(set(collection) - field_names(CollectionConfig))
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword argument(s) {unknown}; see help({owner}) for its arguments.")
    if "dialog_turns_per_batch" not in collection:
        raise TypeError(f"{owner}() missing the keyword argument dialog_turns_per_batch (turns per batch).")
    return CollectionConfig(**{**collection, **overrides})


def config_from(config_cls: type[C], arguments: Mapping[str, Any], **overrides: Any) -> C:
    """A config dataclass built from a constructor's arguments (its ``locals()``), taking the
    fields by name; ``overrides`` replace arguments."""
    names = field_names(config_cls)
    chosen = {name: value for name, value in arguments.items() if name in names}
    return config_cls(**{**chosen, **overrides})


def field_names(config_cls: type) -> frozenset[str]:
    """The names of a config dataclass's constructor fields."""
    return frozenset(f.name for f in dataclasses.fields(config_cls) if f.init)


class ConfiguredCollector:
    """The turn-budget properties every collector (local or Ray) reads from its ``config``."""

    config: CollectionConfig

    dialog_turns_per_batch = forwarded("config.dialog_turns_per_batch", "Number of dialog turns per batch.")
    total_dialog_turns = forwarded("config.total_dialog_turns", "Total number of dialog turns to run (-1: endless).")


def resolve_batching(
    *,
    dialog_turns_per_batch: int,
    total_dialog_turns: int,
    yield_only_last_steps: bool | None,
    yield_completed_trajectories: bool | None,
    flatten_data: bool | None,
    has_replay_buffer: bool = False,
) -> tuple[BatchMode, bool]:
    """Check the batching arguments and return (batch mode, flatten); ``flatten_data=None`` flattens
    when batches go to a replay buffer (as torchrl does: a buffer stores turns, not ``(num_envs, T)`` rows)."""
    if not isinstance(dialog_turns_per_batch, int) or dialog_turns_per_batch <= 0:
        raise ValueError(
            f"dialog_turns_per_batch must be a positive int, got {dialog_turns_per_batch!r}; "
            "pass how many dialog turns each batch should hold, e.g. dialog_turns_per_batch=64."
        )
    if not isinstance(total_dialog_turns, int) or (total_dialog_turns <= 0 and total_dialog_turns != -1):
        raise ValueError(f"total_dialog_turns must be a positive int or -1 (endless), got {total_dialog_turns!r}.")
    # As in the API we follow: yield_only_last_steps=True means "completed trajectories, last
    # step only", so yield_completed_trajectories defaults to it and may not contradict it.
    if yield_completed_trajectories is None:
        yield_completed_trajectories = bool(yield_only_last_steps)
    if yield_only_last_steps and not yield_completed_trajectories:
        raise TypeError(
            "yield_only_last_steps=True yields the last step of completed trajectories, so it needs "
            "yield_completed_trajectories=True (or None, its default); drop yield_completed_trajectories=False."
        )
    if yield_only_last_steps:
        mode: BatchMode = "last_steps"
    elif yield_completed_trajectories:
        mode = "trajectories"
    else:
        mode = "steps"
    if mode != "steps" and flatten_data is False:
        raise ValueError(
            f"flatten_data=False cannot be combined with {'yield_only_last_steps' if mode == 'last_steps' else 'yield_completed_trajectories'}=True: "
            "those batches are flat lists of turns. Leave flatten_data=None or set it to True."
        )
    flatten = True if mode != "steps" else (has_replay_buffer if flatten_data is None else flatten_data)
    return mode, flatten
