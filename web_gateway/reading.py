"""Reading one HTTP request: its bearer token, its timeout, its priority, its body (and its
JSON) and its files.

Each function raises :class:`web_gateway.errors.HTTPError` for what it refuses (400, 401, 413,
415), or :class:`web_gateway.errors.ClientGone` when the client leaves mid-body.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import re
import zlib
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.datastructures import Headers, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from broker.priorities import HEADER as PRIORITY_HEADER
from broker.priorities import parse_priority

from .disconnects import gateway_cycle
from .errors import ClientGone, HTTPError, bad_request, shown, shown_header, too_large

TIMEOUT_HEADER = "x-request-timeout"
# An X-Request-Timeout: decimal seconds, with an exponent if need be (`2.5`, `.5`, `1e3`).
SECONDS = re.compile(r"[+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
UTF8_BOM = b"\xef\xbb\xbf"
# Content codings read as another (RFC 9110, 8.4.1.3: a recipient should take x-gzip as gzip).
_ALIASES = {"x-gzip": "gzip"}
# The most arrays and objects one JSON body may hold (--max-json-containers). Each costs the
# parse about 90 bytes (a Python list or dict, the pointer to it, orjson's own node) for as
# little as 2 or 3 bytes of JSON ("[],"): without a bound, a 16 MiB body of empty lists grew a
# gateway process by 500 MB to 1 GB.
DEFAULT_MAX_JSON_CONTAINERS = 1 << 20
# A JSON string from its opening quote: to its closing quote, or to the end of a text that
# never closes it (possessive, so it never backtracks: linear in the text, never fails).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)


class IndexedHeaders(Headers):
    """starlette's Headers, looked up in a dict of each name's first value.

    starlette scans the header list per lookup, and a missing header (most of the 5-7 a
    request looks up) raises and catches a KeyError: ~1.3 us each, against ~0.1 here.
    """

    def __init__(self, scope: Any) -> None:
        super().__init__(scope=scope)
        self._first = dict(reversed(self._list))  # reversed: the first of a repeated name wins
        self.repeated = len(self._first) < len(self._list)  # some name comes more than once

    def get(self, key: str, default: Any = None) -> Any:
        value = self._first.get(_NAMES.get(key) or _name(key))
        return default if value is None else value.decode("latin-1")

    def __getitem__(self, key: str) -> str:
        value = self._first.get(_NAMES.get(key) or _name(key))
        if value is None:
            raise KeyError(key)
        return value.decode("latin-1")

    def __contains__(self, key: Any) -> bool:
        return key.lower().encode("latin-1") in self._first


_NAMES: dict[str, bytes] = {}  # header names looked up, as the raw names they match
_MAX_NAMES = 256


def _name(key: str) -> bytes:
    name = key.lower().encode("latin-1")
    if len(_NAMES) < _MAX_NAMES:
        _NAMES[key] = name
    return name


class _IndexedOnce:
    """A request's :class:`IndexedHeaders`, made at the first look and kept in its ``__dict__``
    (which later looks find first: no call)."""

    def __get__(self, request: Any, owner: Any = None) -> Any:
        if request is None:
            return self
        headers = request.__dict__["headers"] = request._headers = IndexedHeaders(request.scope)
        return headers


class GatewayRequest(Request):
    """starlette's Request with :class:`IndexedHeaders` (for the hot routes)."""

    headers = _IndexedOnce()


def single(headers: Headers, name: str) -> str | None:
    """The value of header ``name``, its lines joined as their comma-separated list when it
    comes more than once (RFC 9110, 5.3), so that a header taking one value refuses two lines
    as it refuses a list on one, rather than obeying the first."""
    value = headers.get(name)
    if value is None or not getattr(headers, "repeated", True):
        return value
    values = headers.getlist(name)
    return value if len(values) == 1 else ", ".join(values)


def authorize(request: Request, tokens: Sequence[bytes]) -> None:
    """401 unless auth is off (no ``tokens``) or the request's bearer token is one of them."""
    if not tokens:
        return
    # two lines read as their list, which no token matches: a request has one (RFC 9110)
    scheme, _, token = (single(request.headers, "authorization") or "").partition(" ")
    # the header's own bytes (headers are read as Latin-1): a token's UTF-8, as a client sends
    # it; only spaces and tabs are trimmed (0x85 and 0xa0 are bytes of UTF-8 characters)
    given = token.strip(" \t").encode("latin-1")
    if scheme.lower() == "bearer" and given:
        # compare with every token, always, so timing tells nothing
        matched = False
        for known in tokens:
            matched |= hmac.compare_digest(given, known)
        if matched:
            return
    raise HTTPError(
        401,
        "Unauthorized",
        "a valid bearer token is required",
        {"WWW-Authenticate": 'Bearer realm="microbatch"'},
    )


