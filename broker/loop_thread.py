"""A private asyncio event loop running in a daemon thread (uvloop when installed)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's where available, else asyncio's default."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """Runs an event loop in a daemon thread; other threads hand it work."""

    def __init__(self, name: str = "microbatch-loop") -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule a coroutine on the loop from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, callback: Any, *args: Any) -> None:
        """Call ``callback(*args)`` on the loop thread, from any thread."""
        self.loop.call_soon_threadsafe(callback, *args)

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    async def _cancel_tasks_and_stop(self) -> None:
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the loop's tasks, stop it and wait for its thread to end."""
        if self.loop.is_closed():
            return
        self.submit(self._cancel_tasks_and_stop())
        if not self.in_loop_thread:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()
