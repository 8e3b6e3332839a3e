"""LoRA adapters as a push: the adapter's own tensors travel, the engine merges them into a kept
copy of its base weights (pure torch; ``peft`` is only read, and only when given a peft model).

A low-rank adapter on a linear layer ``W`` (out x in) is ``A`` (r x in) and ``B`` (out x r); the
layer then computes with ``W + scaling * B @ A``. Every engine that takes a :class:`LoraAdapter`
follows one base rule (docs/weight-sync.md, "LoRA"): a full push (or a delta), whatever its values,
is a new base; an adapter push writes ``base + scaling * B @ A`` on top of the current base, so
adapters replace each other and never stack, and the base model's weights are never sent again.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcollect.weights.buckets import WeightBuckets, pack_buckets

Metadata = Mapping[str, tuple[torch.dtype, torch.Size]]

_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


@dataclass(frozen=True)
class LoraLayerWeights:
    """One adapted linear layer: ``A`` (rank x in), ``B`` (out x rank) and its ``scaling``."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])

    def delta(self) -> torch.Tensor:
        """``scaling * B @ A`` in float32 (out x in): what the adapter adds to the base weight."""
        return (self.lora_b.float() @ self.lora_a.float()) * self.scaling

    def merged(self, base: torch.Tensor) -> torch.Tensor:
        """``base + scaling * B @ A`` in ``base``'s dtype, computed in float32 in one fused matmul-add."""
        a, b = self.lora_a.to(base.device, torch.float32), self.lora_b.to(base.device, torch.float32)
        return torch.addmm(base.float(), b, a, alpha=self.scaling).to(base.dtype)

    def merge_overflows(self, base: torch.Tensor, base_absmax: float | None = None) -> bool:
        """Whether :meth:`merged` of ``base`` holds a value that is not finite in ``base``'s dtype
        (finite but huge factors or scaling overflow it). Decided from bounds first: every element
        of ``B @ A`` is at most ``rank * max|B| * max|A|`` (computed in float32 before the scaling),
        every merged one at most ``|base| + |scaling|`` times that (``base_absmax``: the base's
        largest magnitude, if known); only bounds past the dtypes' range compute the merge."""
        if base_absmax is None:
            base_absmax = max_magnitude(base)
        product = self.rank * max_magnitude(self.lora_b) * max_magnitude(self.lora_a)
        merged = base_absmax + abs(self.scaling) * product
        float32_max = torch.finfo(torch.float32).max
        # False for a NaN or infinite bound too: then the merge itself decides
        if product < float32_max and merged < min(torch.finfo(base.dtype).max, float32_max):
            return False
        return not bool(torch.isfinite(self.merged(base)).all())

    def merge_into(self, base: torch.Tensor, out: torch.Tensor) -> None:
        """Write :meth:`merged` of ``base`` into ``out`` (same shape): straight from the fused
        matmul-add when ``out`` is a float32 tensor, else through a float32 result."""
        if out.dtype == torch.float32 and base.dtype == torch.float32 and out.is_contiguous():
            a, b = self.lora_a.to(out.device, torch.float32), self.lora_b.to(out.device, torch.float32)
            torch.addmm(base, b, a, alpha=self.scaling, out=out)
        else:
            out.copy_(self.merged(base))


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter to push: ``layers`` maps the adapted layer's weight name, as the receiving
    model spells it (``model.layers.0.self_attn.q_proj.weight``), to its :class:`LoraLayerWeights`;
    ``rank`` is the rank the adapter was configured with (every layer must have it, unless
    ``layer_ranks`` gives it its own).

    Build one with :func:`lora_adapter` from a ``peft`` model or from an adapter state dict and
    its ``LoraConfig``; ``push_weights`` / ``update_policy_weights_`` accept a peft model directly.
    """

    layers: Mapping[str, LoraLayerWeights]
    rank: int
    layer_ranks: Mapping[str, int] = field(default_factory=dict)
    """Weight name -> rank of the layers configured with a rank other than ``rank`` (peft's
    ``rank_pattern``); the others must have ``rank``."""

    def rank_of(self, name: str) -> int:
        """The rank layer ``name`` was configured with."""
        return int(self.layer_ranks.get(name, self.rank))

    @property
    def nbytes(self) -> int:
        """Bytes of adapter tensors (what a push sends)."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.lora_a, layer.lora_b))

    def merged_into(self, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``name -> base + scaling * B @ A`` for every adapted layer, in the base tensor's dtype."""
        return {name: layer.merged(base[name]) for name, layer in self.layers.items()}

    def to(self, device: torch.device | str) -> LoraAdapter:
        """The same adapter with its tensors on ``device``."""
        return self._mapped(lambda t: t.to(device))

    def cloned(self, device: torch.device | str | None = None) -> LoraAdapter:
        """The same adapter with tensors of its own (a few MB), on ``device`` (None: where they are)."""
        return self._mapped(lambda t: t.detach().to(t.device if device is None else device, copy=True))

    def _mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LoraAdapter:
        layers = {name: LoraLayerWeights(fn(w.lora_a), fn(w.lora_b), w.scaling) for name, w in self.layers.items()}
        return LoraAdapter(layers=layers, rank=self.rank, layer_ranks=dict(self.layer_ranks))

    def flat(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The adapter as plain data to send: ``<weight name>.lora_A`` / ``.lora_B`` -> tensor, and
        weight name -> scaling (:meth:`from_flat` rebuilds it)."""
        tensors: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"] = layer.lora_a, layer.lora_b
        return tensors, {name: layer.scaling for name, layer in self.layers.items()}

    def cpu_flat(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """:meth:`flat` with contiguous CPU tensors (to pack and send)."""
        tensors, scalings = self.flat()
        return {name: t.detach().cpu().contiguous() for name, t in tensors.items()}, scalings

    @classmethod
    def from_flat(
        cls,
        tensors: Mapping[str, torch.Tensor],
        scalings: Mapping[str, float],
        rank: int,
        layer_ranks: Mapping[str, int] | None = None,
    ) -> LoraAdapter:
        """The adapter :meth:`flat` gave."""
        layers = {
            name: LoraLayerWeights(tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"], float(scaling))
            for name, scaling in scalings.items()
        }
        return cls(layers=layers, rank=int(rank), layer_ranks={k: int(v) for k, v in (layer_ranks or {}).items()})

    def state(self) -> dict[str, Any]:
        """The adapter as plain data (tensors, floats, ints) for a checkpoint; :meth:`from_state` rebuilds it."""
        tensors, scalings = self.flat()
        return {"tensors": tensors, "scalings": scalings, "rank": self.rank, "layer_ranks": dict(self.layer_ranks)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> LoraAdapter:
        """The adapter :meth:`state` described (a TypeError/ValueError naming what is wrong, for a
        state that is not one)."""
        if not isinstance(state, Mapping) or not {"tensors", "scalings", "rank"} <= set(state):
            raise ValueError(
                "a saved LoRA adapter needs 'tensors', 'scalings' and 'rank'; this state was not saved by lmcollect."
            )
        tensors, scalings = state["tensors"], state["scalings"]
        missing = [f"{name}.lora_{half}" for name in scalings for half in "AB" if f"{name}.lora_{half}" not in tensors]
        if missing:
            raise ValueError(
                f"the saved LoRA adapter misses tensors {missing[:5]}; this state was not saved by lmcollect."
            )
        return cls.from_flat(tensors, scalings, state["rank"], state.get("layer_ranks"))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled (e.g. by ``ray.put``) as one packed byte buffer per dtype, held in numpy arrays:
        Ray stores those without copying, where pickling each tensor would serialize it on its own.
        Unpickled, the tensors are views of those bytes (read-only in an object store)."""
        tensors, scalings = self.cpu_flat()
        packed = pack_buckets(tensors, device="cpu").to_numpy()
        return (_unpacked_adapter, (packed, scalings, self.rank, dict(self.layer_ranks)))


def _unpacked_adapter(
    buckets: WeightBuckets, scalings: Mapping[str, float], rank: int, layer_ranks: Mapping[str, int] | None = None
) -> LoraAdapter:
    return LoraAdapter.from_flat(buckets.tensors(), scalings, rank, layer_ranks)


# ---------------------------------------------------------------------- building an adapter
def is_lora_source(source: Any) -> bool:
    """True for a :class:`LoraAdapter` or a peft model with a LoRA adapter."""
    return isinstance(source, LoraAdapter) or _is_peft_model(source)


def lora_adapter(source: Any, config: Any = None) -> LoraAdapter:
    """The :class:`LoraAdapter` of ``source``: a :class:`LoraAdapter` (returned as is), a peft model
    (its active LoRA adapter), or an adapter state dict (``get_peft_model_state_dict``'s keys,
    ``...q_proj.lora_A.weight``) with ``config``, its ``LoraConfig`` (or a dict of its fields).

    Refused with a ValueError naming the fix: DoRA, bias training, ``modules_to_save`` and
    ``fan_in_fan_out`` layers (they change more than the low-rank product), and an A/B pair with
    a missing half or mismatched rank.
    """
    if isinstance(source, LoraAdapter):
        return source
    if _is_peft_model(source):
        return _from_peft_model(source)
    if isinstance(source, Mapping):
        if config is None:
            raise TypeError(
                "an adapter state dict needs its LoraConfig: lora_adapter(state_dict, config) "
                "(or push the peft model itself)."
            )
        return _from_state_dict(source, _config_fields(config))
    raise TypeError(
        f"a LoRA push takes a peft model, a LoraAdapter or (adapter state dict, LoraConfig); got {type(source).__name__}."
    )


def _is_peft_model(source: Any) -> bool:
    return type(source).__module__.startswith("peft") and hasattr(source, "peft_config")


def _config_fields(config: Any) -> dict[str, Any]:
    fields = dict(config) if isinstance(config, Mapping) else dict(vars(config))
    _refuse_unsupported(fields)
    return fields


def _refuse_unsupported(fields: Mapping[str, Any]) -> None:
    problems = []
    if fields.get("use_dora"):
        problems.append("use_dora=True (DoRA rescales the base weight; push the merged model instead)")
    if fields.get("bias", "none") not in (None, "none"):
        problems.append(f"bias={fields.get('bias')!r} (trained biases are not LoRA tensors; use bias='none')")
    if fields.get("modules_to_save"):
        problems.append("modules_to_save (whole trained modules; push them with a full push)")
    if fields.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out=True (Conv1D layers; this push supports nn.Linear layers)")
    if problems:
        raise ValueError("this LoRA config cannot be pushed as an adapter: " + "; ".join(problems) + ".")


def _from_peft_model(model: Any) -> LoraAdapter:
    name = model.active_adapter
    name = name[0] if isinstance(name, (list, tuple)) else name
    _refuse_unsupported(vars(model.peft_config[name]))
    rank = int(model.peft_config[name].r)
    layers: dict[str, LoraLayerWeights] = {}
    layer_ranks: dict[str, int] = {}
    for module_name, module in model.named_modules():
        lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        if lora_a is None or lora_b is None or name not in lora_a:
            continue
        weight_name = _base_name(module_name) + ".weight"
        # the layer's own rank and scaling: peft resolved rank_pattern / alpha_pattern for it
        layers[weight_name] = LoraLayerWeights(
            lora_a[name].weight.detach(), lora_b[name].weight.detach(), float(module.scaling[name])
        )
        if int(module.r[name]) != rank:
            layer_ranks[weight_name] = int(module.r[name])
    if not layers:
        raise ValueError(f"the peft model has no LoRA layers for its active adapter {name!r}: nothing to push.")
    return LoraAdapter(layers=layers, rank=rank, layer_ranks=layer_ranks)


def _from_state_dict(state: Mapping[str, torch.Tensor], fields: Mapping[str, Any]) -> LoraAdapter:
    rank, alpha = int(fields["r"]), float(fields.get("lora_alpha", fields["r"]))
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"adapter key {key!r} is not a LoRA tensor (<layer>.lora_A.weight / <layer>.lora_B.weight); "
                "pass get_peft_model_state_dict(model), or push the peft model itself."
            )
        halves.setdefault(_base_name(match["module"]), {})[match["which"]] = tensor
    missing = [
        f"{module}.lora_{'B' if 'A' in pair else 'A'}.weight" for module, pair in halves.items() if len(pair) != 2
    ]
    if missing:
        raise ValueError(f"the adapter state dict misses half of a LoRA pair: {missing[:5]}.")
    layers, layer_ranks = {}, {}
    for module, pair in halves.items():
        layer_rank = int(_pattern_value(fields.get("rank_pattern"), module, rank))
        layer_alpha = float(_pattern_value(fields.get("alpha_pattern"), module, alpha))
        root = math.sqrt(layer_rank) if fields.get("use_rslora") else layer_rank
        layers[module + ".weight"] = LoraLayerWeights(pair["A"], pair["B"], layer_alpha / root)
        if layer_rank != rank:
            layer_ranks[module + ".weight"] = layer_rank
    return LoraAdapter(layers=layers, rank=rank, layer_ranks=layer_ranks)


def _base_name(module: str) -> str:
    return module[len(_PEFT_PREFIX) :] if module.startswith(_PEFT_PREFIX) else module


def _pattern_value(patterns: Mapping[str, Any] | None, module: str, default: float) -> Any:
    """The value of the first of peft's ``rank_pattern`` / ``alpha_pattern`` keys that matches
    ``module`` (matched as peft does: a regex for the name's tail), else ``default``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


# ---------------------------------------------------------------------- checks
def adapter_problems(adapter: LoraAdapter, metadata: Metadata) -> list[str]:
    """What keeps ``adapter`` from fitting a model with ``metadata`` (name -> (dtype, shape)):
    an adapted layer the model lacks or that is not a 2-D weight, A/B shapes that do not match the
    layer, a rank other than the adapter's, non-floating or non-finite tensors. Empty: it fits."""
    problems: list[str] = []
    for name, layer in adapter.layers.items():
        problems.extend(f"{name}: {p}" for p in _layer_problems(layer, metadata.get(name), adapter.rank_of(name)))
    return problems


def _layer_problems(layer: LoraLayerWeights, held: tuple[torch.dtype, torch.Size] | None, rank: int) -> list[str]:
    if held is None:
        return ["the model has no such weight"]
    shape = tuple(held[1])
    if len(shape) != 2:
        return [f"not a linear layer's weight (shape {shape})"]
    out_features, in_features = shape
    a, b = tuple(layer.lora_a.shape), tuple(layer.lora_b.shape)
    problems: list[str] = []
    if len(a) != 2 or len(b) != 2 or a[1] != in_features or b[0] != out_features or a[0] != b[1]:
        problems.append(
            f"lora_A {a} and lora_B {b} do not fit the weight {shape} (want (r, {in_features}) and ({out_features}, r))"
        )
    elif a[0] != rank:
        problems.append(f"rank {a[0]} but the adapter's rank is {rank}")
    for which, tensor in (("lora_A", layer.lora_a), ("lora_B", layer.lora_b)):
        if not tensor.is_floating_point():
            problems.append(f"{which} has dtype {tensor.dtype}, not a floating type")
        elif not bool(torch.isfinite(tensor).all()):
            problems.append(f"{which} holds non-finite values")
    if not math.isfinite(layer.scaling):
        problems.append(f"scaling {layer.scaling} is not finite")
    return problems


def max_magnitude(tensor: torch.Tensor) -> float:
    """The largest magnitude in ``tensor`` (0 when empty; NaN propagates), from one min/max pass
    (no ``abs()`` copy of the tensor)."""
    if tensor.numel() == 0:
        return 0.0
    low, high = torch.aminmax(tensor.detach())
    return max(-float(low), float(high))


def check_merge(
    adapter: LoraAdapter,
    bases: Mapping[str, torch.Tensor],
    *,
    receiver: str = "the model",
    base_absmax: Mapping[str, float] | None = None,
) -> None:
    """Raise a ValueError, before anything is written, when merging ``adapter`` into ``bases``
    (name -> the base weight each adapted layer merges into) gives a weight that is not finite in
    its dtype (see :meth:`LoraLayerWeights.merge_overflows`; ``base_absmax``: known magnitudes)."""
    known = base_absmax or {}
    overflowing = [
        name for name, layer in adapter.layers.items() if layer.merge_overflows(bases[name], known.get(name))
    ]
    if overflowing:
        raise ValueError(
            f"merging this LoRA adapter into {receiver} gives weights that are not finite in their dtype "
            f"(inf or NaN) in {len(overflowing)} layer(s): {overflowing[:5]}; nothing was loaded and the version "
            "is unchanged. Its factors or scaling are out of range: check the training run (the loss, the "
            "learning rate, lora_alpha) before pushing it."
        )


def check_adapter(adapter: LoraAdapter, metadata: Metadata, *, receiver: str = "the model") -> None:
    """Raise one ValueError naming every problem of :func:`adapter_problems` (nothing is loaded)."""
    problems = adapter_problems(adapter, metadata)
    if problems:
        raise ValueError(
            f"this LoRA adapter does not fit {receiver} ({len(problems)} problem(s)); nothing was loaded: "
            + "; ".join(problems[:8])
            + ". Build the adapter on the model the engine serves, with the same rank as its LoraConfig."
        )
