"""The transport over Redis Streams.

The hot path (enqueue, the reply reader, the worker's reads, replies and acks) runs on lean
connections (:class:`broker.resp_lane.RespLane`); the rest (consumer groups, taking over a
dead worker's entries, dead letters, INFO) on redis-py's asyncio client.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import BrokerUnavailable, MicrobatchError, QueueFull
from .keys import ModelKeys
from .liveness import lapsed_s
from .protocol import CallRequests, request_fields
from .resp_lane import CONNECT_TIMEOUT_S, RespLane, bulk_strings, keepalive_options
from .resp_packing import use_hiredis_packing
from .scripts import ENQUEUE_SCRIPT, RETIRE_CONSUMER_SCRIPT, WITHDRAW_SCRIPT, pack_args
from .transport import Entry, QueueBound, Redelivery, entry_data_size

log = logging.getLogger("microbatch.redis")

UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError)
CANCELLED_TTL_MS = 10 * 60 * 1000  # how long a withdrawal is remembered for workers to skip


def connect(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (redis://, rediss://, unix://; user, password, db)."""
    options.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
    options.setdefault("socket_keepalive", True)
    options.setdefault("socket_keepalive_options", keepalive_options())
    options.setdefault("health_check_interval", 15)
    return use_hiredis_packing(aioredis.Redis.from_url(url, decode_responses=False, **options))


_MULTI = hiredis.pack_command(("MULTI",))
_EXEC = hiredis.pack_command(("EXEC",))
_ID_MARK, _DATA_MARK = "\0id\0", b"\0data\0"


class XaddPacker:
    """XADD commands of request items, RESP-encoded by hand around each item's id and data.

    The rest of a call's entry (stream, reply key, timeout, trace) is packed once into a
    template, kept for the next call with the same ones. (Packing every field of every item
    through hiredis was a tenth of a caller's CPU.)
    """

    MAX_TEMPLATES = 64

    def __init__(self) -> None:
        self._templates: dict[tuple[str, str, int], tuple[bytes, bytes, bytes]] = {}

    def pack(self, stream: str, call: CallRequests) -> bytes:
        """One XADD per item of ``call``, in order."""
        if call.traceparent is None:  # a traced call's template is its own: not kept
            key = (stream, call.reply_key, call.timeout_ms)
            template = self._templates.get(key)
            if template is None:
                if len(self._templates) >= self.MAX_TEMPLATES:
                    self._templates.clear()
                template = self._templates[key] = self._template(stream, call)
        else:
            template = self._template(stream, call)
        head, middle, tail = template
        return b"".join(
            [
                b"%s$%d\r\n%s\r\n%s$%d\r\n%s\r\n%s"
                % (head, len(rid), rid, middle, len(data), data, tail)
                for rid, data in zip(
                    [rid.encode() for rid in call.request_ids], call.payloads, strict=True
                )
            ]
        )

    @staticmethod
    def _template(stream: str, call: CallRequests) -> tuple[bytes, bytes, bytes]:
        """The RESP before an item's id, between its id and its data, and after its data."""
        fields = request_fields(
            _ID_MARK, call.reply_key, call.timeout_ms, _DATA_MARK, call.traceparent
        )
        args = ["XADD", stream, "*", *_flatten(fields)]
        at_id, at_data = args.index(_ID_MARK), args.index(_DATA_MARK)
        head = b"*%d\r\n%s" % (len(args), bulk_strings(args[:at_id]))
        return head, bulk_strings(args[at_id + 1 : at_data]), bulk_strings(args[at_data + 1 :])


