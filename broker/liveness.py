"""Which workers are live: read from the consumers set their supervisors keep fresh.

A worker's supervisor scores its consumer in ``ModelKeys.consumers`` with the time (Redis' clock,
ms) its heartbeat expires; a consumer is live while that time is in the future.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as async_cluster
import redis.cluster

from .keys import ModelKeys


def redis_time_ms(reply: Sequence[Any]) -> int:
    """Redis' ``TIME`` reply (seconds, microseconds) in whole milliseconds."""
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) // 1000


def _names(members: Any) -> list[str]:
    # A worker in another language may vouch under a name that is not UTF-8: it still counts
    # (under distinct, printable escapes: b"\xff" is "\\xff").
    return [
        m.decode(errors="backslashreplace") if isinstance(m, bytes) else str(m) for m in members
    ]


def server_time_ms(client: redis.Redis, key: str) -> int:
    """The clock (TIME, ms) of the server holding ``key``: of a Redis Cluster, the primary
    serving its slot (the one that stamps its stream ids and scores its heartbeats)."""
    if isinstance(client, redis.cluster.RedisCluster):
        return redis_time_ms(client.time(target_nodes=client.get_node_from_key(key)))
    return redis_time_ms(client.time())


def server_times_ms(client: redis.Redis, keys: Sequence[str]) -> list[int]:
    """:func:`server_time_ms` of each of ``keys``, with one TIME per node (one in all on a
    single Redis): a partitioned model's keys may live on several primaries of a cluster."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return [redis_time_ms(client.time())] * len(keys)
    nodes = [client.get_node_from_key(key) for key in keys]
    clocks: dict[str, int] = {}
    for node in nodes:
        if node.name not in clocks:
            clocks[node.name] = redis_time_ms(client.time(target_nodes=node))
    return [clocks[node.name] for node in nodes]


async def async_server_time_ms(client: aioredis.Redis, key: str) -> int:
    """:func:`server_time_ms` with an asyncio client."""
    if isinstance(client, async_cluster.RedisCluster):
        return redis_time_ms(await client.time(target_nodes=client.get_node_from_key(key)))
    return redis_time_ms(await client.time())


def live_consumers(client: redis.Redis, keys: ModelKeys) -> list[str]:
    """The live consumers of a model (synchronous client)."""
    now_ms = server_time_ms(client, keys.consumers)
    return _names(client.zrangebyscore(keys.consumers, now_ms, "+inf"))


async def alive_consumers(client: aioredis.Redis, keys: ModelKeys) -> list[str]:
    """The live consumers of a model (asyncio client)."""
    now_ms = await async_server_time_ms(client, keys.consumers)
    return _names(await client.zrangebyscore(keys.consumers, now_ms, "+inf"))


def wait_for_consumers(
    client: redis.Redis,
    keys: ModelKeys,
    count: int = 1,
    timeout: float = 60.0,
    check: Callable[[], None] | None = None,
) -> None:
    """Return once at least ``count`` consumers of the model are live.

    ``check`` runs before each look and may raise to give up early (say, when the process that
    should start the workers has exited); TimeoutError once ``timeout`` seconds have passed.
    """
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        if len(live_consumers(client, keys)) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} live worker(s) of {keys.model} did not appear")
        time.sleep(0.05)


def lapsed_s(now_ms: int, scores: Iterable[float]) -> float | None:
    """How long the model has had no live consumer, from the consumers' scores: 0.0 while one
    is live, the seconds since the last heartbeat lapsed, or None when none is known (never
    started, forgotten after an hour, or retired on a clean exit)."""
    latest = max(scores, default=None)
    if latest is None:
        return None
    return max(0.0, (now_ms - latest) / 1000)
