"""gpu_worker.model_thread: one thread runs the model's calls in order, and a call that never
returns does not keep the process from exiting."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gpu_worker.model_thread import THREAD_NAME, ModelThread
from tests.conftest import ROOT


def test_calls_run_in_order_on_one_named_thread() -> None:
    async def main() -> list[tuple[str, float]]:
        thread = ModelThread()
        try:
            futures = [
                thread.submit(lambda x: (threading.current_thread().name, x), n) for n in (1, 2)
            ]
            return [result for result, _ in await asyncio.gather(*futures)]
        finally:
            thread.close()

    assert asyncio.run(main()) == [(f"{THREAD_NAME}_0", 1), (f"{THREAD_NAME}_0", 2)]


def test_an_exception_comes_from_the_future_and_close_drops_calls_not_started() -> None:
    release = threading.Event()
    ran: list[int] = []

    def slow(n: int) -> int:
        release.wait(5)
        ran.append(n)
        if n == 1:
            raise ValueError("bad item")
        return n

    async def main() -> None:
        thread = ModelThread()
        first = thread.submit(slow, 1, wait_started=True)
        queued = thread.submit(slow, 2)
        thread.close()
        release.set()
        with pytest.raises(ValueError, match="bad item"):
            await first
        with pytest.raises(asyncio.CancelledError):
            await queued

    asyncio.run(main())
    assert ran == [1]


def test_a_model_call_that_never_returns_does_not_hold_the_process_at_exit() -> None:
    """service_streamer's worker thread was a daemon: a program whose model hung got its
    TimeoutError and exited. Here the model thread was joined at exit, and the program hung
    for as long as the model did."""
    program = textwrap.dedent(
        """
        import time
        from gpu_worker.compat import ThreadedStreamer

        def hangs(batch):
            time.sleep(60)
            return batch

        streamer = ThreadedStreamer(hangs, batch_size=4, max_latency=0.0)
        try:
            streamer.predict([1], timeout=0.5)
        except TimeoutError:
            print("timed out", flush=True)
        streamer.destroy_workers()
        """
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    assert done.stdout == "timed out\n", done.stderr
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
