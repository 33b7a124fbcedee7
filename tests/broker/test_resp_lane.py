"""The lean hot-path connection against a real redis-server: replies, errors, pipelines, blocking
commands, reconnecting, AUTH/SELECT and unix sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from broker import resp_lane
from broker.devserver import RedisServer
from broker.resp_lane import RespLane

# A command Redis takes 0.2 s to answer (DEBUG SLEEP is disabled by default in Redis 7).
BUSY_FOR_200_MS = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start > 200000
return 1
"""


def key() -> str:
    return f"lane:{uuid.uuid4().hex[:8]}"


def test_commands_return_raw_replies_and_error_replies_raise(redis_server: RedisServer) -> None:
    async def main() -> None:
        lane, k = RespLane(redis_server.url), key()
        assert await lane.execute("SET", k, b"\x00\xff") == b"OK"
        assert await lane.execute("GET", k) == b"\x00\xff"
        assert await lane.execute("RPUSH", k + "l", 1, 2.5, "x") == 3
        assert await lane.execute("LRANGE", k + "l", 0, -1) == [b"1", b"2.5", b"x"]
        assert await lane.execute("GET", "lane:missing") is None
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await lane.execute("LPUSH", k, "v")
        assert await lane.execute("GET", k) == b"\x00\xff"  # the lane still works
        lane.close()

    asyncio.run(main())


def test_pipeline_replies_come_in_order_with_errors_in_place(redis_server: RedisServer) -> None:
    async def main() -> None:
        lane, k = RespLane(redis_server.url), key()
        replies = await lane.pipeline([("SET", k, "a"), ("LPUSH", k, "x"), ("GET", k), ("PING",)])
        assert replies[0] == b"OK" and replies[2] == b"a" and replies[3] == b"PONG"
        assert isinstance(replies[1], ResponseError)
        assert await lane.pipeline([]) == []
        lane.close()

    asyncio.run(main())


def test_concurrent_callers_on_one_lane_each_get_their_own_reply(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        lane, k = RespLane(redis_server.url), key()

        async def one(i: int) -> tuple[int, object]:
            if i % 3 == 0:
                return i, await lane.pipeline([("INCR", f"{k}:{i}"), ("ECHO", str(i))])
            return i, await lane.execute("ECHO", str(i))

        results = await asyncio.gather(*(one(i) for i in range(300)))
        for i, reply in results:
            assert reply == ([1, str(i).encode()] if i % 3 == 0 else str(i).encode())
        lane.close()

    asyncio.run(main())


def test_a_blocking_command_returns_at_its_timeout_or_with_data(redis_server: RedisServer) -> None:
    async def main() -> None:
        lane, other, k = RespLane(redis_server.url), RespLane(redis_server.url), key()
        assert await lane.execute_blocking(0.05, "BLPOP", k, 0.05) is None
        waiting = asyncio.ensure_future(lane.execute_blocking(5, "BLPOP", k, 5))
        await asyncio.sleep(0.05)
        await other.execute("RPUSH", k, "v")
        assert await waiting == [k.encode(), b"v"]
        lane.close()
        other.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "push_after_s, busy_poll_s",
    [(0.01, 2.0), (0.15, 0.05)],
    ids=["data-while-polling", "data-after-the-poll"],
)
def test_a_busy_polled_blocking_command_gets_data_sent_during_or_after_the_poll(
    redis_server: RedisServer, push_after_s: float, busy_poll_s: float
) -> None:
    async def main() -> float:
        lane, other, k = RespLane(redis_server.url), RespLane(redis_server.url), key()
        # The push is made by this same event loop: it runs only if polling leaves it free.
        pushing = asyncio.get_running_loop().call_later(
            push_after_s, lambda: asyncio.ensure_future(other.execute("RPUSH", k, "v"))
        )
        started = time.monotonic()
        reply = await lane.execute_blocking(5, "BLPOP", k, 5, busy_poll_s=busy_poll_s)
        assert reply == [k.encode(), b"v"]
        pushing.cancel()
        lane.close()
        other.close()
        return time.monotonic() - started

    # well before the 2 s poll would end: polling did not hold the loop up
    assert asyncio.run(main()) < 1.5


def test_a_cancelled_blocking_command_does_not_hold_up_the_next(redis_server: RedisServer) -> None:
    async def main() -> None:
        lane, other, k = RespLane(redis_server.url), RespLane(redis_server.url), key()
        waiting = asyncio.ensure_future(lane.execute_blocking(30, "BLPOP", k, 30))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        started = time.monotonic()
        assert await asyncio.wait_for(lane.execute("PING"), 5) == b"PONG"
        assert time.monotonic() - started < 5
        # The cancelled BLPOP no longer waits in Redis: it cannot swallow this value.
        await asyncio.sleep(0.05)
        await other.execute("RPUSH", k, "kept")
        assert await other.execute("LRANGE", k, 0, -1) == [b"kept"]
        lane.close()
        other.close()

    asyncio.run(main())


