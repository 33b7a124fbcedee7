"""A private asyncio event loop running in a daemon thread (uvloop when installed).

Every loop thread still running when the program ends is stopped and joined before the
interpreter finalises: a loop's timer firing during finalisation would call back into a
half-torn-down interpreter (a segmentation fault, often with torch loaded). Whoever owns a loop
thread can pass ``on_exit`` to close its own resources first (a Streamer closes itself).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures.thread  # noqa: F401  # its exit hook must be registered before ours
import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("microbatch.loop")

_live: weakref.WeakSet[LoopThread] = weakref.WeakSet()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's where available, else asyncio's default."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def green_threads() -> str | None:
    """The library (gevent, eventlet) whose monkey-patching made threads greenlets, if any."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return "gevent"
    eventlet = sys.modules.get("eventlet.patcher")
    if eventlet is not None and eventlet.is_monkey_patched("thread"):
        return "eventlet"
    return None


def refuse_green_threads() -> None:
    """Raise RuntimeError where threads are greenlets: a loop thread would then be a greenlet
    whose event loop never yields, and every other greenlet (the callers waiting for their
    results among them) would wait forever."""
    library = green_threads()
    if library is not None:
        raise RuntimeError(
            f"{library}'s monkey-patching made threads greenlets, and microbatch's client runs "
            "an event loop on a thread of its own, which would block every greenlet for good: "
            f"do not monkey-patch threads ({library}), and serve with threads instead (Flask's "
            "threaded=True, gunicorn --threads N, waitress); see docs/migration.md"
        )


class LoopThread:
    """Runs an event loop in a daemon thread; other threads hand it work.

    ``on_exit`` (held weakly when it is a bound method) runs at interpreter exit, before the
    loop is stopped, if the thread is still running then.
    """

    def __init__(
        self, name: str = "microbatch-loop", on_exit: Callable[[], Any] | None = None
    ) -> None:
        refuse_green_threads()
        self.loop = new_event_loop()
        self._on_exit: Callable[[], Callable[[], Any] | None] | None = None
        if on_exit is not None:
            if hasattr(on_exit, "__self__") and hasattr(on_exit, "__func__"):
                self._on_exit = weakref.WeakMethod(on_exit)
            else:
                self._on_exit = lambda: on_exit
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()  # stopped (stop, stop_soon): nothing runs on it again

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule a coroutine on the loop from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    async def _cancel_tasks_and_stop(self) -> None:
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the loop's tasks, stop it and wait for its thread to end."""
        _live.discard(self)
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.submit(self._cancel_tasks_and_stop())
        if not self.in_loop_thread:
            self._thread.join(timeout)

    def stop_soon(
        self, first: Coroutine[Any, Any, Any] | None = None, timeout: float = 5.0
    ) -> None:
        """Stop without waiting, from any thread (a garbage collector's included): run
        ``first`` on the loop (for at most ``timeout`` seconds), then cancel the loop's tasks
        and stop it; the thread closes the loop and ends."""
        _live.discard(self)
        if self.loop.is_closed() or not self._thread.is_alive():
            if first is not None:
                first.close()
            return

        async def finish() -> None:
            if first is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(first, timeout)
            await self._cancel_tasks_and_stop()

        finishing = finish()
        try:
            self.submit(finishing)
        except RuntimeError:  # the loop closed meanwhile
            finishing.close()

    def _stop_at_exit(self) -> None:
        owner_close = self._on_exit() if self._on_exit is not None else None
        if owner_close is not None:
            try:
                owner_close()
            except Exception:  # the loop is stopped below whatever happened
                log.debug("closing a loop thread's owner at exit failed", exc_info=True)
        self.stop()


def stop_all() -> None:
    """Stop every loop thread still running (called once, as the program exits)."""
    for thread in list(_live):
        if thread.running:
            thread._stop_at_exit()


def _register_exit_hook() -> None:
    # threading's exit hooks run before non-daemon threads are joined and before atexit's, while
    # the interpreter (and the thread pools a loop may still hand work to) is whole. Ours runs
    # before concurrent.futures' own hook (imported above): hooks run last registered first.
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        atexit.register(stop_all)
    else:
        register(stop_all)


_register_exit_hook()
