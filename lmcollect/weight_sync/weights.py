"""Weights as flat name -> tensor dicts: extraction from any source, checks, and in-place loading."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

WeightDict = dict[str, torch.Tensor]


def to_weight_dict(source: Any) -> WeightDict:
    """Names and tensors of an ``nn.Module``, a TensorDict module, a TensorDict or a (nested) dict."""
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
        "weights must be an nn.Module, a TensorDict, a dict of tensors, or a policy with a .model, "
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
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            targets[name] = tensor
    return targets, aliases


def check_weights(
    weights: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[torch.dtype, torch.Size]],
    *,
    aliases: Mapping[str, str] | None = None,
    convert_dtype: bool = False,
) -> None:
    """Raise one ValueError listing every missing, extra, misshapen or wrongly typed tensor.

    ``aliases`` (tied weights) may be sent or left out; ``convert_dtype`` accepts other float
    dtypes (they are cast when loaded).
    """
    aliases = aliases or {}
    problems: list[str] = []
    for name in expected:
        if name not in weights and not any(a in weights for a, t in aliases.items() if t == name):
            problems.append(f"missing {name!r}")
    for name, tensor in weights.items():
        target = aliases.get(name, name)
        if target not in expected:
            problems.append(f"unexpected {name!r}")
            continue
        dtype, shape = expected[target]
        if tuple(tensor.shape) != tuple(shape):
            problems.append(f"{name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(shape)}")
        if tensor.dtype != dtype and not (convert_dtype and tensor.is_floating_point() and dtype.is_floating_point):
            problems.append(
                f"{name!r} has dtype {tensor.dtype}, the model expects {dtype} (pass convert_dtype=True to cast)"
            )
    if problems:
        shown = "; ".join(problems[:20]) + (f"; ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise ValueError(f"weight push rejected, no weight was changed: {len(problems)} problem(s): {shown}")


def expected_metadata(model: torch.nn.Module) -> tuple[dict[str, tuple[torch.dtype, torch.Size]], dict[str, str]]:
    targets, aliases = unique_targets(model)
    return tensor_metadata(targets), aliases


@torch.no_grad()
def load_weights_(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], *, convert_dtype: bool = False) -> None:
    """Check ``weights`` against ``model``, then copy them into its tensors in place (all or nothing)."""
    targets, aliases = unique_targets(model)
    check_weights(weights, tensor_metadata(targets), aliases=aliases, convert_dtype=convert_dtype)
    for name, tensor in weights.items():
        targets[aliases.get(name, name)].copy_(tensor)
