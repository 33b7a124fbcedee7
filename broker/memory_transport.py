"""An in-process transport with the semantics of the Redis one (for LocalStreamer and tests).

All its methods must be called from one event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence

from . import partitions
from .busy_poll import busy_poll
from .errors import MicrobatchError, QueueFull
from .keys import NORMAL, ModelKeys
from .priorities import LevelTurns
from .protocol import CallRequests, Fields
from .transport import Entry, QueueBound, Redelivery, entry_data_size


class _Stream:
    def __init__(self) -> None:
        self.new: deque[Entry] = deque()
        self.pending: dict[str, Fields] = {}
        self.withdrawn: set[str] = set()
        self.queued_bytes = 0
        self.changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self.new) + len(self.pending)


class _List:
    def __init__(self) -> None:
        self.items: deque[bytes] = deque()
        self.changed = asyncio.Condition()


class InMemoryTransport:
    """:class:`broker.transport.Transport` inside one process: no Redis, same behaviour."""

    clock_epoch = 0  # one clock, this process's

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._lists: dict[str, _List] = {}
        self._last_ms = 0
        self._seq = 0
        # Entry ids and time_ms() read one clock: the wall clock as of now, run on by the
        # monotonic one, so that a step of the wall clock moves no deadline.
        self._base_ms = time.time() * 1000 - time.monotonic() * 1000
        self.dead: dict[str, list[tuple[Entry, str]]] = {}
        self.partition_counts: dict[str, int] = {}  # by ModelKeys.partitions_key
        self.cancellations_pending = True
        self._turns: dict[tuple[str, str], LevelTurns] = {}

    def _stream(self, key: str) -> _Stream:
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream()
        return stream

    def _list(self, key: str) -> _List:
        found = self._lists.get(key)
        if found is None:
            found = self._lists[key] = _List()
        return found

    def _now_ms(self) -> int:
        return int(self._base_ms + time.monotonic() * 1000)

    def _next_id(self) -> str:
        now = self._now_ms()
        if now > self._last_ms:
            self._last_ms, self._seq = now, 0
        else:
            self._seq += 1
        return f"{self._last_ms}-{self._seq}"

    async def enqueue(
        self, keys: ModelKeys, calls: Sequence[CallRequests], bound: QueueBound
    ) -> list[list[str] | MicrobatchError]:
        target = self._stream(keys.stream)
        outcomes: list[list[str] | MicrobatchError] = []
        for call in calls:
            entries = call.entry_fields()
            size = call.data_size
            if bound.max_items and len(target) + len(entries) > bound.max_items:
                outcomes.append(QueueFull(f"queue is at its bound of {bound.max_items} items"))
                continue
            if bound.max_bytes and target.queued_bytes + size > bound.max_bytes:
                outcomes.append(QueueFull(f"queue is at its bound of {bound.max_bytes} bytes"))
                continue
            ids = []
            for fields in entries:
                encoded = {
                    key.encode(): value if isinstance(value, bytes) else value.encode()
                    for key, value in fields.items()
                }
                ids.append(self._next_id())
                target.new.append((ids[-1], encoded))
            target.queued_bytes += size
            outcomes.append(ids)
        # A worker of a partitioned queue waits on partition 0's stream for all of them.
        for woken in {id(s): s for s in (target, self._stream(keys.of(0).stream))}.values():
            async with woken.changed:
                woken.changed.notify_all()
        return outcomes

    async def partition_count(self, keys: ModelKeys) -> int:
        return self.partition_counts.get(keys.partitions_key, 1)

    async def cancel(
        self,
        keys: ModelKeys,
        entries: Sequence[tuple[str, int]],
        request_ids: Sequence[str] = (),
    ) -> None:  # (no pipelines in one process: request ids are not needed)
        source = self._stream(keys.stream)
        withdrawn = {entry_id for entry_id, _ in entries}
        for entry_id, fields in source.new:
            if entry_id in withdrawn:
                source.queued_bytes -= entry_data_size(fields)
        source.new = deque(entry for entry in source.new if entry[0] not in withdrawn)
        for entry_id, _ in entries:  # read ahead by the worker: it skips them
            if entry_id in source.pending:
                source.withdrawn.add(entry_id)

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        replies = self._list(inbox)
        if not replies.items:
            async with replies.changed:
                try:
                    await asyncio.wait_for(replies.changed.wait(), timeout_s)
                except asyncio.TimeoutError:
                    return []
        out: list[bytes] = []
        while replies.items and len(out) < count:
            out.append(replies.items.popleft())
        return out

    async def ensure_group(self, keys: ModelKeys) -> None:
        for part in keys.lanes():
            self._stream(part.stream)

    async def check_functions(self) -> None:
        return None  # nothing to load in-process

    async def read_batch(
        self, keys: ModelKeys, consumer: str, count: int, block_ms: int, busy_poll_s: float = 0.0
    ) -> list[Entry]:
        lanes = keys.lanes()
        sources = [self._stream(part.stream) for part in lanes]
        if not any(source.new for source in sources) and busy_poll_s > 0:
            await busy_poll(lambda: any(source.new for source in sources), busy_poll_s)
        if not any(source.new for source in sources):
            waited = sources[0]  # enqueues to any lane wake it
            async with waited.changed:
                try:
                    await asyncio.wait_for(waited.changed.wait(), max(1, block_ms) / 1000)
                except asyncio.TimeoutError:
                    return []
        turns = self._turns.setdefault((keys.stream, consumer), LevelTurns())
        batch: list[Entry] = []
        normal_taken = 0
        for level in turns.order():  # each level's lanes oldest first, over every partition
            while len(batch) < count:
                heads = [
                    (self._age(s.new[0][0]), k)
                    for k, s in enumerate(sources)
                    if s.new and lanes[k].level == level
                ]
                if not heads:
                    break
                k = min(heads)[1]
                entry_id, fields = sources[k].new.popleft()
                sources[k].pending[entry_id] = fields
                batch.append((partitions.tag(entry_id, lanes[k].lane), fields))
                normal_taken += level == NORMAL
        waiting = any(s.new for k, s in enumerate(sources) if lanes[k].level == NORMAL)
        if batch:
            turns.took(normal_taken, waiting)
        return batch

    @staticmethod
    def _age(entry_id: str) -> tuple[int, int]:
        ms, _, seq = entry_id.partition("-")
        return int(ms), int(seq)

    async def read_rest(self, keys: ModelKeys, consumer: str, count: int) -> list[Entry]:
        return []  # a read hands out all it takes

    async def finish(
        self,
        keys: ModelKeys,
        replies: Sequence[tuple[str, bytes]],
        entries: Sequence[Entry],
        reply_ttl_s: int,
        check: Sequence[str] = (),
    ) -> set[str]:
        touched = set()
        for key, payload in replies:
            self._list(key).items.append(payload)
            touched.add(key)
        for key in touched:
            changed = self._lists[key].changed
            async with changed:
                changed.notify_all()
        self._remove(keys, entries)
        if check:
            # Callers share this loop with the worker, whose model just blocked it: let their
            # queued cancellations (a callback, then the task it starts) land before answering.
            for _ in range(3):
                await asyncio.sleep(0)
        self.cancellations_pending = any(
            self._stream(part.stream).withdrawn for part in keys.lanes()
        )
        return self._withdrawn(keys, check)

    async def withdrawn(self, keys: ModelKeys, entry_ids: Sequence[str]) -> set[str]:
        return self._withdrawn(keys, entry_ids)

    def _withdrawn(self, keys: ModelKeys, entry_ids: Sequence[str]) -> set[str]:
        out = set()
        for entry_id in entry_ids:
            stream_id, partition = partitions.untag(entry_id)
            if stream_id in self._stream(keys.of(partition).stream).withdrawn:
                out.add(entry_id)
        return out

    def _remove(self, keys: ModelKeys, entries: Sequence[Entry]) -> None:
        for partition, part in partitions.group(entries).items():
            source = self._stream(keys.of(partition).stream)
            for entry_id, fields in part:
                source.withdrawn.discard(entry_id)
                if source.pending.pop(entry_id, None) is not None:
                    source.queued_bytes -= entry_data_size(fields)

    async def reclaim(
        self, keys: ModelKeys, consumer: str, min_idle_ms: int, count: int, own: bool = False
    ) -> list[Redelivery]:
        return []  # one process, one consumer: nobody else's entries to take over

    async def dead_letter(self, keys: ModelKeys, entries: Sequence[Entry], reason: str) -> None:
        for partition, part in partitions.group(entries).items():
            dead = self.dead.setdefault(keys.of(partition).dead_letters, [])
            dead.extend((entry, reason) for entry in part)
        self._remove(keys, entries)

    async def workers_lapsed_s(self, keys: ModelKeys) -> float | None:
        return 0.0  # the batch loop in this process is the model's worker

    async def time_ms(self) -> int:
        return self._now_ms()

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
