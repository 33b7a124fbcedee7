"""ModelThread: one dedicated thread that runs a model's batches, in the order given.

The batch loop hands a batch to it and stays free to read and decode the next batch and to
send the last one's replies while the model computes (torch releases the GIL inside its
operations). One thread, so calls never run concurrently and a model sees one thread. A daemon
thread: a model call that never returns cannot keep the process from exiting (its caller got
its deadline already; nobody waits for the result), as service_streamer's worker thread
could not.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
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


# A call for the thread: its future, the function and its argument, and the event it sets
# once begun (None: nobody waits for that); None asks the thread to end.
_Call = tuple["Future[Any]", Callable[[Any], Any], Any, "threading.Event | None"]


def _serve(calls: queue.SimpleQueue[_Call | None]) -> None:
    """The model thread: run each call given, in order, until asked to end."""
    while (call := calls.get()) is not None:
        done, fn, arg, started = call
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(_timed(fn, arg, started))
        except BaseException as exc:  # the model's, whatever it is: the caller's to see
            done.set_exception(exc)
        del call, done, fn, arg  # nothing of the batch outlives its call


class ModelThread:
    """Run ``fn(arg)`` calls one at a time on a thread of their own."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[_Call | None] | None = None

    def submit(
        self, fn: Callable[[Any], T], arg: Any, wait_started: bool = False
    ) -> asyncio.Future[tuple[T, float]]:
        """Queue ``fn(arg)`` behind the calls already given; the future gives its result and
        the seconds it ran (not counting its wait in the queue). Call from the event loop.

        With ``wait_started``, return once the thread has begun the call: Python work that
        the caller does next would otherwise hold the GIL the thread needs to begin (for up
        to the interpreter's 5 ms switch interval).
        """
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            name = f"{THREAD_NAME}_0"  # as a one-thread pool named it
            threading.Thread(target=_serve, args=(self._calls,), name=name, daemon=True).start()
        started = threading.Event() if wait_started else None
        done: Future[tuple[T, float]] = Future()
        self._calls.put((done, fn, arg, started))
        future = asyncio.wrap_future(done)
        if started is not None:
            started.wait(START_WAIT_S)
        return future

    def close(self) -> None:
        """Drop calls not started; one running finishes on its own (its result is ignored),
        then the thread ends."""
        calls, self._calls = self._calls, None
        if calls is None:
            return
        while True:
            try:
                call = calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                call[0].cancel()
        calls.put(None)
