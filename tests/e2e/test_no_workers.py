"""A call whose model has no live worker fails with NoWorkers (its items withdrawn), unless the
caller chose to wait for workers; a worker that comes within the grace period serves it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from broker import DeadlineExceeded, NoWorkers, Streamer, liveness
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from broker.worker_watch import CHECK_EVERY_S, WorkerWatch
from tests.conftest import worker_process
from tests.e2e.test_gateway import gateway_process

GRACE = 2.0  # the workers of these tests renew their heartbeats with --heartbeat-ttl 1
MARGIN = 2 * CHECK_EVERY_S + 5.0  # checks come once a second; generous for shared CPUs


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis_server.client() as connection:
        yield connection


def wait_for_length(client: redis.Redis, stream: str, length: int, timeout: float = 10) -> None:
    """The withdrawal runs in the background, right after the call fails."""
    deadline = time.monotonic() + timeout
    while client.xlen(stream) != length:
        assert time.monotonic() < deadline, f"{stream} holds {client.xlen(stream)} entries"
        time.sleep(0.02)


def test_no_worker_fails_the_call_and_withdraws_its_items(
    redis_server: RedisServer, prefix: str, client: redis.Redis
) -> None:
    keys = ModelKeys("toy", prefix)
    with Streamer("toy", redis_url=redis_server.url, prefix=prefix, workers_grace=GRACE) as s:
        started = time.monotonic()
        with pytest.raises(NoWorkers) as raised:
            s.predict(["a", "b", "c"], timeout=60)
        assert time.monotonic() - started < GRACE + MARGIN
        message = str(raised.value)
        assert raised.value.index == 0
        assert f"model 'toy' under prefix {prefix!r}" in message
        assert "--prefix" in message and "--redis" in message and "broker status" in message
        assert "workers may be exiting" in message  # a crash-looping worker: its log says why
        wait_for_length(client, keys.stream, 0)
        # known to have no worker: later calls fail too (at once, queueing nothing)
        future = s.submit(["d"], timeout=60)
        with pytest.raises(NoWorkers):
            future.result(timeout=GRACE + MARGIN)
        wait_for_length(client, keys.stream, 0)


def test_a_worker_that_starts_within_the_grace_period_serves_the_call(
    redis_server: RedisServer, prefix: str
) -> None:
    with Streamer("toy", redis_url=redis_server.url, prefix=prefix) as streamer:  # grace: 10 s
        future = streamer.submit(["early"], timeout=60)
        with worker_process(redis_server.url, "tests.models:Toy", prefix):
            assert future.result(timeout=60)[0]["item"] == "early"


@pytest.mark.slow  # waits out the grace period
def test_a_worker_that_dies_is_noticed_after_the_grace_period(
    redis_server: RedisServer, prefix: str, client: redis.Redis
) -> None:
    keys = ModelKeys("toy", prefix)
    url = redis_server.url
    with Streamer("toy", redis_url=url, prefix=prefix, workers_grace=GRACE) as streamer:
        with worker_process(url, "tests.models:Toy", prefix, "--heartbeat-ttl", "1"):
            assert streamer.predict(["served"])[0]["item"] == "served"
        # the worker stopped (its consumer retired): the next call waits the grace period
        with pytest.raises(NoWorkers):
            streamer.predict(["late"], timeout=60)
        wait_for_length(client, keys.stream, 0)


@pytest.mark.slow
def test_waiting_for_workers_queues_until_one_comes(
    redis_server: RedisServer, prefix: str, client: redis.Redis
) -> None:
    keys = ModelKeys("toy", prefix)
    url = redis_server.url
    with Streamer(
        "toy", redis_url=url, prefix=prefix, wait_for_workers=True, workers_grace=0.5
    ) as streamer:
        future = streamer.submit(["a", "b"], timeout=60)
        time.sleep(0.5 + MARGIN / 2)  # well past the grace period
        assert not future.done()
        assert client.xlen(keys.stream) == 1  # the call's two items, in one entry
        assert int(client.get(keys.packed_items) or 0) == 1
        with worker_process(url, "tests.models:Toy", prefix):
            assert [out["item"] for out in future.result(timeout=60)] == ["a", "b"]


def test_asyncio_callers_get_no_workers_too(redis_server: RedisServer, prefix: str) -> None:
    async def call() -> None:
        async with Streamer(
            "toy", redis_url=redis_server.url, prefix=prefix, workers_grace=GRACE
        ) as streamer:
            with pytest.raises(NoWorkers):
                await streamer.apredict(["a"], timeout=60)

    asyncio.run(call())


@pytest.mark.slow
def test_the_gateway_answers_503_with_retry_after(
    redis_server: RedisServer, prefix: str, client: redis.Redis
) -> None:
    model = "tests.gateway_models:Doubler"
    env = {"MICROBATCH_GATEWAY_WORKERS_GRACE": str(GRACE)}
    with gateway_process(redis_server.url, [model], prefix, env=env) as (base, _):
        body = {"inputs": [[1.0, 2.0, 3.0, 4.0]]}
        response = httpx.post(f"{base}/v1/models/doubler/predict", json=body, timeout=60)
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == "1"
        error = response.json()["error"]
        assert error["type"] == "NoWorkers" and f"prefix {prefix!r}" in error["message"]
        v2 = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}]}
        response = httpx.post(f"{base}/v2/models/doubler/infer", json=v2, timeout=60)
        assert response.status_code == 503, response.text
        assert response.json()["error"].startswith("NoWorkers: ")
        wait_for_length(client, ModelKeys("doubler", prefix).stream, 0)
    # --wait-for-workers: the request waits (here until its own timeout: 504)
    with gateway_process(redis_server.url, [model], prefix, "--wait-for-workers", env=env) as (
        base,
        _,
    ):
        headers = {"X-Request-Timeout": str(GRACE + 3 * CHECK_EVERY_S)}
        response = httpx.post(
            f"{base}/v1/models/doubler/predict", json=body, headers=headers, timeout=60
        )
        assert response.status_code == 504, response.text


def test_what_counts_as_no_live_worker() -> None:
    watch = WorkerWatch(grace_s=10)
    # no worker ever seen: counted from the oldest call in flight
    watch.observe(now=100.0, lapsed_s=None, oldest_call_at=95.0)
    assert watch.dead_since == 95.0 and not watch.expired(104.0) and watch.expired(105.5)
    # a worker is live: forgotten
    watch.observe(now=106.0, lapsed_s=0.0, oldest_call_at=95.0)
    assert watch.dead_since is None and not watch.expired(200.0)
    # its heartbeat lapsed 3 s ago: counted from then, not from the older call
    watch.observe(now=110.0, lapsed_s=3.0, oldest_call_at=90.0)
    assert watch.dead_since == 107.0 and watch.expired(117.5)
    assert watch.known_dead(117.5) is False  # the last check is too old to fail a call at once
    watch.observe(now=118.0, lapsed_s=11.0, oldest_call_at=118.0)
    assert watch.known_dead(118.5)
    # Redis did not answer: nothing known; the next watch starts after the outage
    watch.unreachable(now=120.0)
    assert not watch.expired(200.0)
    watch.observe(now=125.0, lapsed_s=None, oldest_call_at=100.0)
    assert watch.dead_since == 120.0
    with pytest.raises(ValueError):
        WorkerWatch(grace_s=0)


@pytest.mark.slow  # Redis stalled past the grace period
def test_a_redis_stall_longer_than_the_grace_period_is_not_no_workers(prefix: str) -> None:
    """A stalled Redis (stopped, swapping) lets the workers' heartbeats lapse, and answers a
    check sent before the stall only when it is over, before the supervisors renew them:
    that lapse says nothing about the workers, and calls must not fail with NoWorkers."""
    keys = ModelKeys("m", prefix)
    with RedisServer() as server, server.client() as admin:
        assert server.process is not None

        def vouch(ttl_ms: int) -> None:  # as a live worker's supervisor does
            now_ms = liveness.server_time_ms(admin, keys.consumers)
            admin.zadd(keys.consumers, {"w": now_ms + ttl_ms})

        vouch(1000)
        with Streamer("m", server.url, prefix, workers_grace=GRACE) as streamer:
            future = streamer.submit([1], timeout=7.0)
            time.sleep(0.5)  # the check sent within the stall's first second
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                time.sleep(GRACE + 2.0)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            vouch(60_000)  # its supervisor renews the heartbeat as Redis answers again
            with pytest.raises(DeadlineExceeded):  # no worker answers: its deadline, no sooner
                future.result(15)
