"""Payload codec: msgpack plus an extension type for numpy arrays and torch tensors.

Nothing is ever unpickled. Arrays travel as extension type 1::

    u8 len(dtype) | dtype str (numpy, e.g. "<f4") | u8 ndim | ndim x u64le shape | raw C-order bytes

Only dtypes of :data:`ALLOWED_DTYPES` are accepted. Decoding yields a read-only numpy array that
views the received bytes without a further copy. Torch tensors are encoded through
``tensor.numpy()`` (after moving to the CPU), so the decoded value is always a numpy array.
"""

from __future__ import annotations

import struct
import threading
from typing import Any

import msgpack
import numpy as np

from .errors import CodecError

ARRAY_EXT_TYPE = 1
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The most arrays and maps one message may decode to. Each is a Python list or dict of 64 bytes
# or more for one byte of msgpack (0x90, 0x80): without a bound, a 16 MiB payload of empty
# arrays written straight into a stream grew a worker by 1.7 GB, and a 64 MiB one (the message
# limit) would have taken about 7 GB.
DEFAULT_MAX_CONTAINERS = 1 << 20
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


_VALUES_HINT = (
    "send None, bools, numbers, str, bytes, lists, dicts, numpy arrays or torch tensors "
    "instead: values are never pickled"
)
_ARRAYS_HINT = "bool and numeric arrays only: strings travel as a list of str"

_HEADERS: dict[tuple[np.dtype[Any], tuple[int, ...]], bytes] = {}
_MAX_CACHED_HEADERS = 1024


def _array_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    header = _HEADERS.get((dtype, shape))
    if header is None:
        dtype_str = dtype.str
        if dtype_str not in ALLOWED_DTYPES:
            raise CodecError(f"arrays of dtype {dtype} cannot be sent ({_ARRAYS_HINT})")
        if len(shape) > MAX_NDIM:
            raise CodecError(f"arrays of more than {MAX_NDIM} dimensions cannot be sent")
        dtype_bytes = dtype_str.encode("ascii")
        header = bytes([len(dtype_bytes)]) + dtype_bytes + bytes([len(shape)])
        header += b"".join(_U64.pack(dim) for dim in shape)
        if len(_HEADERS) < _MAX_CACHED_HEADERS:
            _HEADERS[(dtype, shape)] = header
    return header


def _array_body(array: np.ndarray) -> bytes:
    """The extension type's data: header, then the raw C-order bytes (little-endian)."""
    dtype = array.dtype
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
        array = array.astype(dtype)
    return _array_header(dtype, array.shape) + array.tobytes()  # tobytes: C order


def _pack_array(array: np.ndarray) -> msgpack.ExtType:
    return msgpack.ExtType(ARRAY_EXT_TYPE, _array_body(array))


# msgpack's ext 8/16/32 headers: marker, big-endian length, then the type byte. (Bodies of 1,
# 2, 4, 8 or 16 bytes would use the fixext formats instead: left to msgpack.)
_EXT_FORMATS = ((0xFF, b"\xc7", 1), (0xFFFF, b"\xc8", 2), (0xFFFFFFFF, b"\xc9", 4))
EXT_HEADER_SIZES = {0xC7: 3, 0xC8: 4, 0xC9: 6}
_FIXEXT_SIZES = frozenset((1, 2, 4, 8, 16))
_ARRAY_EXT_TYPE_BYTE = bytes((ARRAY_EXT_TYPE,))


def pack_array(array: np.ndarray) -> bytes | None:
    """An array packed exactly as :func:`encode` packs it, without msgpack's per-object hooks
    (the hot path of requests and replies); None where msgpack must do it. Raises
    :class:`CodecError` for an array that cannot be sent."""
    try:
        body = _array_body(array)
    except CodecError:
        raise
    except Exception as exc:  # e.g. MemoryError copying a huge array
        raise CodecError(f"cannot encode array: {type(exc).__name__}") from exc
    head = _ext_head(len(body))
    return None if head is None else head + body


