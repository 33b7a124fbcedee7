"""Values into KServe datatypes: the caller-side rules, shared by TensorSpec and the gateway.

Numeric datatypes take numbers only: never null, booleans or strings, also deep inside nested
lists (numpy would turn them into NaN, 1.0 or a parsed number). Integer datatypes take whole
numbers within their range; FP16/FP32 take finite values that stay finite (NaN and infinities
given as such pass). BOOL takes booleans only. Light: numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# KServe v2 datatypes and the numpy dtypes they travel as (BYTES: str or bytes values).
DATATYPES: dict[str, str | None] = {
    "BOOL": "bool",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BYTES": None,
}


class Unfit(ValueError):
    """A value that a datatype does not take, at ``position`` (indices into the value given)."""

    def __init__(self, position: Sequence[int], problem: str) -> None:
        super().__init__(problem)
        self.position = [int(i) for i in position]
        self.problem = problem

    def describe(self, name: str, position: Sequence[int] | None = None) -> str:
        """``input 'x' at [3]: <problem>`` (``position`` overrides the stored one)."""
        where = self.position if position is None else list(position)
        at = f" at {where}" if where else ""
        return f"input {name!r}{at}: {self.problem}"


def to_datatype(value: Any, dtype: np.dtype[Any], datatype: str) -> np.ndarray:
    """``value`` (a number, or nested lists and arrays of numbers) as an array of ``dtype``.

    Raises :class:`Unfit` for a value ``datatype`` does not take, and ``ValueError`` (or
    ``TypeError``/``OverflowError``) when ``value`` is not a tensor at all (ragged lists).
    """
    boolean = dtype.kind == "b"
    bad = first_unfit(value, boolean)
    if bad is not None:
        position, leaf = bad
        wanted = "a boolean" if boolean else "a number"
        raise Unfit(position, f"{_describe(leaf)} is not {wanted} ({datatype})")
    if dtype.kind == "f":
        return _to_floats(value, dtype, datatype)
    if boolean:
        return np.asarray(value, dtype=dtype)
    return _to_integers(value, dtype, datatype)


def _first(mask: np.ndarray) -> list[int]:
    return [int(i) for i in np.argwhere(mask)[0]]


def _to_floats(value: Any, dtype: np.dtype[Any], datatype: str) -> np.ndarray:
    if dtype.itemsize == 8:
        return np.asarray(value, dtype=dtype)
    wide = np.asarray(value, dtype=np.float64)  # exact for every number a caller can send
    limit = float(np.finfo(dtype).max)
    if (np.abs(wide) > limit).any():  # rare: look for a finite one (inf and nan may pass)
        # past the largest value, but one that rounds down to it is that value (3.4028235e38,
        # FP32's largest as it is written in its shortest form, v1's and v2's outputs included)
        with np.errstate(over="ignore"):
            narrow = wide.astype(dtype)
        too_large = np.isfinite(wide) & np.isinf(narrow)
        if too_large.any():
            position = _first(too_large)
            number = float(wide[tuple(position)])
            raise Unfit(position, f"{number!r} is out of range for {datatype}")
        return narrow
    return wide.astype(dtype)


def _to_integers(value: Any, dtype: np.dtype[Any], datatype: str) -> np.ndarray:
    source = np.asarray(value)
    info = np.iinfo(dtype)
    if source.dtype.kind == "O" or (
        # Python ints past 2**53 in a list with floats: float64 is no longer exact
        source.dtype.kind == "f"
        and not isinstance(value, np.ndarray)
        and (np.abs(source) >= 2.0**53).any()
    ):
        return _to_integers_exactly(value, dtype, datatype)
    if source.dtype.kind == "f":
        whole = np.isfinite(source) & (source == np.trunc(source))
        if not whole.all():
            position = _first(~whole)
            number = float(source[tuple(position)])
            raise Unfit(position, f"{number!r} is not a whole number ({datatype})")
        # powers of two are exact as floats: compare with them, not with iinfo's bounds
        low = -(2.0 ** (info.bits - 1)) if info.min < 0 else 0.0
        outside = (source < low) | (source >= low + 2.0**info.bits)
    elif np.can_cast(source.dtype, dtype):
        return source.astype(dtype, copy=False)
    else:
        outside = (source < info.min) | (source > info.max)
    if outside.any():
        position = _first(outside)
        number = source[tuple(position)].item()
        raise Unfit(position, f"{number!r} is out of range for {datatype}")
    return source.astype(dtype)


def _to_integers_exactly(value: Any, dtype: np.dtype[Any], datatype: str) -> np.ndarray:
    """The slow, exact path: each leaf checked as a Python number."""
    leaves = np.asarray(value, dtype=object)
    info = np.iinfo(dtype)
    out = np.empty(leaves.shape, dtype=dtype)
    for position, leaf in np.ndenumerate(leaves):
        if isinstance(leaf, (list, tuple, np.ndarray)):
            raise ValueError("nested lists of different lengths")
        number = leaf.item() if isinstance(leaf, np.generic) else leaf
        if isinstance(number, float):
            if not (math.isfinite(number) and number == math.trunc(number)):
                raise Unfit(position, f"{number!r} is not a whole number ({datatype})")
            whole = math.trunc(number)
        else:
            whole = int(number)
        if not info.min <= whole <= info.max:
            raise Unfit(position, f"{number!r} is out of range for {datatype}")
        out[position] = whole
    return out


def _is_number_type(kind: type) -> bool:
    return issubclass(kind, (int, float, np.integer, np.floating)) and not issubclass(
        kind, (bool, np.bool_)
    )


def _is_boolean_type(kind: type) -> bool:
    return issubclass(kind, (bool, np.bool_))


# The leaf types each kind of datatype takes, for one quick subset test of a flat list
# (subclasses of these are checked one by one).
_NUMBER_TYPES = frozenset({int, float, *(np.dtype(code).type for code in "bBhHiIlLqQefd")})
_BOOLEAN_TYPES = frozenset({bool, np.bool_})
_ARRAY_KINDS = {False: "iuf", True: "b"}


def first_unfit(value: Any, boolean: bool = False) -> tuple[list[int], Any] | None:
    """The position and value of the first leaf of ``value`` (a number, or nested lists and
    arrays) that is not a number (with ``boolean``: not a boolean); None if every leaf is."""
    if isinstance(value, list) and set(map(type, value)) <= (
        _BOOLEAN_TYPES if boolean else _NUMBER_TYPES
    ):
        return None  # the common case, a flat list of numbers
    return _walk(value, boolean)


def _walk(node: Any, boolean: bool) -> tuple[list[int], Any] | None:
    fits = _is_boolean_type if boolean else _is_number_type
    if isinstance(node, (list, tuple)):
        for index, child in enumerate(node):
            if isinstance(child, (list, tuple, np.ndarray)):
                found = _walk(child, boolean)
                if found is not None:
                    return [index, *found[0]], found[1]
            elif not fits(type(child)):
                return [index], child
        return None
    if isinstance(node, np.ndarray):
        if node.dtype.kind in _ARRAY_KINDS[boolean]:
            return None
        for position, child in np.ndenumerate(node):
            if node.dtype.kind != "O" or not fits(type(child)):
                return [int(i) for i in position], child
        return None
    return None if fits(type(node)) else ([], node)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (bool, np.bool_)):
        return f"a boolean ({str(bool(value)).lower()})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (bytes, bytearray)):
        return "bytes"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return f"the number {value!r}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
