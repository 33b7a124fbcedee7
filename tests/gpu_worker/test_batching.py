"""gpu_worker.batching: the batch loop's own edge cases, over the in-memory transport."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from broker import codec
from broker.errors import BrokerUnavailable
from broker.keys import ModelKeys
from broker.memory_transport import InMemoryTransport
from broker.protocol import CallRequests, Reply, decode_reply
from broker.transport import UNBOUNDED
from gpu_worker.batching import THREAD_FROM_S, BatchLoop, BatchObserver, BatchSettings
from gpu_worker.model_thread import THREAD_NAME
from gpu_worker.preparing import PreparedBatch


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
        call = CallRequests(keys.inbox("c"), 5000, ["r1"], [codec.encode(1)])
        await transport.enqueue(keys, [call], UNBOUNDED)
        transport.cancellations_pending = False  # replies go out as a task, not awaited
        transport.on_outage = loop.stop
        await asyncio.wait_for(loop.run(), 5)
        await asyncio.sleep(0)
        # checked here: asyncio.run() would cancel whatever is left when main() returns
        assert transport.reply_task is not None
        return transport.reply_task.cancelled()

    assert asyncio.run(main())


# -- the model thread ------------------------------------------------------------------------------
class CountingTransport(InMemoryTransport):
    """Counts the entries read and not yet answered (the most at once, too)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_hand = 0
        self.most_in_hand = 0

    async def read_batch(self, *args: Any, **kwargs: Any) -> Any:
        entries = await super().read_batch(*args, **kwargs)
        self.in_hand += len(entries)
        self.most_in_hand = max(self.most_in_hand, self.in_hand)
        return entries

    async def finish(self, keys: ModelKeys, replies: Any, entries: Any, *args: Any) -> set[str]:
        self.in_hand -= len(entries)
        return await super().finish(keys, replies, entries, *args)