def timeout(request: Request, fallback: float, cap: float) -> float:
    """Seconds from the X-Request-Timeout header (else ``fallback``), at most ``cap``."""
    raw = single(request.headers, TIMEOUT_HEADER)
    if raw is None:
        return min(fallback, cap)
    if not SECONDS.fullmatch(raw.strip(" \t")):  # float() also takes '1_0', 'inf', 'nan'
        raise bad_request("X-Request-Timeout must be a number of seconds")
    value = float(raw)
    if not (value > 0 and math.isfinite(value)):
        raise bad_request("X-Request-Timeout must be a positive number of seconds")
    return min(value, cap)


def priority(request: Request, parameter: Any = None) -> int:
    """The request's priority level: ``parameter`` (a v2 ``priority`` parameter) if given,
    else the X-Priority header, else normal; 400 if the one given is not a priority."""
    if parameter is not None:
        where, value, show = "the 'priority' parameter", parameter, shown
    else:
        where, value = PRIORITY_HEADER, single(request.headers, PRIORITY_HEADER)
        show = shown_header
    try:
        return parse_priority(value, show)
    except ValueError as exc:
        raise bad_request(f"{where}: {exc}") from None


def check_items(count: int, max_items: int) -> None:
    """400 for no items, 413 for more than ``max_items``."""
    if count == 0:
        raise bad_request("a request needs at least one item")
    if count > max_items:
        raise too_large(f"{count} items is over the limit of {max_items}")


