"""The wire format, version 1.

A request is one stream entry per item with the fields:

====== ==================================================================
``v``        protocol version, ``"1"``
``id``       request id (any string unique among the caller's in-flight requests)
``reply``    the key (a Redis list) the reply is pushed to
``timeout``  milliseconds; the item's deadline is the entry id's time plus this
``data``     the item, encoded by :mod:`broker.codec`
====== ==================================================================

Optional: ``traceparent`` (W3C trace context) and ``deadline``, an absolute deadline in ms on
Redis' clock that can only bring the deadline forward (a pipeline's stages forward an item with
its caller's deadline: docs/pipelines.md).

A reply is one msgpack map pushed (RPUSH) to the reply key, which then gets a TTL::

    {"id": <request id>, "ok": true, "result": <value>}
    {"id": <request id>, "ok": false, "error": {"type": <ErrorClass>, "message": <str>}}

(The replies to items of multi-item entries may share one list element, an array of these maps:
:mod:`broker.reply_elements`.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from . import codec
from .errors import MicrobatchError, ProtocolError

VERSION = "1"
# What a worker reads: v1 entries, and v2 (multi-item) entries, which it reads as v1 items
# (broker.multi_item) before they reach parse_request.
SPOKEN = "'1' and '2'"
F_VERSION = b"v"
F_ID = b"id"
F_REPLY = b"reply"
F_TIMEOUT = b"timeout"
F_DATA = b"data"
F_TRACE = b"traceparent"
F_DEADLINE = b"deadline"

Fields = dict[bytes, bytes]

# W3C trace context: version-trace id-parent id-flags, lower-case hex. Anything else is dropped,
# so that nothing a caller writes reaches a worker's log lines unchecked.
TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def valid_traceparent(value: str | None) -> str | None:
    """``value`` if it is a W3C traceparent, else None."""
    return value if value is not None and TRACEPARENT.fullmatch(value) else None


def entry_time_ms(entry_id: str | bytes) -> int:
    """The Redis server time (ms) at which a stream entry was added, read from its id."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-", 1)[0])


def carried_deadline(fields: Fields, deadline_ms: int) -> int:
    """``deadline_ms``, or the entry's ``deadline`` field if that is earlier (a field that is
    not ASCII digits is ignored: it can only bring a deadline forward, never extend it)."""
    carried = fields.get(F_DEADLINE)
    if isinstance(carried, bytes) and carried.isdigit() and len(carried) <= 15:
        return min(deadline_ms, int(carried))
    return deadline_ms


def request_fields(
    request_id: str, reply_key: str, timeout_ms: int, data: bytes, traceparent: str | None = None
) -> dict[str, str | bytes]:
    """The stream entry fields of one item."""
    fields: dict[str, str | bytes] = {
        "v": VERSION,
        "id": request_id,
        "reply": reply_key,
        "timeout": str(int(timeout_ms)),
        "data": data,
    }
    if valid_traceparent(traceparent):
        fields["traceparent"] = traceparent  # type: ignore[assignment]
    return fields


@dataclass(slots=True)
class CallRequests:
    """The items of one call as they go onto a model's stream: one entry per item, sharing
    the call's reply key, timeout and trace context."""

    reply_key: str
    timeout_ms: int
    request_ids: list[str]
    payloads: Sequence[bytes]
    traceparent: str | None = None

    def __post_init__(self) -> None:
        self.traceparent = valid_traceparent(self.traceparent)

    @property
    def data_size(self) -> int:
        """Bytes the items count for against a queue's byte bound."""
        return sum(map(len, self.payloads))

    def entry_fields(self) -> list[dict[str, str | bytes]]:
        """Each item's stream entry fields (see :func:`request_fields`)."""
        return [
            request_fields(request_id, self.reply_key, self.timeout_ms, data, self.traceparent)
            for request_id, data in zip(self.request_ids, self.payloads, strict=True)
        ]


