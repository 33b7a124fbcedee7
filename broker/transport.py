"""The transport interface: the Redis operations both ends need, as a small async protocol.

:class:`broker.redis_transport.RedisTransport` implements it over Redis Streams;
:class:`broker.memory_transport.InMemoryTransport` implements the same semantics inside one
process, so the client and the batch loop are written once and run over either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import BrokerUnavailable, MicrobatchError
from .keys import ModelKeys
from .protocol import CallRequests, Fields

Entry = tuple[str, Fields]
"""A stream entry as the worker reads it: (entry id, fields)."""

Redelivery = tuple[Entry, int]
"""An entry taken over from a dead consumer (or this one's, after an outage) and how many
times it had been delivered before."""


class RepliesRefused(BrokerUnavailable):
    """Redis refused this client's user the read of its replies (an ACL's NOPERM): unlike an
    outage, waiting will not bring them. Travels, and is answered, as BrokerUnavailable."""

    @property
    def type(self) -> str:
        return BrokerUnavailable.__name__


class PartitionsChanged(BrokerUnavailable):
    """A worker's partitioned queue on a Redis Cluster: a partition was set aside (its primary
    stopped answering) or is back. What the worker holds is dropped and its own pending
    entries taken back, as after an outage, and it goes on with the partitions that answer
    (:class:`broker.redis_transport.RedisTransport`)."""


@dataclass(frozen=True)
class QueueBound:
    """Refuse a call whose items would take the queue over either limit (0: no limit)."""

    max_items: int = 0
    max_bytes: int = 0


UNBOUNDED = QueueBound()


class Transport(Protocol):
    """What the client and the batch loop need from a message broker.

    Every method raises :class:`broker.errors.BrokerUnavailable` when the broker cannot be reached.
    """

    cancellations_pending: bool
    """Whether callers had withdrawn entries that workers still held, as of the last finish()."""

    @property
    def clock_epoch(self) -> int:
        """Changes when the server whose clock :meth:`time_ms` reads may have changed (a
        cluster moved the stream's slot to another node): estimates of it are then stale."""
        ...

    # -- caller side ----------------------------------------------------------------------
    async def enqueue(
        self, keys: ModelKeys, calls: Sequence[CallRequests], bound: QueueBound
    ) -> list[list[str] | MicrobatchError]:
        """Append each call's items to the stream of ``keys`` (one partition's), in order, each
        call atomically.

        Returns one outcome per call: the entry ids if queued, :class:`QueueFull` if its items
        would take the queue over ``bound`` (then none of them is queued).
        """
        ...

    async def cancel(
        self,
        keys: ModelKeys,
        entries: Sequence[tuple[str, int]],
        request_ids: Sequence[str] = (),
    ) -> None:
        """Withdraw entries, given as (entry id, data size), whose caller gave up.

        One no worker has read yet is deleted; one a worker holds is marked for it to skip.
        Their ``request_ids`` are marked withdrawn too, for a pipeline's later stages, to
        which an entry's item may have moved on.
        """
        ...

    async def partition_count(self, keys: ModelKeys) -> int:
        """How many partitions the model's queue is spread over, as its workers stored it
        (1 when none is stored)."""
        ...

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        """Wait up to ``timeout_s`` for replies on ``inbox``; return up to ``count`` of them.
        :class:`RepliesRefused` if Redis refuses this user the read."""
        ...

    async def workers_lapsed_s(self, keys: ModelKeys) -> float | None:
        """How long the model has had no live worker: 0.0 while one is live, the seconds since
        the last one's heartbeat lapsed, or None when none is known."""
        ...

    # -- worker side ----------------------------------------------------------------------
    # ``keys`` are the model's (partition 0's) with its partition count: a worker reads every
    # partition, and the ids of the entries it is handed name their partition
    # (:mod:`broker.partitions`), so the methods that take entries find their streams.
    async def ensure_group(self, keys: ModelKeys) -> None:
        """Create the model's stream and its consumer group if missing."""
        ...

    async def check_functions(self) -> None:
        """Make sure the broker runs what a worker needs to answer (over Redis: the microbatch
        functions, loaded here if they are missing and this user may). Raises
        BrokerUnavailable saying what is missing, so that no entry is read meanwhile."""
        ...

    async def read_batch(
        self, keys: ModelKeys, consumer: str, count: int, block_ms: int, busy_poll_s: float = 0.0
    ) -> list[Entry]:
        """Read up to ``count`` new entries for ``consumer``, waiting up to ``block_ms`` (>= 1);
        the first ``busy_poll_s`` of the wait polling, without sleeping."""
        ...

    async def read_rest(self, keys: ModelKeys, consumer: str, count: int) -> list[Entry]:
        """Stopping: up to ``count`` entries that reads for ``consumer`` delivered and
        read_batch has not handed out yet (a partitioned queue's reads in flight are waited
        for, and no new one is sent); empty once there are none."""
        ...

    async def finish(
        self,
        keys: ModelKeys,
        replies: Sequence[tuple[str, bytes]],
        entries: Sequence[Entry],
        reply_ttl_s: int,
        check: Sequence[str] = (),
    ) -> set[str]:
        """Push each (reply key, reply) with a TTL, then acknowledge and delete the entries.

        In the same round trip, return which of the entry ids in ``check`` (of a batch read
        ahead) their callers have withdrawn since, so that they are not computed.
        """
        ...

    async def withdrawn(self, keys: ModelKeys, entry_ids: Sequence[str]) -> set[str]:
        """Which of these entries (held by a worker) their callers have withdrawn."""
        ...

    async def reclaim(
        self, keys: ModelKeys, consumer: str, min_idle_ms: int, count: int, own: bool = False
    ) -> list[Redelivery]:
        """Take over up to ``count`` entries that dead consumers (no heartbeat) were holding.

        With ``own``, take back this consumer's own unacknowledged entries instead (after a
        broker outage). Dead consumers that hold nothing leave the group.
        """
        ...

    async def dead_letter(self, keys: ModelKeys, entries: Sequence[Entry], reason: str) -> None:
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


def counter_value(value: Any) -> int:
    """A counter or bound as Redis holds it (bytes of ASCII digits): 0 where it is absent,
    negative or not a whole number (it is read, never trusted)."""
    try:
        return max(int(value), 0) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def is_data_field(name: Any) -> bool:
    """Whether a stream entry's field holds an item's data (``data``, or ``data.<i>`` of a
    multi-item entry's item i)."""
    return isinstance(name, bytes) and (name == b"data" or name.startswith(b"data."))


def entry_data_size(fields: Mapping[Any, Any]) -> int:
    """Bytes an entry counts for against a queue's byte bound: the size of its data field, or
    of its ``data.<i>`` fields (a multi-item entry released whole, not item by item: one whose
    item count is not one the workers take)."""
    value = fields.get(b"data", fields.get("data"))
    if value is not None:
        return len(value)
    return sum(
        len(value)
        for name, value in fields.items()
        if is_data_field(name) and isinstance(value, bytes)
    )
