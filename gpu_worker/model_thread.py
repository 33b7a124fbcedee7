"""ModelThread: one dedicated thread that runs a model's batches, in the order given.

The batch loop hands a batch to it and stays free to read and decode the next batch and to
send the last one's replies while the model computes (torch releases the GIL inside its
operations). One thread, so calls never run concurrently and a model sees one thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

THREAD_NAME = "microbatch-model"
# The longest submit(..., wait_started=True) blocks its caller: the thread is idle when that is
# asked, so it starts at once unless a call the loop gave up on (after an outage) still runs.
START_WAIT_S = 0.01


def _timed(fn: Callable[[Any], T], arg: Any, started: threading.Event | None) -> tuple[T, float]:
    if started is not None:
        started.set()
    began = time.perf_counter()
    result = fn(arg)
    return result, time.perf_counter() - began


class ModelThread:
    """Run ``fn(arg)`` calls one at a time on a thread of their own."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def submit(
        self, fn: Callable[[Any], T], arg: Any, wait_started: bool = False
    ) -> asyncio.Future[tuple[T, float]]:
        """Queue ``fn(arg)`` behind the calls already given; the future gives its result and
        the seconds it ran (not counting its wait in the queue). Call from the event loop.

        With ``wait_started``, return once the thread has begun the call: Python work that
        the caller does next would otherwise hold the GIL the thread needs to begin (for up
        to the interpreter's 5 ms switch interval).
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        started = threading.Event() if wait_started else None
        future = asyncio.wrap_future(self._executor.submit(_timed, fn, arg, started))
        if started is not None:
            started.wait(START_WAIT_S)
        return future

    def close(self) -> None:
        """Drop calls not started; one running finishes on its own (its result is ignored)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
