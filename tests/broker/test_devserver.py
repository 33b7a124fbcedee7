"""The development Redis the tests, the demo and the benchmarks start: a port taken between
being picked and being bound is traded for another, a restart keeps its port; free ports are
picked where outgoing connections do not take theirs, and never twice."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import redis

from broker import devserver
from broker.devserver import RedisServer, free_port


def test_a_picked_port_taken_meanwhile_is_traded_for_another_and_a_restart_keeps_it() -> None:
    with RedisServer() as first:
        second = RedisServer()
        second.port = first.port  # as if another process bound the port picked for it
        with second:
            assert second.port != first.port
            assert second.client().info("server")["process_id"] == second.process.pid  # type: ignore[union-attr]
            assert first.client().info("server")["process_id"] == first.process.pid  # type: ignore[union-attr]
            port = second.port
            second.kill()
            second.start()
            assert second.port == port
            assert second.client().ping()


def test_a_port_given_and_taken_is_an_error_naming_it() -> None:
    with RedisServer() as first:
        with pytest.raises(RuntimeError, match=f"did not start on port {first.port}"):
            RedisServer(port=first.port).start()
        assert first.client().ping()  # the server that holds the port is left alone


def test_free_ports_lie_below_the_ephemeral_range_differ_and_bind() -> None:
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(devserver.LOWEST_PICKED_PORT <= port < start for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_a_bound_port_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        picks = iter([port - devserver.LOWEST_PICKED_PORT, 0, 1, 2, 3])
        monkeypatch.setattr(devserver, "_ephemeral_start", lambda: 65536)
        monkeypatch.setattr(devserver._chance, "randrange", lambda _: next(picks))
        assert free_port() != port


def test_without_room_below_the_ephemeral_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(devserver, "_ephemeral_start", lambda: devserver.LOWEST_PICKED_PORT)
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    assert all(port > 0 for port in ports)


def test_a_forked_child_does_not_pick_its_parents_next_ports() -> None:
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ports, to the parent
        os.write(writer, json.dumps([free_port() for _ in range(5)]).encode())
        os._exit(0)
    os.close(writer)
    os.waitpid(pid, 0)
    with os.fdopen(reader) as pipe:
        child = json.loads(pipe.read())
    assert set(child).isdisjoint(free_port() for _ in range(5))


def test_a_server_told_to_require_a_password_starts_and_asks_for_it() -> None:
    """redis-py 8 answers a password-protected server's NOAUTH as an AuthenticationError (a
    connection error): the start-up wait took it for a server not listening yet."""
    with RedisServer({"requirepass": "pw"}) as server:
        assert server.client(password="pw").ping()
        with pytest.raises(redis.AuthenticationError):
            server.client().ping()
