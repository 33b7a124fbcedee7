"""Which workers are live: read from the consumers set their supervisors keep fresh.

A worker's supervisor scores its consumer in ``ModelKeys.consumers`` with the time (Redis' clock,
ms) its heartbeat expires; a consumer is live while that time is in the future.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis

from .keys import ModelKeys


def _names(members: Any) -> list[str]:
    return [m.decode() if isinstance(m, bytes) else str(m) for m in members]


def _now_ms(seconds: Any, micros: Any) -> int:
    return int(seconds) * 1000 + int(micros) // 1000


def live_consumers(client: redis.Redis, keys: ModelKeys) -> list[str]:
    """The live consumers of a model (synchronous client)."""
    now_ms = _now_ms(*client.time())
    return _names(client.zrangebyscore(keys.consumers, now_ms, "+inf"))


async def alive_consumers(client: aioredis.Redis, keys: ModelKeys) -> list[str]:
    """The live consumers of a model (asyncio client)."""
    now_ms = _now_ms(*await client.time())
    return _names(await client.zrangebyscore(keys.consumers, now_ms, "+inf"))
