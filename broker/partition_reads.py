"""A worker's reads of a partitioned queue: one XREADGROUP per partition, merged.

Streams in different hash slots cannot share one XREADGROUP, and a blocked XREADGROUP cannot
be called back once sent (Redis may deliver entries to it at any moment, and they are then
pending for this consumer). So each partition has at most one read in flight, on a connection
of its own, and what any read brings is kept here, oldest first (by the time in its entry id),
until the batch loop takes it: a batch never exceeds what it asked for, and nothing a read
delivered is dropped. New reads start only when less than a batch is kept, so a worker holds
at most about one batch per partition that it has not started on. What is kept is taken high
priority first (each partition's read already orders its levels, :mod:`broker.priorities`),
then oldest first.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
from collections.abc import Awaitable, Callable

from .keys import MAX_PARTITIONS
from .partitions import is_high, untag
from .protocol import entry_time_ms
from .transport import Entry

ReadOne = Callable[[int, int, int, float], Awaitable[list[Entry]]]
"""Read one partition: (partition, count, block ms, busy-poll s) -> its entries (ids tagged
with their lane, :mod:`broker.partitions`)."""


class PartitionReads:
    """The reads of every partition of one model's queue for one consumer."""

    def __init__(self, partitions: int, read: ReadOne) -> None:
        self.partitions = partitions
        self._read = read
        self._inflight: dict[int, asyncio.Task[None]] = {}
        # a heap: (normal level?, entry time, order, entry)
        self._kept: list[tuple[bool, int, int, Entry]] = []
        self._order = 0
        self._arrived = asyncio.Event()
        self._error: BaseException | None = None

    async def take(self, count: int, block_ms: int, busy_poll_s: float = 0.0) -> list[Entry]:
        """Up to ``count`` entries, oldest first: at once if any are kept, else waiting up to
        ``block_ms`` for any partition's read to bring some. A read that failed raises its
        error here (BrokerUnavailable), once."""
        if len(self._kept) < count:
            for partition in range(self.partitions):
                if partition not in self._inflight:
                    self._start(partition, count, block_ms, busy_poll_s)
        if not self._kept and self._error is None:
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), max(1, block_ms) / 1000)
        if self._error is not None:
            # What is kept is pending for this consumer: the batch loop takes its own pending
            # entries back after an outage, so keeping them too would run them twice.
            error, self._error = self._error, None
            self._kept.clear()
            raise error
        taken: list[Entry] = []
        while self._kept and len(taken) < count:
            taken.append(heapq.heappop(self._kept)[3])
        return taken

    async def rest(self, count: int) -> list[Entry]:
        """Up to ``count`` of what the reads brought, once those in flight have ended (within
        their block time); no new read is sent. For a consumer that stops: what Redis
        delivered to it is answered, rather than left pending until others take it over
        (counted as one more delivery)."""
        while self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        self._error = None  # what failed delivered nothing
        taken: list[Entry] = []
        while self._kept and len(taken) < count:
            taken.append(heapq.heappop(self._kept)[3])
        return taken

    def _start(self, partition: int, count: int, block_ms: int, busy_poll_s: float) -> None:
        task = asyncio.get_running_loop().create_task(
            self._run(partition, count, block_ms, busy_poll_s)
        )
        self._inflight[partition] = task

    async def _run(self, partition: int, count: int, block_ms: int, busy_poll_s: float) -> None:
        try:
            entries = await self._read(partition, count, block_ms, busy_poll_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the next take()
            self._error = exc
            entries = []
        finally:
            self._inflight.pop(partition, None)
        for entry in entries:
            self._order += 1
            entry_id = entry[0]
            heapq.heappush(
                self._kept, (not is_high(entry_id), entry_time_ms(entry_id), self._order, entry)
            )
        if entries or self._error is not None:
            self._arrived.set()

    def forget(self, partition: int) -> None:
        """Drop what reads of ``partition`` (either level) brought and was not taken: it stays
        pending for this consumer, taken back later as its own."""
        kept = [item for item in self._kept if untag(item[3][0])[1] % MAX_PARTITIONS != partition]
        if len(kept) != len(self._kept):
            heapq.heapify(kept)
            self._kept = kept

    def held(self) -> list[str]:
        """The ids of the entries kept (read, not yet taken)."""
        return [entry[0] for *_, entry in self._kept]

    async def close(self) -> None:
        """Cancel the reads in flight (what Redis delivers to them stays pending for this
        consumer, and is taken over once it is no longer vouched for)."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