def _ext_head(size: int) -> bytes | None:
    """The extension header (marker, length, type) msgpack writes ahead of an array's body of
    ``size`` bytes; None where it packs the body as fixext (or cannot pack it)."""
    if size in _FIXEXT_SIZES:
        return None
    for limit, marker, width in _EXT_FORMATS:
        if size <= limit:
            return b"".join((marker, size.to_bytes(width, "big"), _ARRAY_EXT_TYPE_BYTE))
    return None


def array_prefix(dtype: np.dtype[Any], shape: tuple[int, ...]) -> tuple[bytes, int] | None:
    """What :func:`encode` packs every array of ``dtype`` and ``shape`` to ahead of its data,
    and the size of the whole: a payload of that size that starts so is such an array
    (``np.ndarray(shape, dtype, payload, len(prefix))``, read-only, as :func:`decode` makes
    it). None where there is no one prefix (a dtype that cannot be sent, or bodies msgpack
    packs as fixext)."""
    if dtype.byteorder == ">" or any(dim < 0 for dim in shape):
        return None
    try:
        header = _array_header(dtype, shape)
    except CodecError:
        return None
    data_bytes = dtype.itemsize
    for dim in shape:
        data_bytes *= dim
    head = _ext_head(len(header) + data_bytes)
    if head is None:
        return None
    prefix = head + header
    total = len(prefix) + data_bytes
    return (prefix, total) if total <= DEFAULT_MAX_MESSAGE_BYTES else None


def _unpack_bare_array(data: bytes, offset: int = 0) -> np.ndarray | None:
    """Decode ``data[offset:]`` if it is exactly one array (the common case), else None."""
    start = EXT_HEADER_SIZES.get(data[offset]) if len(data) > offset else None
    if start is None:
        return None
    start += offset
    if len(data) <= start or data[start - 1] != ARRAY_EXT_TYPE:
        return None
    if int.from_bytes(data[offset + 1 : start - 1], "big") != len(data) - start:
        return None
    return _unpack_array(data, start)


def decode_array_at(data: bytes, offset: int) -> np.ndarray | None:
    """The array packed by :func:`encode` that makes up ``data[offset:]``, without a copy;
    None if that is not one array. Raises :class:`CodecError`, and nothing else, for a
    malformed one."""
    return _unpack_bare_array(data, offset)


def parse_array_header(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """(dtype, shape, data bytes) of an array header (extension type 1's data up to the raw
    bytes), checked as :func:`decode` checks it; raises :class:`CodecError` for a bad one
    (or IndexError for one cut short)."""
    return _parse_header(header)


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
    if isinstance(obj, int):  # msgpack hands over the ints it has no format for
        raise CodecError(f"integers below -2**63 or above 2**64-1 cannot be sent ({_short(obj)})")
    raise CodecError(f"values of type {type(obj).__name__} cannot be sent ({_VALUES_HINT})")


def _short(number: int) -> str:
    """An int for an error message: its digits, or how many there are of them."""
    bits = number.bit_length()
    return str(number) if bits <= 128 else f"an integer of {bits} bits"


_PARSED: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], int]] = {}
_MAX_BYTES = 2**63  # numpy's limit: the nonzero dims times the itemsize must stay below it


