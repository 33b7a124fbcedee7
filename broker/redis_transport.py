"""The transport over Redis Streams, on redis-py's asyncio client (hiredis when installed)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import BrokerUnavailable
from .transport import Entry

log = logging.getLogger("microbatch.redis")

UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError)


def connect(url: str, **options: Any) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (redis://, rediss://, unix://; user, password, db)."""
    options.setdefault("socket_connect_timeout", 2.0)
    options.setdefault("socket_keepalive", True)
    options.setdefault("health_check_interval", 15)
    return aioredis.Redis.from_url(url, decode_responses=False, **options)


class RedisTransport:
    """:class:`broker.transport.Transport` over a Redis server (6.2 or later)."""

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self.redis = connect(url, **options)
        self._has_blmpop: bool | None = None

    async def _server_has_blmpop(self) -> bool:
        if self._has_blmpop is None:
            info = await self.redis.info("server")
            major = int(str(info.get("redis_version", "6")).split(".")[0])
            self._has_blmpop = major >= 7
        return self._has_blmpop

    # -- caller side ----------------------------------------------------------------------
    async def enqueue(self, stream: str, entries: Sequence[Mapping[str, str | bytes]]) -> None:
        # MULTI/EXEC: a blocked worker wakes to all of the entries at once, not to the first.
        try:
            async with self.redis.pipeline(transaction=len(entries) > 1) as pipe:
                for fields in entries:
                    pipe.xadd(stream, dict(fields))  # type: ignore[arg-type]
                await pipe.execute()
        except UNAVAILABLE as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        try:
            if await self._server_has_blmpop():
                got: Any = await self.redis.blmpop(
                    timeout_s, 1, inbox, direction="LEFT", count=count
                )
                return list(got[1]) if got else []
            first = await self.redis.blpop([inbox], timeout=timeout_s)
            if not first:
                return []
            more = await self.redis.lpop(inbox, count - 1) if count > 1 else None
            return [first[1], *(more or [])]
        except UNAVAILABLE as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc

    # -- worker side ----------------------------------------------------------------------
    async def ensure_group(self, stream: str, group: str) -> None:
        try:
            await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        except UNAVAILABLE as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc

    async def read_batch(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int
    ) -> list[Entry]:
        try:
            got: Any = await self.redis.xreadgroup(
                group, consumer, {stream: ">"}, count=count, block=max(1, block_ms)
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The stream was deleted (FLUSHALL, a purge): recreate it and read again next time.
            log.warning("consumer group %s vanished from %s; recreating it", group, stream)
            await self.ensure_group(stream, group)
            return []
        except UNAVAILABLE as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc
        if not got:
            return []
        return [(entry_id.decode(), fields or {}) for entry_id, fields in got[0][1]]

    async def finish(
        self,
        stream: str,
        group: str,
        replies: Sequence[tuple[str, bytes]],
        entry_ids: Sequence[str],
        reply_ttl_s: int,
    ) -> None:
        by_key: dict[str, list[bytes]] = {}
        for key, payload in replies:
            by_key.setdefault(key, []).append(payload)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, payloads in by_key.items():
                    pipe.rpush(key, *payloads)
                    pipe.expire(key, reply_ttl_s)
                if entry_ids:
                    pipe.xack(stream, group, *entry_ids)
                    pipe.xdel(stream, *entry_ids)
                await pipe.execute()
        except UNAVAILABLE as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc

    async def dead_letter(
        self, stream: str, group: str, dead_stream: str, entries: Sequence[Entry], reason: str
    ) -> None:
        if not entries:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for entry_id, fields in entries:
                    record: dict[Any, Any] = dict(fields)
                    record[b"dead_reason"] = reason
                    record[b"dead_entry"] = entry_id
                    pipe.xadd(dead_stream, record)
                ids = [entry_id for entry_id, _ in entries]
                pipe.xack(stream, group, *ids)
                pipe.xdel(stream, *ids)
                await pipe.execute()
        except UNAVAILABLE as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc

    async def time_ms(self) -> int:
        try:
            seconds, micros = await self.redis.time()
        except UNAVAILABLE as exc:
            raise BrokerUnavailable(f"cannot reach Redis: {exc}") from exc
        return int(seconds) * 1000 + int(micros) // 1000

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (*UNAVAILABLE, ResponseError):
            return False

    async def close(self) -> None:
        await self.redis.aclose()
