"""Turn nested state (dicts, lists, tensors, TensorDicts, Histories) into JSON plus named tensors.

A checkpoint must not unpickle arbitrary objects, so state goes through this codec: tensors are
stored by name (in a safetensors file), everything else becomes plain JSON with a few tagged types.
Anything else is refused with an error naming where it was found.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_tensor_collection

from lmcollect.data.history import History

_TAG = "$"


class Encoder:
    """Collects tensors while turning a value into JSON-able data (see :func:`encode`)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, where: str = "state") -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            name = f"t{len(self.tensors)}"
            self.tensors[name] = value.detach().cpu().contiguous().clone()
            return {_TAG: "tensor", "name": name}
        if isinstance(value, History):
            saved = {_TAG: "history", "messages": value.to_dicts()}
            return saved if value.tools is None else {**saved, "tools": [dict(tool) for tool in value.tools]}
        if isinstance(value, TensorDictBase):
            return self._tensordict(value, where)
        if isinstance(value, Mapping):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"{where}: dict keys must be str to be saved, got {sorted(map(repr, value))[:5]}.")
            return {_TAG: "dict", "items": {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}}
        if isinstance(value, (list, tuple)):
            tag = "list" if isinstance(value, list) else "tuple"
            return {_TAG: tag, "items": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, bytes):
            return {_TAG: "bytes", "hex": value.hex()}
        raise TypeError(
            f"{where}: cannot save a {type(value).__name__} without pickling it; checkpoints hold tensors, "
            "TensorDicts, Histories, str/int/float/bool/None and lists/dicts of those."
        )

    def _tensordict(self, td: TensorDictBase, where: str) -> dict:
        if td.batch_dims:
            return {
                _TAG: "stack",
                "items": [self._tensordict(part, f"{where}[{i}]") for i, part in enumerate(td.unbind(0))],
            }
        entries: list = []
        self._leaves(td, [], entries, where)
        return {_TAG: "td", "entries": entries}

    def _leaves(self, td: TensorDictBase, prefix: list[str], entries: list, where: str) -> None:
        """Every leaf (tensor or non-tensor value) under ``td``, with its full key."""
        for name, value in td.items():
            key = [*prefix, name]
            if isinstance(value, (NonTensorData, NonTensorStack)):
                value = value.tolist() if isinstance(value, NonTensorStack) else value.data
            elif is_tensor_collection(value):
                self._leaves(value, key, entries, where)
                continue
            entries.append([key, self.encode(value, f"{where}[{'.'.join(key)}]")])


def encode(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able data, tensors by name) for ``value``."""
    encoder = Encoder()
    return encoder.encode(value), encoder.tensors


def decode(data: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`encode`."""
    if not isinstance(data, dict):
        return data
    tag = data.get(_TAG)
    if tag == "tensor":
        return tensors[data["name"]]
    if tag == "history":
        return History.from_dicts(data["messages"], tools=data.get("tools"))
    if tag == "dict":
        return {k: decode(v, tensors) for k, v in data["items"].items()}
    if tag == "list":
        return [decode(v, tensors) for v in data["items"]]
    if tag == "tuple":
        return tuple(decode(v, tensors) for v in data["items"])
    if tag == "bytes":
        return bytes.fromhex(data["hex"])
    if tag == "stack":
        from tensordict import lazy_stack

        return lazy_stack([decode(v, tensors) for v in data["items"]])
    if tag == "td":
        td = TensorDict({}, batch_size=[])
        for key, value in data["entries"]:
            td.set(tuple(key), decode(value, tensors))
        return td
    raise ValueError(f"not a value written by lmcollect.data.codec: {str(data)[:200]}")


def save(path: str | Path, value: Any) -> Path:
    """Write ``value`` to ``path`` (a ``.safetensors`` file; the JSON part is in its metadata)."""
    import json

    from safetensors.torch import save_file

    data, tensors = encode(value)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    os.close(os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_NOFOLLOW, 0o600))  # 0600: weights, prompts
    os.chmod(tmp, 0o600)  # a tmp file a crashed save left keeps its mode otherwise
    save_file(tensors, str(tmp), metadata={"lmcollect": json.dumps(data)})
    tmp.replace(path)  # a crash while saving never leaves a half-written file under the real name
    return path


def load(path: str | Path) -> Any:
    """Read what :func:`save` wrote."""
    import json

    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if "lmcollect" not in metadata:
            raise ValueError(f"{path} was not written by lmcollect (no 'lmcollect' metadata).")
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - a safe_open handle is not iterable
    return decode(json.loads(metadata["lmcollect"]), tensors)