def test_a_connection_killed_by_the_server_is_replaced(redis_server: RedisServer) -> None:
    async def main() -> None:
        lane = RespLane(redis_server.url)
        client_id = await lane.execute("CLIENT", "ID")
        admin = redis_server.client()
        assert admin.client_kill_filter(_id=client_id) == 1
        admin.close()
        await asyncio.sleep(0.05)
        assert await lane.execute("PING") == b"PONG"
        assert await lane.execute("CLIENT", "ID") != client_id
        lane.close()

    asyncio.run(main())


def test_commands_in_flight_fail_when_redis_dies_and_work_once_it_is_back() -> None:
    server = RedisServer().start()
    try:

        async def main() -> None:
            lane = RespLane(server.url)
            waiting = asyncio.ensure_future(lane.execute_blocking(30, "BLPOP", key(), 30))
            await asyncio.sleep(0.05)
            await asyncio.get_running_loop().run_in_executor(None, server.kill)
            with pytest.raises(RedisConnectionError):
                await asyncio.wait_for(waiting, 5)
            with pytest.raises(RedisConnectionError):
                await lane.execute("PING")  # nobody listens on the port
            await asyncio.get_running_loop().run_in_executor(None, server.start)
            assert await lane.execute("PING") == b"PONG"
            lane.close()

        asyncio.run(main())
    finally:
        server.stop()


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never answers (a hung or half-open peer)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    yield listener.getsockname()[1]
    listener.close()


def test_a_blocking_command_with_no_reply_past_its_grace_drops_the_connection(
    silent_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resp_lane, "BLOCKING_GRACE_S", 0.2)

    async def main() -> None:
        lane = RespLane(f"redis://127.0.0.1:{silent_server}/0")
        started = time.monotonic()
        with pytest.raises(RedisConnectionError, match="no reply"):
            await lane.execute_blocking(0.1, "BLPOP", "k", 0.1)
        assert time.monotonic() - started < 5
        lane.close()

    asyncio.run(main())


def test_user_password_and_database_come_from_the_url(redis_server: RedisServer) -> None:
    admin = redis_server.client()
    user = f"lane{uuid.uuid4().hex[:6]}"
    admin.acl_setuser(user, enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])
    k = key()
    try:

        async def main() -> None:
            url = f"redis://{user}:s3cret@127.0.0.1:{redis_server.port}/3"
            lane = RespLane(url)
            assert await lane.execute("ACL", "WHOAMI") == user.encode()
            await lane.execute("SET", k, "in db 3")
            lane.close()
            with pytest.raises(AuthenticationError):
                await RespLane(f"redis://{user}:wrong@127.0.0.1:{redis_server.port}/0").execute(
                    "PING"
                )

        asyncio.run(main())
        assert redis_server.client(db=3).get(k) == b"in db 3"
        assert redis_server.client(db=0).get(k) is None
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_a_password_for_a_redis_without_one_is_let_in_as_redis_py_lets_it(
    redis_server: RedisServer,
) -> None:
    """``redis://:pw@...`` to a Redis whose default user needs no password: redis-py logs in
    (its HELLO sends ``AUTH default pw``, which Redis accepts), so the supervisor, the gateway's
    readiness and `broker status` all work; the lane must too, or a worker looks ready yet
    reads nothing and every call fails with ``ERR AUTH <password> called without any
    password configured``."""
    url = f"redis://:not-needed@127.0.0.1:{redis_server.port}/0"
    assert redis_server.client(password="not-needed").ping()

    async def main() -> None:
        lane = RespLane(url)
        assert await lane.execute("PING") == b"PONG"
        assert await lane.execute("ACL", "WHOAMI") == b"default"
        lane.close()

    asyncio.run(main())


def test_unix_socket_urls_connect_over_the_socket() -> None:
    path = os.path.join(tempfile.mkdtemp(prefix="microbatch-lane-"), "redis.sock")
    with RedisServer({"unixsocket": path, "unixsocketperm": "700"}):

        async def main() -> None:
            lane = RespLane(f"unix://{path}?db=2")
            assert await lane.execute("PING") == b"PONG"
            info = await lane.execute("CLIENT", "INFO")
            assert b"db=2" in info and b"addr=/" in info
            lane.close()

        asyncio.run(main())


def test_a_lane_moves_to_a_new_event_loop(redis_server: RedisServer) -> None:
    lane = RespLane(redis_server.url)
    assert asyncio.run(lane.execute("PING")) == b"PONG"
    assert asyncio.run(lane.execute("PING")) == b"PONG"  # a new loop: a new connection
    lane.close()