def _parse_header(header: bytes) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """(dtype, shape, byte count) of an array header, checked against the allow-list and
    numpy's size limit (the product of the nonzero dims times the itemsize is below 2**63,
    so no dim is 2**63 or more)."""
    parsed = _PARSED.get(header)
    if parsed is not None:
        return parsed
    dtype_len = header[0]
    try:
        dtype_str = header[1 : 1 + dtype_len].decode("ascii")
    except UnicodeDecodeError as exc:
        raise CodecError("malformed array header") from exc
    ndim = header[1 + dtype_len]
    if ndim > MAX_NDIM:
        raise CodecError(f"array has {ndim} dimensions (most {MAX_NDIM})")
    if dtype_str not in ALLOWED_DTYPES:
        raise CodecError(f"array dtype {dtype_str!r} is not allowed")
    dtype = np.dtype(dtype_str)
    start = 2 + dtype_len
    shape = tuple(_U64.unpack_from(header, start + 8 * i)[0] for i in range(ndim))
    nominal = dtype.itemsize  # Python ints: no overflow, however large the dims
    for dim in shape:
        if dim:
            nominal *= dim
            if nominal >= _MAX_BYTES:
                raise CodecError("array shape is too large")
    parsed = (dtype, shape, 0 if 0 in shape else nominal)
    if len(_PARSED) >= _MAX_CACHED_HEADERS:
        _PARSED.clear()  # whoever sends many distinct shapes must not keep others uncached
    _PARSED[header] = parsed
    return parsed


def _unpack_array(data: bytes, start: int = 0) -> np.ndarray:
    """The array whose extension data begins at ``data[start]`` and runs to the end."""
    try:
        header_len = 2 + data[start] + 8 * data[start + 1 + data[start]]
    except IndexError as exc:
        raise CodecError("malformed array header") from exc
    end = start + header_len
    if end > len(data):
        raise CodecError("malformed array header")
    dtype, shape, size = _parse_header(data[start:end])
    if size != len(data) - end:
        raise CodecError("array data does not match its shape and dtype")
    try:
        # positional: numpy parses keyword arguments slowly (twice this call's cost)
        array: np.ndarray = np.ndarray(shape, dtype, data, end)
    except Exception as exc:  # not expected after the checks above; never a crash either way
        raise CodecError(f"malformed array: {type(exc).__name__}") from exc
    return array


def _ext_hook(code: int, data: bytes) -> Any:
    if code == ARRAY_EXT_TYPE:
        return _unpack_array(data)
    raise CodecError(f"unknown extension type {code}")


# msgpack decodes extension type -1 (its timestamp) itself, never through the ext_hook: a
# payload holding one is found by the headers such an extension starts with (4, 8 or 12 bytes
# of data), and then by looking for the Timestamp it became.
TIMESTAMP_EXT_TYPE = -1
_TIMESTAMP_HEADS = (
    b"\xd6\xff",
    b"\xd7\xff",
    b"\xc7\x0c\xff",
    b"\xc8\x00\x0c\xff",
    b"\xc9\x00\x00\x00\x0c\xff",
)


def _may_hold_timestamp(data: bytes) -> bool:
    return b"\xff" in data and any(head in data for head in _TIMESTAMP_HEADS)


def _holds_timestamp(value: Any) -> bool:
    pending = [value]
    while pending:
        value = pending.pop()
        if isinstance(value, msgpack.Timestamp):
            return True
        if isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value)
            pending.extend(value.values())
    return False


_local = threading.local()


def _packer() -> msgpack.Packer:
    packer: msgpack.Packer | None = getattr(_local, "packer", None)
    if packer is None:  # one per thread: a Packer is not thread-safe, and costs to create
        packer = _local.packer = msgpack.Packer(default=_default, use_bin_type=True)
    return packer


def _pack_with_msgpack(obj: Any) -> bytes:
    packer = _packer()
    try:
        data: bytes = packer.pack(obj)
    except CodecError:
        packer.reset()
        raise
    except Exception as exc:  # msgpack's own errors, or a value's (a tensor that won't convert)
        packer.reset()
        raise CodecError(f"cannot encode value: {type(exc).__name__}: {exc}") from exc
    return data