class Doubler:
    """predict for tests: doubles each item after ``delay`` seconds, raises for -1, and
    records the thread and size of every call."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls: list[tuple[str, int]] = []
        self.running = False

    def __call__(self, batch: list[Any]) -> list[Any]:
        self.calls.append((threading.current_thread().name, len(batch)))
        self.running = True
        time.sleep(self.delay)
        self.running = False
        if -1 in batch:
            raise ValueError("no negative ones")
        return [item * 2 for item in batch]

    def threads(self) -> set[str]:
        return {thread for thread, _ in self.calls}


async def serve_items(
    predict: Doubler,
    items: list[int],
    mode: str,
    transport: InMemoryTransport | None = None,
    batch_size: int = 4,
    block_ms: int = 20,
    busy_poll_s: float | None = 0.0,
) -> tuple[dict[str, Reply], float]:
    """Enqueue ``items`` at once, serve them with a BatchLoop until all are answered, stop.

    Returns the replies by request id and the seconds until the last one arrived."""
    keys = ModelKeys("double", "t")
    transport = transport or InMemoryTransport()
    settings = BatchSettings(
        batch_size=batch_size, block_ms=block_ms, model_thread=mode, busy_poll_s=busy_poll_s
    )
    loop = BatchLoop(predict, transport, keys, "c1", settings)
    await transport.ensure_group(keys)
    ids = [f"r{i}" for i in range(len(items))]
    call = CallRequests(keys.inbox("c"), 30_000, ids, [codec.encode(item) for item in items])
    await transport.enqueue(keys, [call], UNBOUNDED)
    started = time.monotonic()
    serving = asyncio.ensure_future(loop.run())
    replies: dict[str, Reply] = {}
    while len(replies) < len(items):
        for data in await transport.pop_replies(keys.inbox("c"), len(items), 10):
            reply = decode_reply(data)
            replies[reply.request_id] = reply
    answered_after = time.monotonic() - started
    loop.stop()
    await asyncio.wait_for(serving, 10)
    loop.close()
    return replies, answered_after


def test_model_thread_on_computes_every_batch_on_its_thread_and_answers_each_item() -> None:
    predict = Doubler(delay=0.002)
    items = [*range(30), -1, *range(30, 60)]
    replies, _ = asyncio.run(serve_items(predict, items, "on"))
    for index, item in enumerate(items):
        reply = replies[f"r{index}"]
        if item == -1:  # only the failing item fails: its batch is split on the model thread
            assert not reply.ok and reply.error_type == "ModelError"
        else:
            assert reply.ok and reply.result == item * 2
    assert predict.threads() == {f"{THREAD_NAME}_0"}
    assert max(size for _, size in predict.calls) == 4


def test_model_thread_off_computes_on_the_loops_thread() -> None:
    predict = Doubler(delay=0.02)
    asyncio.run(serve_items(predict, list(range(16)), "off"))
    assert predict.threads() == {"MainThread"}


def test_model_thread_auto_moves_slow_batches_to_the_thread_and_keeps_fast_ones_inline() -> None:
    slow, fast = Doubler(delay=2 * THREAD_FROM_S), Doubler()
    asyncio.run(serve_items(slow, list(range(24)), "auto"))
    asyncio.run(serve_items(fast, list(range(24)), "auto"))
    # the first full batch shows it is slow; the rest run on the model thread
    assert [thread for thread, _ in slow.calls] == ["MainThread"] + [f"{THREAD_NAME}_0"] * 5
    assert fast.threads() == {"MainThread"}


def test_the_model_thread_gets_the_next_batch_read_ahead_but_never_more() -> None:
    transport = CountingTransport()
    predict = Doubler(delay=0.01)
    asyncio.run(serve_items(predict, list(range(40)), "on", transport, batch_size=4))
    # one batch computing and one read ahead at a time: never a third
    assert transport.most_in_hand == 8
    assert transport.in_hand == 0


@pytest.mark.slow
def test_a_full_batch_with_nothing_behind_it_is_answered_without_waiting_for_the_read() -> None:
    # the read ahead blocks for block_ms when the queue is empty; the batch computing must be
    # answered when it is done, not when that read gives up
    predict = Doubler(delay=0.05)
    _, seconds = asyncio.run(serve_items(predict, list(range(4)), "on", block_ms=5000))
    assert seconds < 2.5


async def stop_when(
    predict: Any, settings: BatchSettings, ready: Callable[[CountingTransport], bool]
) -> tuple[CountingTransport, int]:
    """Serve 40 items, stop the loop once ``ready``: the transport, and the replies sent."""
    keys = ModelKeys("double", "t")
    transport = CountingTransport()
    loop = BatchLoop(predict, transport, keys, "c1", settings)
    await transport.ensure_group(keys)
    ids = [f"r{i}" for i in range(40)]
    call = CallRequests(keys.inbox("c"), 30_000, ids, [codec.encode(1)] * 40)
    await transport.enqueue(keys, [call], UNBOUNDED)
    serving = asyncio.ensure_future(loop.run())
    while not ready(transport):
        await asyncio.sleep(0.005)
    loop.stop()
    await asyncio.wait_for(serving, 5)
    return transport, len(await transport.pop_replies(keys.inbox("c"), 100, 0.1))


def test_stopping_answers_the_batches_in_hand_on_the_model_thread() -> None:
    predict = Doubler(delay=0.05)
    settings = BatchSettings(batch_size=4, block_ms=20, model_thread="on")
    # stopped with a batch computing and the next one read ahead
    transport, answered = asyncio.run(stop_when(predict, settings, lambda t: t.most_in_hand >= 8))
    computed = sum(size for _, size in predict.calls)
    assert transport.in_hand == 0  # everything read was answered
    assert answered == computed >= 8
    assert computed < 40  # the rest stays queued for other workers


def test_an_unknown_model_thread_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="model_thread must be one of auto, on, off"):
        BatchLoop(
            Doubler(),
            InMemoryTransport(),
            ModelKeys("d", "t"),
            "c",
            BatchSettings(model_thread="yes"),
        )


# -- busy polling ----------------------------------------------------------------------------------
class PollRecordingTransport(InMemoryTransport):
    """Records each read's busy poll and whether the model was computing when it was made."""

    def __init__(self, predict: Doubler) -> None:
        super().__init__()
        self.predict = predict
        self.reads: list[tuple[float, bool]] = []

    async def read_batch(
        self, keys: ModelKeys, consumer: str, count: int, block_ms: int, busy_poll_s: float = 0.0
    ) -> Any:
        self.reads.append((busy_poll_s, self.predict.running))
        return await super().read_batch(keys, consumer, count, block_ms, busy_poll_s)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_only_reads_with_nothing_computing_busy_poll(mode: str) -> None:
    predict = Doubler(delay=0.01)
    transport = PollRecordingTransport(predict)
    items = list(range(40))
    replies, _ = asyncio.run(serve_items(predict, items, mode, transport, busy_poll_s=0.003))
    assert all(replies[f"r{i}"].result == item * 2 for i, item in enumerate(items))
    polled = [computing for poll, computing in transport.reads if poll == 0.003]
    assert polled and not any(polled)  # never while the model thread holds a batch
    if mode == "on":  # the reads ahead, made while the model computes, sleep at once
        assert any(computing for poll, computing in transport.reads if poll == 0)


