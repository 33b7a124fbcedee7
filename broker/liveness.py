"""Which workers are live: read from the consumers set their supervisors keep fresh.

A worker's supervisor scores its consumer in ``ModelKeys.consumers`` with the time (Redis' clock,
ms) its heartbeat expires; a consumer is live while that time is in the future.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as async_cluster
import redis.cluster

from .keys import ModelKeys


def _names(members: Any) -> list[str]:
    return [m.decode() if isinstance(m, bytes) else str(m) for m in members]


def _now_ms(seconds: Any, micros: Any) -> int:
    return int(seconds) * 1000 + int(micros) // 1000


def server_time_ms(client: redis.Redis, key: str) -> int:
    """The clock (TIME, ms) of the server holding ``key``: of a Redis Cluster, the primary
    serving its slot (the one that stamps its stream ids and scores its heartbeats)."""
    if isinstance(client, redis.cluster.RedisCluster):
        node = client.get_node_from_key(key)
        return _now_ms(*client.time(target_nodes=node))
    return _now_ms(*client.time())


async def async_server_time_ms(client: aioredis.Redis, key: str) -> int:
    """:func:`server_time_ms` with an asyncio client."""
    if isinstance(client, async_cluster.RedisCluster):
        node = client.get_node_from_key(key)
        return _now_ms(*await client.time(target_nodes=node))
    return _now_ms(*await client.time())


def live_consumers(client: redis.Redis, keys: ModelKeys) -> list[str]:
    """The live consumers of a model (synchronous client)."""
    now_ms = server_time_ms(client, keys.consumers)
    return _names(client.zrangebyscore(keys.consumers, now_ms, "+inf"))


async def alive_consumers(client: aioredis.Redis, keys: ModelKeys) -> list[str]:
    """The live consumers of a model (asyncio client)."""
    now_ms = await async_server_time_ms(client, keys.consumers)
    return _names(await client.zrangebyscore(keys.consumers, now_ms, "+inf"))


def lapsed_s(now_ms: int, scores: Iterable[float]) -> float | None:
    """How long the model has had no live consumer, from the consumers' scores: 0.0 while one
    is live, the seconds since the last heartbeat lapsed, or None when none is known (never
    started, forgotten after an hour, or retired on a clean exit)."""
    latest = max(scores, default=None)
    if latest is None:
        return None
    return max(0.0, (now_ms - latest) / 1000)