def _unavailable(exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(f"cannot reach Redis: {exc}")


class RedisTransport:
    """:class:`broker.transport.Transport` over a Redis server (6.2 or later)."""

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self.redis = connect(url, **options)
        connect_timeout_s = float(options.get("socket_connect_timeout") or CONNECT_TIMEOUT_S)
        self._lane = RespLane(url, connect_timeout_s)  # commands that answer at once
        # blocking reads, each bounded by its own timeout instead of the lane's reply timeout
        self._reads = RespLane(url, connect_timeout_s, None)  # the worker's XREADGROUP
        self._replies = RespLane(url, connect_timeout_s, None)  # the caller's BLMPOP
        self._xadds = XaddPacker()
        self._has_blmpop: bool | None = None
        self.cancellations_pending = True  # as of the last finish(); True until known

    async def _server_has_blmpop(self) -> bool:
        if self._has_blmpop is None:
            info = await self.redis.info("server")
            major = int(str(info.get("redis_version", "6")).split(".")[0])
            self._has_blmpop = major >= 7
        return self._has_blmpop

    # -- caller side ----------------------------------------------------------------------
    async def enqueue(
        self, keys: ModelKeys, calls: Sequence[CallRequests], bound: QueueBound
    ) -> list[list[str] | MicrobatchError]:
        if not bound.max_items and not bound.max_bytes:
            return await self._enqueue_unbounded(keys, calls)
        # One script call per round trip, its arguments one msgpack blob, so that the bound is
        # checked atomically with the XADDs.
        blob = pack_args(
            [
                [call.data_size, *(_flatten(fields) for fields in call.entry_fields())]
                for call in calls
            ]
        )
        try:
            results = await ENQUEUE_SCRIPT.run(
                self._lane,
                [keys.stream, keys.queued_bytes],
                [bound.max_items, bound.max_bytes, blob],
            )
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        return [_enqueue_outcome(result, bound) for result in results]

    async def _enqueue_unbounded(
        self, keys: ModelKeys, calls: Sequence[CallRequests]
    ) -> list[list[str] | MicrobatchError]:
        """No bound to check: one transaction of plain XADDs and the byte count, no Lua (less
        work for Redis; a blocked worker still wakes once, to the whole transaction)."""
        stream = keys.stream
        pack = self._xadds.pack
        size = sum(call.data_size for call in calls)
        commands = [_MULTI, *(pack(stream, call) for call in calls)]
        incrby: tuple[Any, ...] = ("INCRBY", keys.queued_bytes, size)
        commands.append(hiredis.pack_command(incrby))
        commands.append(_EXEC)
        count = 3 + sum(len(call.request_ids) for call in calls)
        try:
            replies = await self._lane.pipeline_packed(b"".join(commands), count)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        executed = replies[-1]
        if not isinstance(executed, list):  # EXECABORT: a command was refused as queued
            raise next((r for r in replies if isinstance(r, ResponseError)), executed)
        for result in executed:
            if isinstance(result, ResponseError):  # e.g. the stream key holds another type
                raise result
        ids = [entry_id.decode() for entry_id in executed[:-1]]
        outcomes: list[list[str] | MicrobatchError] = []
        start = 0
        for call in calls:
            end = start + len(call.request_ids)
            outcomes.append(ids[start:end])
            start = end
        return outcomes

    async def cancel(self, keys: ModelKeys, entries: Sequence[tuple[str, int]]) -> None:
        if not entries:
            return
        now_ms = await self.time_ms()
        args = [
            keys.group,
            now_ms + CANCELLED_TTL_MS,
            now_ms,
            pack_args([item for entry in entries for item in entry]),
        ]
        try:
            await WITHDRAW_SCRIPT.run(
                self._lane, [keys.stream, keys.queued_bytes, keys.cancelled], args
            )
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self._delete_unread(keys, entries)

    async def _delete_unread(self, keys: ModelKeys, entries: Sequence[tuple[str, int]]) -> None:
        """Withdraw entries of a stream no worker has ever read (it has no consumer group):
        delete them and release their bytes."""
        try:
            deleted = await self._lane.pipeline([("XDEL", keys.stream, e) for e, _ in entries])
            released = sum(size for (_, size), n in zip(entries, deleted, strict=True) if n == 1)
            if released:
                await self._lane.execute("DECRBY", keys.queued_bytes, released)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        try:
            lane = self._replies
            if await self._server_has_blmpop():
                got: Any = await lane.execute_blocking(
                    timeout_s, "BLMPOP", timeout_s, 1, inbox, "LEFT", "COUNT", count
                )
                return list(got[1]) if got else []
            first = await lane.execute_blocking(timeout_s, "BLPOP", inbox, timeout_s)
            if not first:
                return []
            more = await self._lane.execute("LPOP", inbox, count - 1) if count > 1 else None
            return [first[1], *(more or [])]
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc

    # -- worker side ----------------------------------------------------------------------
    async def ensure_group(self, keys: ModelKeys) -> None:
        try:
            await self.redis.xgroup_create(keys.stream, keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc

    async def read_batch(
        self, keys: ModelKeys, consumer: str, count: int, block_ms: int, busy_poll_s: float = 0.0
    ) -> list[Entry]:
        block_ms = max(1, block_ms)
        try:
            got: Any = await self._reads.execute_blocking(
                block_ms / 1000, "XREADGROUP", "GROUP", keys.group, consumer,
                "COUNT", count, "BLOCK", block_ms, "STREAMS", keys.stream, ">",
                busy_poll_s=busy_poll_s,
            )  # fmt: skip
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The stream was deleted (FLUSHALL, a purge): recreate it and read again next time.
            log.warning(
                "consumer group %s vanished from %s; recreating it", keys.group, keys.stream
            )
            await self.ensure_group(keys)
            return []
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        if not got:
            return []
        return [(entry_id.decode(), _pairs(fields)) for entry_id, fields in got[0][1]]

    async def finish(
        self,
        keys: ModelKeys,
        replies: Sequence[tuple[str, bytes]],
        entries: Sequence[Entry],
        reply_ttl_s: int,
        check: Sequence[str] = (),
    ) -> set[str]:
        by_key: dict[str, list[bytes]] = {}
        for key, payload in replies:
            by_key.setdefault(key, []).append(payload)
        commands: list[tuple[Any, ...]] = []
        for key, payloads in by_key.items():
            commands.append(("RPUSH", key, *payloads))
            commands.append(("EXPIRE", key, reply_ttl_s))
        commands += _removal(keys, entries)
        if check:
            commands.append(("ZMSCORE", keys.cancelled, *check))
        commands.append(("ZCARD", keys.cancelled))
        try:
            results = await self._lane.pipeline(commands)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        pending = results.pop()
        self.cancellations_pending = not isinstance(pending, int) or pending > 0
        scores: Any = results.pop() if check else []
        for result in results:
            if isinstance(result, Exception):  # e.g. a reply key that is not a list
                log.warning("a reply could not be completed: %s", result)
        if isinstance(scores, Exception):
            log.warning("could not check for withdrawn requests: %s", scores)
            return set()
        if entries and isinstance(results[-1], int) and results[-1] < 0:
            # A caller that XADDed without counting its bytes (see docs/protocol.md) drove the
            # counter below zero: bring it back, so that it never loosens the byte bound.
            await self._floor_queued_bytes(keys, results[-1])
        return {entry_id for entry_id, score in zip(check, scores, strict=True) if score}

    async def withdrawn(self, keys: ModelKeys, entry_ids: Sequence[str]) -> set[str]:
        if not entry_ids:
            return set()
        try:
            scores = await self._lane.execute("ZMSCORE", keys.cancelled, *entry_ids)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        return {entry_id for entry_id, score in zip(entry_ids, scores, strict=True) if score}

    async def _floor_queued_bytes(self, keys: ModelKeys, value: int) -> None:
        with contextlib.suppress(*UNAVAILABLE, ResponseError):
            await self.redis.incrby(keys.queued_bytes, -value)

    async def reclaim(
        self, keys: ModelKeys, consumer: str, min_idle_ms: int, count: int, own: bool = False
    ) -> list[Redelivery]:
        try:
            if own:
                holders = [consumer]
            else:
                holders = await self._dead_consumers(keys, consumer)
            taken: list[Redelivery] = []
            for holder in holders:
                if len(taken) < count:
                    taken += await self._claim(
                        keys, consumer, holder, min_idle_ms, count - len(taken), own
                    )
                if holder != consumer:
                    await RETIRE_CONSUMER_SCRIPT.run(
                        self._lane, [keys.stream, keys.heartbeat(holder)], [keys.group, holder]
                    )
            return taken
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc

    async def _dead_consumers(self, keys: ModelKeys, consumer: str) -> list[str]:
        try:
            consumers: Any = await self.redis.xinfo_consumers(keys.stream, keys.group)
        except ResponseError:  # no stream or group yet
            return []
        others = [_text(info["name"]) for info in consumers]
        others = [name for name in others if name != consumer]
        if not others:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in others:
                pipe.exists(keys.heartbeat(name))
            alive = await pipe.execute()
        return [name for name, exists in zip(others, alive, strict=True) if not exists]

    async def _claim(
        self, keys: ModelKeys, consumer: str, holder: str, min_idle_ms: int, count: int, own: bool
    ) -> list[Redelivery]:
        pending: Any = await self.redis.xpending_range(
            keys.stream, keys.group, "-", "+", count, consumername=holder
        )
        if not pending:
            return []
        deliveries = {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        claimed: Any = await self.redis.xclaim(
            keys.stream, keys.group, consumer, 0 if own else min_idle_ms, list(deliveries)
        )
        found = [(_text(entry_id), fields) for entry_id, fields in claimed if entry_id is not None]
        # Not claimed: deleted while pending (answered, then the ack was lost), or not idle for
        # min_idle_ms (read just before its worker died, or just claimed by another worker).
        # Only the deleted ones may be acknowledged: acking the others would lose them. Redis 7
        # drops deleted entries from the group itself; Redis 6.2 hands them to the claimer.
        missed = sorted(set(deliveries) - {entry_id for entry_id, _ in found})
        if missed:
            async with self.redis.pipeline(transaction=False) as pipe:
                for entry_id in missed:
                    pipe.xpending_range(keys.stream, keys.group, entry_id, entry_id, 1)
                owners: Any = await pipe.execute()
            gone = [
                entry_id
                for entry_id, rows in zip(missed, owners, strict=True)
                if rows and _text(rows[0]["consumer"]) == consumer
            ]
            if gone:
                await self.redis.xack(keys.stream, keys.group, *gone)
        if found:
            log.warning(
                "took over %d entr%s from %s consumer %s",
                len(found), "y" if len(found) == 1 else "ies", "own" if own else "dead", holder,
            )  # fmt: skip
        return [((entry_id, fields), deliveries[entry_id]) for entry_id, fields in found]

    async def dead_letter(self, keys: ModelKeys, entries: Sequence[Entry], reason: str) -> None:
        if not entries:
            return
        commands: list[tuple[Any, ...]] = []
        for entry_id, fields in entries:
            record: dict[Any, Any] = dict(fields)
            record[b"dead_reason"] = reason
            record[b"dead_entry"] = entry_id
            commands.append(("XADD", keys.dead_letters, "*", *_flatten(record)))
        commands += _removal(keys, entries)
        try:
            results = await self._lane.pipeline(commands)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        for result in results:
            if isinstance(result, ResponseError):
                raise result

    async def eviction_warning(self) -> str | None:
        """A warning if Redis may evict keys (streams would lose requests), else None."""
        return await eviction_warning(self.redis)

    async def workers_lapsed_s(self, keys: ModelKeys) -> float | None:
        commands = [("TIME",), ("ZRANGEBYSCORE", keys.consumers, "-inf", "+inf", "WITHSCORES")]
        try:
            time, flat = await self._lane.pipeline(commands)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        for result in (time, flat):
            if isinstance(result, Exception):  # e.g. an ACL user without ZRANGEBYSCORE
                raise result
        seconds, micros = time
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        return lapsed_s(now_ms, [float(score) for score in flat[1::2]])

    async def time_ms(self) -> int:
        try:
            seconds, micros = await self._lane.execute("TIME")
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        return int(seconds) * 1000 + int(micros) // 1000

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (*UNAVAILABLE, ResponseError):
            return False

    async def close(self) -> None:
        for lane in (self._lane, self._reads, self._replies):
            lane.close()
        await self.redis.aclose()


async def eviction_warning(client: aioredis.Redis) -> str | None:
    """A warning if this Redis may evict keys (request streams would be lost), else None.

    Reads INFO (not CONFIG GET, which ACLs and managed services often refuse).
    """
    try:
        info = await client.info("memory")
    except (ResponseError, *UNAVAILABLE):
        return None  # nothing to check with
    policy = _text(info.get("maxmemory_policy", "noeviction"))
    if policy == "noeviction":
        return None
    return (
        f"Redis runs with maxmemory-policy {policy}: under memory pressure it may evict "
        "request streams and lose requests; set maxmemory-policy noeviction"
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _enqueue_outcome(result: Any, bound: QueueBound) -> list[str] | MicrobatchError:
    code = int(result[0])
    if code == 0:
        return [entry_id.decode() for entry_id in result[1:]]
    if code == 1:
        return QueueFull(f"queue is at its bound of {bound.max_items} items")
    return QueueFull(f"queue is at its bound of {bound.max_bytes} bytes")


def _removal(keys: ModelKeys, entries: Sequence[Entry]) -> list[tuple[Any, ...]]:
    """The ack, delete and byte release of entries this worker holds."""
    if not entries:
        return []
    ids = [entry_id for entry_id, _ in entries]
    commands: list[tuple[Any, ...]] = [
        ("XACK", keys.stream, keys.group, *ids),
        ("XDEL", keys.stream, *ids),
    ]
    size = sum(entry_data_size(fields) for _, fields in entries)
    if size:
        commands.append(("DECRBY", keys.queued_bytes, size))
    return commands


def _pairs(flat: list[bytes] | None) -> dict[bytes, bytes]:
    """A stream entry's fields from RESP's flat [field, value, ...] list."""
    if not flat:
        return {}
    it = iter(flat)
    return dict(zip(it, it, strict=False))


def _flatten(fields: Mapping[Any, Any]) -> list[Any]:
    """A stream entry's fields as RESP's flat [field, value, ...] list."""
    return list(chain.from_iterable(fields.items()))