def test_a_busy_polling_read_lets_the_loop_run_and_takes_what_arrives() -> None:
    async def main() -> tuple[list[Any], float]:
        keys, transport = ModelKeys("double", "t"), InMemoryTransport()
        await transport.ensure_group(keys)
        call = CallRequests(keys.inbox("c"), 30_000, ["r1"], [codec.encode(1)])
        asyncio.get_running_loop().call_later(
            0.01, lambda: asyncio.ensure_future(transport.enqueue(keys, [call], UNBOUNDED))
        )
        started = time.monotonic()
        entries = await transport.read_batch(keys, "c1", 4, 5000, busy_poll_s=2.0)
        return entries, time.monotonic() - started

    entries, seconds = asyncio.run(main())
    assert len(entries) == 1
    assert seconds < 1.5  # the enqueue, on the same loop, ran during the poll


# -- outputs that come pending (a GPU computing asynchronously) ------------------------------------
class LaterDoubler:
    """predict for tests that returns at once with a future of the outputs, computed ``delay``
    seconds later on a thread of its own (the device); records when each batch is handed over
    and when its outputs are taken. A batch holding -1 fails when its outputs are taken."""

    def __init__(self, delay: float = 0.005) -> None:
        self.delay = delay
        self.device = ThreadPoolExecutor(max_workers=1)
        self.events: list[tuple[str, int]] = []
        self.threads: set[str] = set()
        self.launched = 0

    def __call__(self, batch: list[Any]) -> Any:
        self.threads.add(threading.current_thread().name)
        number = self.launched = self.launched + 1
        self.events.append(("launch", number))
        computing = self.device.submit(self._compute, list(batch))
        events = self.events

        class Pending:
            def done(self) -> bool:
                return computing.done()

            def result(self) -> list[Any]:
                events.append(("taken", number))
                return computing.result()

        return Pending()

    def _compute(self, batch: list[Any]) -> list[Any]:
        time.sleep(self.delay)
        if -1 in batch:
            raise RuntimeError("device-side assert")
        return [item * 2 for item in batch]


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_pending_outputs_overlap_the_next_batch_and_every_item_is_answered(mode: str) -> None:
    predict = LaterDoubler(delay=2 * THREAD_FROM_S)  # slow: auto must not take it to a thread
    transport = CountingTransport()
    items = [*range(30), -1, *range(30, 60)]
    replies, _ = asyncio.run(serve_items(predict, items, mode, transport, batch_size=4))
    for index, item in enumerate(items):
        reply = replies[f"r{index}"]
        if item == -1:  # the failing batch is computed again in halves: only this item fails
            assert not reply.ok and reply.error_type == "ModelError"
            assert "device-side assert" in (reply.error_message or "")
        else:
            assert reply.ok and reply.result == item * 2
    assert predict.threads == {"MainThread"}
    events = predict.events
    # under the backlog, each batch's outputs are taken only after the next one was handed over
    overlapped = [
        n
        for kind, n in events
        if kind == "taken"
        and ("launch", n + 1) in events
        and events.index(("launch", n + 1)) < events.index(("taken", n))
    ]
    assert len(overlapped) >= 10
    # a batch pending, the next one handed over and one read ahead: never a fourth in hand
    assert 8 < transport.most_in_hand <= 12
    assert transport.in_hand == 0