def _check_length(request: Request, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is None:
        return
    try:
        length = int(declared)
    except ValueError:
        raise bad_request("Content-Length must be an integer") from None
    if length > limit:
        raise too_large(f"request body is over {limit} bytes")


async def body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (and decompressed)."""
    _check_length(request, limit)
    # under the gateway's HTTP protocol, a body that has all arrived is taken at once (what
    # receive() would answer, without the message)
    cycle = gateway_cycle(request.receive)
    whole = None if cycle is None else cycle.whole_body()
    if whole is None:
        data = await _received(request.receive, limit)
    elif len(whole) > limit:
        raise too_large(f"request body is over {limit} bytes")
    else:
        data = whole
    request._stream_consumed = True
    encoding = (single(request.headers, "content-encoding") or "identity").strip().lower()
    encoding = _ALIASES.get(encoding, encoding)
    if encoding in ("gzip", "deflate"):
        received = len(data)
        # off the event loop (zlib lets go of the GIL): a small body may inflate to the
        # limit, 16 MiB in ~70 ms of CPU, which the loop's other requests would wait out
        data = await asyncio.to_thread(_decompress, data, encoding, limit)
        # what it grew by is held too, against the process's limit, until answered
        over = None if cycle is None else cycle.hold(len(data) - received)
        if over is not None:
            raise HTTPError(
                503,
                "TooManyBodyBytes",
                f"this gateway process holds its limit of {over.max_held_body_bytes} bytes of "
                "request bodies (counted decompressed)",
                headers={"Retry-After": str(over.retry_after)},
            )
    elif encoding not in ("", "identity"):
        raise HTTPError(
            415,
            "UnsupportedMediaType",
            f"Content-Encoding {encoding!r}: use gzip, deflate or identity",
            # RFC 9110, 15.5.16: the codings that would have been taken
            headers={"Accept-Encoding": "gzip, deflate"},
        )
    request._body = data  # so request.form() parses what was read here
    return data


def json_containers(text: bytes, limit: int) -> int:
    """How many arrays and objects the JSON ``text`` holds, exactly where that is over
    ``limit`` (else a number no higher than ``limit``): its ``[`` and ``{`` outside strings.
    A count, never a parse (valid JSON or not), in time linear in the text and constant
    memory."""
    if len(text) <= 2 * limit:  # every array or object takes at least 2 bytes
        return 0
    count = text.count(b"[") + text.count(b"{")
    if count <= limit or b'"' not in text:
        return count
    # Past the limit with strings in it, some of whose brackets may be within them: counted
    # string by string (checked every _CHECK_EVERY strings) until the brackets outside them
    # pass the limit (then that is the answer) or those left could no longer take them past it.
    within = checked = outside = seen = 0
    find = text.count
    for strings, string in enumerate(_JSON_STRING.finditer(text), 1):
        start, end = string.span()
        within += find(b"[", start, end) + find(b"{", start, end)
        if not strings % _CHECK_EVERY:
            seen += find(b"[", checked, end) + find(b"{", checked, end)
            checked = end
            outside = seen - within
            if outside > limit or count - within <= limit:
                return outside if outside > limit else count - within
    return count - within


# strings between two checks of json_containers' count (each check counts the text since the
# last one: linear in all)
_CHECK_EVERY = 1024


def json_document(text: bytes, max_containers: int = DEFAULT_MAX_JSON_CONTAINERS) -> Any:
    """A body's JSON text, parsed (400 if it is not JSON; 413, before any parsing, if it
    holds more than ``max_containers`` arrays and objects). A UTF-8 byte order mark before
    it, which some tools write (Windows PowerShell 5's UTF-8 files), is ignored, as RFC 8259
    lets a parser do."""
    if text.startswith(UTF8_BOM):
        text = text[3:]
    if json_containers(text, max_containers) > max_containers:
        raise too_large(
            f"the JSON body holds more than {max_containers} arrays and objects "
            "(--max-json-containers)"
        )
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("str is not valid UTF-8"):  # orjson's words for any bad byte
            raise bad_request("request body is not valid JSON: it is not UTF-8 text") from None
        raise bad_request(f"request body is not valid JSON: {exc}") from None


async def _received(receive: Any, limit: int) -> bytes:
    """The body, read from ASGI's receive() as starlette's Request.stream() does, without its
    async generator; 413 past ``limit`` bytes."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        kind = message["type"]
        if kind == "http.request":
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise too_large(f"request body is over {limit} bytes")
                chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
        elif kind == "http.disconnect":  # gone, or cut off by the body timeout (answered 408)
            raise ClientGone("before its body arrived")


# The most gzip members one body may hold (a tool writing one per block, as BGZF's 64 KiB
# blocks, makes 256 of a 16 MiB body), and the compressed bytes handed to zlib at once: at a
# member's end zlib copies out what it was given past that end (its unused_data), so given
# the whole body, every member cost a copy of the rest (quadratic: a 16 MiB body of empty
# members held the event loop for minutes).
MAX_GZIP_MEMBERS = 1024
_INFLATE_STEP = 64 * 1024


def _decompress(data: bytes, encoding: str, limit: int) -> bytes:
    """``data`` decompressed, checked whole: a stream cut short (for gzip, its CRC and length
    trailer) or followed by other bytes is a 400; gzip members one after another are one body,
    as RFC 1952 and the gzip tool take them (at most MAX_GZIP_MEMBERS, else a 400); 413 past
    ``limit`` bytes."""
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    view = memoryview(data)
    parts: list[bytes] = []
    size = pos = members = 0
    while True:
        if members == MAX_GZIP_MEMBERS:
            raise bad_request(f"body is not valid {encoding}: it has more than {members} members")
        inflater = zlib.decompressobj(wbits)
        while not inflater.eof and pos < len(data):
            step = view[pos : pos + _INFLATE_STEP]
            try:
                out = inflater.decompress(step, limit - size + 1)
            except zlib.error as exc:
                what = "bytes follow its end" if members else str(exc)
                raise bad_request(f"body is not valid {encoding}: {what}") from None
            size += len(out)
            if size > limit or inflater.unconsumed_tail:
                raise too_large(f"decompressed request body is over {limit} bytes")
            parts.append(out)
            pos += len(step) - len(inflater.unused_data)
        if not inflater.eof:
            raise bad_request(f"body is not valid {encoding}: it is cut short")
        members += 1
        if pos == len(data):
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if encoding != "gzip":
            raise bad_request(f"body is not valid {encoding}: bytes follow its end")


async def uploaded_files(request: Request, max_items: int) -> list[bytes]:
    """The contents of a multipart body's ``file`` fields (read by :func:`body` first)."""
    try:
        form = await request.form(max_files=max_items + 1, max_fields=max_items + 1)
    except StarletteHTTPException as exc:
        raise bad_request(f"malformed multipart body: {exc.detail}") from None
    except MultiPartException as exc:  # starlette's limits (above), and what it could not parse
        if exc.message.startswith("Too many files"):
            raise too_large(
                f"more than {max_items + 1} items is over the limit of {max_items}"
            ) from None
        raise bad_request(f"malformed multipart body: {exc.message}") from None
    except Exception as exc:  # python-multipart's own parse errors
        raise bad_request(f"malformed multipart body: {type(exc).__name__}") from None
    try:
        fields = form.getlist("file")
        uploads = [value for value in fields if isinstance(value, UploadFile)]
        if len(uploads) < len(fields):
            raise bad_request(
                "a 'file' field of the multipart body has no filename, so it is text, not a "
                "file upload: send each item as a file (curl -F file=@path)"
            )
        if not uploads:
            raise bad_request("multipart body needs one or more 'file' fields")
        return [await upload.read() for upload in uploads]
    finally:
        await form.close()


async def disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body must have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
