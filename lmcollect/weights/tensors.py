"""Weights as flat name -> tensor dicts: extraction from any source, checks, and in-place loading."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule

from lmcollect.weights.buckets import WeightBuckets, holds_non_finite

WeightDict = dict[str, torch.Tensor]
Metadata = Mapping[str, tuple[torch.dtype, torch.Size]]


def to_weight_dict(source: Any, *, like: Any = None) -> WeightDict:
    """Names and tensors of an ``nn.Module``, a TensorDict module, a TensorDict, a (nested) dict,
    a policy exposing ``.model``, or :class:`WeightBuckets` (zero-copy views).

    ``like``: the receiving model (or its names); names that all carry one extra leading
    component it lacks (a policy module wrapping the model as ``.model`` gives ``model.*``)
    are spelled its way (see :func:`align_names`).
    """
    weights = _extract(source)
    if like is None:
        return weights
    names = like if isinstance(like, (set, frozenset, Mapping)) else set(like.state_dict().keys())
    return align_names(weights, names)


def align_names(weights: WeightDict, expected_names: Any) -> WeightDict:
    """``weights`` renamed to ``expected_names`` when every name has one extra leading component.

    A policy that wraps its model (``policy.model = model``) reports ``model.layer.weight`` for the
    model's ``layer.weight``; dropping the common ``model.`` makes the push fit. Names that already
    fit, or that do not fit after dropping it either, are returned unchanged (the check then names
    what is wrong).
    """
    expected = set(expected_names)
    if not weights or set(weights) <= expected:
        return weights
    prefixes = {name.split(".", 1)[0] for name in weights}
    if len(prefixes) != 1 or any("." not in name for name in weights):
        return weights
    stripped = {name.split(".", 1)[1]: tensor for name, tensor in weights.items()}
    return stripped if set(stripped) <= expected else weights


def _extract(source: Any) -> WeightDict:
    if isinstance(source, WeightBuckets):
        return source.tensors()
    if isinstance(source, TensorDictModule) and isinstance(source.module, torch.nn.Module):
        # the wrapped model's names (no "module." prefix), as the receiving model spells them
        return dict(source.module.state_dict())
    if isinstance(source, torch.nn.Module):
        return dict(source.state_dict())
    if isinstance(source, TensorDictBase):
        return {k: v for k, v in source.flatten_keys(".").items()}
    if isinstance(source, Mapping):
        return _flatten_mapping(source)
    model = getattr(source, "model", None)  # a policy object exposing its model
    if isinstance(model, torch.nn.Module):
        return dict(model.state_dict())
    raise TypeError(
        "weights must be an nn.Module, a TensorDict, a dict of tensors, WeightBuckets or a policy with a .model, "
        f"got {type(source).__name__}."
    )


def _flatten_mapping(mapping: Mapping, prefix: str = "") -> WeightDict:
    out: WeightDict = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten_mapping(value, name + "."))
        elif isinstance(value, torch.Tensor):
            out[name] = value
        else:
            raise TypeError(f"weight {name!r} is a {type(value).__name__}, not a tensor.")
    return out


def tensor_metadata(weights: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """name -> (dtype, shape), the form vLLMUpdater's ``model_metadata`` uses."""
    return {name: (t.dtype, t.shape) for name, t in weights.items()}


def unique_targets(model: torch.nn.Module) -> tuple[WeightDict, dict[str, str]]:
    """The model's state (without tied aliases) and a map alias -> the name it shares storage with."""
    targets: WeightDict = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen and tensor.numel() > 0:  # empty tensors may all report data_ptr 0
            aliases[name] = seen[key]
        else:
            seen[key] = name
            targets[name] = tensor
    return targets, aliases


def check_weights(
    weights: Mapping[str, torch.Tensor],
    expected: Metadata,
    *,
    aliases: Mapping[str, str] | None = None,
    convert_dtype: bool = False,
) -> None:
    """Raise one ValueError listing every missing, extra, misshapen or wrongly typed tensor."""
    raise_if_problems(weight_problems(tensor_metadata(weights), expected, aliases=aliases, convert_dtype=convert_dtype))


