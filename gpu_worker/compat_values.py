"""Torch tensors through gpu_worker.compat's streamers: they leave as tensors, arrive as tensors.

microbatch's codec sends a tensor as an array (never pickle) and decodes it as a numpy array.
service_streamer handed tensors over as tensors, so the compat streamers mark them on the way
out and rebuild them on the way in, at any depth in lists, tuples and dicts: an item (or a
result) that holds a tensor travels as ``{TENSOR_ITEM: value}`` with each tensor in it as
``{TENSOR: array}`` (plus its dtype when the array's differs, as for bfloat16). Items without
tensors travel unchanged, and receiving them costs one type check.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

TENSOR_ITEM = "\0microbatch.compat.tensors"
TENSOR = "\0torch"
DTYPE = "\0dtype"

_PLAIN = frozenset((str, bytes, int, float, bool, type(None), np.ndarray))


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _mark(value: Any) -> tuple[Any, bool]:
    """(the value with its tensors marked, whether it held one)."""
    kind = type(value)
    if kind in _PLAIN:
        return value, False
    if kind is list or kind is tuple:
        marked = [_mark(item) for item in value]
        if any(found for _, found in marked):
            return [item for item, _ in marked], True
        return value, False
    if kind is dict:
        pairs = {key: _mark(item) for key, item in value.items()}
        if any(found for _, found in pairs.values()):
            return {key: item for key, (item, _) in pairs.items()}, True
        return value, False
    if _is_tensor(value):
        tensor = value.detach().cpu()
        marker: dict[str, Any] = {TENSOR: tensor}
        if str(tensor.dtype) == "torch.bfloat16":  # the codec widens it to float32
            marker[DTYPE] = "bfloat16"
        return marker, True
    return value, False


def to_wire(value: Any) -> Any:
    """``value`` ready for the codec, its tensors marked (unchanged if it holds none)."""
    if type(value) in _PLAIN or "torch" not in sys.modules:  # no torch: no tensors to find
        return value
    marked, found = _mark(value)
    return {TENSOR_ITEM: marked} if found else value


def _rebuild(value: Any, torch: Any) -> Any:
    kind = type(value)
    if kind is list:
        return [_rebuild(item, torch) for item in value]
    if kind is dict:
        array = value.get(TENSOR)
        if isinstance(array, np.ndarray) and len(value) <= 2:
            if torch is None:  # no torch on this side: the array is the closest thing
                return array
            tensor = torch.from_numpy(np.array(array))  # a writable copy, as unpickling gives
            dtype = value.get(DTYPE)
            return tensor.to(getattr(torch, dtype)) if isinstance(dtype, str) else tensor
        return {key: _rebuild(item, torch) for key, item in value.items()}
    return value


def from_wire(value: Any) -> Any:
    """A decoded item or result with its marked tensors rebuilt (unchanged if it holds none)."""
    if type(value) is not dict or TENSOR_ITEM not in value or len(value) != 1:
        return value
    torch: Any
    try:
        import torch
    except ImportError:  # no torch on this side: the arrays are the closest thing
        torch = None
    return _rebuild(value[TENSOR_ITEM], torch)
