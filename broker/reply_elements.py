"""Reply elements: what one element of a reply list holds (docs/protocol.md, section 7.1).

An element is either **one reply map** (``{"id", "ok", "result"/"error"}``) or a **packed
element**: a msgpack array of reply maps, the replies of one batch to one reply key for items
of multi-item (v2) entries, whose writers read both forms. A worker packs them with
:func:`pack` (the maps as they were encoded, concatenated behind an array header: nothing is
encoded twice); a caller tells the two apart by the first byte (:func:`is_packed`: a map
starts with 0x80-0x8f, 0xde or 0xdf, an array with 0x90-0x9f, 0xdc or 0xdd) and reads a packed
one with :func:`decode_element`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import codec
from .errors import CodecError, ProtocolError
from .protocol import RESULT_OK, Reply, decode_reply, reply_from_message, result_id_span

# The most replies, and bytes, one packed element holds: a reader decodes an element at once,
# so it stays far below the codec's message limit; a reply bigger than this goes alone.
MAX_ELEMENT_REPLIES = 512
MAX_ELEMENT_BYTES = 1024 * 1024

_ARRAY_MARKERS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
_OK_LEN = len(RESULT_OK)
_NO_DTYPE = np.dtype("u1")  # (a placeholder: no array read yet)


def array_header(count: int) -> bytes:
    """The msgpack header of an array of ``count`` (at most 65535) values."""
    if count < 16:
        return bytes((0x90 | count,))
    return b"\xdc" + count.to_bytes(2, "big")


def pack(payloads: Sequence[bytes]) -> list[bytes]:
    """Reply maps to one reply key as list elements: packed elements of up to
    MAX_ELEMENT_REPLIES replies and MAX_ELEMENT_BYTES bytes, in order, each begun where the
    next reply would pass either; a group of one reply (one over MAX_ELEMENT_BYTES, or one
    left over) goes as its map."""
    if len(payloads) <= MAX_ELEMENT_REPLIES and sum(map(len, payloads)) <= MAX_ELEMENT_BYTES:
        return [_joined(list(payloads))] if payloads else []  # the usual case: all in one
    elements: list[bytes] = []
    group: list[bytes] = []
    size = 0
    for payload in payloads:
        if group and (len(group) >= MAX_ELEMENT_REPLIES or size + len(payload) > MAX_ELEMENT_BYTES):
            elements.append(_joined(group))
            group, size = [], 0
        group.append(payload)
        size += len(payload)
    if group:
        elements.append(_joined(group))
    return elements


def _joined(group: list[bytes]) -> bytes:
    if len(group) == 1:
        return group[0]
    return array_header(len(group)) + b"".join(group)


def is_packed(element: bytes) -> bool:
    """Whether a reply list's element is a packed element (else it is one reply map)."""
    return bool(element) and element[0] in _ARRAY_MARKERS


def reply_id(payload: bytes) -> bytes | None:
    """The request id of a reply map whose first field is ``id`` (as every reply this package
    encodes), read from its head without decoding it; None for any other."""
    span = result_id_span(payload)
    return None if span is None else payload[span[0] : span[1]]


def decode_element(element: bytes) -> list[Reply | ProtocolError]:
    """The replies of a packed element, in order: each a :class:`Reply`, or a ProtocolError
    where an entry of the array is not a map with a string ``id`` (nothing routes it). Raises
    :class:`CodecError` (and nothing else) if the element as a whole cannot be read."""
    fast = _decode_array_results(element)
    return fast if fast is not None else _decode_through_msgpack(element)


def _decode_through_msgpack(element: bytes) -> list[Reply | ProtocolError]:
    """:func:`decode_element` through msgpack: any element."""
    messages = codec.decode(element)
    if not isinstance(messages, list):
        raise CodecError("packed reply element is not an array")
    out: list[Reply | ProtocolError] = []
    for message in messages:
        try:
            out.append(reply_from_message(message))
        except ProtocolError as exc:
            out.append(exc)
    return out