def weight_problems(
    sent: Metadata,
    expected: Metadata,
    *,
    aliases: Mapping[str, str] | None = None,
    convert_dtype: bool = False,
) -> list[str]:
    """Every difference between the ``sent`` and ``expected`` (name -> (dtype, shape)) metadata.

    ``aliases`` (tied weights: alias -> name) may be sent or left out; ``convert_dtype`` accepts
    other floating dtypes for floating tensors (they are cast when loaded).
    """
    aliases = aliases or {}
    problems: list[str] = []
    for name in expected:
        if name not in sent and not any(a in sent for a, t in aliases.items() if t == name):
            problems.append(f"missing {name!r}")
    for name, (dtype, shape) in sent.items():
        target = aliases.get(name, name)
        if target not in expected:
            problems.append(f"unexpected {name!r}")
            continue
        want_dtype, want_shape = expected[target]
        if tuple(shape) != tuple(want_shape):
            problems.append(f"{name!r} has shape {tuple(shape)}, the model expects {tuple(want_shape)}")
        if dtype != want_dtype and not (convert_dtype and dtype.is_floating_point and want_dtype.is_floating_point):
            problems.append(
                f"{name!r} has dtype {dtype}, the model expects {want_dtype} (pass convert_dtype=True to cast)"
            )
    return problems


def problems_per_receiver(
    weights: Mapping[str, torch.Tensor],
    receivers: Iterable[tuple[Metadata, Mapping[str, str]]],
    *,
    convert_dtype: bool = False,
) -> list[list[str]]:
    """:func:`weight_problems` of pushing ``weights`` to each receiver (``receivers``: each one's
    ``(metadata, aliases)``), in the receivers' order: what a push to several must check first."""
    sent = tensor_metadata(weights)
    return [weight_problems(sent, meta, aliases=aliases, convert_dtype=convert_dtype) for meta, aliases in receivers]


def non_finite_problems(
    weights: Mapping[str, torch.Tensor], *, dtypes: Mapping[str, torch.dtype] | None = None
) -> list[str]:
    """A problem for every floating tensor holding a NaN or an infinity (pushed only with
    ``allow_non_finite=True``). One min/max pass per tensor: NaN propagates through both, so min
    and max are finite exactly when every element is (much cheaper than ``isfinite(t).all()``).

    ``dtypes``: name -> the dtype a receiver holds the tensor in (``convert_dtype``). The check is
    then on the converted values: a cast is monotonic, so the extremes overflow first (fp32 1e5
    becomes fp16 inf: a problem, though finite as pushed)."""
    problems = []
    for name, tensor in weights.items():
        held = (dtypes or {}).get(name, tensor.dtype)
        if holds_non_finite(tensor, as_dtype=held):
            where = "" if held == tensor.dtype else f" once cast to {held}"
            problems.append(f"{name!r} holds NaN or infinite values{where} (allow_non_finite=True pushes it anyway)")
    return problems


