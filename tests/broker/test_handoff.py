"""Mailbox, Relay and Waiter: results reach the right thread exactly once, whatever the timing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import queue
import random
import signal
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from broker.handoff import CallFuture, Mailbox, Relay, Waiter


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, as the client's is."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_many_threads_each_get_their_own_result_from_batches_woken_in_turn() -> None:
    relay = Relay()
    threads, calls = 32, 60
    requests: queue.Queue[tuple[Waiter, int]] = queue.Queue()
    wrong: list[tuple[int, Any]] = []
    batches_done = []

    def caller(index: int) -> None:
        for call in range(calls):
            token = index * calls + call
            waiter = Waiter(relay)
            requests.put((waiter, token))
            got = waiter.wait(60)
            if got != token:
                wrong.append((token, got))

    def settler() -> None:  # the loop thread's part: settle whatever is queued, in batches
        left = threads * calls
        while left:
            batch = [requests.get()]
            while len(batch) < random.randint(1, 40) and not requests.empty():
                batch.append(requests.get_nowait())
            random.shuffle(batch)
            left -= len(batch)
            done = threading.Event()
            batches_done.append(done)
            relay.settle([(waiter, token, None) for waiter, token in batch], done.set)

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
    workers.append(threading.Thread(target=settler))
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not any(worker.is_alive() for worker in workers)
    assert wrong == []
    assert all(done.is_set() for done in batches_done)  # each batch's last thread ran `then`


def test_a_waiter_that_gave_up_is_left_out_and_the_rest_of_its_batch_still_wakes() -> None:
    relay = Relay()
    waiters = [Waiter(relay) for _ in range(5)]
    with pytest.raises(TimeoutError):
        waiters[2].wait(0.01)
    assert waiters[2].cancelled() and waiters[2].done()

    results: dict[int, Any] = {}

    def wait(index: int) -> None:
        try:
            results[index] = waiters[index].wait(60)  # far longer than the join below
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=wait, args=(i,)) for i in (0, 1, 3, 4)]
    for thread in threads:
        thread.start()
    then = threading.Event()
    error = ValueError("item 3 failed")
    outcomes = [(w, i, error if i == 3 else None) for i, w in enumerate(waiters)]
    relay.settle(outcomes, then.set)
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)  # woken, not timed out
    assert results == {0: 0, 1: 1, 3: error, 4: 4}
    assert then.is_set()
    assert waiters[2].cancelled()  # it never got a result: the relay skipped it


def test_a_thread_that_leaves_before_waiting_still_passes_its_wake_up_on() -> None:
    relay = Relay()
    leaving, next_ = Waiter(relay), Waiter(relay)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(next_.wait(60)))
    thread.start()
    then = threading.Event()
    relay.settle([(leaving, "never read", None), (next_, "next", None)], then.set)
    leaving.abandon()  # its thread erred between sending its call and waiting for it
    thread.join(10)
    assert not thread.is_alive() and got == ["next"] and then.is_set()
    assert not leaving.cancelled()  # it was settled before it left: nothing to withdraw

    unsettled = Waiter(relay)
    unsettled.abandon()
    assert unsettled.cancelled()
    unsettled.abandon()  # twice is harmless


def test_a_batch_whose_waiters_all_gave_up_runs_then_at_once() -> None:
    relay = Relay()
    waiter = Waiter(relay)
    with pytest.raises(TimeoutError):
        waiter.wait(0.001)
    ran = []
    relay.settle([(waiter, "late", None)], lambda: ran.append(threading.get_ident()))
    assert ran == [threading.get_ident()]


def test_a_result_set_before_the_wait_is_returned_at_once_and_again() -> None:
    waiter = Waiter(Relay())
    waiter.set_result("early")
    assert waiter.done() and not waiter.cancelled()
    assert waiter.wait(0) == "early"
    assert waiter.wait(0) == "early"
    failed = Waiter(Relay())
    failed.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        failed.wait(0)


def test_a_wait_timing_out_as_its_result_comes_returns_it_or_gives_up_never_both() -> None:
    returned = gave_up = 0
    for attempt in range(300):
        relay = Relay()
        racing, after = Waiter(relay), Waiter(relay)
        outcome: dict[str, Any] = {}

        def wait_briefly(w: Waiter = racing, out: dict[str, Any] = outcome) -> None:
            try:
                out["racing"] = w.wait(random.uniform(0, 0.0005))
            except TimeoutError:
                out["racing"] = "timed out"

        def wait_long(w: Waiter = after, out: dict[str, Any] = outcome) -> None:
            out["after"] = w.wait(60)

        threads = [threading.Thread(target=wait_briefly), threading.Thread(target=wait_long)]
        for thread in threads:
            thread.start()
        if attempt % 2:
            threading.Event().wait(random.uniform(0, 0.0005))
        relay.settle([(racing, "result", None), (after, "next", None)])
        for thread in threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in threads)
        assert outcome["after"] == "next"  # the thread behind it is woken either way
        if outcome["racing"] == "result":
            returned += 1
            assert not racing.cancelled()
        else:
            gave_up += 1
            assert outcome["racing"] == "timed out" and racing.cancelled()
    assert returned + gave_up == 300


@pytest.mark.usefixtures("ctrl_c")
def test_an_interrupted_wait_cancels_the_waiter() -> None:
    assert threading.current_thread() is threading.main_thread()  # signals go to it alone
    relay = Relay()
    waiter = Waiter(relay)
    interrupt = threading.Timer(0.05, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    interrupt.start()
    with pytest.raises(KeyboardInterrupt):
        waiter.wait(10)
    interrupt.join()
    assert waiter.cancelled()
    relay.settle([(waiter, "too late", None)])  # skipped: nothing is released twice
    assert waiter.cancelled()


def test_posts_from_many_threads_arrive_once_each_in_order(
    loop: asyncio.AbstractEventLoop,
) -> None:
    got: list[tuple[int, int]] = []
    mailbox: Mailbox[tuple[int, int]] = Mailbox(loop, got.append)

    def post(thread: int) -> None:
        for n in range(500):
            mailbox.post((thread, n))

    threads = [threading.Thread(target=post, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)  # the loop caught up
    assert sorted(got) == [(t, n) for t in range(8) for n in range(500)]
    for t in range(8):
        assert [n for thread, n in got if thread == t] == list(range(500))


class CountingMailbox(Mailbox[int]):
    wakeups = 0

    def _schedule(self) -> None:
        type(self).wakeups += 1
        super()._schedule()


def test_a_burst_wakes_the_loop_once_and_held_posts_wait_for_release(
    loop: asyncio.AbstractEventLoop,
) -> None:
    got: list[int] = []
    mailbox = CountingMailbox(loop, got.append)
    busy, free = threading.Event(), threading.Event()
    loop.call_soon_threadsafe(lambda: (busy.set(), free.wait(5)))
    busy.wait(5)
    for n in range(100):  # the loop is busy: one wake-up for the whole burst
        mailbox.post(n)
    free.set()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)
    assert got == list(range(100)) and CountingMailbox.wakeups == 1

    loop.call_soon_threadsafe(mailbox.hold)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)
    for n in range(100, 110):
        mailbox.post(n)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(5)
    assert got == list(range(100)) and CountingMailbox.wakeups == 1  # held back, no wake-up
    threading.Thread(target=mailbox.release).start()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(5)
    assert got == list(range(110)) and CountingMailbox.wakeups == 2


def test_let_out_delivers_what_is_held_and_goes_on_holding(
    loop: asyncio.AbstractEventLoop,
) -> None:
    got: list[int] = []
    mailbox: Mailbox[int] = Mailbox(loop, got.append)
    loop.call_soon_threadsafe(mailbox.hold)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)
    for n in range(3):
        mailbox.post(n)
    threading.Thread(target=mailbox.let_out).start()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(5)
    assert got == [0, 1, 2]
    mailbox.post(3)
    mailbox.let_out()
    mailbox.post(4)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(5)
    assert got[:4] == [0, 1, 2, 3]  # (4 may have come with it: it was posted before delivery)
    mailbox.post(5)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(5)
    assert 5 not in got  # still held
    mailbox.release()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(5)
    assert got == [0, 1, 2, 3, 4, 5]
    mailbox.let_out()  # nothing held: harmless


@pytest.mark.parametrize(("count", "every", "meanwhiles"), [(10, 3, 3), (9, 3, 2), (4, 8, 0)])
def test_a_batch_runs_meanwhile_every_n_woken_threads_and_then_at_its_end(
    count: int, every: int, meanwhiles: int
) -> None:
    relay = Relay()
    waiters = [Waiter(relay) for _ in range(count)]
    results: dict[int, Any] = {}
    ran: list[str] = []
    lock = threading.Lock()

    def wait(index: int) -> None:
        results[index] = waiters[index].wait(10)

    def note(what: str) -> None:
        with lock:
            ran.append(what)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    relay.settle(
        [(waiter, i * 10, None) for i, waiter in enumerate(waiters)],
        functools.partial(note, "then"), every=every, meanwhile=functools.partial(note, "mid"),
    )  # fmt: skip
    for thread in threads:
        thread.join(10)
    assert results == {i: i * 10 for i in range(count)}
    assert sorted(ran) == sorted(["mid"] * meanwhiles + ["then"])


def test_a_closed_loop_refuses_posts_and_a_release_is_harmless() -> None:
    loop = asyncio.new_event_loop()
    mailbox: Mailbox[int] = Mailbox(loop, lambda item: None)
    mailbox.hold()
    mailbox.post(1)
    loop.close()
    mailbox.release()  # the last thread of a batch releasing after close: no error
    with pytest.raises(RuntimeError):
        Mailbox(loop, lambda item: None).post(2)


def test_a_closed_mailbox_refuses_what_the_loop_did_not_take_and_later_posts(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Posted after close (while the loop was stopping), an item was never delivered nor
    refused: its caller waited for nothing until its own timeout."""
    got: list[int] = []
    refused: list[tuple[int, str]] = []
    mailbox: Mailbox[int] = Mailbox(
        loop, got.append, lambda item: refused.append((item, threading.current_thread().name))
    )
    loop.call_soon_threadsafe(mailbox.hold)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)
    mailbox.post(1)
    loop.call_soon_threadsafe(mailbox.close)  # 1 was held: refused on the loop
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(5)
    mailbox.post(2)  # refused at once, in the posting thread: the loop may never run again
    assert got == [] and [item for item, _ in refused] == [1, 2]
    assert refused[1][1] == threading.current_thread().name


