"""Preparing a batch: entries read from the stream turned into items the model can take.

Everything read from Redis is untrusted: whatever an entry holds, preparing it fails that
entry alone (a typed error to its caller, or a dead letter when nobody can be told).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker import codec
from broker.errors import CodecError, DeadlineExceeded, InvalidInput
from broker.keys import MAX_PARTITIONS, ModelKeys
from broker.logs import ThrottledWarning
from broker.partitions import untag
from broker.protocol import MalformedEntry, Request, RequestReader, encode_error
from broker.transport import Entry

from .model import ItemCheck
from .observer import BatchObserver
from .outcomes import describe

log = logging.getLogger("microbatch.worker")

# Why an entry with no readable request id or reply key is dead-lettered.
NO_READER = "malformed entry: no readable request id or reply key"
# Malformed and misdirected entries are logged the first time, then at most once this often,
# counted: a line each let a caller writing them (a v2 entry of 512 items without their
# fields is 512, in one XADD) flood the log. Each is answered to its caller or dead-lettered.
ENTRY_LOG_EVERY_S = 10.0


@dataclass(slots=True)
class PreparedBatch:
    """A batch read and decoded, ready for the model: its entries, the answers already known
    (errors), the entries nothing can be answered to (with why), and the requests and items
    to compute."""

    entries: list[Entry]
    now_ms: float
    replies: list[tuple[str, bytes]]
    dead: list[tuple[Entry, str]]
    live: list[Request]
    items: list[Any]
    costs: list[int] = field(default_factory=list)  # of the items, with a cost budget


class Preparer:
    """Parse, decode and check entries of one model's stream, against the broker's clock."""

    def __init__(
        self,
        keys: ModelKeys,
        observer: BatchObserver,
        now_ms: Callable[[], float],
        check_item: ItemCheck | None = None,
        compute_ms: Callable[[int], float] = lambda items: 0.0,
    ) -> None:
        self.keys = keys
        self.observer = observer
        self.now_ms = now_ms
        # How long computing a batch of so many items takes (ms): an item due sooner would be
        # answered after its caller has given up, so it gets DeadlineExceeded instead of a
        # place in a batch.
        self.compute_ms = compute_ms
        # Each decoded item goes through this before the model sees it (the model's declared
        # input, see gpu_worker.model.input_check): it returns the item, or raises InvalidInput.
        self.check_item = check = check_item
        # A payload packed as an array of exactly the input's dtype and shape is read by one
        # compare of its head: (prefix, size, shape, dtype, data offset).
        self._packed: tuple[bytes, int, tuple[int, ...], np.dtype[Any], int] | None = None
        if check is not None and not check.wildcards:
            found = codec.array_prefix(check.dtype, check.shape)
            if found is not None:
                prefix, size = found
                self._packed = (prefix, size, check.shape, check.dtype, len(prefix))
        # Each partition's inbox namespaces (its own first, then the model's), and why an
        # entry of it whose reply key is in neither is dead-lettered.
        parts = [keys.of(k).reply_namespaces for k in range(keys.partitions)]
        self._reply_namespaces = parts
        self._misdirected = [
            f"reply key outside this model's inboxes ({' or '.join(f'{n}*' for n in names)})"
            for names in parts
        ]
        stream = keys.stream
        self._malformed_log = ThrottledWarning(
            log,
            f"%d malformed entry(ies) of {stream} since the last such line (at most one every "
            f"{ENTRY_LOG_EVERY_S:g} s); the latest: %s",
            every_s=ENTRY_LOG_EVERY_S,
        )
        self._misdirected_log = ThrottledWarning(
            log,
            f"%d entry(ies) of {stream} dead-lettered since the last such line (at most one "
            f"every {ENTRY_LOG_EVERY_S:g} s) for a reply key that is none of this model's "
            "inboxes; the latest: %s",
            every_s=ENTRY_LOG_EVERY_S,
        )

    def prepare(self, entries: list[Entry], skip: set[str] | None = None) -> PreparedBatch:
        """Parse, decode and check a batch; the entries that cannot be computed get their
        answer (or, when nobody can be told, a dead letter). Entries in ``skip`` were withdrawn
        by their callers. Whatever an entry holds, this fails that entry alone: it never
        raises."""
        now_ms = self.now_ms()
        due_ms = now_ms + self.compute_ms(len(entries))
        batch = PreparedBatch(entries, now_ms, [], [], [], [])
        items, live = batch.items, batch.live
        decode, parse = self._decode, RequestReader().parse
        # The items of a multi-item entry share its reply key and partition: the last one's
        # verdict is reused (the same key of the same partition passes, or not, alike).
        allowed_key, allowed_lane = "", -1
        partitioned = len(self._reply_namespaces) > 1
        for entry in entries:
            entry_id = entry[0]
            if skip and entry_id in skip:
                self.observer.answered("withdrawn")
                continue
            try:
                request = parse(entry_id, entry[1])
            except Exception as exc:  # MalformedEntry (were it anything else: not fatal)
                self._malformed(entry, exc, batch)
                continue
            reply_key = request.reply_key
            lane = untag(entry_id)[1] % MAX_PARTITIONS if partitioned else 0
            if reply_key != allowed_key or lane != allowed_lane:
                if not self.may_reply_to(reply_key, entry_id):
                    self._misdirected_entry(batch, entry, reply_key)
                    continue
                allowed_key, allowed_lane = reply_key, lane
            # Past its deadline, or due before a batch could be computed: also when the clock
            # estimate lags Redis' a little, an entry is never before its own time (so one of
            # timeout 0 is never computed).
            deadline_ms = request.deadline_ms
            if deadline_ms <= due_ms or deadline_ms <= request.arrival_ms:
                batch.replies.append(self.expired(request, now_ms, due_ms))
                continue
            try:
                item = decode(request.data)
            except Exception as exc:  # CodecError, InvalidInput
                batch.replies.append(self._refused(request, exc))
                continue
            items.append(item)
            live.append(request)
        return batch

    def _misdirected_entry(self, batch: PreparedBatch, entry: Entry, reply_key: str) -> None:
        """Dead-letter an entry whose reply key is none of this model's inboxes."""
        batch.dead.append((entry, self.misdirected(entry[0])))
        self._misdirected_log.note(
            f"{entry[0]}: reply key {reply_key[:200]!r} is none of this model's inboxes"
        )
        self.observer.answered("malformed")

    def _decode(self, data: bytes) -> Any:
        packed = self._packed
        if packed is not None and len(data) == packed[1] and data.startswith(packed[0]):
            # exactly the input's dtype and shape, as codec.decode would read it (a view)
            return np.ndarray(packed[2], packed[3], data, packed[4])
        item = codec.decode(data)
        check = self.check_item
        # an item of the input's dtype and shape passes at the cost of this comparison
        if check is not None and (
            type(item) is not np.ndarray
            or item.dtype is not check.dtype
            or item.shape != check.shape
        ):
            item = check(item)
        return item

    def _malformed(self, entry: Entry, exc: Exception, batch: PreparedBatch) -> None:
        """Answer (or dead-letter, when nobody can be told) an entry that is not a request."""
        if not isinstance(exc, MalformedEntry):  # parsing raises nothing else
            log.error("cannot parse entry %s on %s: %s", entry[0], self.keys.stream, describe(exc))
            exc = MalformedEntry("entry could not be parsed")
        if not exc.request_id or not exc.reply_key:
            batch.dead.append((entry, NO_READER))
        elif self.may_reply_to(exc.reply_key, entry[0]):
            batch.replies.append((exc.reply_key, encode_error(exc.request_id, exc)))
        else:
            batch.dead.append((entry, self.misdirected(entry[0])))
        self._malformed_log.note(f"{entry[0]}: {exc}")
        self.observer.answered("malformed")

    def _refused(self, request: Request, exc: Exception) -> tuple[str, bytes]:
        """The reply to an item whose data cannot be decoded or does not fit the model."""
        if isinstance(exc, InvalidInput):
            self.observer.answered("invalid_input")
        else:
            if not isinstance(exc, CodecError):  # the codec raises nothing else: never expected
                log.error("decoding entry %s failed: %s", request.entry_id, describe(exc))
                exc = CodecError(f"malformed payload: {type(exc).__name__}")
            self.observer.answered("codec_error")
        return request.reply_key, encode_error(request.request_id, exc)

    def expired(self, request: Request, now_ms: float, due_ms: float) -> tuple[str, bytes]:
        """The reply to an item whose deadline passed before it was computed, or would pass
        before a batch computed from ``now_ms`` ends (at ``due_ms``)."""
        self.observer.answered("deadline")
        if request.deadline_ms <= now_ms or request.deadline_ms <= request.arrival_ms:
            error = DeadlineExceeded("deadline passed before the item was computed")
        else:
            error = DeadlineExceeded(
                "deadline too near to compute the item in time (batches take "
                f"{due_ms - now_ms:.0f} ms)"
            )
        return request.reply_key, encode_error(request.request_id, error)

    def may_reply_to(self, key: str, entry_id: str) -> bool:
        """ModelKeys.may_reply_to for the partition of the entry ``entry_id`` (tagged with its
        lane, as the transport hands it out), without formatting namespaces for every entry."""
        parts = self._reply_namespaces
        partition = untag(entry_id)[1] % MAX_PARTITIONS if len(parts) > 1 else 0
        if partition >= len(parts):
            return False
        for namespace in parts[partition]:
            if len(key) > len(namespace) and key.startswith(namespace):
                return True
        return False

    def misdirected(self, entry_id: str) -> str:
        """Why the entry ``entry_id``, whose reply key may not be replied to, is dead-lettered."""
        partition = untag(entry_id)[1] % MAX_PARTITIONS
        return self._misdirected[min(partition, len(self._misdirected) - 1)]

    def drop_stale(self, batch: PreparedBatch, withdrawn: set[str]) -> bool:
        """Take items withdrawn or (nearly) past their deadline out of a prepared batch (their
        entries stay, to be acknowledged with it); False if there were none."""
        now_ms = self.now_ms()
        due_ms = now_ms + self.compute_ms(len(batch.live))
        stale = [
            request.entry_id in withdrawn or request.deadline_ms <= due_ms for request in batch.live
        ]
        if not any(stale):
            return False
        costs = batch.costs
        live, items, kept_costs = [], [], []
        for index, (request, item, drop) in enumerate(
            zip(batch.live, batch.items, stale, strict=True)
        ):
            if not drop:
                live.append(request)
                items.append(item)
                if costs:
                    kept_costs.append(costs[index])
            elif request.entry_id in withdrawn:
                self.observer.answered("withdrawn")
            else:
                batch.replies.append(self.expired(request, now_ms, due_ms))
        batch.live, batch.items, batch.costs = live, items, kept_costs
        return True


def in_chunks(batch: PreparedBatch, size: int) -> list[PreparedBatch]:
    """A prepared batch cut into batches of at most ``size`` items, in order (items taken
    back after an outage can be more than a batch: multi-item entries hold several). The
    first carries the answers already known and the entries computed by none."""
    if len(batch.items) <= size:
        return [batch]
    by_id = {entry[0]: entry for entry in batch.entries}
    parts = []
    for start in range(0, len(batch.items), size):
        live = batch.live[start : start + size]
        parts.append(
            PreparedBatch(
                [by_id[request.entry_id] for request in live],
                batch.now_ms,
                [],
                [],
                live,
                batch.items[start : start + size],
                batch.costs[start : start + size],
            )
        )
    computed = {request.entry_id for request in batch.live}
    first = parts[0]
    first.entries += [entry for entry in batch.entries if entry[0] not in computed]
    first.replies, first.dead = batch.replies, batch.dead
    return parts