def _decode_array_results(data: bytes) -> list[Reply | ProtocolError] | None:
    """A packed element whose every reply is a result that is one array, packed as
    :func:`broker.protocol.encode_result` packs it, read without msgpack (the hot path of a
    caller); None for any other element. Each array gets its own copy of its bytes, so one
    result kept does not keep its element's others alive. The arrays of one batch usually
    share dtype and shape: an array header equal to the last one's is not parsed again."""
    counted = _array_count(data)
    if counted is None:
        return None
    count, at = counted
    out: list[Reply | ProtocolError] = []
    append, ndarray = out.append, np.ndarray
    id_span, ok_mark, ok_len = result_id_span, RESULT_OK, _OK_LEN
    layout: tuple[bytes, np.dtype[Any], tuple[int, ...], int] = (b"", _NO_DTYPE, (), 0)
    try:
        for _ in range(count):
            span = id_span(data, at)
            if span is None:
                return None
            start, end = span
            if not data.startswith(ok_mark, end):
                return None
            at = end + ok_len
            if not (layout[0] and data.startswith(layout[0], at)):
                found = _array_layout(data, at)
                if found is None:
                    return None
                layout = found
            body = at + len(layout[0])
            at = body + layout[3]
            array = ndarray(layout[2], layout[1], data[body:at])  # TypeError if cut short
            append(Reply(data[start:end].decode(), True, array))
    except Exception:  # cut short, not UTF-8, a malformed array: msgpack says what is wrong
        return None
    return out if at == len(data) else None


def _array_count(data: bytes) -> tuple[int, int] | None:
    """(how many values, where the first begins) of a msgpack array of fewer than 65536
    values at the start of ``data``; None for anything else."""
    marker = data[0] if data else 0
    if 0x90 <= marker <= 0x9F:
        return marker & 0x0F, 1
    if marker == 0xDC and len(data) >= 3:
        return int.from_bytes(data[1:3], "big"), 3
    return None


def _array_layout(data: bytes, at: int) -> tuple[bytes, np.dtype[Any], tuple[int, ...], int] | None:
    """(the bytes from the extension header at ``data[at]`` to the end of its array header,
    the array's dtype, shape and data bytes) of an array as codec packs it, with data; else
    None (raises CodecError or IndexError where it is malformed or cut short)."""
    width = codec.EXT_HEADER_SIZES.get(data[at])
    if width is None or data[at + width - 1] != codec.ARRAY_EXT_TYPE:
        return None
    body = at + width
    size = int.from_bytes(data[at + 1 : body - 1], "big")
    header_len = 2 + data[body] + 8 * data[body + 1 + data[body]]
    dtype, shape, nbytes = codec.parse_array_header(data[body : body + header_len])
    if nbytes == 0 or nbytes != size - header_len:
        return None
    return data[at : body + header_len], dtype, shape, nbytes


def decode_any(element: bytes) -> list[Reply | ProtocolError]:
    """Every reply of a reply list's element, whichever form it has (see
    :func:`decode_element`; a reply map gives one). Raises :class:`CodecError` or
    :class:`ProtocolError` when nothing of it can be routed."""
    try:
        if is_packed(element):
            return decode_element(element)
        return [decode_reply(element)]
    except CodecError as exc:
        salvaged = _salvage(element)
        if salvaged is None:
            salvaged = _failed_by_head(element, exc)
        if salvaged is None:
            raise exc from None
        return salvaged


def _failed_by_head(element: bytes, problem: CodecError) -> list[Reply | ProtocolError] | None:
    """A reply map the codec cannot read at all (more arrays and maps, or more bytes, than it
    reads) that begins as workers write one, a map of three whose first key is ``id`` with a
    str value: its item fails with ProtocolError rather than wait for its deadline. None for
    any other element."""
    span = result_id_span(element)
    if span is None or span[1] > len(element):
        return None
    try:
        request_id = element[span[0] : span[1]].decode()
    except UnicodeDecodeError:
        return None
    failed = Reply(request_id, False, error_type=ProtocolError.__name__,
                   error_message=f"malformed reply: {problem}")  # fmt: skip
    return [failed]


def _salvage(element: bytes) -> list[Reply | ProtocolError] | None:
    """The replies of an element holding a value the codec refuses (a foreign worker's array
    of a dtype off section 4's list, an unknown extension type): each reply map is read alone,
    and one the codec refuses fails its item with ProtocolError rather than leave its call to
    its deadline. None where no map can be routed: not msgpack, or over the codec's limits."""
    try:
        whole = codec.decode_unchecked(element)
    except CodecError:  # not msgpack, or not of any value a reply can hold: nothing routes it
        return None
    if not (is_packed(element) and isinstance(whole, tuple)):
        reply = _salvage_map(whole)
        return [reply] if isinstance(reply, Reply) else None
    return [_salvage_map(message) for message in whole]


def _salvage_map(message: Any) -> Reply | ProtocolError:
    """One reply map of :func:`_salvage`, decoded alone by the codec."""
    try:
        return reply_from_message(codec.decode(codec.repack_unchecked(message)))
    except ProtocolError as exc:
        return exc
    except CodecError as exc:
        request_id = message.get("id") if isinstance(message, dict) else None
        if not isinstance(request_id, str):
            return ProtocolError("reply is not a map with a string 'id'")
        return Reply(request_id, False, error_type="ProtocolError",
                     error_message=f"malformed reply: {exc}")  # fmt: skip
