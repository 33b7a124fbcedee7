"""The gateway's HTTP protocol: uvicorn's httptools protocol with connection limits, writing
each response with one system call.

**Limits** (uvicorn has no header or body read timeout; they live here). Each connection is in
one phase, with a deadline checked by one sweep per event loop (every 0.5 s, or a quarter of the
shortest timeout when that is less), so a request costs a few attribute writes and no timer:

- headers: from the connection's start (or from the first byte of a later request) until its
  headers are complete, at most ``header_timeout`` s; then 408 and close (pipelined behind
  requests still being answered: after their answers).
- body: from the end of the headers until the last body byte, at most ``body_timeout`` s (a
  Content-Length longer than the body sent ends here); then 408 (or a bare close once a
  response has started) and the app sees the client gone.
- idle: between a response and the next request's first byte, at most ``keepalive_timeout`` s;
  then close.
- busy: while the app works on a complete request, no deadline (the request's own timeout
  applies).

Apart from its phase, a connection whose answers the client does not take is aborted: when its
transport's write buffer stays over the high-water mark (writing paused) for ``send_timeout`` s,
or when it was closed with answers still unsent ``send_timeout`` s ago. (Without it a client that
sends requests and never reads held its connection, and megabytes of kernel buffers, for ever:
the app waits on the transport's drain, and a transport closed with data unsent waits for it to
leave.)

A process holds at most ``max_connections`` connections: one more is answered 503 and closed at
once. A request whose URL and headers grow past ``max_header_bytes`` is answered 431 and its
connection closed (uvicorn's httptools protocol holds them all, however many). At most
``MAX_PIPELINED`` requests pipelined behind the one being answered are queued; past that, the
connection reads no more, answers those, and is closed. A process holds at most
``max_held_body_bytes`` of request bodies at once (counted from their first byte until each is
answered): a body arriving past that is answered 503 and its connection closed (without it,
connections sending large bodies each held up to ``--max-body-bytes``, all of them together
without bound). Limits come from the gateway's settings (``MICROBATCH_GATEWAY_HEADER_TIMEOUT``
etc.).

**Framing.** A transfer coding other than chunked (``gzip, chunked``, which the parser reads as
chunked alone) is answered 501 and the connection closed; an HTTP/1.0 request with a
Transfer-Encoding is its connection's last (RFC 9112, 6.1). A request with more than one Host
header, or an HTTP/1.1 one with none, is answered 400 and the connection closed (RFC 9112, 3.2).
A request line whose method the parser does not know (``FOO``, ``get``) is answered 501 and the
connection closed (RFC 9110, 15.6.2), where it starts a read; elsewhere (the parser says not
where it refused), and for what is no method at all, 400.

**Expect: 100-continue.** A request answered before its body was asked for (a 413 from its
Content-Length), none of its body come, is its connection's last (:class:`ExpectingCycle`):
its client need not send the body, and uvicorn, keeping the connection, read the client's next
request as that body.

**Refusals in order.** A request refused (400, 431, 501, 503) behind pipelined requests still
being answered gets its refusal once they are answered (RFC 9112, 9.3.2), reading stopped.

**Trailers.** The trailer fields of a chunked body are dropped, not added to the request's
headers as uvicorn did (RFC 9110, 6.5.1).

**Disconnects without a task.** :func:`when_gone` calls back when a request's client goes (its
connection lost, or cut by a read deadline), so the app need not keep a task waiting on
``receive()`` per request to learn it.

**A JSON answer in one step.** :meth:`GatewayCycle.answer_json` writes a whole JSON response
(status line, uvicorn's default headers, content-length and content-type, the body: the bytes
uvicorn's ``send`` writes for the two ASGI messages) without those messages, for the hot routes.

**HTTP/1.0 keep-alive.** uvicorn closes every HTTP/1.0 connection after its answer; one whose
request asks to be kept alive (``Connection: keep-alive``, as ApacheBench's ``-k``) is kept, and
its answer says so (:class:`Http10KeepAliveCycle`).

**One write per response.** uvicorn writes a response's status line and headers, then its body,
as two ``transport.write`` calls: two ``send`` system calls (and two TCP segments) per response,
about a sixth of the gateway's CPU at high request rates. The connection's transport holds back
what is written during one turn of the event loop and sends it together at the end of that
turn. Order is kept, and closing the connection sends what is held first.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import math
import re
import sys
import termios
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, cast

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from broker.logs import Every

from .disconnects import ON_GONE, gone
from .errors import error_body, is_v2, shown, v2_error_body

if TYPE_CHECKING:
    from .settings import GatewaySettings

log = logging.getLogger("microbatch.gateway")

NO_DEADLINE = math.inf
READ_SLACK_BYTES = 256 * 1024  # the most one read of the event loop hands over
MAX_PIPELINED = 64  # requests of one connection queued behind the one being answered
SWEEP_PERIOD_S = 0.5
FIRST_REQUEST_GRACE_S = 1.0  # a stopping server waits this long for a new connection's request
REPORT_EVERY_S = 10.0


class CoalescingTransport:
    """Wraps an asyncio transport: writes made in one loop turn leave in one ``write``."""

    __slots__ = ("_held", "_loop", "_on_closed_unsent", "_transport")

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        on_closed_unsent: Callable[[], None] | None = None,
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None
        self._on_closed_unsent = on_closed_unsent

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = [data]
            self._loop.call_soon(self.flush)
        else:
            self._held.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Send what is held now."""
        held, self._held = self._held, None
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def is_closing(self) -> bool:  # asked once a request: not through __getattr__
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        held = sum(len(data) for data in self._held) if self._held else 0
        return self._transport.get_write_buffer_size() + held

    def close(self) -> None:
        """Close once what is written is sent (``on_closed_unsent`` is called where some of
        it waits on the client)."""
        self.flush()
        self._transport.close()
        if self._on_closed_unsent is not None and self._transport.get_write_buffer_size():
            self._on_closed_unsent()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


