"""Streamer.astart: a call's future on the running loop, without a coroutine; cancelling it
withdraws the call's items, as its deadline passing does (on a real Redis with a real worker,
and on a LocalStreamer)."""

from __future__ import annotations

import asyncio

import pytest

from broker import DeadlineExceeded, Streamer
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from gpu_worker import LocalStreamer
from tests.conftest import worker_process
from tests.models import Toy


def test_astart_gives_the_outputs_and_a_cancel_withdraws(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()

    async def scenario() -> tuple[list[object], list[object], bool]:
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        first = streamer.astart(["first"], timeout=60)  # queued: no worker yet
        assert isinstance(first, asyncio.Future)
        await asyncio.sleep(0.2)
        never = streamer.astart(["never"], timeout=60)
        await asyncio.sleep(0.3)
        assert client.xlen(keys.stream) == 2  # an entry each
        never.cancel()
        await asyncio.sleep(0.5)
        assert client.xlen(keys.stream) == 1  # withdrawn from the queue
        with worker_process(redis_server.url, "tests.models:Toy", prefix):
            done = await first
            after = await streamer.astart(["after"], timeout=60)
        await streamer.aclose()
        return done, after, never.cancelled()

    done, after, cancelled = asyncio.run(scenario())
    assert cancelled
    assert [output["item"] for output in done] == ["first"]  # type: ignore[index]
    # "never" was not computed: "after" is the model's second item
    assert [(output["item"], output["seq"]) for output in after] == [("after", 1)]  # type: ignore[index]


def test_a_call_past_its_deadline_withdraws_its_queued_items(
    redis_server: RedisServer, prefix: str
) -> None:
    """Expired items left queued would wait for a worker only to be skipped, counted against
    the queue bound meanwhile: with no worker reading, they alone could fill it."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()

    async def scenario() -> None:
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        try:
            with pytest.raises(DeadlineExceeded):
                await streamer.apredict(["a", "b", "c"], timeout=0.3)  # one multi-item entry
            with pytest.raises(DeadlineExceeded):
                await streamer.apredict(["d"], timeout=0.3)  # a v1 entry
            deadline = asyncio.get_running_loop().time() + 5
            while client.xlen(keys.stream) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        finally:
            await streamer.aclose()

    asyncio.run(scenario())
    assert client.xlen(keys.stream) == 0
    assert int(client.get(keys.queued_bytes) or 0) == 0
    assert int(client.get(keys.packed_items) or 0) == 0
    assert client.zcard(keys.cancelled) == 0


def test_astart_on_a_local_streamer_runs_the_model_with_its_postprocess() -> None:
    class Doubled(Toy):
        def postprocess(self, output: object) -> object:
            return {**output, "doubled": output["item"] * 2}  # type: ignore[index, dict-item]

    async def main(local: LocalStreamer) -> list[object]:
        return await local.astart([1, 2])

    with LocalStreamer(Doubled, batch_size=2) as local:
        outputs = asyncio.run(main(local))
    assert [output["doubled"] for output in outputs] == [2, 4]  # type: ignore[index]