def cast_to_held(
    weights: Mapping[str, torch.Tensor], metadata: Mapping[str, tuple[torch.dtype, Any]], aliases: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """``weights`` with every floating tensor cast to the floating dtype the receiver holds it in
    (``metadata`` / ``aliases`` as :func:`expected_metadata` gives them): a ``convert_dtype`` push
    into an engine that checks dtypes strictly. Names the receiver does not know are left for its check."""
    cast = {}
    for name, tensor in weights.items():
        held = metadata.get(aliases.get(name, name))
        dtype = held[0] if held is not None else tensor.dtype
        floating = tensor.is_floating_point() and dtype.is_floating_point
        cast[name] = tensor.to(dtype) if floating and dtype != tensor.dtype else tensor
    return cast


def narrowest_held_dtypes(
    weights: Mapping[str, torch.Tensor],
    receivers: Iterable[tuple[Mapping[str, tuple[torch.dtype, Any]], Mapping[str, str]]],
) -> dict[str, torch.dtype]:
    """name -> the floating dtype of least range that any receiver holds the tensor in, where it
    differs from the pushed one (``receivers``: each one's ``(metadata, aliases)``); for
    :func:`non_finite_problems` on a ``convert_dtype`` push."""
    receivers = list(receivers)
    narrowest: dict[str, torch.dtype] = {}
    for name, tensor in weights.items():
        if not tensor.is_floating_point():
            continue
        held = [meta[aliases.get(name, name)][0] for meta, aliases in receivers if aliases.get(name, name) in meta]
        floating = [dtype for dtype in held if dtype.is_floating_point and dtype != tensor.dtype]
        if floating:
            narrowest[name] = min(floating, key=lambda dtype: torch.finfo(dtype).max)
    return narrowest


def agreed_held_dtypes(
    weights: Mapping[str, torch.Tensor],
    receivers: Iterable[tuple[Mapping[str, tuple[torch.dtype, Any]], Mapping[str, str]]],
    *,
    why_one: str,
) -> dict[str, torch.dtype]:
    """name -> the one dtype every receiver holds the tensor in, where it differs from the pushed one
    (``receivers``: each one's ``(metadata, aliases)``; call after the names were checked).

    Receivers that disagree raise ``ValueError``; ``why_one`` says why the push needs them to agree
    and how to fix it.
    """
    receivers = list(receivers)
    dtypes: dict[str, torch.dtype] = {}
    for name, tensor in weights.items():
        held = {meta[aliases.get(name, name)][0] for meta, aliases in receivers}
        if len(held) > 1:
            raise ValueError(f"receivers hold {name!r} in different dtypes {sorted(map(str, held))}; {why_one}")
        dtype = held.pop()
        if dtype != tensor.dtype:
            dtypes[name] = dtype
    return dtypes


def raise_if_problems(problems: list[str], *, where: str = "") -> None:
    """One ValueError naming every problem (the first 20 in full)."""
    if not problems:
        return
    shown = "; ".join(problems[:20]) + (f"; ... and {len(problems) - 20} more" if len(problems) > 20 else "")
    raise ValueError(f"weight push rejected{where}, no weight was changed: {len(problems)} problem(s): {shown}")


def expected_metadata(model: torch.nn.Module) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
    """What ``model`` accepts: name -> (dtype, shape) of its distinct tensors, and its tied aliases."""
    targets, aliases = unique_targets(model)
    return tensor_metadata(targets), aliases


@torch.no_grad()
def load_weights_(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], *, convert_dtype: bool = False) -> None:
    """Check ``weights`` against ``model``, then copy them into its tensors in place (all or nothing).

    Only the model's state-dict tensors change: tied weights stay tied (same storage), and
    non-persistent buffers and other attributes are left alone.
    """
    targets, aliases = unique_targets(model)
    check_weights(weights, tensor_metadata(targets), aliases=aliases, convert_dtype=convert_dtype)
    for name, tensor in weights.items():
        targets[aliases.get(name, name)].copy_(tensor)


def _tensors_by_target(model: torch.nn.Module) -> tuple[dict[str, list[torch.Tensor]], dict[str, str]]:
    """Every state tensor object of ``model`` under the distinct name it shares storage with."""
    targets, aliases = unique_targets(model)
    groups: dict[str, list[torch.Tensor]] = {name: [tensor] for name, tensor in targets.items()}
    state = model.state_dict(keep_vars=True)
    for alias, name in aliases.items():
        groups[name].append(state[alias])
    return groups, aliases


@torch.no_grad()
def share_weights_(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], *, convert_dtype: bool = False) -> None:
    """Check ``weights`` against ``model``, then point its tensors at them: no copy (all or nothing).

    For weights that live in shared memory (a Ray object mapped by every collector on a node): the
    model then reads that memory directly, so a push costs one copy in all, however many
    collectors share it. The memory may be read-only: never write such a model's tensors in
    place before :func:`unshare_weights_`. Tied weights stay tied (every alias is repointed); a
    tensor cast by ``convert_dtype`` is a private copy.
    """
    groups, aliases = _tensors_by_target(model)
    check_weights(
        weights, {n: (g[0].dtype, g[0].shape) for n, g in groups.items()}, aliases=aliases, convert_dtype=convert_dtype
    )
    for name, tensor in weights.items():
        group = groups[aliases.get(name, name)]
        data = tensor if tensor.dtype == group[0].dtype else tensor.to(group[0].dtype)
        for target in group:
            target.data = data


@torch.no_grad()
def unshare_weights_(model: torch.nn.Module) -> None:
    """Give ``model`` private, writable copies of tensors :func:`share_weights_` pointed elsewhere."""
    groups, _ = _tensors_by_target(model)
    for group in groups.values():
        data = group[0].detach().clone()
        for target in group:
            target.data = data