def test_tls_urls_get_a_tls_context_from_redis_pys_url_options() -> None:
    lane = RespLane("rediss://cache.example:6380/0?ssl_cert_reqs=none")
    assert isinstance(lane._ssl, ssl.SSLContext) and lane._ssl.verify_mode == ssl.CERT_NONE
    assert (lane._host, lane._port, lane._path) == ("cache.example", 6380, None)
    assert RespLane("redis://h:1/0")._ssl is None


def test_a_tls_url_to_a_plain_text_port_says_that_port_may_not_speak_tls(
    redis_server: RedisServer,
) -> None:
    """A plain-text Redis waits for a command while a TLS client waits for its hello: all an
    operator saw was a connect timeout."""
    url = f"rediss://127.0.0.1:{redis_server.port}/0?ssl_cert_reqs=none"

    async def main() -> None:
        lane = RespLane(url, connect_timeout_s=0.5)
        with pytest.raises(RedisTimeoutError, match=r"with TLS: does that port speak TLS\?"):
            await lane.execute("PING")
        lane.close()

    asyncio.run(main())


def test_commands_left_unanswered_past_the_reply_timeout_drop_the_connection(
    silent_server: int,
) -> None:
    async def main() -> None:
        lane = RespLane(f"redis://127.0.0.1:{silent_server}/0", reply_timeout_s=0.2)
        started = time.monotonic()
        with pytest.raises(RedisConnectionError, match="no reply"):
            await lane.execute("PING")
        assert time.monotonic() - started < 5
        lane.close()

    asyncio.run(main())


def test_a_slow_command_that_answers_within_the_reply_timeout_is_fine(
    redis_server: RedisServer,
) -> None:
    async def main() -> None:
        lane = RespLane(redis_server.url, reply_timeout_s=0.5)
        # Quiet spells longer than the timeout, with nothing waiting, are no reason to drop it.
        assert await lane.execute("PING") == b"PONG"
        await asyncio.sleep(1.0)
        assert await lane.execute("EVAL", BUSY_FOR_200_MS, 0) == 1
        lane.close()

    asyncio.run(main())


def test_tcp_connections_probe_idle_peers_within_seconds(redis_server: RedisServer) -> None:
    # Firewalls and NAT gateways drop idle connections silently; keepalive probes every few
    # seconds keep them and notice a peer that is gone (the kernel's default waits two hours).
    async def main() -> dict[int, int]:
        lane = RespLane(redis_server.url)
        await lane.execute("PING")
        assert lane._protocol is not None and lane._protocol.transport is not None
        sock = lane._protocol.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
        got = {option: sock.getsockopt(socket.IPPROTO_TCP, option) for option in expected}
        lane.close()
        return got

    expected = resp_lane.keepalive_options()
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux: all three
        assert expected[socket.TCP_KEEPIDLE] == resp_lane.KEEPALIVE_IDLE_S
        assert expected[socket.TCP_KEEPINTVL] == resp_lane.KEEPALIVE_INTERVAL_S
        assert expected[socket.TCP_KEEPCNT] == resp_lane.KEEPALIVE_PROBES
    assert asyncio.run(main()) == expected

    # redis-py's connections (the cold path) get the same
    from broker.redis_transport import connect

    async def cold_path() -> dict[int, int]:
        client = connect(redis_server.url)
        await client.ping()
        connection = await client.connection_pool.get_connection()
        try:
            sock = connection._writer.transport.get_extra_info("socket")
            return {option: sock.getsockopt(socket.IPPROTO_TCP, option) for option in expected}
        finally:
            await client.connection_pool.release(connection)
            await client.aclose()

    assert asyncio.run(cold_path()) == expected


def test_a_redis_at_maxclients_is_a_connection_error_saying_so_until_a_client_leaves() -> None:
    """Redis at ``maxclients`` accepts a connection, answers ``ERR max number of clients
    reached`` and closes it: a connection error that says so (as redis-py's is), with or
    without a handshake, not a bad file descriptor, a protocol error or a wrong password."""
    with RedisServer() as server:
        admin = server.client()
        admin.config_set("requirepass", "pw")
        admin.config_set("maxclients", 2)
        holder = server.client(password="pw")
        holder.ping()  # two clients: the server takes no more

        async def main() -> None:
            handshake = RespLane(f"redis://:pw@127.0.0.1:{server.port}/1")
            no_handshake = RespLane(f"redis://127.0.0.1:{server.port}/0")
            for lane in (handshake, no_handshake):
                for _ in range(3):
                    with pytest.raises(RedisConnectionError, match="max number of clients"):
                        await lane.execute("PING")
                    with pytest.raises(RedisConnectionError, match="max number of clients"):
                        await lane.pipeline([("PING",), ("PING",)])
            await asyncio.to_thread(holder.close)
            assert await handshake.execute("PING") == b"PONG"
            handshake.close()
            no_handshake.close()

        asyncio.run(main())
        admin.close()