def _settle_futures(relay: Relay, batch: list[tuple[CallFuture[Any], Any]]) -> None:
    """What the client's loop does with a batch of replies for futures."""
    waking: list[tuple[Waiter, Any, BaseException | None]] = []
    for future, value in batch:
        waking += [(waiter, None, None) for waiter in future.settle_quietly(value, None)]
    relay.settle(waking)


def test_futures_settled_in_batches_wake_every_thread_blocked_on_them() -> None:
    relay = Relay()
    futures = [CallFuture[int](relay) for _ in range(40)]
    got: queue.Queue[tuple[int, int]] = queue.Queue()

    def waiter(index: int) -> None:
        got.put((index, futures[index % 40].result(60)))

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(80)]  # two per future
    for thread in threads:
        thread.start()
    while sum(len(f._sleepers) for f in futures) < 80:  # every thread blocked in result()
        threading.Event().wait(0.01)
    _settle_futures(relay, [(f, i) for i, f in enumerate(futures[:25])])
    futures[25].set_result(25)  # settled alone: its threads are woken at once
    _settle_futures(relay, [(f, i) for i, f in enumerate(futures) if i > 25])
    for thread in threads:
        thread.join(10)
    results = sorted(got.queue)
    assert results == [(i, i % 40) for i in range(80)]
    assert all(f.result(0) == i and f.done() for i, f in enumerate(futures))


