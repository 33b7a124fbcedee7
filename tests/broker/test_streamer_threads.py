"""A Streamer shared by many threads: across a fork, and closed while their calls are in flight."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from broker import BrokerUnavailable, Streamer
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from tests.broker.test_redis_transport import echo_worker


@contextlib.contextmanager
def echoing(url: str, keys: ModelKeys) -> Iterator[None]:
    """An echo worker serving ``keys`` on a thread of its own until the block ends."""
    started, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        async with echo_worker(url, keys):
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_s_first_calls_from_many_threads_use_one_fresh_core(
    redis_server: RedisServer, prefix: str
) -> None:
    """In a child forked after the Streamer was used (gunicorn --preload with a warm-up call,
    then gthread workers), the first calls of several threads at once raced to forget the
    parent's state: some posted to the parent's loop, which is not in the child, and failed
    with DeadlineExceeded only after their timeout plus 5 s; others each started a loop thread
    of their own that close() never closed."""
    streamer = Streamer("echo", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
    with echoing(redis_server.url, ModelKeys("echo", prefix)):
        assert streamer.predict(["parent"]) == ["parent"]
        for _ in range(4):
            pid = os.fork()
            if pid == 0:  # the child: report through the exit status, never return to pytest
                code = 1
                try:
                    code = _child_calls(streamer)
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "see the codes in _child_calls"
        assert streamer.predict(["parent-again"]) == ["parent-again"]
        streamer.close()


def _child_calls(streamer: Streamer, threads: int = 16) -> int:
    """Call from ``threads`` threads at once: 0 if all got their results in time from one
    loop thread that close() ended; 2 if a call failed or was late, 3 if several loop threads
    were started, 4 if one outlived close()."""
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows
    barrier = threading.Barrier(threads)
    failed: list[int] = []

    def call(index: int) -> None:
        barrier.wait()
        started = time.monotonic()
        try:
            if streamer.predict([index], timeout=2) != [index]:
                failed.append(index)
        except Exception:
            failed.append(index)
        if time.monotonic() - started > 2:
            failed.append(index)

    workers = [threading.Thread(target=call, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    name = f"microbatch-{streamer.name}"
    loops = [thread for thread in threading.enumerate() if thread.name == name]
    streamer.close()
    if failed:
        return 2
    if len(loops) != 1:
        return 3
    return 4 if any(thread.is_alive() for thread in loops) else 0


@pytest.mark.parametrize("how", ["predict", "submit"])
def test_a_call_on_its_way_in_as_the_streamer_closes_fails_with_broker_unavailable(
    how: str,
) -> None:
    """A call whose items were still being prepared when another thread closed the Streamer
    posted them to the closed loop: RuntimeError('Event loop is closed') from predict() or
    submit() rather than the BrokerUnavailable that close() promises (or, posted while the
    loop was stopping, no answer until its timeout plus 5 s)."""
    preparing, go_on = threading.Event(), threading.Event()

    class Held:
        def preprocess(self, item: object) -> object:
            preparing.set()
            go_on.wait(10)
            return item

        def postprocess(self, output: object) -> object:
            return output

    # never reached: nothing of the call is sent
    streamer = Streamer("held", redis_url="redis://127.0.0.1:1/0", model=Held())
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            if how == "predict":
                streamer.predict(["x"], timeout=5)
            else:
                streamer.submit(["x"], timeout=5).result(10)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert preparing.wait(10)
    streamer.close()
    started = time.monotonic()
    go_on.set()
    caller.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], BrokerUnavailable), outcome
    assert "closed while the call waited" in str(outcome[0])
    assert time.monotonic() - started < 2
    streamer.close()


def test_a_submit_callback_that_would_wait_on_the_streamer_s_own_thread_is_told_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """A submit() future's callbacks run on the Streamer's loop thread. A predict() there
    waited for a reply that loop could no longer read (every call of the Streamer stalled),
    then failed with a DeadlineExceeded 5 s after its timeout; result() of another pending
    future stalled it for its whole timeout (forever without one); close() for 9 s."""
    streamer = Streamer("idle", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
    pending = streamer.submit(["waits"], timeout=30)  # no worker: it waits
    seen: dict[str, object] = {}
    done = threading.Event()

    def callback(_: object) -> None:
        started = time.monotonic()
        for what, wait in (
            ("predict", lambda: streamer.predict(["x"], timeout=1)),
            ("result", lambda: pending.result(1)),
        ):
            try:
                seen[what] = wait()
            except Exception as exc:
                seen[what] = exc
        streamer.close()
        seen["seconds"] = time.monotonic() - started
        done.set()

    streamer.submit(["expires"], timeout=0.2).add_done_callback(callback)
    assert done.wait(30)
    for what in ("predict", "result"):
        assert isinstance(seen[what], RuntimeError), seen
        assert "own thread" in str(seen[what])
    assert isinstance(seen["seconds"], float) and seen["seconds"] < 1
    error = pending.exception(5)  # the close from the callback ended it
    assert isinstance(error, BrokerUnavailable), error
    streamer.close()
