"""The Streamer's asyncio side as asyncio applications use it: event loops in several threads,
and coroutines run where no asyncio loop is."""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading

import pytest

from broker import Streamer
from broker.client import ClientCore
from broker.devserver import RedisServer

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


@pytest.mark.parametrize("method", ["apredict", "astart", "aconnect", "aclose"])
def test_without_an_asyncio_loop_the_error_says_what_to_do(method: str) -> None:
    """Under trio (or a coroutine driven by hand) asyncio's bare "no running event loop" said
    nothing of what to use instead."""
    streamer = Streamer("toy", redis_url=NOWHERE)
    args = ([[1.0]],) if method in ("apredict", "astart") else ()
    with pytest.raises(RuntimeError, match=r"need a running asyncio event loop.*predict"):
        started = getattr(streamer, method)(*args)
        if asyncio.iscoroutine(started):
            try:
                started.send(None)
            finally:
                started.close()
    streamer.close()


def test_a_sync_close_on_the_loop_as_it_ends_closes_its_connections(
    redis_server: RedisServer, prefix: str
) -> None:
    """close() called inside a coroutine (a lifespan's shutdown, say) only starts closing the
    loop's core; asyncio.run() then cancelled that, and its shutdown skipped the core as
    closing already: one Redis connection and file descriptor left per run (with the garbage
    collector off, for good)."""

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def use_then_close(streamer: Streamer) -> None:
        assert await streamer.aconnect()
        streamer.close()

    fds_before = fds()
    gc.disable()
    try:
        for _ in range(5):
            streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
            asyncio.run(use_then_close(streamer))
        assert fds() <= fds_before + 1, "each run left its connection open"
    finally:
        gc.enable()


def test_aconnect_opens_the_connection_calls_are_sent_on(prefix: str) -> None:
    """aconnect() pinged on a connection no call uses: a gateway's first request to each model
    still paid for connecting, and each model it had called held three connections, not two
    (the one calls are sent on and the reader of their replies)."""
    from broker import DeadlineExceeded

    with RedisServer() as server:
        admin = server.client()

        def streamer_connections() -> int:
            return len(admin.client_list(_type="normal")) - 1  # less admin's own

        async def connect_then_call() -> tuple[int, int]:
            async with Streamer(
                "toy", redis_url=server.url, prefix=prefix, wait_for_workers=True
            ) as streamer:
                assert await streamer.aconnect()
                connected = streamer_connections()
                with pytest.raises(DeadlineExceeded):
                    await streamer.apredict([[1.0]], timeout=0.2)
                return connected, streamer_connections()

        assert asyncio.run(connect_then_call()) == (1, 2)