@pytest.mark.slow
def test_pending_outputs_with_nothing_behind_them_are_answered_without_waiting_for_the_read() -> (
    None
):
    predict = LaterDoubler(delay=0.05)
    _, seconds = asyncio.run(serve_items(predict, list(range(4)), "off", block_ms=5000))
    assert seconds < 2.5


def test_a_lone_short_batch_with_pending_outputs_is_answered_at_once() -> None:
    predict = LaterDoubler(delay=0.01)
    replies, seconds = asyncio.run(serve_items(predict, [1, 2], "off", block_ms=2000))
    assert [replies[f"r{i}"].result for i in range(2)] == [2, 4]
    assert seconds < 1.0  # not held for a next batch that is not coming (the read blocks 2 s)


def test_stopping_answers_a_pending_batch() -> None:
    predict = LaterDoubler(delay=0.05)
    settings = BatchSettings(batch_size=4, block_ms=20)
    # stopped with a batch pending and the next one handed over
    transport, answered = asyncio.run(stop_when(predict, settings, lambda t: predict.launched >= 2))
    assert transport.in_hand == 0
    assert answered == 4 * predict.launched >= 8
    assert answered < 40


class RecordingObserver(BatchObserver):
    """Records the order of batch_started and batch_finished."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def batch_started(self, size: int, queue_waits_s: Any, traces: Any) -> None:
        self.calls.append("started")

    def batch_finished(self, size: int, inference_s: float) -> None:
        self.calls.append("finished")


def test_the_watchdog_hears_of_one_batch_at_a_time_while_batches_are_pending() -> None:
    async def main() -> tuple[list[str], LaterDoubler]:
        keys, transport = ModelKeys("double", "t"), InMemoryTransport()
        # long enough that a loaded machine still finds outputs pending when it hands over the next
        predict = LaterDoubler(delay=0.03)
        observer = RecordingObserver()
        settings = BatchSettings(batch_size=4, block_ms=20)
        loop = BatchLoop(predict, transport, keys, "c1", settings, observer)
        await transport.ensure_group(keys)
        ids = [f"r{i}" for i in range(40)]
        call = CallRequests(keys.inbox("c"), 30_000, ids, [codec.encode(1)] * 40)
        await transport.enqueue(keys, [call], UNBOUNDED)
        serving = asyncio.ensure_future(loop.run())
        answered = 0
        while answered < 40:
            answered += len(await transport.pop_replies(keys.inbox("c"), 100, 0.05))
        loop.stop()
        await asyncio.wait_for(serving, 5)
        return observer.calls, predict

    calls, predict = asyncio.run(main())
    # a batch is handed over before the last one is answered, but the host (its watchdog, which
    # watches one batch) hears "finished" for that one before "started" for this one
    assert calls == ["started", "finished"] * 10
    events = predict.events
    overlapped = [
        n for n in range(1, 10) if events.index(("launch", n + 1)) < events.index(("taken", n))
    ]
    assert overlapped  # batches did overlap, so the order above was kept while they did


# -- the broker's clock ----------------------------------------------------------------------------
class ClockCounting(InMemoryTransport):
    """Counts the worker's reads of the broker's clock (TIME)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    async def time_ms(self) -> int:
        self.syncs += 1
        return await super().time_ms()


