"""Batches formed by a cost budget: the batch loop over the in-memory transport, and a real
worker serving a model that declares its items' cost."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from broker import Streamer, codec
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from broker.memory_transport import InMemoryTransport
from broker.protocol import CallRequests, Reply, decode_reply
from broker.transport import UNBOUNDED
from gpu_worker import LocalStreamer
from gpu_worker.batching import WINDOW_BATCHES, BatchLoop, BatchSettings
from gpu_worker.forming import padding
from tests.conftest import worker_process
from tests.gpu_worker.test_batching import CountingTransport
from tests.gpu_worker.test_devices import run_worker_cli
from tests.models import Costed

KEYS = ModelKeys("costed", "t")
INBOX = KEYS.inbox("c")


class Recorder:
    """predict for tests: items are [index, cost]; records each batch's items, answers the
    index. Sleeps ``delay`` per batch; ``on_batch(n)`` runs before batch n is computed."""

    def __init__(self, delay: float = 0.0, on_batch: Callable[[int], None] | None = None) -> None:
        self.delay = delay
        self.on_batch = on_batch
        self.batches: list[list[tuple[int, int]]] = []

    def __call__(self, batch: list[Any]) -> list[Any]:
        if self.on_batch is not None:
            self.on_batch(len(self.batches))
        self.batches.append([(int(index), int(cost)) for index, cost in batch])
        time.sleep(self.delay)
        return [index for index, _ in batch]

    def order(self) -> list[int]:
        return [index for batch in self.batches for index, _ in batch]


def item_cost(item: Any) -> int:
    cost = item[1]
    if cost < 0:
        raise ValueError("no negative costs")
    return int(cost)


class Served:
    """A BatchLoop with a budget over the in-memory transport, fed items [index, cost]."""

    def __init__(
        self,
        predict: Recorder,
        batch_size: int = 8,
        budget: int = 100,
        mode: str = "off",
        transport: InMemoryTransport | None = None,
    ) -> None:
        self.transport = transport or InMemoryTransport()
        settings = BatchSettings(
            batch_size=batch_size, block_ms=20, model_thread=mode, max_batch_cost=budget
        )
        self.loop = BatchLoop(predict, self.transport, KEYS, "c1", settings, item_cost=item_cost)
        self.ids: list[str] = []
        self.replies: dict[int, Reply] = {}
        self.serving: asyncio.Future[None] | None = None

    async def enqueue(self, costs: list[int], timeout_ms: int = 30_000) -> list[str]:
        await self.transport.ensure_group(KEYS)
        first = len(self.ids)
        indices = range(first, first + len(costs))
        payloads = [codec.encode([i, cost]) for i, cost in zip(indices, costs, strict=True)]
        call = CallRequests(INBOX, timeout_ms, [f"r{i}" for i in indices], payloads)
        (ids,) = await self.transport.enqueue(KEYS, [call], UNBOUNDED)
        assert isinstance(ids, list)
        self.ids += ids
        return ids

    def start(self) -> None:
        self.serving = asyncio.ensure_future(self.loop.run())

    async def collect(self, count: int) -> dict[int, Reply]:
        while len(self.replies) < count:
            for data in await self.transport.pop_replies(INBOX, 100, 10):
                reply = decode_reply(data)
                self.replies[int(reply.request_id[1:])] = reply
        return self.replies

    async def stop(self) -> None:
        self.loop.stop()
        assert self.serving is not None
        await asyncio.wait_for(self.serving, 10)
        self.loop.close()


def serve(
    costs: list[int], predict: Recorder, mode: str = "off", **kwargs: Any
) -> dict[int, Reply]:
    """Enqueue items of these costs at once, serve them all, stop; the replies by index."""

    async def main() -> dict[int, Reply]:
        served = Served(predict, mode=mode, **kwargs)
        await served.enqueue(costs)
        served.start()
        replies = await served.collect(len(costs))
        await served.stop()
        return replies

    return asyncio.run(main())


MODES = ["off", "on"]  # inline, and on the model thread


@pytest.mark.parametrize("mode", MODES)
def test_batches_keep_to_the_budget_and_batch_size_and_answer_every_item(mode: str) -> None:
    costs = [(7 * i) % 45 + 1 for i in range(100)]
    predict = Recorder()
    replies = serve(costs, predict, mode, batch_size=8, budget=100)
    assert all(replies[i].ok and replies[i].result == i for i in range(100))
    assert sorted(predict.order()) == list(range(100))  # each computed once
    for batch in predict.batches:
        assert len(batch) <= 8
        assert sum(cost for _, cost in batch) <= 100


@pytest.mark.parametrize("mode", MODES)
def test_an_item_over_the_budget_runs_alone_and_is_answered(mode: str) -> None:
    costs = [5, 5, 500, 5, 5, 5]
    predict = Recorder()
    replies = serve(costs, predict, mode, batch_size=8, budget=100)
    assert all(reply.ok for reply in replies.values())
    assert [(2, 500)] in predict.batches
    assert sorted(predict.order()) == list(range(6))


def test_similar_lengths_are_batched_together() -> None:
    costs = [3, 40, 4, 38, 3, 41, 5, 39] * 4  # short and long, alternating
    grouped, counted = Recorder(), Recorder()
    serve(costs, grouped, batch_size=8, budget=400)
    serve(costs, counted, batch_size=8, budget=0)  # 0: count-based, arrival order
    wasted = [sum(padding([c for _, c in b]) for b in rec.batches) for rec in (grouped, counted)]
    assert all(len({c > 20 for _, c in batch}) == 1 for batch in grouped.batches)
    assert wasted[0] * 10 < wasted[1]


def test_items_held_back_run_before_anything_read_after_them() -> None:
    # a backlog of 100 items: windows of 2 x batch_size entries, cut and run in turn; no item
    # is overtaken by one enqueued a window or more after it (no starvation)
    costs = [1 if i % 10 else 60 for i in range(100)]
    predict = Recorder()
    serve(costs, predict, batch_size=8, budget=64)
    order = predict.order()
    window = WINDOW_BATCHES * 8
    for position, index in enumerate(order):
        overtaken_by = [later for later in order[:position] if later > index]
        assert all(later - index < window for later in overtaken_by), (index, overtaken_by)


def test_entries_held_back_stay_pending_and_are_answered_when_the_worker_stops() -> None:
    async def main() -> tuple[int, int, int]:
        transport = CountingTransport()
        predict = Recorder(delay=0.05)
        served = Served(predict, batch_size=4, budget=20, transport=transport)
        await served.enqueue([10] * 40)  # two per batch: a window of 8 is 4 batches
        served.start()
        while len(predict.batches) < 1:
            await asyncio.sleep(0.005)
        assert served.loop.ahead.held  # the window's other batches are held
        await served.stop()  # stopping: the held batches still run
        answered = len(await transport.pop_replies(INBOX, 100, 0.1))
        return transport.in_hand, answered, len(predict.order())

    in_hand, answered, computed = asyncio.run(main())
    assert in_hand == 0  # everything read was answered and acknowledged
    assert answered == computed == 8  # the whole first window; the rest stays queued


@pytest.mark.parametrize("mode", MODES)
def test_a_held_item_whose_deadline_passes_is_answered_deadline_exceeded_not_computed(
    mode: str,
) -> None:
    async def main() -> tuple[dict[int, Reply], Recorder]:
        predict = Recorder(delay=0.6)
        served = Served(predict, batch_size=8, budget=100, mode=mode)
        await served.enqueue([1], timeout_ms=200)  # runs first: the earliest deadline
        await served.enqueue([90], timeout_ms=400)  # held behind it, expires meanwhile
        await served.enqueue([2, 3], timeout_ms=30_000)
        served.start()
        replies = await served.collect(4)
        await served.stop()
        return replies, predict

    replies, predict = asyncio.run(main())
    assert not replies[1].ok and replies[1].error_type == "DeadlineExceeded"
    assert 1 not in predict.order()
    assert all(replies[i].ok for i in (0, 2, 3))


class AckRecorder(CountingTransport):
    """Records the entry ids each finish() acknowledges."""

    def __init__(self) -> None:
        super().__init__()
        self.acks: list[set[str]] = []
        self.ids: list[str] = []  # of the items, in order

    async def finish(self, keys: ModelKeys, replies: Any, entries: Any, *args: Any) -> set[str]:
        self.acks.append({entry_id for entry_id, _ in entries})
        return await super().finish(keys, replies, entries, *args)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("withdrawn", [1, 2])
def test_a_held_item_withdrawn_by_its_caller_is_not_computed(mode: str, withdrawn: int) -> None:
    async def main() -> tuple[dict[int, Reply], Recorder, AckRecorder]:
        served: Served

        def withdraw(batch: int) -> None:
            if batch == 0:  # items 1 and 2 are held back now: a caller gives up
                cancel = served.transport.cancel(KEYS, [(served.ids[withdrawn], 0)])
                asyncio.run_coroutine_threadsafe(cancel, aloop)

        aloop = asyncio.get_running_loop()
        predict = Recorder(delay=0.05, on_batch=withdraw)
        transport = AckRecorder()
        served = Served(predict, batch_size=8, budget=100, mode=mode, transport=transport)
        transport.ids = await served.enqueue([2, 90, 95, 3, 4])  # batches [0, 3, 4], [1], [2]
        served.start()
        replies = await served.collect(4)
        while transport.in_hand:  # the withdrawn entry is acknowledged too
            await asyncio.sleep(0.01)
        await served.stop()
        return replies, predict, transport

    replies, predict, transport = asyncio.run(main())
    assert predict.batches[0] == [(0, 2), (3, 3), (4, 4)]
    assert withdrawn not in predict.order() and withdrawn not in replies
    assert sorted(predict.order()) == sorted({0, 1, 2, 3, 4} - {withdrawn})
    assert transport.in_hand == 0
    if mode == "off":  # acknowledged with the next batch that runs, not after it
        ids = transport.ids
        assert transport.acks[1] == ({ids[1], ids[2]} if withdrawn == 2 else {ids[1]})


def test_an_item_whose_cost_cannot_be_computed_fails_alone() -> None:
    predict = Recorder()
    replies = serve([3, -1, 4], predict, batch_size=8, budget=100)
    assert not replies[1].ok and replies[1].error_type == "ModelError"
    assert "item_cost failed: ValueError: no negative costs" in str(replies[1].error_message)
    assert replies[0].ok and replies[2].ok
    assert predict.batches == [[(0, 3), (2, 4)]]


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch_cost cannot be negative"):
        BatchLoop(Recorder(), InMemoryTransport(), KEYS, "c", BatchSettings(max_batch_cost=-1))


def test_a_model_declares_a_positive_budget() -> None:
    from gpu_worker import ManagedModel

    with pytest.raises(ValueError, match="max_batch_cost must be a positive int or None"):

        class Bad(ManagedModel):
            max_batch_cost = 0


def test_local_streamer_forms_batches_by_the_models_budget() -> None:
    with LocalStreamer(Costed) as local:
        outputs = local.predict(["x" * n for n in (2, 30, 3, 2, 31, 3)])
    short = [2, 2, 3, 3]
    assert [out["batch"] for out in outputs] == [short, [30], short, short, [31], short]


# -- a real worker -----------------------------------------------------------------------------
def test_a_worker_forms_batches_by_the_models_budget_and_the_flag_overrides_it(
    redis_server: RedisServer, prefix: str
) -> None:
    lengths = [1, 2, 14, 3, 1, 15, 2, 30, 16, 1, 2, 13, 3, 14, 2, 1] * 3
    texts = ["x" * n for n in lengths]
    wasted = {}
    for budget in ("model", "0"):
        name = f"costed-{budget}"
        streamer = Streamer(name, redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
        future = streamer.submit(texts)  # queued before the worker starts: a backlog
        time.sleep(0.2)
        args = ["--name", name] + ([] if budget == "model" else ["--max-batch-cost", budget])
        with worker_process(redis_server.url, "tests.models:Costed", prefix, *args, name=name):
            outputs = future.result(timeout=60)
        streamer.close()
        assert [out["item"] for out in outputs] == texts
        batches = {out["batch_no"]: out["batch"] for out in outputs}
        if budget == "model":
            for batch in batches.values():
                assert len(batch) <= Costed.batch_size
                assert sum(batch) <= Costed.max_batch_cost or len(batch) == 1
            assert [30] in batches.values()  # over the budget: alone
        wasted[budget] = sum(padding(batch) for batch in batches.values())
    assert wasted["model"] * 3 < wasted["0"]


def test_a_negative_max_batch_cost_gives_one_line(redis_server: RedisServer) -> None:
    env = {"MICROBATCH_WORKER_MAX_BATCH_COST": "-1", "REDIS_URL": redis_server.url}
    result = run_worker_cli("--model", "tests.models:Costed", env=env)
    assert result.returncode == 2 and "max-batch-cost" in result.stderr.lower()


def pending(client: redis.Redis, keys: ModelKeys) -> int:
    """Entries the model's workers have read and not acknowledged (0 before the group)."""
    try:
        return int(client.xpending(keys.stream, keys.group)["pending"])
    except redis.ResponseError:  # NOGROUP: no worker has got that far yet
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("entry_items", [1, 32])
def test_sigterm_answers_the_batches_held_back(
    redis_server: RedisServer, prefix: str, entry_items: int
) -> None:
    """Also when the window's items come in one multi-item entry: it is acknowledged with
    the last of its batches."""
    streamer = Streamer(
        "costed",
        redis_url=redis_server.url,
        prefix=prefix,
        wait_for_workers=True,
        entry_items=entry_items,
    )
    texts = ["x" * 20] * 12  # one per batch: the first window read is 12 batches
    entries = len(texts) if entry_items == 1 else 1
    future = streamer.submit(texts)
    time.sleep(0.2)
    env = {"MICROBATCH_TEST_BATCH_DELAY": "0.2"}
    keys = ModelKeys("costed", prefix)
    client = redis.Redis.from_url(redis_server.url)
    with worker_process(redis_server.url, "tests.models:Costed", prefix, env=env) as proc:
        deadline = time.monotonic() + 60
        while pending(client, keys) < entries:
            assert time.monotonic() < deadline, "the worker read nothing"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the window is read: most of it held
        assert proc.wait(30) == 0
    assert pending(client, keys) == 0 and client.xlen(keys.stream) == 0
    client.close()
    # answered before it exited: no other worker could have taken them over
    outputs = future.result(timeout=10)
    streamer.close()
    assert [out["item"] for out in outputs] == texts
    assert len({out["batch_no"] for out in outputs}) == 12


def test_the_benchmarks_text_mix_is_the_seeded_one_and_mixes_short_and_long() -> None:
    from bench.length_batching import MIX_PATH, make_mix
    from examples.embedder import Tokenizer

    texts = json.loads(MIX_PATH.read_text())
    assert texts == make_mix()
    tokenizer = Tokenizer()
    lengths = sorted(len(tokenizer.encode(text)) for text in texts)
    assert lengths[len(lengths) // 2] < 32 and lengths[-len(lengths) // 10] > 128