_JSON_TYPE = b"\r\ncontent-type: application/json\r\n"
_SPECIAL = {b"content-length", b"transfer-encoding", b"connection"}  # send() reads them


class GatewayCycle(RequestResponseCycle):
    """uvicorn's request cycle, with a whole JSON response written in one step."""

    # uvicorn's default headers as written (they change each second: the date), and the list
    # they were written from; None where send() must write them (it checks them each time)
    _defaults: ClassVar[tuple[Any, bytes | None]] = (None, None)
    held = 0  # bytes of its body counted as held by the process, until it is answered
    kept_alive = b""  # the header line a response kept alive carries (HTTP/1.1: none)
    protocol: GatewayHttpProtocol | None = None  # the connection's (set for each request)

    def hold(self, size: int) -> ConnectionLimits | None:
        """Count ``size`` more bytes as held for this request until it is answered (its
        body decompressed, beside the bytes that came in): None if counted (or nothing
        counts them: the request is answered), else the limits whose
        ``max_held_body_bytes`` they would take the process over (nothing is counted)."""
        protocol = self.protocol
        if protocol is None or self.response_complete or size <= 0:
            return None
        return protocol.hold_more(self, size)

    def whole_body(self) -> bytes | None:
        """The request's body, when all of it has arrived and nothing has read it: what the
        first ``receive()`` would answer in its one ``http.request`` message, taken as it
        would be; None where ``receive()`` must answer (and nothing is taken)."""
        if (
            self.more_body
            or self.disconnected
            or self.response_complete
            or self.waiting_for_100_continue
            or not self.message_event.is_set()
        ):
            return None
        self.flow.resume_reading()
        self.message_event.clear()
        body = bytes(self.body)
        self.body = bytearray()
        return body

    def answer_json(self, status: int, body: bytes) -> bool:
        """Answer ``status`` with the JSON ``body``, as ``send()`` would for
        ``http.response.start`` (headers content-length, content-type: application/json) and
        one ``http.response.body``; False, having done nothing, where ``send()`` must do it
        (a response started, the client gone, writing paused, uvicorn's access log on)."""
        if (
            self.response_started
            or self.disconnected
            or self.flow.write_paused
            or self.access_log
            or self.scope["method"] == "HEAD"
        ):
            return False
        written = _defaults_written(self.default_headers)
        if written is None:
            return False
        self.response_started = True
        self.waiting_for_100_continue = False
        self.chunked_encoding = False
        self.expected_content_length = 0
        close = self.kept_alive if self.keep_alive else b"connection: close\r\n"
        length = str(len(body)).encode("latin-1")
        self.transport.write(
            b"".join((STATUS_LINE[status], written, b"content-length: ", length, _JSON_TYPE))
            + close
            + b"\r\n"
            + body
        )
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()
        return True


class Http10KeepAliveCycle(GatewayCycle):
    """An HTTP/1.0 request that asked to be kept alive (``Connection: keep-alive``, as
    ApacheBench's ``-k`` sends): kept alive, which uvicorn never does for HTTP/1.0, where its
    response has a Content-Length, and the response says so (an HTTP/1.0 client takes a
    response without ``connection: keep-alive`` as the connection's last)."""

    kept_alive = b"connection: keep-alive\r\n"

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            headers = list(message.get("headers", ()))
            if any(name.lower() == b"content-length" for name, _ in headers):
                headers.append((b"connection", b"keep-alive"))
                message = {**message, "headers": headers}
            else:  # its end is the connection's close
                self.keep_alive = False
        await super().send(message)


class ExpectingCycle(GatewayCycle):
    """A request waiting for ``100 Continue`` before it sends its body. Answered before it was
    asked for the body (a 413 from its Content-Length, a 401), and none of it come, it is its
    connection's last: its client may then never send that body, and what it sent next would
    be read as the body (RFC 9110, 10.1.1: such an answer says whether the connection stays).
    A client already sending it is let finish, as before (the rest read and dropped): closing
    with its bytes unread would reset the connection, the answer perhaps lost."""

    def _close_unasked(self) -> None:
        if (
            self.waiting_for_100_continue
            and self.more_body
            and not self.body
            and not self.response_started
        ):
            self.keep_alive = False

    async def send(self, message: Any) -> None:
        self._close_unasked()
        await super().send(message)

    def answer_json(self, status: int, body: bytes) -> bool:
        self._close_unasked()
        return super().answer_json(status, body)


