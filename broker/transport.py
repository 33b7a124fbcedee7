"""The transport interface: the Redis operations both ends need, as a small async protocol.

:class:`broker.redis_transport.RedisTransport` implements it over Redis Streams; the in-memory
transport of ``gpu_worker`` implements the same semantics inside one process, so the client and
the batch loop are written once and run over either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from .protocol import Fields

Entry = tuple[str, Fields]
"""A stream entry as the worker reads it: (entry id, fields)."""


class Transport(Protocol):
    """What the client and the batch loop need from a message broker.

    Every method raises :class:`broker.errors.BrokerUnavailable` when the broker cannot be reached.
    """

    # -- caller side ----------------------------------------------------------------------
    async def enqueue(self, stream: str, entries: Sequence[Mapping[str, str | bytes]]) -> None:
        """Append entries to a stream, in order (one round trip where the broker allows)."""
        ...

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        """Wait up to ``timeout_s`` for replies on ``inbox``; return up to ``count`` of them."""
        ...

    # -- worker side ----------------------------------------------------------------------
    async def ensure_group(self, stream: str, group: str) -> None:
        """Create the stream and its consumer group if missing."""
        ...

    async def read_batch(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int
    ) -> list[Entry]:
        """Read up to ``count`` new entries for ``consumer``, waiting up to ``block_ms`` (>= 1)."""
        ...

    async def finish(
        self,
        stream: str,
        group: str,
        replies: Sequence[tuple[str, bytes]],
        entry_ids: Sequence[str],
        reply_ttl_s: int,
    ) -> None:
        """Push each (reply key, reply) with a TTL, then acknowledge and delete the entries."""
        ...

    async def dead_letter(
        self, stream: str, group: str, dead_stream: str, entries: Sequence[Entry], reason: str
    ) -> None:
        """Copy entries to the dead-letter stream with a reason, then ack and delete them."""
        ...

    async def time_ms(self) -> int:
        """The broker's clock, in ms since the epoch (stream ids are stamped with it)."""
        ...

    async def ping(self) -> bool:
        """True if the broker answers."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
