"""Pack Redis commands in C (hiredis) on redis-py's asyncio connections: the cold path.

Every asyncio client that :func:`broker.connections.async_client` makes gets it: what the
transport sends through redis-py (consumer groups, reclaims and takeovers, INFO, PING) and the
gateway's health checks. The hot path (submitting, reading batches, replies) does not come here:
:mod:`broker.resp_lane` packs its commands with hiredis itself.

redis-py's synchronous client packs with ``hiredis.pack_command`` when hiredis is installed,
but its asyncio connections always pack in Python (about a microsecond per argument).
:func:`use_hiredis_packing` swaps in the C packer, keeping whatever connection class (TCP, TLS,
unix socket, Sentinel) the URL chose.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import DataError

hiredis: Any
try:
    import hiredis
except ImportError:  # pragma: no cover - hiredis is a dependency; plain redis-py still works
    hiredis = None


def _pack(args: tuple[Any, ...]) -> bytes:
    if isinstance(args[0], str):  # "CONFIG GET": the server expects separate arguments
        args = tuple(args[0].encode().split()) + args[1:]
    elif b" " in args[0]:
        args = tuple(args[0].split()) + args[1:]
    if any(isinstance(arg, (bytearray, memoryview)) for arg in args):
        args = tuple(bytes(a) if isinstance(a, (bytearray, memoryview)) else a for a in args)
    try:
        packed: bytes = hiredis.pack_command(args)
    except TypeError as exc:
        raise DataError(str(exc)).with_traceback(sys.exc_info()[2]) from None
    return packed


_CLASSES: dict[type, type] = {}


def _with_hiredis_packing(base: type) -> type:
    if base in _CLASSES or base in _CLASSES.values():
        return _CLASSES.get(base, base)

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        return [_pack(args)]

    def pack_commands(self: Any, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        return [b"".join(_pack(tuple(command)) for command in commands)]

    methods = {"pack_command": pack_command, "pack_commands": pack_commands}
    fast = _CLASSES[base] = type(base.__name__, (base,), methods)
    return fast


def use_hiredis_packing(client: aioredis.Redis) -> aioredis.Redis:
    """Make ``client``'s future connections pack commands with hiredis (a no-op without it)."""
    if hiredis is not None and hasattr(hiredis, "pack_command"):
        pool = client.connection_pool
        pool.connection_class = _with_hiredis_packing(pool.connection_class)
    return client
