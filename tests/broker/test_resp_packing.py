"""Commands packed by hiredis on asyncio connections: byte for byte what redis-py packs."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from broker.resp_packing import use_hiredis_packing

COMMANDS = [
    ("PING",),
    ("CONFIG GET", "maxmemory"),  # a two-word command name
    (b"XACK", "mb:{p:m}:requests", "workers", "1-0", "2-0"),
    ("RPUSH", "inbox", b"\x00\xff" * 5000, b"x" * 7000, memoryview(b"view"), bytearray(b"ba")),
    ("EXPIRE", "inbox", 60),
    ("ZADD", "z", 1.5, "member"),
    ("SET", "kéy", "välue"),
]


def test_packed_commands_match_redis_pys_own_packing() -> None:
    plain = Connection()
    fast = use_hiredis_packing(aioredis.Redis()).connection_pool.connection_class()
    assert type(fast) is not Connection and isinstance(fast, Connection)
    for command in COMMANDS:
        assert b"".join(fast.pack_command(*command)) == b"".join(plain.pack_command(*command))
    assert b"".join(fast.pack_commands(COMMANDS)) == b"".join(plain.pack_commands(COMMANDS))


def test_values_redis_cannot_take_are_refused_as_redis_py_refuses_them() -> None:
    fast = use_hiredis_packing(aioredis.Redis()).connection_pool.connection_class()
    with pytest.raises(DataError):
        fast.pack_command("SET", "k", None)


def test_tls_and_unix_socket_urls_keep_their_connection_class() -> None:
    for url, base in [("rediss://h:1/0", "SSLConnection"), ("unix:///tmp/r.sock", "UnixDomain")]:
        client = use_hiredis_packing(aioredis.Redis.from_url(url))
        cls = client.connection_pool.connection_class
        assert any(parent.__name__.startswith(base) for parent in cls.__mro__[1:])
