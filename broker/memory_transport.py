"""An in-process transport with the semantics of the Redis one (for LocalStreamer and tests).

All its methods must be called from one event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping, Sequence

from .protocol import Fields
from .transport import Entry


class _Stream:
    def __init__(self) -> None:
        self.new: deque[Entry] = deque()
        self.pending: dict[str, Fields] = {}
        self.changed = asyncio.Condition()


class _List:
    def __init__(self) -> None:
        self.items: deque[bytes] = deque()
        self.changed = asyncio.Condition()


class InMemoryTransport:
    """:class:`broker.transport.Transport` inside one process: no Redis, same behaviour."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._lists: dict[str, _List] = {}
        self._last_ms = 0
        self._seq = 0
        self.dead: dict[str, list[tuple[Entry, str]]] = {}

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

    def _next_id(self) -> str:
        now = int(time.time() * 1000)
        if now > self._last_ms:
            self._last_ms, self._seq = now, 0
        else:
            self._seq += 1
        return f"{self._last_ms}-{self._seq}"

    async def enqueue(self, stream: str, entries: Sequence[Mapping[str, str | bytes]]) -> None:
        target = self._stream(stream)
        for fields in entries:
            encoded = {
                key.encode(): value if isinstance(value, bytes) else value.encode()
                for key, value in fields.items()
            }
            target.new.append((self._next_id(), encoded))
        async with target.changed:
            target.changed.notify_all()

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

    async def ensure_group(self, stream: str, group: str) -> None:
        self._stream(stream)

    async def read_batch(
        self, stream: str, group: str, consumer: str, count: int, block_ms: int
    ) -> list[Entry]:
        source = self._stream(stream)
        if not source.new:
            async with source.changed:
                try:
                    await asyncio.wait_for(source.changed.wait(), max(1, block_ms) / 1000)
                except asyncio.TimeoutError:
                    return []
        batch: list[Entry] = []
        while source.new and len(batch) < count:
            entry = source.new.popleft()
            source.pending[entry[0]] = entry[1]
            batch.append(entry)
        return batch

    async def finish(
        self,
        stream: str,
        group: str,
        replies: Sequence[tuple[str, bytes]],
        entry_ids: Sequence[str],
        reply_ttl_s: int,
    ) -> None:
        touched = set()
        for key, payload in replies:
            self._list(key).items.append(payload)
            touched.add(key)
        for key in touched:
            changed = self._lists[key].changed
            async with changed:
                changed.notify_all()
        source = self._stream(stream)
        for entry_id in entry_ids:
            source.pending.pop(entry_id, None)

    async def dead_letter(
        self, stream: str, group: str, dead_stream: str, entries: Sequence[Entry], reason: str
    ) -> None:
        source = self._stream(stream)
        for entry in entries:
            self.dead.setdefault(dead_stream, []).append((entry, reason))
            source.pending.pop(entry[0], None)

    async def time_ms(self) -> int:
        return int(time.time() * 1000)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