@dataclass(slots=True)
class Request:
    """One parsed stream entry."""

    entry_id: str
    request_id: str
    reply_key: str
    arrival_ms: int
    deadline_ms: int
    data: bytes
    traceparent: str | None = None


class MalformedEntry(ProtocolError):
    """A stream entry that is not a valid v1 request.

    ``request_id`` and ``reply_key`` are set when they could be read, so the sender can be told.
    """

    def __init__(
        self, message: str, *, request_id: str | None = None, reply_key: str | None = None
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.reply_key = reply_key

    @property
    def type(self) -> str:
        return ProtocolError.__name__  # on the wire, callers see the public class


def _text(fields: Fields, name: bytes) -> str | None:
    value = fields.get(name)
    return _utf8(value) if isinstance(value, bytes) else None


def _utf8(value: bytes) -> str | None:
    """``value`` read as UTF-8; None where it is not."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


_VERSION_BYTES = VERSION.encode()
# Python reads at most 4,300 digits into an int: a longer timeout (a deadline thousands of
# years away, like any of more than 15 digits) is read as this one.
MAX_TIMEOUT_MS: int = int("9" * 15)
SHOWN_CHARS = 32  # of a field quoted in an error message (and so in logs)


def parse_request(entry_id: str | bytes, fields: Fields) -> Request:
    """Parse one stream entry; raise :class:`MalformedEntry` if it is not a valid v1 request
    (and nothing else, whatever the entry holds)."""
    return RequestReader().parse(entry_id, fields)


class RequestReader:
    """:func:`parse_request` for the entries of a stream read one after another, on one
    thread: the reply key and arrival time of the entry before are reused where its bytes say
    they are the same (the items of a multi-item entry share both), with the same results."""

    __slots__ = ("_arrival_ms", "_reply", "_reply_key", "_stamp")

    def __init__(self) -> None:
        self._reply: object = None  # the reply field last decoded, and its text
        self._reply_key = ""
        self._stamp = ""  # the last entry id's time and its dash, and that time
        self._arrival_ms = 0

    def parse(self, entry_id: str | bytes, fields: Fields) -> Request:
        """:func:`parse_request`."""
        try:  # the common case, on the worker's hot path
            entry = entry_id if isinstance(entry_id, str) else entry_id.decode()
            timeout = fields[F_TIMEOUT]
            reply = fields[F_REPLY]
            if reply is self._reply:
                reply_key = self._reply_key
            else:
                reply_key = reply.decode()
                self._reply, self._reply_key = reply, reply_key
            request_id = fields[F_ID].decode()
            valid = fields[F_VERSION] == _VERSION_BYTES and timeout.isdigit()  # bytes: ASCII only
            if valid and request_id and reply_key:
                stamp = self._stamp
                if stamp and entry.startswith(stamp):
                    arrival_ms = self._arrival_ms
                else:
                    stamp = entry.split("-", 1)[0]
                    arrival_ms = int(stamp)  # entry_time_ms, inlined
                    self._stamp, self._arrival_ms = stamp + "-", arrival_ms
                deadline_ms = arrival_ms + int(timeout)
                if F_DEADLINE in fields:
                    deadline_ms = carried_deadline(fields, deadline_ms)
                trace = None if F_TRACE not in fields else valid_traceparent(_text(fields, F_TRACE))
                # positional: a slots dataclass takes them faster than keywords
                return Request(
                    entry, request_id, reply_key, arrival_ms, deadline_ms, fields[F_DATA], trace
                )
        except Exception:  # whatever is wrong, the slow path below says what, and to whom
            pass
        return _parse_carefully(entry_id, fields)


def _shown(value: bytes) -> str:
    """A field's value as an error message may quote it: decoded, cut short, repr-quoted."""
    text = value[: SHOWN_CHARS * 4].decode("utf-8", "replace")
    return repr(text[:SHOWN_CHARS] + ("..." if len(text) > SHOWN_CHARS else ""))


def _parse_carefully(entry_id: str | bytes, fields: Fields) -> Request:
    """The slow path of parse_request: find what is wrong, and who can be told (or read a
    valid entry that the fast path could not: one with a timeout of thousands of digits)."""
    if not isinstance(fields, dict):
        raise MalformedEntry("entry has no fields")
    request_id = _text(fields, F_ID)
    reply_key = _text(fields, F_REPLY)
    if not request_id or not reply_key:
        raise MalformedEntry(
            "entry has no readable 'id' or 'reply' field",
            request_id=request_id,
            reply_key=reply_key if request_id else None,
        )
    version = fields.get(F_VERSION)
    if version == b"2":  # a multi-item entry that broker.multi_item could not split
        raise MalformedEntry(
            "multi-item entry (v '2') without a valid 'n' (1 to 512 items)",
            request_id=request_id,
            reply_key=reply_key,
        )
    if version != _VERSION_BYTES:
        message = (
            f"unsupported protocol version {_shown(version)} (this worker speaks {SPOKEN})"
            if isinstance(version, bytes)
            else f"entry has no protocol version field 'v' (this worker speaks {SPOKEN})"
        )
        raise MalformedEntry(message, request_id=request_id, reply_key=reply_key)
    timeout = fields.get(F_TIMEOUT)
    data = fields.get(F_DATA)
    if not isinstance(timeout, bytes) or not timeout.isdigit() or not isinstance(data, bytes):
        raise MalformedEntry(
            "entry lacks a valid 'timeout' or 'data' field",
            request_id=request_id,
            reply_key=reply_key,
        )
    try:
        entry = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        arrival_ms = entry_time_ms(entry)
    except Exception:  # not an id Redis hands out
        raise MalformedEntry(
            "entry could not be parsed", request_id=request_id, reply_key=reply_key
        ) from None
    digits = timeout.lstrip(b"0")
    return Request(
        entry_id=entry,
        request_id=request_id,
        reply_key=reply_key,
        arrival_ms=arrival_ms,
        deadline_ms=carried_deadline(
            fields, arrival_ms + (int(digits or b"0") if len(digits) <= 15 else MAX_TIMEOUT_MS)
        ),
        data=data,
        traceparent=valid_traceparent(_text(fields, F_TRACE)),
    )


RESULT_HEAD = b"\x83\xa2id"  # a map of 3; "id"
RESULT_OK = b"\xa2ok\xc3\xa6result"  # "ok": true, "result"
# What a success reply holds ahead of its request id, by the id's length in bytes (below 256:
# a fixstr under 32, else a str 8)
RESULT_ID_HEADS = tuple(
    RESULT_HEAD + (bytes((0xA0 | n,)) if n < 32 else bytes((0xD9, n))) for n in range(256)
)


def encode_result(request_id: str, result: Any) -> bytes:
    """A success reply. Raises :class:`CodecError` if the result cannot be encoded."""
    if type(result) is np.ndarray:  # the common case, packed without msgpack's hooks
        array = codec.pack_array(result)
        rid = request_id.encode()
        if array is not None and len(rid) < len(RESULT_ID_HEADS):
            return b"".join((RESULT_ID_HEADS[len(rid)], rid, RESULT_OK, array))
    return codec.encode({"id": request_id, "ok": True, "result": result})


def encode_error(request_id: str, error: MicrobatchError | Exception) -> bytes:
    """An error reply; non-microbatch exceptions travel as their class name and message."""
    if isinstance(error, MicrobatchError):
        type_name, message = error.type, error.message
    else:
        type_name, message = type(error).__name__, str(error)
    packed: bytes = msgpack.packb(
        {"id": request_id, "ok": False, "error": {"type": type_name, "message": message}},
        use_bin_type=True,
    )
    return packed


@dataclass(slots=True)
class Reply:
    """One decoded reply."""

    request_id: str
    ok: bool
    result: Any = None
    error_type: str = ""
    error_message: str = ""
    error_stage: str | None = None  # the pipeline stage that answered the error, if named


def result_id_span(data: bytes, at: int = 0) -> tuple[int, int] | None:
    """(start, end) of the request id in the reply map at ``data[at:]``, read from its head
    without decoding it, for a map that begins as :func:`encode_result` writes it (``id`` first,
    a fixstr or str 8 value); None for any other."""
    if not data.startswith(RESULT_HEAD, at):
        return None
    at += len(RESULT_HEAD)
    marker = data[at] if len(data) > at else 0
    if marker & 0xE0 == 0xA0:  # fixstr
        return at + 1, at + 1 + (marker & 0x1F)
    if marker == 0xD9 and len(data) > at + 1:  # str 8
        return at + 2, at + 2 + data[at + 1]
    return None


def _decode_array_result(data: bytes) -> Reply | None:
    """The reply as :func:`encode_result` packs an array result, read without msgpack (the
    hot path of every client); None for any other reply."""
    span = result_id_span(data)
    if span is None:
        return None
    start, end = span
    if data[end : end + len(RESULT_OK)] != RESULT_OK:
        return None
    array = codec.decode_array_at(data, end + len(RESULT_OK))
    if array is None:
        return None
    try:
        request_id = data[start:end].decode()
    except UnicodeDecodeError:
        return None
    return Reply(request_id, True, result=array)


def decode_reply(data: bytes) -> Reply:
    """Decode a reply. Raises :class:`CodecError` or :class:`ProtocolError` (and nothing else)
    when it has no string ``id`` to route it by; a reply whose ``id`` can be read but whose
    rest is malformed becomes a ``ProtocolError`` answer to that request."""
    fast = _decode_array_result(data)
    return fast if fast is not None else _decode_reply_map(data)


def _decode_reply_map(data: bytes) -> Reply:
    """:func:`decode_reply` through msgpack: any reply."""
    return reply_from_message(codec.decode(data))


def _reply_text(value: Any) -> str | None:
    """A reply's string field: a msgpack str, or a bin holding UTF-8 (a worker in another
    language echoing the request id as the bytes its Redis client read it as); else None."""
    if isinstance(value, str):
        return value
    return _utf8(value) if isinstance(value, bytes) else None


def _with_text_keys(message: Any) -> Any:
    """A map whose bin keys holding UTF-8 are read as str keys (as :func:`_reply_text`)."""
    if not isinstance(message, dict) or not any(isinstance(key, bytes) for key in message):
        return message
    return {_reply_text(key) or key: value for key, value in message.items()}


def reply_from_message(message: Any) -> Reply:
    """A decoded reply map as a :class:`Reply` (see :func:`decode_reply`; raises
    :class:`ProtocolError` when it has no string ``id``)."""
    request_id = message.get("id") if isinstance(message, dict) else None
    if not isinstance(request_id, str):  # (every reply of this package has a str id)
        message = _with_text_keys(message)
        request_id = _reply_text(message.get("id")) if isinstance(message, dict) else None
        if request_id is None:
            raise ProtocolError("reply is not a map with a string 'id'")
    ok = message.get("ok")
    if ok is True:
        return Reply(request_id, True, result=message.get("result"))
    error = message.get("error")
    if ok is not False or not isinstance(error, dict):
        problem = "'ok' is not a boolean" if ok is not False else "no 'error' map"
    else:
        error = _with_text_keys(error)
        type_name, text = _reply_text(error.get("type")), _reply_text(error.get("message", ""))
        if type_name is not None and text is not None:
            stage = _reply_text(error.get("stage"))
            return Reply(
                request_id, False, error_type=type_name, error_message=text, error_stage=stage
            )
        problem = "'error.type' or 'error.message' is not a string"
    return Reply(
        request_id,
        False,
        error_type=ProtocolError.__name__,
        error_message=f"malformed reply: {problem}",
    )
