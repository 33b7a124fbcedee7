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

from . import codec
from .errors import CodecError, ProtocolError
from .protocol import RESULT_HEAD, RESULT_OK, Reply, decode_reply, reply_from_message

# The most replies, and bytes, one packed element holds: a reader decodes an element at once,
# so it stays far below the codec's message limit; a reply bigger than this goes alone.
MAX_ELEMENT_REPLIES = 512
MAX_ELEMENT_BYTES = 1024 * 1024

_ARRAY_MARKERS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))
_EXT_HEADERS = {0xC7: 3, 0xC8: 4, 0xC9: 6}  # marker: header bytes (marker, length, type)
_HEAD_LEN, _OK_LEN = len(RESULT_HEAD), len(RESULT_OK)


def array_header(count: int) -> bytes:
    """The msgpack header of an array of ``count`` (at most 65535) values."""
    if count < 16:
        return bytes((0x90 | count,))
    return b"\xdc" + count.to_bytes(2, "big")


def pack(payloads: Sequence[bytes]) -> list[bytes]:
    """Reply maps to one reply key as list elements: packed elements of up to
    MAX_ELEMENT_REPLIES replies and MAX_ELEMENT_BYTES bytes, in order; a reply left alone (one
    over MAX_ELEMENT_BYTES, or the last of its group) goes as its map."""
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
    if not payload.startswith(RESULT_HEAD):
        return None
    at = len(RESULT_HEAD)
    marker = payload[at] if len(payload) > at else 0
    if marker & 0xE0 == 0xA0:  # fixstr
        return payload[at + 1 : at + 1 + (marker & 0x1F)]
    if marker == 0xD9 and len(payload) > at + 1:  # str 8
        return payload[at + 2 : at + 2 + payload[at + 1]]
    return None


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
    result kept does not keep its element's others alive."""
    marker = data[0] if data else 0
    if 0x90 <= marker <= 0x9F:
        count, at = marker & 0x0F, 1
    elif marker == 0xDC and len(data) >= 3:
        count, at = int.from_bytes(data[1:3], "big"), 3
    else:
        return None
    out: list[Reply | ProtocolError] = []
    try:
        for _ in range(count):
            found = _array_result_at(data, at)
            if found is None:
                return None
            reply, at = found
            out.append(reply)
    except (IndexError, UnicodeDecodeError, CodecError):
        return None  # msgpack says what is wrong, and with which reply
    return out if at == len(data) else None


def _array_result_at(data: bytes, at: int) -> tuple[Reply, int] | None:
    """The reply map at ``data[at]`` if it is an array result as encode_result packs it, and
    where it ends; else None (IndexError, UnicodeDecodeError, CodecError where it is cut or
    malformed)."""
    if not data.startswith(RESULT_HEAD, at):
        return None
    at += _HEAD_LEN
    marker = data[at]
    if marker & 0xE0 == 0xA0:  # fixstr
        start = at + 1
        end = start + (marker & 0x1F)
    elif marker == 0xD9:  # str 8
        start = at + 2
        end = start + data[at + 1]
    else:
        return None
    if not data.startswith(RESULT_OK, end):
        return None
    at = end + _OK_LEN
    width = _EXT_HEADERS.get(data[at])
    if width is None or data[at + width - 1] != codec.ARRAY_EXT_TYPE:
        return None
    body = at + width
    at = body + int.from_bytes(data[at + 1 : body - 1], "big")
    if at > len(data):
        return None
    result = codec.decode_array_body(data[body:at])
    return Reply(data[start:end].decode(), True, result=result), at


def decode_any(element: bytes) -> list[Reply | ProtocolError]:
    """Every reply of a reply list's element, whichever form it has (see
    :func:`decode_element`; a reply map gives one). Raises :class:`CodecError` or
    :class:`ProtocolError` when nothing of it can be routed."""
    if is_packed(element):
        return decode_element(element)
    return [decode_reply(element)]
