"""Hot-path lanes to a Redis Cluster: one :class:`RespLane` per node, routed by hash slot.

A :class:`ClusterLanes` keeps a lane to each node it has had to talk to and hands out a
:class:`SlotLane` per hash slot, which speaks like a lane (``execute``, ``execute_blocking``,
``pipeline``, ``pipeline_packed``) and sends to whichever primary serves its slot now,
following the cluster's redirections:

- ``MOVED <slot> <host:port>``: the slot lives elsewhere now (a reshard, a failover). The map
  learns it, a full re-read of the slot map (``CLUSTER SLOTS``) follows in the background, and
  the command goes to the new owner.
- ``ASK <slot> <host:port>``: the slot is migrating and the keys are not (all) here: the
  command goes once to the target, after ``ASKING``.
- ``TRYAGAIN``: a command of several keys while they are split between the two nodes of a
  migration: sent again shortly, for up to :data:`UNSETTLED_FOR_S`.
- Redirections that go on (more than :data:`REDIRECTS_AT_ONCE` for one command): the nodes
  disagree about who serves the slot, as while a migration's end (``CLUSTER SETSLOT ... NODE``)
  reaches them one at a time and each sends the command to the other. It is sent again after
  growing pauses, as for ``TRYAGAIN``, until they agree (for up to :data:`UNSETTLED_FOR_S`).
- ``CLUSTERDOWN``, or a node that cannot be reached: a connection error (the caller's
  ``BrokerUnavailable``), and the slot map is read again before the next command, so that a
  replica promoted by a failover is found.

A redirection means the command did not run, so following it never runs anything twice. A
pipeline of several commands (all of one slot: the keys of one model share a hash tag) is sent
as one ``MULTI``/``EXEC`` transaction: during a migration some of its commands could otherwise
be redirected while the others ran (an entry acknowledged on one node while its reply went
astray), whereas a transaction runs whole on one node or not at all. Its replies are those of
the commands, in order, as :meth:`RespLane.pipeline` gives them.

The slot map is shared by the lanes of one transport (a :class:`ClusterMap`); its ``epoch``
changes whenever a slot changes owner, so that whoever keeps something per node (a worker's
estimate of the stream node's clock) knows to renew it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, TypeVar

import hiredis
from redis.crc import key_slot as _key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .redis_url import Address, ClusterURL
from .resp_lane import (
    _RAISED,
    CONNECT_TIMEOUT_S,
    FOLLOW_EVERY_S,
    REPLY_TIMEOUT_S,
    LaneTarget,
    ReplicaError,
    RespLane,
)
from .resp_lane import ssl_context as make_ssl_context

log = logging.getLogger("microbatch.cluster")

SLOTS = 16384
REDIRECTS_AT_ONCE = 2  # MOVED and ASK followed for one command without a pause
UNSETTLED_FOR_S = 5.0  # how long a command the cluster refuses or redirects is sent again
UNSETTLED_FIRST_PAUSE_S = 0.005  # the first pause before sending it again
UNSETTLED_MAX_PAUSE_S = 0.1  # (the pauses double up to this)
REFRESH_EVERY_S = 0.1  # the most often the slot map is read again after failures

_ASKING = hiredis.pack_command(("ASKING",))
_MULTI = hiredis.pack_command(("MULTI",))
_EXEC = hiredis.pack_command(("EXEC",))
_REDIRECTS = ("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN")
_FAILURES = (RedisConnectionError, RedisTimeoutError, OSError)
_T = TypeVar("_T")


class Settling:
    """The pauses before a command that the cluster refuses (TRYAGAIN) or keeps redirecting
    is sent again: from UNSETTLED_FIRST_PAUSE_S, doubling up to UNSETTLED_MAX_PAUSE_S, for up
    to UNSETTLED_FOR_S from when this is made."""

    __slots__ = ("_give_up", "_pause")

    def __init__(self) -> None:
        self._give_up = time.monotonic() + UNSETTLED_FOR_S
        self._pause = UNSETTLED_FIRST_PAUSE_S

    def next_pause(self) -> float | None:
        """The pause before the next try; None once the time is up."""
        if time.monotonic() > self._give_up:
            return None
        pause, self._pause = self._pause, min(self._pause * 2, UNSETTLED_MAX_PAUSE_S)
        return pause


def key_slot(key: str | bytes) -> int:
    """The hash slot of ``key`` (its hash tag's, if it has one)."""
    return _key_slot(key.encode() if isinstance(key, str) else key)


def _redirect(reply: Any) -> str | None:
    """The text of a redirection (or CLUSTERDOWN) error reply, else None."""
    if type(reply) is ResponseError:
        text = str(reply)
        if text.startswith(_REDIRECTS):
            return text
    return None


def _address(text: str, asked: Address) -> Address:
    """The node a redirection names (``host:port``; no host: the node that answered)."""
    host, _, port = text.rpartition(":")
    return Address(host.strip("[]") or asked.host, int(port))


class ClusterMap:
    """Which primary serves each hash slot, read with ``CLUSTER SLOTS`` from any node."""

    def __init__(self, url: ClusterURL, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.url = url
        self.connect_timeout_s = connect_timeout_s
        self._ssl = make_ssl_context(dict(url.options)) if url.tls else None
        self._slots: list[Address | None] = [None] * SLOTS
        self._stale = True  # read the map before the next command
        self._wanted = False  # read it again soon, in the background
        self._refreshing: asyncio.Future[None] | None = None
        self._refreshed_at = float("-inf")
        self._background: asyncio.Task[None] | None = None
        self._failing: dict[Address, float] = {}  # nodes that failed lately: asked last
        self.epoch = 0  # changes whenever a slot changes owner

    def target(self, address: Address) -> LaneTarget:
        """How a lane connects to the node at ``address``."""
        return LaneTarget(
            host=address.host, port=address.port, ssl=self._ssl, username=self.url.username,
            password=self.url.password, label=f"cluster node {address}",
        )  # fmt: skip

    def known(self, slot: int) -> Address | None:
        """The node believed to serve ``slot`` now (None: not known yet)."""
        return self._slots[slot]

    def primaries(self) -> list[Address]:
        """The primaries that serve slots, as the map knows them."""
        return sorted({a for a in self._slots if a is not None}, key=str)

    async def owner(self, slot: int) -> Address:
        """The primary serving ``slot`` (the map read first when it must be)."""
        if self._stale or self._slots[slot] is None:
            await self.refresh()
        elif self._wanted:
            loop, task = asyncio.get_running_loop(), self._background
            if task is None or task.done() or task.get_loop() is not loop:
                self._background = loop.create_task(self._refresh_soon())
        address = self._slots[slot]
        if address is None:
            raise RedisConnectionError(f"no node of the cluster serves hash slot {slot}")
        return address

    def moved(self, slot: int, address: Address) -> None:
        """A node said ``slot`` is served by ``address`` (MOVED): remember it, and read the
        whole map again soon (a reshard or failover moves more than one slot)."""
        if self._slots[slot] != address:
            self._slots[slot] = address
            self.epoch += 1
        self._wanted = True

    def failed(self, address: Address | None = None) -> None:
        """A node (``address``) could not be reached, or the cluster is down: read the map
        before the next command (a failover may have promoted a replica), asking that node
        last (a host gone silent would make each read wait out the connect timeout first)."""
        self._stale = True
        if address is not None:
            self._failing[address] = time.monotonic()

    async def _refresh_soon(self) -> None:
        with contextlib.suppress(*_FAILURES):
            await self.refresh()

    async def refresh(self) -> None:
        """Read the slot map from the first node that answers (one read at a time, at most
        every :data:`REFRESH_EVERY_S`); a connection error if none does."""
        loop = asyncio.get_running_loop()
        refreshing = self._refreshing
        if refreshing is not None and not refreshing.done() and refreshing.get_loop() is loop:
            return await asyncio.shield(refreshing)
        if time.monotonic() - self._refreshed_at < REFRESH_EVERY_S and any(self._slots):
            return None  # just read: the nodes have not changed their minds yet
        self._refreshing = future = loop.create_future()
        try:
            await self._read()
        except BaseException as exc:
            if isinstance(exc, Exception):
                future.set_exception(exc)
                future.exception()  # retrieved: concurrent waiters may be none
            else:
                future.cancel()
            raise
        future.set_result(None)
        return None

    async def _read(self) -> None:
        self._refreshed_at = time.monotonic()
        candidates = list(dict.fromkeys([*self.primaries(), *self.url.nodes]))
        candidates.sort(key=lambda address: self._failing.get(address, 0.0))  # stable
        last: Exception | None = None
        for address in candidates:
            lane = RespLane(self.target(address), self.connect_timeout_s, self.connect_timeout_s)
            try:
                slots = await lane.execute("CLUSTER", "SLOTS")
            except (*_FAILURES, ResponseError) as exc:
                last = exc
                self._failing[address] = time.monotonic()
                continue
            finally:
                lane.close()
            self._learn(slots, address)
            self._failing.pop(address, None)
            return
        raise RedisConnectionError(f"no node of the cluster answers: {last}")

    def _learn(self, slots: Any, asked: Address) -> None:
        table: list[Address | None] = [None] * SLOTS
        for start, end, primary, *_replicas in slots:
            host = primary[0].decode() if primary[0] else ""
            if host in ("", "?"):  # the node does not know its own address: the one asked
                host = asked.host
            address = Address(host, int(primary[1]))
            for slot in range(int(start), int(end) + 1):
                table[slot] = address
        if not any(table):
            raise RedisConnectionError(f"cluster node {asked} serves no slots (not formed yet?)")
        if table != self._slots:
            self.epoch += 1
            self._slots = table
        self._stale = self._wanted = False


class ClusterLanes:
    """Lanes of one kind (commands answered at once, or blocking ones) to the nodes of a
    cluster, and a :class:`SlotLane` per hash slot."""

    def __init__(
        self,
        cluster: ClusterMap,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        reply_timeout_s: float | None = REPLY_TIMEOUT_S,
    ) -> None:
        self.map = cluster
        self._connect_timeout_s = connect_timeout_s
        self._reply_timeout_s = reply_timeout_s
        self._nodes: dict[Address, RespLane] = {}
        self._slots: dict[int, SlotLane] = {}
        self._watch: asyncio.Task[None] | None = None  # see _watch_stalled
        # Set (a worker of a partitioned queue): a node that answers nothing for this long
        # while commands wait is dropped, its commands failed, though it still serves slots.
        self.silent_after_s: float | None = None

    def at(self, key: str | bytes) -> SlotLane:
        """The lane of ``key``'s hash slot."""
        slot = key_slot(key)
        found = self._slots.get(slot)
        if found is None:
            found = self._slots[slot] = SlotLane(self, slot)
        return found

    def node(self, address: Address) -> RespLane:
        """The lane to the node at ``address``."""
        lane = self._nodes.get(address)
        if lane is None:
            target = self.map.target(address)
            lane = self._nodes[address] = RespLane(
                target, self._connect_timeout_s, self._reply_timeout_s
            )
        return lane

    def watch(self) -> None:
        """Watch the lanes for a node gone silent while commands wait (see
        :meth:`_watch_stalled`), unless they have no reply timeout (blocking commands) or a
        watch runs already."""
        watch, loop = self._watch, asyncio.get_running_loop()
        if self._reply_timeout_s is None:
            return
        if watch is not None and not watch.done() and watch.get_loop() is loop:
            return
        self._watch = loop.create_task(self._watch_stalled())

    async def _watch_stalled(self) -> None:
        """While commands wait, every FOLLOW_EVERY_S: if a node has answered nothing for that
        long, read the slot map again (that node asked last), and drop the connection to it
        if it serves no slot any more. A primary gone silent (its host lost, its process
        stopped) keeps its connections open: once a failover has promoted its replica, its
        commands fail at once (a connection error) instead of waiting out the reply timeout.
        With :attr:`silent_after_s`, so do they once the node has answered nothing for that
        long, whether or not it still serves slots."""
        while True:
            await asyncio.sleep(FOLLOW_EVERY_S)
            waited = {address: lane.unanswered_for() for address, lane in self._nodes.items()}
            if not any(waited.values()):
                return  # (the next command starts another)
            stalled = [address for address, s in waited.items() if s >= FOLLOW_EVERY_S]
            if not stalled:
                continue
            for address in stalled:
                self.map.failed(address)
            with contextlib.suppress(*_FAILURES):
                await self.map.refresh()
            primaries = set(self.map.primaries())
            silent_s = self.silent_after_s
            for address in stalled:
                if address not in primaries:
                    reason = f"cluster node {address} serves no slot any more (a failover?)"
                    self._nodes[address].abandon(reason)
                elif silent_s is not None and waited[address] >= silent_s:
                    reason = f"cluster node {address} answered nothing for {silent_s:g} s"
                    self._nodes[address].abandon(reason)

    def close(self) -> None:
        """Drop every connection (a later command reconnects)."""
        if self._watch is not None:
            with contextlib.suppress(RuntimeError):  # its event loop is closed
                self._watch.cancel()
        for lane in self._nodes.values():
            lane.close()


Send = Callable[[RespLane, bool], Awaitable[list[Any]]]


class SlotLane:
    """A lane for the keys of one hash slot: commands go to the primary serving it now,
    redirections followed (see the module's docstring)."""

    draining = False  # (a Sentinel master's lanes drain the master they left; see RespLane)

    async def on_left_master(self, *args: Any) -> None:
        """Nothing: a cluster's nodes stay where they are (see :class:`RespLane`)."""
        return None

    def __init__(self, lanes: ClusterLanes, slot: int) -> None:
        self._lanes = lanes
        self.slot = slot
        self.answered_by: Address | None = None  # the node that ran the last command

    async def each_node(self, action: Callable[[RespLane], Awaitable[_T]]) -> list[_T]:
        """Run ``action`` with the lane of every primary, and of the node that ran this slot's
        last command (the target of a migration may serve no other slot yet), one after the
        other: e.g. to load the functions, since each node has its own. Raises the first
        error."""
        cluster = self._lanes.map
        await cluster.owner(self.slot)  # the map, read if it must be
        nodes = dict.fromkeys([*cluster.primaries(), *filter(None, [self.answered_by])])
        done = []
        for address in nodes:
            try:
                done.append(await action(self._lanes.node(address)))
            except _FAILURES:
                cluster.failed(address)
                raise
        return done

    @property
    def generation(self) -> Hashable:
        """Changes whenever commands of this slot go to another connection (another node, or
        a new connection to the same one)."""
        address = self._lanes.map.known(self.slot)
        if address is None:
            return None
        return (address, self._lanes.node(address).generation)

    async def execute(self, *args: Any) -> Any:
        """Send one command; return its reply (raise ResponseError for an error reply)."""
        packed = hiredis.pack_command(args)

        async def send(lane: RespLane, asking: bool) -> list[Any]:
            if asking:
                return (await lane.pipeline_packed(_ASKING + packed, 2))[1:]
            return await lane.pipeline_packed(packed, 1)

        (reply,) = await self._follow(send)
        if type(reply) in _RAISED:
            raise reply
        return reply

    async def execute_blocking(self, timeout_s: float, *args: Any, busy_poll_s: float = 0.0) -> Any:
        """:meth:`RespLane.execute_blocking` on the slot's node."""

        async def send(lane: RespLane, asking: bool) -> list[Any]:
            try:
                reply = await lane.execute_blocking(
                    timeout_s, *args, busy_poll_s=busy_poll_s, asking=asking
                )
            except ReplicaError as exc:
                if "no longer exists" not in str(exc):
                    raise
                # A blocked read whose key a migration moved away (MIGRATE deletes it here):
                # nothing was read; it is sent again, and redirected.
                reply = ResponseError(f"TRYAGAIN {exc}")
            except ResponseError as exc:
                if _redirect(exc) is None:
                    raise
                reply = exc
            return [reply]

        (reply,) = await self._follow(send)
        if type(reply) in _RAISED:
            raise reply
        return reply

    async def pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Send commands (of this slot) in one write, as one transaction if several; return
        their replies in order, error replies in place (not raised)."""
        if not commands:
            return []
        packed = b"".join([hiredis.pack_command(tuple(command)) for command in commands])
        return await self.pipeline_packed(packed, len(commands))

    async def pipeline_packed(self, packed: bytes, count: int) -> list[Any]:
        """:meth:`pipeline` for ``count`` commands already RESP-encoded into ``packed``."""
        if count == 1:

            async def send_one(lane: RespLane, asking: bool) -> list[Any]:
                if asking:
                    return (await lane.pipeline_packed(_ASKING + packed, 2))[1:]
                return await lane.pipeline_packed(packed, 1)

            return await self._follow(send_one)
        wrapped = _MULTI + packed + _EXEC

        async def send(lane: RespLane, asking: bool) -> list[Any]:
            if asking:
                return (await lane.pipeline_packed(_ASKING + wrapped, count + 3))[1:]
            return await lane.pipeline_packed(wrapped, count + 2)

        return _unwrap(await self._follow(send))

    async def _follow(self, send: Send) -> list[Any]:
        cluster = self._lanes.map
        ask: Address | None = None
        redirects = 0
        settling: Settling | None = None
        while True:
            address = ask or await cluster.owner(self.slot)
            self._lanes.watch()
            try:
                replies = await send(self._lanes.node(address), ask is not None)
            except _FAILURES:
                cluster.failed(address)
                raise
            text = next(filter(None, map(_redirect, replies)), None)
            self.answered_by = address
            if text is None:
                if any(isinstance(reply, RedisConnectionError) for reply in replies):
                    cluster.failed()  # e.g. a demoted primary (READONLY)
                return replies
            ask = None
            kind, *rest = text.split()
            if kind == "CLUSTERDOWN":
                cluster.failed()
                raise RedisConnectionError(f"the cluster is down: {text}")
            redirects += 1
            if kind == "TRYAGAIN" or redirects > REDIRECTS_AT_ONCE:
                # keys split by a migration (TRYAGAIN), or nodes that disagree about who
                # serves the slot: sent again once the migration has moved on
                settling = settling or Settling()
                pause = settling.next_pause()
                if pause is None:
                    raise RedisConnectionError(
                        f"hash slot {self.slot} did not settle in {UNSETTLED_FOR_S:g} s "
                        f"(a migration?): {text}"
                    )
                await asyncio.sleep(pause)
                if kind == "TRYAGAIN":
                    continue
            target = _address(rest[1], address)
            if kind == "MOVED":
                cluster.moved(int(rest[0]), target)
            else:
                ask = target


def _unwrap(replies: list[Any]) -> list[Any]:
    """The commands' replies of ``[MULTI, commands..., EXEC]``'s."""
    opened, queued, done = replies[0], replies[1:-1], replies[-1]
    if isinstance(opened, Exception):  # MULTI refused (an ACL?): the commands ran one by one
        return queued
    if isinstance(done, list):
        return done
    # The transaction was discarded (EXECABORT): each command's own refusal where it had one
    return [reply if isinstance(reply, Exception) else done for reply in queued]