def _defaults_written(defaults: list[tuple[bytes, bytes]]) -> bytes | None:
    """uvicorn's default headers (``defaults``) as send() writes them, remembered while
    they stay the same list; None where send() must write them."""
    known, written = GatewayCycle._defaults
    if known is not defaults:
        written = _written(defaults)
        GatewayCycle._defaults = (defaults, written)
    return written


def _written(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """Default headers as send() writes them; None where send() would refuse or read one."""
    lines = []
    for name, value in headers:
        if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
            return None
        name = name.lower()
        if name in _SPECIAL:
            return None
        lines.append(b"%s: %s\r\n" % (name, value))
    return b"".join(lines)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol over a :class:`CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        coalescing: Any = CoalescingTransport(transport, self.loop, self.closed_unsent)
        super().connection_made(coalescing)

    def closed_unsent(self) -> None:
        """Called when the connection is closed with some of what was written unsent."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection read deadlines (seconds), the connection cap of one process, and the
    Retry-After (seconds) of the 503s this protocol answers itself."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 5.0
    max_connections: int = 1000
    max_header_bytes: int = 65536
    send_timeout: float = 30.0
    max_held_body_bytes: int = 512 * 2**20
    max_body_bytes: int = 16 * 2**20  # of one request: the app answers 413 past it
    retry_after: int = 1

    @classmethod
    def of(cls, settings: GatewaySettings) -> ConnectionLimits:
        """The limits of a gateway with ``settings``."""
        return cls(
            header_timeout=settings.header_timeout,
            body_timeout=settings.body_timeout,
            keepalive_timeout=settings.keepalive_timeout,
            max_connections=settings.max_connections,
            max_header_bytes=settings.max_header_bytes,
            send_timeout=settings.send_timeout,
            max_held_body_bytes=settings.max_held_body_bytes,
            max_body_bytes=settings.max_body_bytes,
            retry_after=settings.retry_after,
        )

    @classmethod
    def from_settings(cls) -> ConnectionLimits:
        """The limits set in the environment (``MICROBATCH_GATEWAY_<LIMIT>``), checked."""
        from .settings import GatewaySettings

        return cls.of(GatewaySettings())

    @property
    def sweep_period(self) -> float:
        shortest = min(
            self.header_timeout, self.body_timeout, self.keepalive_timeout, self.send_timeout
        )
        return max(0.01, min(SWEEP_PERIOD_S, shortest / 4))


SERVED_VERSIONS = frozenset(("1.1", "1.0"))  # as httptools names them
_CALLBACK_FAILURES = Every(60.0)

# the request headers on_header looks into (uvicorn's looked for Expect alone)
_FRAMING_HEADERS = frozenset((b"host", b"expect", b"transfer-encoding", b"connection"))

# Phases of a connection (see the module's docstring).
IDLE, HEADERS, BODY, BUSY, QUEUED, REFUSED = range(6)


class _StopParsing(Exception):
    """Raised in the parser's callbacks to stop it (headers too large, too many pipelined)."""


def _raw_response(
    status: str, error: str, message: str, v2: bool, extra: str = "", defaults: bytes = b""
) -> bytes:
    """A JSON error response closing its connection; ``defaults``: the header lines every
    response carries (the date), as written."""
    body = orjson.dumps((v2_error_body if v2 else error_body)(error, message))
    head = (
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}"
        "connection: close\r\n\r\n"
    )
    return b"HTTP/1.1 %s\r\n%s%s%s" % (status.encode("ascii"), defaults, head.encode("ascii"), body)


# why connections were closed: counted, and reported together
_CLOSED_FOR = ("headers", "body", "unread", "invalid", "large", "pipelined", "held", "refused")


class _Sweeper:
    """Enforces the deadlines of one server's connections, counts the bytes of request bodies
    they hold, and reports what it closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connections: set[Any], period: float):
        self.loop = loop
        self.connections = connections
        self.period = period
        self.counts = dict.fromkeys(_CLOSED_FOR, 0)
        self.held_body_bytes = 0
        self.reported = -math.inf
        self.handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.handle is None:
            self.handle = self.loop.call_later(self.period, self.sweep)

    def sweep(self) -> None:
        self.handle = None
        now = self.loop.time()
        for protocol in list(self.connections):
            if getattr(protocol, "deadline", NO_DEADLINE) <= now:
                protocol.expire()
            if getattr(protocol, "send_deadline", NO_DEADLINE) <= now:
                protocol.sending_expired()
        self.report()
        if self.connections or any(self.counts.values()):
            self.start()

    def count(self, kind: str) -> None:
        self.counts[kind] += 1
        self.report()

    def report(self, now: bool = False) -> None:
        """At most one log line per REPORT_EVERY_S, however many connections misbehave (with
        ``now``, what is counted is reported at once)."""
        if not any(self.counts.values()):
            return
        if not now and time.monotonic() - self.reported < REPORT_EVERY_S:
            return
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        self.reported = time.monotonic()
        log.warning(
            "closed %d connection(s) whose headers, and %d whose body, came too slowly, %d "
            "whose client did not take its answers, %d not valid HTTP, %d whose headers were too "
            "large, %d that pipelined over %d requests, and %d whose body came past the bytes of "
            "bodies held; refused %d over the connection cap",
            counts["headers"],
            counts["body"],
            counts["unread"],
            counts["invalid"],
            counts["large"],
            counts["pipelined"],
            MAX_PIPELINED,
            counts["held"],
            counts["refused"],
        )


_sweepers: weakref.WeakKeyDictionary[Any, _Sweeper] = weakref.WeakKeyDictionary()


def _declared_length(cycle: RequestResponseCycle) -> int:
    """The request's Content-Length (-1 where it has none, or not a number)."""
    for name, value in cycle.scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else -1
    return -1


def _unread(transport: Any) -> bool:
    """Whether bytes the client sent wait in the socket, not yet read by the event loop."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        waiting = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return False
    return int.from_bytes(waiting, sys.byteorder) > 0


def _tell_app_gone(cycle: RequestResponseCycle) -> None:
    """The app's ``receive()`` says the request's client has gone; :func:`when_gone` calls
    back."""
    cycle.disconnected = True
    cycle.message_event.set()
    gone(cycle)


# A request line's method (a token, RFC 9110, 5.6.2) and the space after it, and its target.
_METHOD = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) ([^ \r\n]*)")


def _unknown_method(exc: Exception, start: bytes) -> tuple[str, str] | None:
    """The method and target of a request line the parser refused for its method: a token it
    does not know, where ``start`` (the request's first bytes) shows one; None for anything
    else."""
    if not isinstance(exc, httptools.HttpParserInvalidMethodError):
        return None
    found = _METHOD.match(start)
    if found is None:
        return None
    return found.group(1).decode("ascii"), found.group(2).decode("latin-1")


def report_closed_connections() -> None:
    """Log the connections closed or refused since the last periodic line (at a stop)."""
    for sweeper in list(_sweepers.values()):
        sweeper.report(now=True)


class GatewayHttpProtocol(CoalescingHttpToolsProtocol):
    """The gateway's protocol: one write per response, read deadlines, a connection cap."""

    limits: ClassVar[ConnectionLimits | None] = None  # None: ConnectionLimits.from_settings()

    deadline = NO_DEADLINE
    send_deadline = NO_DEADLINE  # by when the client must take what waits to be sent
    phase = HEADERS
    header_bytes = 0  # of the request being read: its URL and headers parsed so far
    overflowed = False  # more requests were pipelined than are queued: read no more
    last_words: bytes | None = None  # and the refusal written once the queued are answered
    held_body_bytes = 0  # of this connection's requests' bodies, counted until answered
    answering: GatewayCycle | None = None  # the request whose app runs
    unparsed_header_bytes = 0  # and the bytes read while its headers were incomplete
    transfer_coding = b""  # of the request being read: its Transfer-Encoding (lower case)
    host_lines = 0  # and its Host headers
    asks_close = False  # and whether its Connection header names "close"
    upgrade_body_left = 0  # body bytes still to come of a request served despite its upgrade
    stopping = False  # the server stops: the request being read is the connection's last
    messages_begun = messages_complete = 0  # requests the parser began and finished reading

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cls = type(self)
        if cls.limits is None:
            cls.limits = ConnectionLimits.from_settings()
        self._limits = cls.limits
        self._max_header_bytes = cls.limits.max_header_bytes  # read for every header
        sweeper = _sweepers.get(self.server_state)
        if sweeper is None:
            sweeper = _sweepers[self.server_state] = _Sweeper(
                self.loop, self.connections, self._limits.sweep_period
            )
        self._sweeper = sweeper

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._limits.max_connections:
            cap = self._limits.max_connections
            refusal = self._refusal(
                "503 Service Unavailable",
                "TooManyConnections",
                f"this gateway process is at its limit of {cap} connections",
                v2=False,
                extra=f"retry-after: {self._limits.retry_after}\r\n",
            )
            self._close_refused("refused", refusal)
            return
        self.phase = HEADERS
        self.deadline = self.loop.time() + self._limits.header_timeout
        self._sweeper.start()

    def connection_lost(self, exc: Exception | None) -> None:
        self.deadline = self.send_deadline = NO_DEADLINE
        self._sweeper.held_body_bytes -= self.held_body_bytes
        self.held_body_bytes = 0
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            gone(cycle)

    def data_received(self, data: bytes) -> None:
        if self.phase == REFUSED or self.overflowed:
            return
        if self.upgrade_body_left and not (data := self._take_upgrade_body(data)):
            return
        if self.phase == IDLE:  # the next request starts
            self.phase = HEADERS
            self.deadline = self.loop.time() + self._limits.header_timeout
        between = self.messages_begun == self.messages_complete  # data starts a request
        begun = self.messages_begun
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:  # and _StopParsing, raised in a callback
            if self.phase != REFUSED and not self.overflowed:  # (those answer for themselves)
                # the refused request's first bytes, where the parser is known to have begun
                # it at this read's start (it says no position)
                start = data if between and self.messages_begun == begun + 1 else b""
                self._refuse_invalid(exc, start)
            return
        except httptools.HttpParserUpgrade as exc:
            # served as plain HTTP/1.1 (the gateway has no WebSocket routes); uvicorn said so
            # in two warning lines per request, for clients as common as `curl --http2`
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._serve_upgrade_as_http(data[exc.args[0] :])
            return
        if self.phase == HEADERS:
            # The parser hands over a header only once it is whole: one that never ends is
            # held, and grown, inside it. Bounded here, with one read's slack (a read may also
            # hold the end of the request before).
            self.unparsed_header_bytes += len(data)
            if self.unparsed_header_bytes > self._max_header_bytes + READ_SLACK_BYTES:
                self._refuse_large_headers()

    def _serve_upgrade_as_http(self, rest: bytes) -> None:
        """Serve a request asking for an upgrade (``Upgrade: h2c``, as ``curl --http2`` sends)
        as HTTP/1.1. The parser ended it at its headers and took what follows as the new
        protocol's: its body, and any request after it. Without this the app saw an empty body,
        and a body that read as a request was served as one (a proxy passing the upgrade on
        would have seen one request where the gateway ran two)."""
        cycle = cast(GatewayCycle, self.cycle)
        if any(name == b"transfer-encoding" for name, _ in cycle.scope["headers"]):
            _tell_app_gone(cycle)
            self._refuse_invalid(ValueError("an upgrade request's body must have a Content-Length"))
            return
        length = _declared_length(cycle)
        if length > 0 and not cycle.response_complete:  # its body is still to come: reopened
            cycle.more_body = True
            cycle.message_event.clear()
            self.upgrade_body_left = length
            if self.answering is cycle:
                self.phase = BODY
                self.deadline = self.loop.time() + self._limits.body_timeout
        if rest:
            self.data_received(rest)

    def _take_upgrade_body(self, data: bytes) -> bytes:
        """The body of a request served despite its upgrade, taken from ``data``; what follows
        it is returned, for the parser."""
        size = min(len(data), self.upgrade_body_left)
        self.upgrade_body_left -= size
        try:
            self.on_body(data[:size])
            if not self.upgrade_body_left:
                self.on_message_complete()
        except _StopParsing:
            return b""
        return data[size:]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.messages_begun += 1
        self.header_bytes = self.unparsed_header_bytes = 0
        self.transfer_coding = b""
        self.host_lines = 0
        self.asks_close = False
        if self.phase != HEADERS:  # a pipelined request, read while the last one is served
            self.phase = HEADERS
            self.deadline = self.loop.time() + self._limits.header_timeout

    def on_url(self, url: bytes) -> None:
        self.header_bytes += len(url)
        if self.header_bytes > self._max_header_bytes:
            self._stop_large_headers()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if self.header_bytes > self._max_header_bytes:
            self._stop_large_headers()
        name = name.lower()  # uvicorn's on_header, with more than Expect looked at
        if name in _FRAMING_HEADERS:
            self._note_framing(name, value)
        self.headers.append((name, value))

    def _note_framing(self, name: bytes, value: bytes) -> None:
        """Note a header the request's framing (or its expectation) depends on."""
        if name == b"host":
            self.host_lines += 1
        elif name == b"expect":
            if value.lower() == b"100-continue":
                self.expect_100_continue = True
        elif name == b"connection":
            if b"close" in (option.strip(b" \t").lower() for option in value.split(b",")):
                self.asks_close = True
        elif self.transfer_coding in (b"", b"chunked"):  # the first coding that is not kept
            self.transfer_coding = value.strip(b" \t").lower()

    def _check_framing(self) -> None:
        """Refuse (and stop the parser) a request whose body the gateway cannot read as sent
        (RFC 9112, 6.1): a transfer coding other than chunked is 501 (the parser takes the
        body as chunked alone, so a `gzip, chunked` body reached the app still compressed);
        or that has more than one Host header, or none in HTTP/1.1 (RFC 9112, 3.2: 400); or
        of an HTTP version other than 1.0 and 1.1 (RFC 9110, 15.6.6: 505)."""
        v2 = is_v2(self.url.decode("latin-1"))
        coding = self.transfer_coding
        version = self.parser.get_http_version()
        if version not in SERVED_VERSIONS:  # the parser reads HTTP/0.9 and HTTP/2.0 request lines
            refusal = self._refusal(
                "505 HTTP Version Not Supported",
                "HTTPVersionNotSupported",
                f"HTTP/{version} is not served: send HTTP/1.1 (or HTTP/1.0)",
                v2=v2,
            )
        elif coding and coding != b"chunked":
            refusal = self._refusal(
                "501 Not Implemented",
                "NotImplemented",
                f"Transfer-Encoding {coding.decode('latin-1')!r}: only chunked is supported "
                "(compress the body with Content-Encoding instead)",
                v2=v2,
            )
        elif self.host_lines > 1:
            refusal = self._refusal(
                "400 Bad Request", "BadRequest", "a request has one Host header at most", v2=v2
            )
        elif not self.host_lines and version == "1.1":
            refusal = self._refusal(
                "400 Bad Request", "BadRequest", "an HTTP/1.1 request needs a Host header", v2=v2
            )
        else:
            return
        self._close_refused("invalid", refusal)
        self._stop_parsing()

    def _stop_large_headers(self) -> NoReturn:
        """Refuse a request whose URL and headers grew past the limit (else they would all be
        held in memory until the header timeout), and stop the parser."""
        self._refuse_large_headers()
        self._stop_parsing()

    def _stop_parsing(self) -> NoReturn:
        """Stop the parser from one of its callbacks (the connection has been answered)."""
        raise _StopParsing

    def _refuse_invalid(self, exc: Exception, start: bytes = b"") -> None:
        """Answer 400 to what is not HTTP/1.1 and close; counted, not logged one by one (as
        uvicorn did: a line per connection sending garbage). A request line whose method is a
        token the parser does not know (``start``: the request's first bytes, when known) is
        answered 501 instead (RFC 9110, 15.6.2)."""
        unknown = _unknown_method(exc, start)
        if unknown is not None:
            method, target = unknown
            refusal = self._refusal(
                "501 Not Implemented",
                "NotImplemented",
                f"method {shown(method)} is not implemented (the routes take GET, HEAD and POST)",
                v2=is_v2(target),
            )
            self._close_refused("invalid", refusal)
            return
        cause = exc.__context__
        if isinstance(exc, httptools.HttpParserCallbackError) and isinstance(
            cause, httptools.HttpParserError
        ):
            # what uvicorn's callback found (a request target that is no URL path, as
            # CONNECT's `host:port`), not the parser's "User callback error"
            exc = cause
        elif (
            isinstance(exc, httptools.HttpParserCallbackError)
            and cause is not None
            and _CALLBACK_FAILURES.due()
        ):
            # a callback's own failure (a fault of this code or uvicorn's), not the client's:
            # answered 400 all the same, but said, with its traceback, at most once a minute
            log.error("an HTTP parser callback failed; the request was answered 400",
                      exc_info=cause)  # fmt: skip
        message = f"the request is not valid HTTP: {exc}"
        # the URL of the request being parsed, when its request line was read (reset as each
        # request begins): a /v2 route's client reads the protocol's error body
        v2 = is_v2(getattr(self, "url", b"").decode("latin-1"))
        refusal = self._refusal("400 Bad Request", "BadRequest", message, v2=v2)
        self._close_refused("invalid", refusal)

    def _refusal(self, status: str, error: str, message: str, v2: bool, extra: str = "") -> bytes:
        """A response of the protocol's own (see :func:`_raw_response`), with the date and the
        other default headers of the app's responses (RFC 9110, 6.6.1: a 4xx has a Date)."""
        defaults = _defaults_written(self.server_state.default_headers) or b""
        return _raw_response(status, error, message, v2, extra, defaults)

    def _close_refused(self, counted_as: str, response: bytes | None) -> None:
        """Write ``response`` (if any) and close; what else the connection sends is ignored.
        Counted in the sweeper's summary as ``counted_as``. Requests pipelined before the
        refused one are answered first, the refusal after them (RFC 9112, 9.3.2: answers in
        the order of the requests; it was written at once, and taken for the first one's)."""
        refused = self.cycle if self.phase in (BODY, QUEUED) else None  # else not yet made
        if refused is not None and refused.response_started:
            # answered early (a 401, a 413), its body broken or its trailers too large after:
            # a second answer would be taken for the client's next request's
            response = None
        self.phase, self.deadline = REFUSED, NO_DEADLINE
        self._sweeper.count(counted_as)
        answering = self.answering  # (one told its client is gone will never answer)
        if (
            answering is not None
            and answering is not refused
            and not (answering.response_complete or answering.disconnected)
        ):
            if self.pipeline and self.pipeline[0][0] is refused:
                self.pipeline.popleft()  # never served
            self.overflowed = True  # read no more; closed once the queued are answered
            self.flow.pause_reading()
            self.last_words = response
            return
        if response is not None:
            self.transport.write(response)
        self.transport.close()

    def _refuse_large_headers(self) -> None:
        """Answer 431 and close the connection; what else it sends is ignored."""
        limit = self._max_header_bytes
        refusal = self._refusal(
            "431 Request Header Fields Too Large",
            "HeadersTooLarge",
            f"the request's URL and headers are over the limit of {limit} bytes",
            v2=is_v2(getattr(self, "url", b"").decode("latin-1")),
        )
        self._close_refused("large", refusal)

    def on_headers_complete(self) -> None:
        if (
            self.host_lines != 1
            or self.transfer_coding
            or self.parser.get_http_version() not in SERVED_VERSIONS
        ):
            self._check_framing()
        cycle = self.cycle
        super().on_headers_complete()
        if self.transfer_coding:
            # its trailer fields, which the parser hands to on_header too, are dropped: uvicorn
            # added them to the request's headers, where the app took a trailer's
            # Content-Encoding or X-Request-Timeout as the client's (RFC 9110, 6.5.1: a
            # trailer is never merged into the headers unless its definition says how)
            self.headers = []
        if self.cycle is not cycle:  # a new request's cycle: when_gone may watch it
            # an HTTP/1.0 request with a Transfer-Encoding is its connection's last, whatever
            # it asks (RFC 9112, 6.1: its framing may be read otherwise along the way); so is
            # one whose Connection names close beside keep-alive (the parser reads keep-alive)
            if (
                self.cycle.keep_alive
                or not self.parser.should_keep_alive()
                or self.transfer_coding
                or self.asks_close
            ):
                self.cycle.__class__ = GatewayCycle
            else:  # HTTP/1.0 with Connection: keep-alive
                self.cycle.__class__ = Http10KeepAliveCycle
                self.cycle.keep_alive = True
            if self.cycle.waiting_for_100_continue:
                if self.parser.get_http_version() == "1.0":  # RFC 9110, 10.1.1: ignored
                    self.cycle.waiting_for_100_continue = False
                else:
                    self.cycle.__class__ = ExpectingCycle
            setattr(self.cycle, ON_GONE, None)
            cast(GatewayCycle, self.cycle).protocol = self
            if self.stopping:
                self.cycle.keep_alive = False
        if self.pipeline and self.pipeline[0][0] is self.cycle:
            if len(self.pipeline) > MAX_PIPELINED:
                self._stop_pipelining()
            # queued behind a request in progress, reading paused: its body deadline starts
            # when it is taken up (on_response_complete)
            self.phase = QUEUED
            self.deadline = NO_DEADLINE
        else:
            self.answering = cast(GatewayCycle, self.cycle)
            self.phase = BODY
            self.deadline = self.loop.time() + self._limits.body_timeout

    def on_body(self, body: bytes) -> None:
        cycle = cast(GatewayCycle, self.cycle)
        if not cycle.response_complete:  # (else uvicorn drops it)
            size = len(body)
            cycle.held += size
            self.held_body_bytes += size
            sweeper = self._sweeper
            sweeper.held_body_bytes += size
            if sweeper.held_body_bytes > self._limits.max_held_body_bytes:
                self._refuse_over_held()
        super().on_body(body)

    def hold_more(self, cycle: GatewayCycle, size: int) -> ConnectionLimits | None:
        """See :meth:`GatewayCycle.hold`."""
        sweeper, limits = self._sweeper, self._limits
        if sweeper.held_body_bytes + size > limits.max_held_body_bytes:
            sweeper.count("held")
            return limits
        cycle.held += size
        self.held_body_bytes += size
        sweeper.held_body_bytes += size
        return None

    def _refuse_over_held(self) -> NoReturn:
        """Answer 503 (unless the app has answered) and close: the process holds its limit of
        request bodies; the app sees the client gone. A body over the limit of one request is
        answered 413 instead, as the app would have (no retry could succeed)."""
        cycle = cast(GatewayCycle, self.cycle)
        refusal = None
        if not cycle.response_started:
            v2 = is_v2(str(cycle.scope.get("path", "")))
            limits = self._limits
            if max(cycle.held, _declared_length(cycle)) > limits.max_body_bytes:
                refusal = self._refusal(
                    "413 Request Entity Too Large",
                    "PayloadTooLarge",
                    f"request body is over {limits.max_body_bytes} bytes",
                    v2=v2,
                )
            else:
                refusal = self._refusal(
                    "503 Service Unavailable",
                    "TooManyBodyBytes",
                    f"this gateway process holds its limit of {limits.max_held_body_bytes} "
                    "bytes of request bodies",
                    v2=v2,
                    extra=f"retry-after: {limits.retry_after}\r\n",
                )
        _tell_app_gone(cycle)
        self._close_refused("held", refusal)
        self._stop_parsing()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.messages_complete += 1
        self.phase = BUSY
        self.deadline = NO_DEADLINE

    def _stop_pipelining(self) -> NoReturn:
        """Drop the request just parsed, over the queue's bound, and stop reading: the
        queued requests are answered, then the connection is closed. (uvicorn queued every
        request of each read, and took another read at every response: a client that
        pipelined requests without reading the answers filled the process's memory.)"""
        self.pipeline.popleft()
        self.overflowed = True
        self.phase, self.deadline = QUEUED, NO_DEADLINE  # (the dropped request's were set)
        self.flow.pause_reading()
        self._sweeper.count("pipelined")
        self._stop_parsing()

    def on_response_complete(self) -> None:
        # uvicorn's, with the keep-alive timer replaced by the idle deadline
        self.server_state.total_requests += 1
        answered = self.answering
        if answered is not None and answered.held:  # its body is no longer held
            self.held_body_bytes -= answered.held
            self._sweeper.held_body_bytes -= answered.held
            answered.held = 0
        if self.transport.is_closing():
            return
        if self.overflowed:
            if not self.pipeline:
                if self.last_words is not None:
                    self.transport.write(self.last_words)
                self.transport.close()
                return
        else:
            self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self.answering = cast(GatewayCycle, cycle)
            self._start_asgi_task(cycle, app)
            if cycle.more_body:
                self.phase = BODY
                self.deadline = self.loop.time() + self._limits.body_timeout
        elif self.phase == BUSY:
            self.phase = IDLE
            self.deadline = self.loop.time() + self._limits.keepalive_timeout

    def shutdown(self) -> None:
        """uvicorn's graceful stop: an idle connection is closed at once, and the one of a
        request in progress once it is answered; here a request that has begun to arrive (read
        in part, or waiting unread in the socket) is served too, as the connection's last
        (closing would reset it). So is the first request of a connection accepted just before
        the stop, if it arrives within FIRST_REQUEST_GRACE_S: its client opened it to send one
        (at a worker's `--max-requests` replacement, one such connection in a few was closed
        unanswered)."""
        self.stopping = True
        cycle = self.cycle
        if (cycle is None or cycle.response_complete) and (
            (self.phase == HEADERS and self.unparsed_header_bytes > 0)
            or (self.phase in (IDLE, HEADERS) and _unread(self.transport))
        ):
            return
        if cycle is None and self.phase == HEADERS:
            self.deadline = min(self.deadline, self.loop.time() + FIRST_REQUEST_GRACE_S)
            return
        super().shutdown()

    def _never_spoke(self) -> bool:
        """No byte of a request has arrived on this connection."""
        return (
            self.cycle is None
            and self.phase == HEADERS
            and self.unparsed_header_bytes == 0
            and not _unread(self.transport)
        )

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.send_deadline == NO_DEADLINE:
            self.send_deadline = self.loop.time() + self._limits.send_timeout

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.send_deadline != NO_DEADLINE and not self.transport.is_closing():
            self.send_deadline = NO_DEADLINE

    def closed_unsent(self) -> None:
        """Closed with answers unsent, they get the send timeout to leave (a transport waits
        for them before it lets the connection go, however long)."""
        if self.send_deadline == NO_DEADLINE:
            self.send_deadline = self.loop.time() + self._limits.send_timeout

    def sending_expired(self) -> None:
        """The client took too little of its answers within the send timeout: abort the
        connection (its answers are dropped; the app sees the client gone)."""
        self.deadline = self.send_deadline = NO_DEADLINE
        self._sweeper.count("unread")
        self.transport.abort()

    def _timeout_refusal(self, what: str, v2: bool) -> bytes:
        """The 408 of a request whose ``what`` (headers or body) came too slowly."""
        limit = self._limits.header_timeout if what == "headers" else self._limits.body_timeout
        message = f"the request's {what} did not arrive within {limit:g} s"
        return self._refusal("408 Request Timeout", "RequestTimeout", message, v2=v2)

    def expire(self) -> None:
        """The deadline passed: answer 408 where nothing was answered yet, and close."""
        phase, self.deadline = self.phase, NO_DEADLINE
        if self.transport.is_closing():
            return
        if phase == IDLE and _unread(self.transport):
            # the next request came in time, but the loop has not read it yet (it was busy or
            # stalled): closing would reset it
            self.phase = HEADERS
            self.deadline = self.loop.time() + self._limits.header_timeout
            return
        cycle = self.cycle
        if phase == HEADERS and cycle is not None and not cycle.response_complete:
            # a pipelined request's headers, behind one still answering: that answer goes
            # first, then the 408 (as any refusal in order), then the close
            self._close_refused("headers", self._timeout_refusal("headers", v2=False))
            return
        if self.stopping and self._never_spoke():  # nothing to answer: close
            self.transport.close()
            return
        if phase == HEADERS:  # a new request
            unanswered = True
        else:  # its body: answer unless the app has (e.g. 413 before reading it all)
            unanswered = phase == BODY and cycle is not None and not cycle.response_started
        if unanswered:
            what = "headers" if phase == HEADERS else "body"
            v2 = phase == BODY and is_v2(str(self.scope.get("path", "")))
            self.transport.write(self._timeout_refusal(what, v2))
        if phase in (HEADERS, BODY):
            self._sweeper.count("headers" if phase == HEADERS else "body")
        if cycle is not None and not cycle.response_complete:
            _tell_app_gone(cycle)
        self.transport.close()