def encode(obj: Any, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """Encode a value (msgpack types, numpy arrays and scalars, torch tensors) to bytes;
    raises :class:`CodecError`, and nothing else, for a value that cannot be sent."""
    data = pack_array(obj) if type(obj) is np.ndarray else None
    if data is None:
        data = _pack_with_msgpack(obj)
    if len(data) > max_bytes:
        raise CodecError(f"message of {len(data)} bytes is over the {max_bytes}-byte limit")
    return data


class _Containers:
    """Counts the arrays and maps msgpack decodes (its list and object hook), and stops the
    decode with :class:`CodecError` at one past ``limit``."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.left = self.limit = limit

    def __call__(self, value: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise CodecError(f"message holds more than {self.limit} arrays and maps")
        return value


def decode_unchecked(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_containers: int = DEFAULT_MAX_CONTAINERS,
) -> Any:
    """Decode within :func:`decode`'s size and container limits, but leave every extension
    value a :class:`msgpack.ExtType`, unchecked, take arrays and maps as map keys (arrays as
    tuples, maps as dicts that hash by identity) and str that are not UTF-8 (their bytes as
    surrogates, which :func:`repack_unchecked` packs back): to read what surrounds a value
    :func:`decode` refuses (the request id of a foreign worker's reply). Raises
    :class:`CodecError`, and nothing else, for anything malformed."""
    if len(data) > max_bytes:
        raise CodecError(f"message of {len(data)} bytes is over the {max_bytes}-byte limit")
    count = _Containers(max_containers) if len(data) > max_containers else None

    def mapping(pairs: list[tuple[Any, Any]]) -> _KeyMap:
        built = _KeyMap(pairs)
        return count(built) if count is not None else built

    try:
        return msgpack.unpackb(
            data,
            ext_hook=msgpack.ExtType,
            raw=False,
            strict_map_key=False,
            use_list=False,
            list_hook=count,
            object_pairs_hook=mapping,
            unicode_errors="surrogateescape",
        )
    except CodecError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise CodecError(f"malformed payload: {type(exc).__name__}") from exc


def repack_unchecked(value: Any) -> bytes:
    """msgpack of a value :func:`decode_unchecked` gave, with the bytes it read (for
    :func:`decode` to say what is wrong with them)."""
    packed: bytes = msgpack.packb(value, use_bin_type=True, unicode_errors="surrogateescape")
    return packed


class _KeyMap(dict):  # type: ignore[type-arg]
    """A decoded map that may itself be a map key (a Ruby Hash's key may be any value)."""

    __hash__ = object.__hash__  # type: ignore[assignment]


def decode(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_containers: int = DEFAULT_MAX_CONTAINERS,
) -> Any:
    """Decode bytes made by :func:`encode`; raises :class:`CodecError`, and nothing else, for
    anything malformed (this is the boundary behind which every untrusted payload is read),
    or for a message of more than ``max_bytes`` bytes, or of more than ``max_containers``
    arrays and maps (counted as they are decoded: the decode stops there)."""
    try:
        if len(data) > max_bytes:
            raise CodecError(f"message of {len(data)} bytes is over the {max_bytes}-byte limit")
        array = _unpack_bare_array(data)
        if array is not None:
            return array
        # each array or map takes at least one byte: a shorter message needs no count
        count = _Containers(max_containers) if len(data) > max_containers else None
        value = msgpack.unpackb(
            data,
            ext_hook=_ext_hook,
            raw=False,
            strict_map_key=False,
            list_hook=count,
            object_hook=count,
        )
        if _may_hold_timestamp(data) and _holds_timestamp(value):
            raise CodecError(f"unknown extension type {TIMESTAMP_EXT_TYPE}")
        return value
    except CodecError:
        raise
    except TypeError as exc:  # a map key that is an array or a map: no dict can hold it
        if "unhashable" not in str(exc):
            raise CodecError(f"malformed payload: {type(exc).__name__}") from exc
        raise CodecError(
            "a map key is an array or a map (a tuple key, say), which cannot be decoded"
        ) from exc
    except UnicodeDecodeError as exc:
        raise CodecError(
            "a msgpack str holds bytes that are not UTF-8 (send bytes as bin)"
        ) from exc
    except Exception as exc:  # msgpack (and numpy) raise several unrelated types
        raise CodecError(f"malformed payload: {type(exc).__name__}") from exc
