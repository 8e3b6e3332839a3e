"""A full push straight into a vLLM model's parameters (runs in the vLLM worker).

vLLM's general in-place reload (``reload_weights(..., is_checkpoint_format=True)``) rebuilds every
layer from its recorded metadata on each push: new tensors for the whole model, the load into
them, the layer's processing, a copy back. For an unquantized dense model almost all of that is
work a push does not need: the model's own ``load_weights`` copies each checkpoint tensor into its
parameter (fusing q/k/v and gate/up through the parameters' weight loaders), and all that is left
to redo is what the platform derives from the weights. On CUDA nothing (the linear layers read
their weights); on CPU the packed copy vLLM's GEMM reads (oneDNN), built from the weight and then
the weight is dropped. So :class:`DirectLoad` keeps each CPU linear layer's weight in model format
(made once, from the metadata vLLM recorded when it loaded the model), puts it back into the layer
for the load, then has vLLM pack it again (its own dispatch) and drop it from the layer: the
layer ends as vLLM's loader leaves it. A push is then one copy of the bytes plus the repacking.

Anything else (a quantized model, another platform, a layer vLLM recorded nothing for) is not
supported here: :func:`direct_load_for` answers None and the worker keeps vLLM's reload.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["DirectLoad", "direct_load_for"]

_LINEAR = "UnquantizedLinearMethod"
_EMBEDDING = "UnquantizedEmbeddingMethod"


def direct_load_for(model: torch.nn.Module, *, quantization: str | None, platform: str) -> DirectLoad | None:
    """A :class:`DirectLoad` for ``model``, or None where pushes must go through vLLM's reload: a
    quantized model, a platform other than ``"cpu"`` or ``"cuda"``, a layer with another processing."""
    if quantization is not None or platform not in ("cpu", "cuda"):
        return None
    methods = {type(method).__name__ for method in _quant_methods(model).values()}
    if not methods <= {_LINEAR, _EMBEDDING}:
        return None
    try:
        return DirectLoad(model, on_cpu=platform == "cpu")
    except LookupError as missing:  # vLLM recorded no metadata to rebuild a dropped weight from
        logger.info("pushes use vLLM's reload: %s", missing)
        return None


def _quant_methods(model: torch.nn.Module) -> dict[torch.nn.Module, Any]:
    return {m: m.quant_method for m in model.modules() if getattr(m, "quant_method", None) is not None}


class DirectLoad:
    """Loads full pushes into ``model`` in place (see the module's docstring); worker thread only."""

    def __init__(self, model: torch.nn.Module, *, on_cpu: bool) -> None:
        self.model = model
        methods = _quant_methods(model)
        linear = [m for m, method in methods.items() if type(method).__name__ == _LINEAR]
        # CPU: the linear layers whose weight vLLM dropped once it packed it; their weight, kept here
        self._kept = {layer: _model_format_weight(layer) for layer in linear if on_cpu and _dropped(layer)}
        # CPU: layers whose packed GEMM copy is built beside a weight they keep (the output embedding)
        self._repacked = [m for m, method in methods.items() if on_cpu and type(method).__name__ == _EMBEDDING]

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy ``weights`` (checkpoint names, checked) into the model, then rebuild what derives from them."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for layer, weight in self._kept.items():
            layer.weight = weight  # model format again, for the model's weight loaders
        try:
            self.model.load_weights(iter(weights.items()))
        finally:
            for layer in self._kept:  # packed again from the new weight, which the layer drops again
                dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        for module in self._repacked:
            module.quant_method.process_weights_after_loading(module)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the weights kept in model format (CPU: the linear layers')."""
        return sum(weight.numel() * weight.element_size() for weight in self._kept.values())


def _dropped(layer: torch.nn.Module) -> bool:
    weight = getattr(layer, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.numel() == 0


def _model_format_weight(layer: torch.nn.Module) -> torch.nn.Parameter:
    """A new weight for ``layer`` as its quant method created it (shape, dtype, weight loader), from
    the metadata vLLM recorded for reloading it."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    info = LAYERWISE_INFO.get(layer)
    meta = None if info is None else info.restore_metadata[0].get("weight")
    if meta is None:
        raise LookupError(f"no recorded weight metadata for {type(layer).__name__}")
    with info.restore_device:
        weight = materialize_meta_tensor(meta)
    return restore_layer_refs(weight, layer)
