"""A lean Redis connection for the hot path: RESP over an asyncio Protocol, parsed by hiredis.

redis-py's asyncio client spends about 50 us of Python per command (pool checkout, timeout
contexts, a read loop per reply, response callbacks): on a worker serving small models that is
more than Redis takes to run the commands, and at concurrency 1 it is most of the latency
microbatch adds. A :class:`RespLane` is one connection that writes each command (or pipeline)
packed by hiredis in one ``write`` and resolves its future when hiredis has parsed the reply in
``data_received``: no pool, no per-reply coroutine. Commands are answered in order, so any
number may be in flight on one lane; a blocking command (XREADGROUP BLOCK, BLMPOP) holds the
lane until it returns, so blocking reads get a lane of their own.

Replies come back raw (RESP2: bytes, ints, lists, None); error replies as redis-py's
:class:`~redis.exceptions.ResponseError`, except ``LOADING`` (a Redis reading its dataset after
a restart), which is redis-py's :class:`~redis.exceptions.BusyLoadingError` as with redis-py,
``BUSY`` (a script running past Redis's busy threshold) a :class:`ScriptBusyError`, ``NOAUTH``
and ``WRONGPASS`` redis-py's :class:`~redis.exceptions.AuthenticationError`, Redis at its
maxclients a :class:`TooManyClients`, and a lost connection as redis-py's
:class:`~redis.exceptions.ConnectionError`, so callers handle failures as they do with redis-py
(all are connection errors: the server is not available yet, or not to this connection).
The lane reconnects on the next command after a connection is lost. Where it connects and how it
logs in is a :class:`LaneTarget`: a fixed address read from a redis://, rediss:// or unix:// URL
by redis-py, or an address asked of an :class:`AddressSource` at each connect (the current
master of a Sentinel service: :mod:`broker.sentinel`; :mod:`broker.connections` makes lanes from
any URL). An error reply saying the server is no master any more (``READONLY``, ``UNBLOCKED``
after a role change, ``MASTERDOWN``: a failover moved the master) drops the connection and
is a :class:`ReplicaError`, a connection error too, so the next command reconnects to wherever
the master is now.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import hiredis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.connection import parse_url as parse_redis_url
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoPermissionError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .busy_poll import busy_poll

CONNECT_TIMEOUT_S = 2.0  # to open a connection, and for its AUTH/SELECT to be answered

# How long past its own timeout a blocking command may take before the connection is
# presumed dead (a half-open TCP connection otherwise hangs the reader forever).
BLOCKING_GRACE_S = 5.0
# How long commands that answer at once may wait with no reply before the connection is
# presumed dead (redis-py's asyncio client, without a socket_timeout, would wait forever).
REPLY_TIMEOUT_S = 10.0
# How often a lane whose address comes from a source (a Sentinel service's master) checks,
# while connected, that the source still names the server it is connected to.
FOLLOW_EVERY_S = 1.0
# How long a lane that left a master for another (a failover) keeps reading, on request, what
# is put there (see RespLane.on_left_master), and how often.
DRAIN_S = 3.0
DRAIN_EVERY_S = 0.2

# TCP keepalive on every connection to Redis: a probe after 15 s idle, then every 5 s, dead
# after 3 unanswered. Firewalls and NAT gateways that drop idle connections silently (often
# after a few minutes) keep them, and a peer gone without a word is noticed within ~30 s
# rather than the kernel's default two hours.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 15, 5, 3


def keepalive_options() -> dict[int, int]:
    """The TCP_KEEP* socket options of :data:`KEEPALIVE_IDLE_S` and its peers, where the
    platform has them (redis-py's ``socket_keepalive_options`` takes this form)."""
    wanted = (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPALIVE", KEEPALIVE_IDLE_S),  # macOS's name for TCP_KEEPIDLE
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    )
    return {getattr(socket, name): value for name, value in wanted if hasattr(socket, name)}


# Error replies of a server that is no master (any more): a failover demoted it.
NOT_MASTER = ("READONLY", "UNBLOCKED", "MASTERDOWN")
# What Redis at its maxclients answers a new connection, before closing it.
MAX_CLIENTS = "ERR max number of clients reached"
# Error replies of a server that wants a password this connection lacks (redis-py raises them
# as its AuthenticationError), and the one it closes a connection after (a command longer than
# it takes from a client that has not authenticated, or garbage).
NOT_AUTHENTICATED = ("NOAUTH", "WRONGPASS")
PROTOCOL_ERROR = "ERR Protocol error"
NO_PERMISSION = "NOPERM "  # an ACL refused the command or a key to this user


class ReplicaError(RedisConnectionError):
    """The server answered as a replica (a failover moved the master): the connection is
    dropped, and the next command connects to wherever the master is now."""


class TooManyClients(RedisConnectionError):
    """``ERR max number of clients reached``: Redis at its ``maxclients`` refused the
    connection (it closes it after this reply); the server is not available yet."""


class ClosedByRedis(RedisConnectionError):
    """``ERR Protocol error``: Redis refused a command and closes the connection."""


class ScriptBusyError(RedisConnectionError):
    """``BUSY``: a script or function has run past Redis's busy threshold, and Redis answers
    nothing else until it ends or is killed; the server is not available yet."""


def is_script_busy(message: str) -> bool:
    """Whether an error reply is ``BUSY`` (not ``BUSYGROUP``, and not ``BUSYKEY``)."""
    return message.startswith("BUSY ")


def _reply_error(message: str) -> Exception:
    """The exception an error reply becomes (hiredis calls this for each one)."""
    if message.startswith("LOADING"):
        return BusyLoadingError(message)
    if is_script_busy(message):
        return ScriptBusyError(message)
    if message.startswith(NOT_MASTER):
        return ReplicaError(f"Redis is not the master (failover?): {message}")
    if message.startswith(MAX_CLIENTS):
        return TooManyClients(f"Redis refused the connection: {message}")
    if message.startswith(NOT_AUTHENTICATED):
        return AuthenticationError(message)
    if message.startswith(PROTOCOL_ERROR):
        return ClosedByRedis(message)
    if message.startswith(NO_PERMISSION):  # as redis-py raises it, without the error code
        return NoPermissionError(message.removeprefix(NO_PERMISSION))
    return ResponseError(message)


# error replies execute() raises
_RAISED = (
    ResponseError, BusyLoadingError, ReplicaError, ScriptBusyError, TooManyClients,
    AuthenticationError, ClosedByRedis, NoPermissionError,
)  # fmt: skip
# error replies after which the connection is dropped: those that follow would fail the same
_DROPPING = (TooManyClients, AuthenticationError, ClosedByRedis)


class ServerDown(RedisConnectionError):
    """An :class:`AddressSource` knows of no server up now, and knows why: the one it named
    is seen down (a lane still connected to it drops the connection, as its writes would go
    nowhere)."""


class AddressSource(Protocol):
    """Where a lane's server is now, asked at each connect (e.g. a Sentinel service's master)."""

    async def address(self, max_age_s: float = 0.0) -> tuple[str, int]:
        """(host, port), as learnt at most ``max_age_s`` ago; a redis-py ConnectionError
        when it cannot be known now (:class:`ServerDown` when the server is seen down)."""
        ...

    def close(self) -> None:
        """Drop whatever connections finding the address holds."""
        ...


@dataclass
class LaneTarget:
    """Where a lane connects and how it logs in: a fixed host and port (or unix socket), or
    the address ``source`` gives at each connect."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None  # a unix socket
    ssl: ssl.SSLContext | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    source: AddressSource | None = None
    label: str = ""  # how errors name it (instead of host:port)

    @classmethod
    def from_url(cls, url: str) -> LaneTarget:
        """The target of a redis://, rediss:// or unix:// URL, as redis-py reads it."""
        options: dict[str, Any] = dict(parse_redis_url(url))
        connection_class = options.pop("connection_class", None)
        # Only to read what redis-py makes of the URL (TLS context, defaults); never connected.
        settings: Any = (connection_class or Connection)(**options)
        unix = connection_class is UnixDomainSocketConnection
        return cls(
            host=getattr(settings, "host", "localhost"),
            port=int(getattr(settings, "port", 6379)),
            path=settings.path if unix else None,
            ssl=settings.ssl_context.get() if isinstance(settings, SSLConnection) else None,
            db=int(options.get("db", 0) or 0),
            username=options.get("username"),
            password=options.get("password"),
        )


def ssl_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The TLS context redis-py makes of its ``ssl_*`` connection options."""
    settings = SSLConnection(**{k: v for k, v in options.items() if k.startswith("ssl_")})
    context: ssl.SSLContext = settings.ssl_context.get()
    return context


class _Pipeline:
    """Replies still expected for one pipeline, collected for its future."""

    __slots__ = ("expected", "future", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], expected: int) -> None:
        self.future = future
        self.expected = expected
        self.replies: list[Any] = []


class _RespProtocol(asyncio.Protocol):
    """One connection: writes commands and hands out replies in order.

    With a ``reply_timeout_s``, the connection is dropped when commands wait that long with
    no reply at all (a stalled server, or a connection a middlebox dropped silently).
    """

    def __init__(self, reply_timeout_s: float | None = None) -> None:
        self.reader = hiredis.Reader(replyError=self._reply_error)
        self.dropping: str | None = None  # why an error reply means the connection must go
        self.waiting: deque[asyncio.Future[Any] | _Pipeline] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.error: RedisConnectionError | None = None  # what the waiting commands failed with
        self.reply_timeout_s = reply_timeout_s
        self.progress = 0.0  # when the last reply came, or the first command of a quiet spell
        self.watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        if self.reply_timeout_s:
            self._watch()

    def _reply_error(self, message: str) -> Exception:
        error = _reply_error(message)
        if type(error) is ReplicaError:  # what follows would fail the same way
            self.dropping = "Redis is not the master any more"
        elif type(error) in _DROPPING:
            self.dropping = str(error)
        return error

    def _watch(self) -> None:
        timeout = self.reply_timeout_s
        assert timeout is not None
        if self.lost:
            return
        if self.waiting and time.monotonic() - self.progress > timeout:
            self.abort(f"no reply from Redis in {timeout:g} s")
            return
        self.watchdog = asyncio.get_running_loop().call_later(timeout / 2, self._watch)

    def send(self, packed: bytes, waiter: asyncio.Future[Any] | _Pipeline) -> None:
        transport = self.transport
        if self.lost or transport is None or transport.is_closing():
            raise RedisConnectionError("connection to Redis is closing")
        if not self.waiting:
            self.progress = time.monotonic()
        self.waiting.append(waiter)
        transport.write(packed)

    def data_received(self, data: bytes) -> None:
        reader, waiting = self.reader, self.waiting
        reader.feed(data)
        if self.watchdog is not None:
            self.progress = time.monotonic()
        try:
            while (reply := reader.gets()) is not False:
                head = waiting[0]
                if type(head) is _Pipeline:
                    head.replies.append(reply)
                    if len(head.replies) < head.expected:
                        continue
                    waiting.popleft()
                    if not head.future.done():
                        head.future.set_result(head.replies)
                else:
                    waiting.popleft()
                    if not head.done():  # type: ignore[union-attr]
                        head.set_result(reply)  # type: ignore[union-attr]
        except hiredis.ProtocolError as exc:
            self.abort(f"protocol error: {exc!r}")
        except IndexError:  # a reply nobody asked for: a refused connection's error, say
            self.abort(str(reply) if isinstance(reply, Exception) else "stray reply")
            return
        if self.dropping is not None:
            self.abort(self.dropping)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.watchdog is not None:
            self.watchdog.cancel()
        error = RedisConnectionError(f"connection to Redis lost: {exc or 'closed by server'}")
        if self.error is None:  # abort() calls this with its reason before the transport does
            self.error = error
        while self.waiting:
            head = self.waiting.popleft()
            future = head.future if type(head) is _Pipeline else head
            if not future.done():  # type: ignore[union-attr]
                future.set_exception(error)  # type: ignore[union-attr]

    def abort(self, reason: str) -> None:
        """Drop the connection; every command waiting on it fails with ConnectionError."""
        if self.transport is not None and not self.lost:
            self.transport.abort()
            self.lost = True
        self.connection_lost(RedisConnectionError(reason))


def _send_pipeline(
    protocol: _RespProtocol, commands: Sequence[Sequence[Any]]
) -> asyncio.Future[list[Any]]:
    """Write ``commands`` in one go; the future gets their replies, error replies in place."""
    packed = b"".join([hiredis.pack_command(tuple(command)) for command in commands])
    return _send_packed(protocol, packed, len(commands))


def _send_packed(protocol: _RespProtocol, packed: bytes, count: int) -> asyncio.Future[list[Any]]:
    future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
    protocol.send(packed, _Pipeline(future, count))
    return future


def bulk_strings(args: Sequence[Any]) -> bytes:
    """``args`` as RESP bulk strings, without a command's array header: a piece to splice
    into commands packed by hand (see :meth:`RespLane.pipeline_packed`)."""
    if not args:
        return b""
    packed: bytes = hiredis.pack_command(tuple(args))
    return packed[packed.index(b"\r\n") + 2 :]


_ASKING = hiredis.pack_command(("ASKING",))


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future nobody awaits as seen (its error, if any, is the next command's too)."""
    if not future.cancelled():
        future.exception()


class RespLane:
    """One lean connection to the Redis at ``target`` (a :class:`LaneTarget`, or a redis://,
    rediss:// or unix:// URL), (re)connected on first use.

    ``reply_timeout_s`` bounds how long commands may go unanswered (None: no bound; blocking
    commands have their own, from their timeout).
    """

    def __init__(
        self,
        target: str | LaneTarget,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        reply_timeout_s: float | None = REPLY_TIMEOUT_S,
    ) -> None:
        if isinstance(target, str):
            target = LaneTarget.from_url(target)
        self.target = target
        self._path = target.path
        self._host, self._port = target.host, target.port
        self._ssl = target.ssl
        self._db = target.db
        self._username, self._password = target.username, target.password
        self._connect_timeout_s = connect_timeout_s
        self._reply_timeout_s = reply_timeout_s
        self._protocol: _RespProtocol | None = None
        self.generation = 0  # how many connections this lane has opened
        self._follower: asyncio.Task[None] | None = None  # see _follow
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future[_RespProtocol] | None = None
        self._left: RespLane | None = None  # to the master this lane left, while drained
        self._drain_until = self._next_drain = 0.0

    @property
    def draining(self) -> bool:
        """Whether this lane left a master for another (a failover) and has not finished
        reading what is put there: see :meth:`on_left_master`."""
        return self._left is not None

    async def on_left_master(self, *args: Any) -> Any:
        """Run ``args`` (a non-blocking read) on the master this lane left, for
        :data:`DRAIN_S` after it left, at most every :data:`DRAIN_EVERY_S`; None when there
        is nothing to run now, or no answer.

        Each connection of each process learns of a failover on its own timer (and from
        whichever sentinel answers first), and Sentinel demotes a live old master only seconds
        later: meanwhile writers that have not learnt of the move still write there. A worker
        whose read left first never saw the requests callers put there, nor a caller the
        replies a worker pushed there, which the old master then dropped at its demotion (10
        to 33 calls per graceful failover at 80 calls/s). Readers that drain the old master
        for a while read them; writers put nothing more there once they know."""
        left = self._left
        if left is None:
            return None
        now = asyncio.get_running_loop().time()
        if now < self._next_drain:
            return None
        self._next_drain = now + DRAIN_EVERY_S
        try:
            reply = await asyncio.wait_for(left.execute(*args), CONNECT_TIMEOUT_S)
        except Exception:  # demoted (READONLY), gone, or slow: nothing more to read there
            reply, now = None, self._drain_until
        if now >= self._drain_until and not reply:
            self._stop_draining(left)
        return reply

    def _left_for_another(self, address: tuple[str, int]) -> None:
        """Keep a way to the master at ``address``, which this lane is leaving, for
        :meth:`on_left_master`."""
        if self._left is not None:
            self._left.close()
        target = replace(self.target, host=address[0], port=address[1], source=None, label="")
        left = self._left = RespLane(target, self._connect_timeout_s)
        loop = asyncio.get_running_loop()
        self._drain_until = loop.time() + DRAIN_S
        self._next_drain = 0.0
        # a lane nobody reads on any more (a writer's, an idle caller's) lets it go
        loop.call_later(2 * DRAIN_S, self._stop_draining, left)

    def _stop_draining(self, left: RespLane) -> None:
        if self._left is left:
            self._left = None
        left.close()

    async def execute(self, *args: Any) -> Any:
        """Send one command; return its reply (raise ResponseError for an error reply)."""
        protocol = await self._ready()
        future = asyncio.get_running_loop().create_future()
        protocol.send(hiredis.pack_command(args), future)
        reply = await future
        if type(reply) in _RAISED:
            raise reply
        return reply

    def at(self, key: str | bytes) -> RespLane:
        """The lane for ``key``: this one (a cluster's lanes pick one per hash slot)."""
        return self

    async def execute_blocking(
        self, timeout_s: float, *args: Any, busy_poll_s: float = 0.0, asking: bool = False
    ) -> Any:
        """Send a command that blocks in Redis for up to ``timeout_s`` (0: forever).

        With ``busy_poll_s``, the event loop keeps polling the socket (and running its other
        tasks) for up to that long before it sleeps until the reply: see :func:`busy_poll`.
        With ``asking``, ASKING goes first (a Redis Cluster's ASK redirection). The
        connection is dropped if no reply comes ``BLOCKING_GRACE_S`` after the timeout, and
        when the caller is cancelled (its reply would otherwise hold up the commands behind
        it).
        """
        protocol = await self._ready()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if asking:
            asked = loop.create_future()
            asked.add_done_callback(_retrieve)
            protocol.send(_ASKING, asked)
        protocol.send(hiredis.pack_command(args), future)
        guard = None
        if timeout_s > 0:
            guard = loop.call_later(
                timeout_s + BLOCKING_GRACE_S, protocol.abort, "no reply to a blocking command"
            )
        try:
            if busy_poll_s > 0:
                await busy_poll(future.done, busy_poll_s)
            reply = await future
        except asyncio.CancelledError:
            protocol.abort("blocking command cancelled")
            raise
        finally:
            if guard is not None:
                guard.cancel()
        if type(reply) in _RAISED:
            raise reply
        return reply

    async def pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Send commands in one write; return their replies in order, error replies in place
        (as ResponseError or BusyLoadingError instances, not raised)."""
        if not commands:
            return []
        return await _send_pipeline(await self._ready(), commands)

    async def pipeline_packed(self, packed: bytes, count: int) -> list[Any]:
        """:meth:`pipeline` for ``count`` commands already RESP-encoded into ``packed``."""
        return await _send_packed(await self._ready(), packed, count)

    def unanswered_for(self) -> float:
        """How long commands have waited on this lane with no reply at all (0 when none
        waits; counted only with a reply timeout, as the watchdog counts it)."""
        protocol = self._protocol
        if protocol is None or protocol.lost or not protocol.waiting or not protocol.watchdog:
            return 0.0
        return time.monotonic() - protocol.progress

    def abandon(self, reason: str) -> None:
        """Drop the connection now: the commands waiting on it fail with ConnectionError
        (``reason``); the next command reconnects."""
        protocol = self._protocol
        if protocol is not None and not protocol.lost:
            protocol.abort(reason)

    def close(self) -> None:
        """Drop the connection, and the source's (a later command reconnects)."""
        self._drop()
        left, self._left = self._left, None
        if left is not None:
            left.close()
        if self.target.source is not None:
            self.target.source.close()

    def _drop(self) -> None:
        protocol, self._protocol = self._protocol, None
        follower, self._follower = self._follower, None
        if follower is not None and not follower.done():
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nothing to do
                follower.cancel()
        if protocol is not None and protocol.transport is not None:
            with contextlib.suppress(RuntimeError):
                protocol.transport.close()

    async def _ready(self) -> _RespProtocol:
        protocol = self._protocol
        if protocol is not None and not protocol.lost and self._loop is asyncio.get_running_loop():
            return protocol
        return await self._reconnect()

    async def _reconnect(self) -> _RespProtocol:
        loop = asyncio.get_running_loop()
        if self._connecting is not None and self._loop is loop and not self._connecting.done():
            return await asyncio.shield(self._connecting)  # one connect for concurrent callers
        self._drop()
        self._loop = loop
        self._connecting = loop.create_future()
        try:
            protocol = await self._open(loop)
        except BaseException as exc:
            connecting, self._connecting = self._connecting, None
            if isinstance(exc, Exception):
                connecting.set_exception(exc)
                connecting.exception()  # retrieved: concurrent waiters may be none
            else:
                connecting.cancel()
            raise
        self._protocol = protocol
        self.generation += 1
        if self.target.source is not None:
            self._follower = loop.create_task(self._follow(protocol, (self._host, self._port)))
        self._connecting.set_result(protocol)
        return protocol

    async def _follow(self, protocol: _RespProtocol, address: tuple[str, int]) -> None:
        """While connected, ask the source every :data:`FOLLOW_EVERY_S` where the server is,
        and drop the connection once it names another: a master replaced by a failover may
        take its time to refuse writes (Sentinel demotes a live old master only seconds
        later), and writes it took meanwhile would be lost. Dropped too once the source sees
        the server down: a host that died silently would swallow writes until the failover
        is done; instead, calls fail fast (no server can be known) until it is."""
        source = self.target.source
        assert source is not None
        while not protocol.lost:
            await asyncio.sleep(FOLLOW_EVERY_S)
            try:
                now = await source.address(max_age_s=FOLLOW_EVERY_S / 2)
            except ServerDown as exc:
                if not protocol.lost:
                    protocol.abort(str(exc))
                continue
            except Exception:  # nothing is known now: the connection speaks for itself
                continue
            if now != address and not protocol.lost:
                self._left_for_another(address)
                protocol.abort(f"the master moved to {now[0]}:{now[1]}")

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _RespProtocol:
        def protocol_factory() -> _RespProtocol:
            return _RespProtocol(self._reply_timeout_s)

        if self.target.source is not None:  # asked anew at each connect: it may have moved
            self._host, self._port = await self.target.source.address()
        if self._path is not None:
            opening = loop.create_unix_connection(protocol_factory, self._path)
        else:
            opening = loop.create_connection(
                protocol_factory, self._host, self._port, ssl=self._ssl
            )
        try:
            _, protocol = await asyncio.wait_for(opening, self._connect_timeout_s)
        except asyncio.TimeoutError as exc:
            # a plain-text Redis waits for a command while the client waits for its TLS hello
            hint = " (with TLS: does that port speak TLS?)" if self._ssl is not None else ""
            raise RedisTimeoutError(
                f"timed out connecting to Redis: {self._where()}{hint}"
            ) from exc
        except OSError as exc:
            raise RedisConnectionError(
                f"cannot connect to Redis at {self._where()}: {exc}"
            ) from exc
        if protocol.lost:  # closed as soon as accepted (Redis at its maxclients)
            assert protocol.error is not None
            raise RedisConnectionError(
                f"cannot connect to Redis at {self._where()}: {protocol.error}"
            )
        assert protocol.transport is not None
        sock = protocol.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in keepalive_options().items():
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
        await self._handshake(protocol)
        return protocol

    async def _handshake(self, protocol: _RespProtocol) -> None:
        commands: list[tuple[Any, ...]] = []
        if self._password is not None:
            # Always name the user, as redis-py's HELLO does: a Redis whose default user needs no
            # password accepts `AUTH default <any>` but refuses `AUTH <password>` (ERR ... called
            # without any password configured), so a URL with a password it does not need
            # would let the supervisor in through redis-py and shut the workers out.
            commands.append(("AUTH", self._username or "default", self._password))
        if self._db:
            commands.append(("SELECT", self._db))
        if not commands:
            return
        try:
            replies = await asyncio.wait_for(
                _send_pipeline(protocol, commands), self._connect_timeout_s
            )
        except asyncio.TimeoutError as exc:
            protocol.abort("handshake timed out")
            raise RedisTimeoutError(f"no answer from Redis at {self._where()}") from exc
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, RedisConnectionError):  # e.g. Redis at its maxclients
                protocol.abort(str(reply))
                raise reply
            if isinstance(reply, (ResponseError, BusyLoadingError)):
                protocol.abort("handshake refused")
                if command[0] == "AUTH":
                    raise AuthenticationError(str(reply))
                raise reply

    def _where(self) -> str:
        where = self._path or f"{self._host}:{self._port}"
        return f"{self.target.label} at {where}" if self.target.label else where
