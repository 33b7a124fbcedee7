"""Connections from a redis+sentinel:// URL against real sentinels on loopback: every kind of
connection (lean lane, redis-py sync and asyncio) reaches the master, follows a failover by
itself, and fails fast, typed, while no master is known."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from broker import connections
from broker.errors import BrokerUnavailable
from broker.redis_transport import RedisTransport
from broker.resp_lane import ReplicaError, RespLane
from broker.sentinel import MasterNotFound
from tests.sentinel_local import SERVICE, LocalSentinel, wait_for


@pytest.fixture
def sentinel() -> Iterator[LocalSentinel]:
    with LocalSentinel(replicas=1, sentinels=1) as setup:
        yield setup


def key() -> str:
    return f"sentinel:{uuid.uuid4().hex[:8]}"


async def until_answers(lane: RespLane, *command: object, timeout: float = 20.0) -> object:
    """The lane's reply to ``command`` once it answers; the errors met on the way must all be
    connection errors (BrokerUnavailable's kind), never anything else or a hang."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.wait_for(lane.execute(*command), 5)
        except RedisConnectionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_a_lane_reaches_the_master_and_follows_a_failover(sentinel: LocalSentinel) -> None:
    k = key()

    async def main() -> tuple[int, int]:
        lane = connections.lane(sentinel.url())
        assert await lane.execute("SET", k, "before") == b"OK"
        assert (await lane.execute("ROLE"))[0] == b"master"
        first = lane.generation
        wait_for(lambda: sentinel.node(sentinel.replicas[0].port).client().get(k), 10, "sync")
        old, new = await asyncio.to_thread(sentinel.failover)
        # The old master lives on and takes writes for seconds (until Sentinel demotes it):
        # the lane leaves it by itself once the sentinels name the new one.
        deadline = time.monotonic() + 10
        while lane.generation == first:
            assert time.monotonic() < deadline, "the lane stayed with the old master"
            await until_answers(lane, "PING")
            await asyncio.sleep(0.05)
        assert await until_answers(lane, "SET", k, "after") == b"OK"
        assert (await lane.execute("ROLE"))[0] == b"master"
        assert await lane.execute("GET", k) == b"after"
        lane.close()
        return old, new

    old, new = asyncio.run(main())
    assert old != new
    with sentinel.node(new).client() as client:
        assert client.get(k) == b"after"


@pytest.mark.slow  # a Sentinel failover
def test_a_lane_that_left_the_old_master_drains_it_for_a_while(sentinel: LocalSentinel) -> None:
    """Each connection learns of a failover on its own timer: a worker's read that left the
    old master first never saw the requests callers still wrote there (10-33 calls per
    graceful failover at 80 calls/s ended in DeadlineExceeded). A lane moves at once, and
    reads what is still put on the master it left for DRAIN_S."""
    from broker.resp_lane import DRAIN_S

    k = key()

    async def port_of(lane: RespLane) -> int:
        info = await lane.execute("INFO", "server")
        return int(info.split(b"tcp_port:")[1].split(b"\r\n")[0])

    async def main() -> None:
        lane = RespLane(connections.lane_target(sentinel.url()), reply_timeout_s=None)
        old = await port_of(lane)
        first = lane.generation
        assert not lane.draining and await lane.on_left_master("LPOP", k, 10) is None
        _, new = await asyncio.to_thread(sentinel.failover)
        deadline = time.monotonic() + 10
        while lane.generation == first:  # it leaves within a follow period
            assert time.monotonic() < deadline, "the lane stayed with the old master"
            await until_answers(lane, "PING")
            await asyncio.sleep(0.05)
        assert await port_of(lane) == new and lane.draining
        left_at = time.monotonic()
        with sentinel.node(old).client() as late:  # a writer that has not learnt of the move
            late.rpush(k, "written late")
        assert await lane.on_left_master("LPOP", k, 10) == [b"written late"]
        assert await lane.on_left_master("LPOP", k, 10) is None  # at most every 0.2 s
        while lane.draining:  # read until DRAIN_S after the move, then let go
            assert time.monotonic() < left_at + DRAIN_S + 5, "the lane drained for ever"
            await lane.on_left_master("LPOP", k, 10)
            await asyncio.sleep(0.05)
        assert time.monotonic() > left_at + DRAIN_S - 1.5  # (it left up to a period earlier)
        lane.close()

    asyncio.run(main())


def test_a_demoted_master_s_readonly_reply_drops_the_connection(sentinel: LocalSentinel) -> None:
    """A lane straight at a replica (what a lane still connected to a demoted master meets):
    READONLY is a connection error, and the connection is dropped."""
    replica = sentinel.replicas[0]

    async def main() -> None:
        lane = RespLane(replica.url)
        assert await lane.execute("PING") == b"PONG"
        generation = lane.generation
        with pytest.raises(ReplicaError, match="READONLY"):
            await lane.execute("SET", key(), "x")
        replies = await lane.pipeline([("GET", key()), ("SET", key(), "x")])
        assert replies[0] is None and isinstance(replies[1], ReplicaError)
        assert lane.generation == generation + 1  # dropped after the first, reconnected
        lane.close()

    asyncio.run(main())


def test_redis_py_clients_of_a_sentinel_url_follow_a_failover(sentinel: LocalSentinel) -> None:
    k = key()
    client = connections.sync_client(sentinel.url(), socket_timeout=2)
    assert client.set(k, "1") and client.role()[0] == b"master"
    _, new = sentinel.failover()
    direct = sentinel.node(new).client()

    def landed(value: str) -> bool:
        """Whether a write of ``value`` reached the new master (the old one takes writes too,
        until Sentinel demotes it)."""
        return bool(client.set(k, value)) and direct.get(k) == value.encode()

    wait_for(lambda: landed("2"), 10, "the sync client to write to the new master")
    client.close()

    async def main() -> None:
        aclient = connections.async_client(sentinel.url())
        deadline = time.monotonic() + 10
        while True:
            try:
                if await aclient.set(k, "3") and direct.get(k) == b"3":
                    break
            except RedisConnectionError:
                pass
            assert time.monotonic() < deadline, "the asyncio client never reached the master"
            await asyncio.sleep(0.05)
        assert (await aclient.role())[0] == b"master"
        await aclient.aclose()

    asyncio.run(main())
    direct.close()


@pytest.mark.slow  # a Sentinel failover
def test_a_redis_py_command_in_flight_to_a_master_gone_silent_moves_to_the_new_one() -> None:
    """A command already sent to a master that then went silent (stopped: its connection
    stays open, nothing answers) is not held until the reply timeout: once the sentinels
    name a new master the connection is dropped and the command answered there."""
    with LocalSentinel(replicas=1, sentinels=1, down_after_ms=500) as setup:
        k = key()
        old = setup.master_port()

        async def main() -> None:
            aclient = connections.async_client(setup.url(), socket_timeout=120)
            assert await aclient.set(k, "kept")
            assert await aclient.wait(1, 5000) == 1  # the replica has it
            assert setup.master.process is not None
            os.kill(setup.master.process.pid, signal.SIGSTOP)
            try:
                in_flight = asyncio.create_task(aclient.get(k))
                await asyncio.to_thread(setup.wait_new_master, old, 30)
                # far below the 120 s reply timeout the old code waited out
                assert await asyncio.wait_for(in_flight, 15) == b"kept"
                assert (await aclient.role())[0] == b"master"
            finally:
                os.kill(setup.master.process.pid, signal.SIGCONT)
            await aclient.aclose()

        asyncio.run(main())


@pytest.mark.slow  # a Sentinel failover
def test_a_redis_py_command_retried_after_its_timeout_reconnects_to_the_new_master() -> None:
    """A sync command (a heartbeat, the broker CLI) that timed out on a master gone silent is
    retried once: redis-py reconnected the retry to the address it had (the stopped master,
    a second timeout and a failure); it now asks the sentinels, and reaches the new one."""
    with LocalSentinel(replicas=1, sentinels=1, down_after_ms=500) as setup:
        k = key()
        old = setup.master_port()
        client = connections.sync_client(setup.url(), socket_timeout=6)
        assert client.set(k, "kept") and client.wait(1, 5000) == 1
        assert setup.master.process is not None
        os.kill(setup.master.process.pid, signal.SIGSTOP)
        try:
            # sent to the stopped master; the failover is done before its 6 s timeout
            assert client.get(k) == b"kept"
            assert setup.master_port() != old and client.role()[0] == b"master"
        finally:
            os.kill(setup.master.process.pid, signal.SIGCONT)
            client.close()


def test_following_the_master_leaves_no_task_behind(sentinel: LocalSentinel) -> None:
    """What watches the connections in use is a timer: a loop closed without closing the
    client (as many callers do) is left with no pending task to warn about."""

    async def main() -> list[asyncio.Task[Any]]:
        aclient = connections.async_client(sentinel.url())
        assert await aclient.ping()
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(main()) == []
    finally:
        loop.close()


def test_without_a_master_calls_fail_fast_with_broker_unavailable() -> None:
    """No sentinel answers (or none names an up master): connecting fails at once, typed."""
    with LocalSentinel(replicas=0, sentinels=1, down_after_ms=200) as setup:
        url = setup.url()
        setup.master.kill()
        wait_for(
            lambda: "s_down" in setup.ask(lambda c: c.sentinel_master("mbmaster"))[0]["flags"]
            or setup.ask(lambda c: c.sentinel_master("mbmaster"))[0]["is_sdown"],
            10, "the sentinel to see the master down",
        )  # fmt: skip

        async def main() -> None:
            lane = connections.lane(url)
            started = time.monotonic()
            with pytest.raises(MasterNotFound, match="s_down"):
                await lane.execute("PING")
            transport = RedisTransport(url)
            with pytest.raises(BrokerUnavailable, match="no sentinel names an up master"):
                await transport.time_ms()
            assert time.monotonic() - started < 2.0  # no connect timeout was waited out
            await transport.close()
            lane.close()

        asyncio.run(main())
    gone = "redis+sentinel://127.0.0.1:1,127.0.0.1:2/mbmaster"

    async def nobody() -> None:
        with pytest.raises(MasterNotFound, match=r"127\.0\.0\.1:1: .*127\.0\.0\.1:2: "):
            await connections.lane(gone).execute("PING")

    asyncio.run(nobody())


def test_a_silent_sentinel_listed_first_does_not_hold_up_finding_the_master() -> None:
    """A sentinel whose host died silently (it accepted the connection, then said nothing) is
    not waited out before the next one is asked: every sentinel is asked at once, by the lanes
    and by redis-py's clients alike."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the kernel's backlog; nothing ever answers
    try:
        with LocalSentinel(replicas=0, sentinels=1) as setup:
            real = setup.url().split("//", 1)[1]
            url = f"redis+sentinel://127.0.0.1:{silent.getsockname()[1]},{real}"

            async def main() -> None:
                lane = connections.lane(url, connect_timeout_s=60)
                assert await asyncio.wait_for(lane.execute("PING"), 20) == b"PONG"
                client = connections.async_client(url, socket_connect_timeout=60)
                assert await asyncio.wait_for(client.ping(), 20) is True
                await client.aclose()
                lane.close()

            asyncio.run(main())
            blocking = connections.sync_client(url, socket_connect_timeout=60)
            assert blocking.ping() is True
            blocking.close()
    finally:
        silent.close()


def test_a_lane_on_a_master_the_sentinels_see_down_drops_it_and_fails_fast() -> None:
    """A master that went silent (stopped: its connections stay open, nothing answers) is
    left as soon as the sentinels see it down: calls fail fast, typed, instead of being
    written into a connection that swallows them until the reply timeout."""
    with LocalSentinel(replicas=0, sentinels=1, down_after_ms=200) as setup:
        url = setup.url()

        def seen_down() -> bool:
            state = setup.ask(lambda c: c.sentinel_master("mbmaster"))[0]
            return bool(state["is_sdown"])

        async def main() -> None:
            lane = connections.lane(url, reply_timeout_s=60)
            assert await lane.execute("PING") == b"PONG"
            assert setup.master.process is not None
            os.kill(setup.master.process.pid, signal.SIGSTOP)
            try:
                await asyncio.to_thread(wait_for, seen_down, 10, "the sentinels to see it down")
                with pytest.raises(RedisConnectionError):
                    await asyncio.wait_for(lane.execute("PING"), 20)
                with pytest.raises(MasterNotFound, match="s_down"):
                    await asyncio.wait_for(lane.execute("PING"), 20)
            finally:
                os.kill(setup.master.process.pid, signal.SIGCONT)
            lane.close()

        asyncio.run(main())


def test_protected_sentinels_and_masters_take_their_own_passwords() -> None:
    with LocalSentinel(replicas=0, sentinels=1, sentinel_password="watch-pw") as setup:
        # the sentinel itself must log in to the master it watches
        setup.ask(lambda c: c.sentinel_set("mbmaster", "auth-pass", "data-pw"))
        with setup.master.client() as admin:
            admin.config_set("requirepass", "data-pw")
        good = setup.url(":data-pw@", "?sentinel_password=watch-pw")

        async def main() -> None:
            lane = connections.lane(good)
            assert await lane.execute("PING") == b"PONG"
            lane.close()
            with pytest.raises(MasterNotFound, match=r"(?i)auth|password") as caught:
                await connections.lane(setup.url(":data-pw@")).execute("PING")
            assert "watch-pw" not in str(caught.value) and "data-pw" not in str(caught.value)

        asyncio.run(main())
        with connections.sync_client(good) as client:
            assert client.ping()
        with (
            pytest.raises(redis.AuthenticationError),
            connections.sync_client(setup.url(":wrong@", "?sentinel_password=watch-pw")) as client,
        ):
            client.ping()


def test_the_broker_commands_and_a_streamer_take_a_sentinel_url(
    sentinel: LocalSentinel, prefix: str
) -> None:
    """`broker functions load`, `broker status`, `broker dead-letters` and a Streamer served
    by a worker's batch loop, all given the redis+sentinel:// URL."""
    from typer.testing import CliRunner

    from broker import Streamer
    from broker.cli import app
    from broker.keys import ModelKeys
    from gpu_worker.batching import BatchLoop, BatchSettings

    url = sentinel.url()
    cli = CliRunner()
    with sentinel.master.client() as admin:
        admin.function_flush()
    loaded = cli.invoke(app, ["functions", "load", "--redis", url])
    assert loaded.exit_code == 0 and "loaded the microbatch library" in loaded.output
    keys = ModelKeys("echo", prefix)

    async def serve_and_call() -> list[object]:
        transport = RedisTransport(url)
        loop = BatchLoop(lambda items: items, transport, keys, "w-1", BatchSettings(block_ms=50))
        serving = asyncio.ensure_future(loop.run())
        try:
            streamer = Streamer("echo", redis_url=url, prefix=prefix, wait_for_workers=True)
            outputs: list[object] = await streamer.apredict(["a", "b"], timeout=10)
            await streamer.aclose()
            return outputs
        finally:
            loop.stop()
            await serving
            await transport.close()

    assert asyncio.run(serve_and_call()) == ["a", "b"]
    status = cli.invoke(app, ["status", "--redis", url, "--prefix", prefix, "--json"])
    assert status.exit_code == 0, status.output
    (model,) = json.loads(status.output)
    assert (model["model"], model["stream_length"], model["pending"]) == ("echo", 0, 0)
    with sentinel.master.client() as admin:
        admin.xadd(keys.dead_letters, {"id": "x", "dead_reason": "test", "data": b"123"})
    letters = cli.invoke(app, ["dead-letters", "list", "--name", "echo", "--prefix", prefix,
                               "--redis", url, "--json"])  # fmt: skip
    assert letters.exit_code == 0 and json.loads(letters.output)[0]["reason"] == "test"
    bad = cli.invoke(app, ["status", "--redis", "redis+sentinel://s1:26379"])
    assert bad.exit_code == 2 and "names no service" in bad.output
    # a service name the sentinels do not know: one short line naming each sentinel's answer
    # (it quoted the repr of each sentinel's client, connection pool and options: ~1 KB)
    typo = cli.invoke(app, ["status", "--redis", url.replace(f"/{SERVICE}/", "/nosuch/")])
    (port,) = sentinel.sentinel_ports
    assert typo.exit_code == 1 and len(typo.output) < 200, typo.output
    assert f"sentinel 127.0.0.1:{port}: names no up master of 'nosuch'" in typo.output
