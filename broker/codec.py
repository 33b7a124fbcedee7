"""Payload codec: msgpack plus an extension type for numpy arrays and torch tensors.

Nothing is ever unpickled. Arrays travel as extension type 1::

    u8 len(dtype) | dtype str (numpy, e.g. "<f4") | u8 ndim | ndim x u64le shape | raw C-order bytes

Only dtypes of :data:`ALLOWED_DTYPES` are accepted. Decoding yields a read-only numpy array that
views the received bytes without a further copy. Torch tensors are encoded through
``tensor.numpy()`` (after moving to the CPU), so the decoded value is always a numpy array.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from .errors import CodecError

ARRAY_EXT_TYPE = 1
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_NDIM = 32

ALLOWED_DTYPES: frozenset[str] = frozenset(
    np.dtype(name).newbyteorder("<").str
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
)  # fmt: skip

_U64 = struct.Struct("<Q")


def _torch_to_numpy(obj: Any) -> np.ndarray | None:
    """Return a numpy view of a torch tensor without importing torch (None if not a tensor)."""
    module = type(obj).__module__
    if not (module == "torch" or module.startswith("torch.")) or not hasattr(obj, "numpy"):
        return None
    tensor = obj.detach()
    if str(tensor.dtype) == "torch.bfloat16":  # numpy has no bfloat16: widen losslessly
        tensor = tensor.float()
    return np.asarray(tensor.cpu().numpy())


def _pack_array(array: np.ndarray) -> msgpack.ExtType:
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    dtype_str = np.dtype(dtype).str
    if dtype_str not in ALLOWED_DTYPES:
        raise CodecError(f"arrays of dtype {array.dtype} cannot be sent")
    if array.ndim > MAX_NDIM:
        raise CodecError(f"arrays of more than {MAX_NDIM} dimensions cannot be sent")
    data = np.ascontiguousarray(array, dtype=dtype)
    dtype_bytes = dtype_str.encode("ascii")
    header = bytes([len(dtype_bytes)]) + dtype_bytes + bytes([data.ndim])
    header += b"".join(_U64.pack(dim) for dim in data.shape)
    return msgpack.ExtType(ARRAY_EXT_TYPE, header + data.tobytes())


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _pack_array(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    as_numpy = _torch_to_numpy(obj)
    if as_numpy is not None:
        return _pack_array(as_numpy)
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise CodecError(f"values of type {type(obj).__name__} cannot be sent")


def _unpack_array(data: bytes) -> np.ndarray:
    try:
        view = memoryview(data)
        dtype_len = view[0]
        dtype_str = bytes(view[1 : 1 + dtype_len]).decode("ascii")
        pos = 1 + dtype_len
        ndim = view[pos]
        pos += 1
        if ndim > MAX_NDIM:
            raise CodecError(f"array has {ndim} dimensions (most {MAX_NDIM})")
        shape = tuple(_U64.unpack_from(data, pos + 8 * i)[0] for i in range(ndim))
        pos += 8 * ndim
    except (IndexError, struct.error, UnicodeDecodeError) as exc:
        raise CodecError("malformed array header") from exc
    if dtype_str not in ALLOWED_DTYPES:
        raise CodecError(f"array dtype {dtype_str!r} is not allowed")
    dtype = np.dtype(dtype_str)
    count = 1
    for dim in shape:
        count *= dim
    if count * dtype.itemsize != len(data) - pos:
        raise CodecError("array data does not match its shape and dtype")
    return np.frombuffer(data, dtype=dtype, count=count, offset=pos).reshape(shape)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == ARRAY_EXT_TYPE:
        return _unpack_array(data)
    raise CodecError(f"unknown extension type {code}")


def encode(obj: Any, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """Encode a value (msgpack types, numpy arrays and scalars, torch tensors) to bytes."""
    try:
        data: bytes = msgpack.packb(obj, default=_default, use_bin_type=True)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode value: {exc}") from exc
    if len(data) > max_bytes:
        raise CodecError(f"message of {len(data)} bytes is over the {max_bytes}-byte limit")
    return data


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Any:
    """Decode bytes made by :func:`encode`; raises :class:`CodecError` for anything malformed."""
    if len(data) > max_bytes:
        raise CodecError(f"message of {len(data)} bytes is over the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise CodecError(f"malformed payload: {type(exc).__name__}") from exc
