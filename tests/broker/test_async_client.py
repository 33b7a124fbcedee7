"""The Streamer's asyncio side as asyncio applications use it: event loops in several threads,
and coroutines run where no asyncio loop is."""

from __future__ import annotations

import asyncio
import sys
import threading

from broker import Streamer
from broker.client import ClientCore

NOWHERE = "redis://127.0.0.1:1/0"  # no call is made: making a core connects to nothing


def test_event_loops_in_many_threads_make_their_cores_at_once() -> None:
    """Threads each running asyncio.run() make a core for their loop at the same time: the
    unlocked scan for cores of closed loops raised "dictionary changed size during
    iteration" in one of them now and then."""
    streamer = Streamer("toy", redis_url=NOWHERE)
    errors: list[BaseException] = []

    async def make_core() -> ClientCore:
        return streamer._get_loop_core()

    def run() -> None:
        try:
            for _ in range(400):
                asyncio.run(make_core())
        except BaseException as exc:
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows at once
    try:
        threads = [threading.Thread(target=run) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(interval)
        streamer.close()
    assert errors == []