@pytest.mark.parametrize("step_s", [60.0, -3600.0])
def test_a_step_of_the_workers_wall_clock_moves_no_deadline(
    monkeypatch: pytest.MonkeyPatch, step_s: float
) -> None:
    """The broker (here in memory, as on another host) keeps its clock while the worker's
    wall clock steps: a valid item read right after is computed, one past its deadline not."""

    async def main() -> dict[str, Reply]:
        keys = ModelKeys("double", "t")
        transport = InMemoryTransport()
        predict = Doubler(delay=0.3)
        settings = BatchSettings(batch_size=4, block_ms=20, model_thread="on")
        loop = BatchLoop(predict, transport, keys, "c1", settings)
        await transport.ensure_group(keys)
        serving = asyncio.ensure_future(loop.run())
        inbox = keys.inbox("c")
        first = CallRequests(inbox, 30_000, ["first"], [codec.encode(1)])
        await transport.enqueue(keys, [first], UNBOUNDED)
        while not predict.running:  # the worker holds the first batch (0.3 s)
            await asyncio.sleep(0.005)
        wall = time.time
        monkeypatch.setattr(time, "time", lambda: wall() + step_s)
        valid = CallRequests(inbox, 30_000, ["valid"], [codec.encode(2)])
        late = CallRequests(inbox, 50, ["late"], [codec.encode(3)])  # expires while it waits
        await transport.enqueue(keys, [valid, late], UNBOUNDED)
        replies: dict[str, Reply] = {}
        while len(replies) < 3:
            for data in await transport.pop_replies(inbox, 3, 10):
                reply = decode_reply(data)
                replies[reply.request_id] = reply
        loop.stop()
        await asyncio.wait_for(serving, 10)
        loop.close()
        return replies

    replies = asyncio.run(main())
    assert replies["first"].ok and replies["valid"].ok and replies["valid"].result == 4
    assert not replies["late"].ok and replies["late"].error_type == "DeadlineExceeded"


def test_the_broker_clock_is_read_again_under_a_backlog() -> None:
    """Reads never come back empty under a backlog; the estimate is renewed all the same."""
    transport = ClockCounting()
    settings = BatchSettings(batch_size=1, block_ms=20, clock_sync_s=0.05)
    keys = ModelKeys("double", "t")

    async def main() -> None:
        loop = BatchLoop(Doubler(delay=0.01), transport, keys, "c1", settings)
        await transport.ensure_group(keys)
        ids = [f"r{i}" for i in range(40)]
        call = CallRequests(keys.inbox("c"), 30_000, ids, [codec.encode(i) for i in range(40)])
        await transport.enqueue(keys, [call], UNBOUNDED)
        serving = asyncio.ensure_future(loop.run())
        answered = 0
        while answered < 40:
            answered += len(await transport.pop_replies(keys.inbox("c"), 40, 10))
        loop.stop()
        await asyncio.wait_for(serving, 10)
        loop.close()

    asyncio.run(main())
    assert transport.syncs >= 4  # 40 batches of 10 ms: about 8 periods of 50 ms


def test_only_a_full_batch_is_held_to_the_last_full_batches_time() -> None:
    """Items due sooner than a batch takes are answered DeadlineExceeded rather than computed
    too late; but a lone item after a run of full batches is computed far quicker than they
    were, and an estimate no batch has confirmed for a second is dropped."""
    keys = ModelKeys("double", "t")
    loop = BatchLoop(lambda xs: xs, InMemoryTransport(), keys, "c1", BatchSettings(batch_size=4))
    assert loop._compute_ms(4) == 0.0  # no batch yet
    full = PreparedBatch([], 0.0, [], [], [], [1, 2, 3, 4])
    loop.batch_finished(full, 0.3)
    loop.batch_finished(full, 0.2)
    loop.batch_finished(PreparedBatch([], 0.0, [], [], [], [1]), 0.01)  # not full: not counted
    assert loop._compute_ms(4) == pytest.approx(200.0)
    assert loop._compute_ms(1) == 0.0
    loop._finished_at -= 2.0  # none finished since
    assert loop._compute_ms(4) == 0.0
