"""gpu_worker.batching: the batch loop's own edge cases, over the in-memory transport."""

from __future__ import annotations

import asyncio
from typing import Any

from broker import codec
from broker.errors import BrokerUnavailable
from broker.keys import ModelKeys
from broker.memory_transport import InMemoryTransport
from broker.protocol import CallRequests
from broker.transport import UNBOUNDED
from gpu_worker.batching import BatchLoop, BatchSettings


class RedisGoesAway(InMemoryTransport):
    """A reply never completes; the next read finds Redis gone as the worker is told to stop."""

    def __init__(self) -> None:
        super().__init__()
        self.reply_task: asyncio.Task[Any] | None = None
        self.on_outage: Any = None

    async def finish(self, *args: Any, **kwargs: Any) -> set[str]:
        self.reply_task = asyncio.current_task()
        await asyncio.sleep(3600)  # stuck in flight on a dead connection
        return set()

    async def read_batch(self, *args: Any, **kwargs: Any) -> Any:
        if self.reply_task is not None:
            self.on_outage()  # SIGTERM arrives while Redis is away
            raise BrokerUnavailable("connection refused")
        return await super().read_batch(*args, **kwargs)


def test_stopping_while_redis_is_away_leaves_no_reply_task_behind() -> None:
    async def main() -> bool:
        keys = ModelKeys("echo", "t")
        transport = RedisGoesAway()
        loop = BatchLoop(
            lambda batch: batch, transport, keys, "c1", BatchSettings(batch_size=4, block_ms=20)
        )
        await transport.ensure_group(keys)
        call = CallRequests("inbox", 5000, ["r1"], [codec.encode(1)])
        await transport.enqueue(keys, [call], UNBOUNDED)
        transport.cancellations_pending = False  # replies go out as a task, not awaited
        transport.on_outage = loop.stop
        await asyncio.wait_for(loop.run(), 5)
        await asyncio.sleep(0)
        # checked here: asyncio.run() would cancel whatever is left when main() returns
        assert transport.reply_task is not None
        return transport.reply_task.cancelled()

    assert asyncio.run(main())