def test_a_future_result_times_out_then_still_gets_its_result() -> None:
    relay = Relay()
    future = CallFuture[str](relay)
    with pytest.raises(concurrent.futures.TimeoutError):
        future.result(0.05)
    assert future._sleepers == []  # the thread that gave up is no longer woken
    _settle_futures(relay, [(future, "late")])
    assert future.result(0) == "late" and future.exception() is None


def test_a_cancelled_future_wakes_its_threads_and_withdraws_once() -> None:
    relay = Relay()
    withdrawn = []
    future = CallFuture[int](relay, on_cancel=lambda: withdrawn.append(1))
    errors: queue.Queue[BaseException] = queue.Queue()

    def wait() -> None:
        try:
            future.result(60)
        except BaseException as exc:
            errors.put(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    while not future._sleepers:
        threading.Event().wait(0.01)
    assert future.cancel() and future.cancel()
    thread.join(10)
    assert isinstance(errors.get_nowait(), concurrent.futures.CancelledError)
    assert withdrawn == [1]  # once, however often it is cancelled
    assert future.settle_quietly(5, None) == []  # a late result is ignored
    done = CallFuture[int](relay, on_cancel=lambda: withdrawn.append(2))
    done.set_result(1)
    assert not done.cancel() and withdrawn == [1] and done.on_cancel is None


def test_a_cancelled_future_is_done_for_wait_and_as_completed() -> None:
    """concurrent.futures.wait counted a cancelled CallFuture as not done (it waited out its
    timeout, or forever), and as_completed never yielded it."""
    relay = Relay()
    cancelled, settled = CallFuture[int](relay), CallFuture[int](relay)
    threading.Timer(0.05, cancelled.cancel).start()
    done, _ = concurrent.futures.wait(
        [cancelled, settled], timeout=10, return_when="FIRST_COMPLETED"
    )
    assert done == {cancelled} and cancelled.cancel()  # a second cancel is harmless
    threading.Timer(0.05, lambda: _settle_futures(relay, [(settled, 1)])).start()
    assert set(concurrent.futures.as_completed([cancelled, settled], timeout=10)) == {
        cancelled, settled,
    }  # fmt: skip
    assert not concurrent.futures.wait([cancelled], timeout=0).not_done


def test_call_futures_work_with_wait_as_completed_callbacks_and_asyncio() -> None:
    relay = Relay()
    futures = [CallFuture[int](relay) for _ in range(3)]
    seen: list[int] = []
    futures[0].add_done_callback(lambda f: seen.append(f.result()))
    timer = threading.Timer(0.05, lambda: _settle_futures(relay, [(futures[0], 7)]))
    timer.start()
    done, _ = concurrent.futures.wait(futures, timeout=10, return_when="FIRST_COMPLETED")
    assert done == {futures[0]} and seen == [7]
    futures[1].set_exception(ValueError("bad"))
    _settle_futures(relay, [(futures[2], 9)])
    assert {f.done() for f in concurrent.futures.as_completed(futures, timeout=10)} == {True}
    assert isinstance(futures[1].exception(), ValueError)

    async def main() -> int:
        future = CallFuture[int](relay)
        threading.Timer(0.05, lambda: _settle_futures(relay, [(future, 3)])).start()
        return await asyncio.wrap_future(future)

    assert asyncio.run(main()) == 3


def test_a_settled_future_leaves_no_reference_cycle() -> None:
    relay = Relay()
    future = CallFuture[int](relay)
    future.on_cancel = functools.partial(print, future)  # refers to the future, as the client's
    _settle_futures(relay, [(future, 1)])
    ref = weakref.ref(future)
    gc.disable()
    try:
        del future
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()
