"""The batch loop: read up to ``batch_size`` entries, run the model once, reply, ack.

Written once over :class:`broker.transport.Transport`, so the same loop serves Redis workers and
the in-process LocalStreamer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from broker import codec
from broker.errors import (
    BrokerUnavailable,
    CodecError,
    DeadlineExceeded,
    InvalidOutput,
    MicrobatchError,
    ModelError,
    PoisonRequest,
)
from broker.keys import ModelKeys
from broker.protocol import (
    MalformedEntry,
    Request,
    encode_error,
    encode_result,
    entry_time_ms,
    parse_request,
)
from broker.transport import Entry, Transport

log = logging.getLogger("microbatch.worker")

# Event-loop turns a command started as a task needs to be written (the transport's lanes write
# in the task's first step; 1 more covers a task that first awaits something already done).
PREFETCH_TURNS = 2


async def _let_writes_go_out() -> None:
    """Yield so that a command just started as a task is written before the model holds the
    loop (a read ahead, or the replies of the last batch)."""
    for _ in range(PREFETCH_TURNS):
        await asyncio.sleep(0)


PredictFn = Callable[[list[Any]], Sequence[Any]]


@dataclass
class BatchSettings:
    """How a worker forms batches and answers."""

    batch_size: int = 32
    max_latency_s: float = 0.0
    block_ms: int = 500
    reply_ttl_s: int = 60
    clock_sync_s: float = 30.0
    max_deliveries: int = 3
    reclaim_every_s: float = 1.0
    reclaim_min_idle_ms: int = 200


class BatchObserver:
    """What the batch loop reports as it works (metrics, the supervisor's watchdog, logs).

    The base class ignores everything; subclasses override what they need. Calls are made on
    the loop's thread and must be quick.
    """

    def batch_started(
        self, size: int, queue_waits_s: Sequence[float], traces: Sequence[str]
    ) -> None:
        """The model is about to run on ``size`` items (their waits since arrival; the W3C
        traceparents of those that carry one)."""

    def batch_finished(self, size: int, inference_s: float) -> None:
        """The model call (with any splitting after an exception) has returned."""

    def answered(self, outcome: str, count: int = 1) -> None:
        """``count`` items got their answer: ok, model_error, invalid_output, deadline,
        codec_error, malformed, withdrawn or poison."""

    def redelivered(self) -> None:
        """An entry was taken over from a dead consumer (or this one's, after an outage)."""

    def replies_sent(self) -> None:
        """A batch's replies are on their way: bookkeeping that need not delay them goes here."""


class BrokerClock:
    """The broker's clock, estimated from one TIME round trip and refreshed now and then.

    Deadlines are stamped by the broker (entry ids), so workers compare them with its clock.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._offset_ms = 0.0
        self._synced_at = float("-inf")

    async def sync(self) -> None:
        before = time.time()
        server_ms = await self._transport.time_ms()
        after = time.time()
        self._offset_ms = server_ms - (before + after) * 500
        self._synced_at = after

    async def maybe_sync(self, every_s: float) -> None:
        if time.time() - self._synced_at > every_s:
            await self.sync()

    def now_ms(self) -> float:
        return time.time() * 1000 + self._offset_ms


def describe(exc: BaseException) -> str:
    """A one-line description of a model exception (no traceback, no payload)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA (or other accelerator) out-of-memory errors, without importing torch."""
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()


class BatchLoop:
    """Consume one model's stream as ``consumer`` until :meth:`stop` is called."""

    def __init__(
        self,
        predict: PredictFn,
        transport: Transport,
        keys: ModelKeys,
        consumer: str,
        settings: BatchSettings | None = None,
        observer: BatchObserver | None = None,
    ) -> None:
        self.predict_fn = predict
        self.observer = observer or BatchObserver()
        self.transport = transport
        self.keys = keys
        self.consumer = consumer
        self.settings = settings or BatchSettings()
        if self.settings.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.clock = BrokerClock(transport)
        self.batches = 0
        self.items = 0
        self._stopping = False
        self._prefetch: asyncio.Task[list[Entry]] | None = None
        self._withdrawn: set[str] = set()  # read ahead, then withdrawn by their callers
        self._checked: set[str] = set()  # read-ahead ids the last finish() checked
        self._finishing: asyncio.Task[set[str]] | None = None  # replies on their way
        self._next_reclaim = 0.0
        self.redelivered = 0
        self.dead_lettered = 0

    def stop(self) -> None:
        """Stop reading; the batch in hand is finished and answered first."""
        self._stopping = True

    def close(self) -> None:
        """Release resources (nothing today; kept so callers need not change)."""

    async def run(self) -> None:
        """Serve until stopped. Survives broker outages by retrying with backoff.

        The model runs on this thread, inline: no thread hand-off per batch. When a batch is
        full (a backlog), the read of the next one is on its way to Redis before the model runs,
        so fetching the next batch overlaps the model call (at most one batch is read ahead).
        """
        backoff = 0.05
        ready = False
        while True:
            try:
                if not ready:
                    await self.transport.ensure_group(self.keys)
                    await self.clock.sync()
                    ready = True
                    backoff = 0.05  # Redis answers again; a stale pooled connection may still fail
                    # After a start or an outage: answer what this consumer still holds.
                    await self.redeliver(own=True)
                # Also with a batch read ahead: under a backlog there always is one, and a dead
                # worker's entries must not wait for the backlog to drain.
                if time.monotonic() >= self._next_reclaim and not self._stopping:
                    await self.redeliver(own=False)
                skip: set[str] = set()
                if self._prefetch is not None:
                    task, self._prefetch = self._prefetch, None
                    entries = await task
                    skip, self._withdrawn = self._withdrawn, set()
                    # A read ahead usually completes after the last check was sent (the model
                    # held the loop): check what was not checked, if anything is withdrawn.
                    unchecked = [e[0] for e in entries if e[0] not in self._checked]
                    if unchecked and self.transport.cancellations_pending:
                        skip |= await self.transport.withdrawn(self.keys, unchecked)
                elif self._stopping:
                    await self._settle_finish()
                    return
                else:
                    entries = await self.read_batch()
                if not entries:
                    await self.clock.maybe_sync(self.settings.clock_sync_s)
                    continue
                if self.settings.max_latency_s > 0:
                    # The batch formed over a wait: callers may have withdrawn items meanwhile.
                    skip |= await self.transport.withdrawn(self.keys, [e[0] for e in entries])
                if len(entries) >= self.settings.batch_size and not self._stopping:
                    # A full batch means a backlog: read the next one while this one computes.
                    # (After a short batch there is none; new arrivals are left to idle workers.)
                    self._prefetch = asyncio.ensure_future(self.read_batch())
                    await _let_writes_go_out()
                await self.process(entries, skip)
                backoff = 0.05
            except BrokerUnavailable as exc:
                # What the read ahead and the replies in flight read or answered without an ack
                # is taken back (as own, once Redis is back; by others once this worker's
                # heartbeat lapses); a reply sent twice is ignored by its caller.
                self._drop_in_flight()
                if self._stopping:
                    log.warning("broker unavailable (%s) while stopping; stopping now", exc)
                    return
                log.warning("broker unavailable (%s); retrying in %.2f s", exc, backoff)
                ready = False
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)

    def _drop_in_flight(self) -> None:
        """Cancel the batch read ahead and the replies in flight."""
        for task in (self._prefetch, self._finishing):
            if task is not None:
                task.cancel()
        self._prefetch = self._finishing = None

    async def redeliver(self, own: bool) -> None:
        """Take over entries of dead consumers (or, with ``own``, this one's) and answer them.

        Entries are claimed and answered one at a time: a request that kills its worker then
        takes no innocent entry down with it (claiming counts as a delivery), and each runs
        alone. One delivered ``max_deliveries`` times already is dead-lettered and its caller
        gets PoisonRequest. This worker's own entries (after an outage) are the exception:
        none of them killed a worker (this one is alive), so they run together, as batches.
        """
        settings = self.settings
        read_ahead = self._withdrawn
        # own: at most a batch in hand and one read ahead; else a bounded share per round
        count, rounds = (settings.batch_size, 2) if own else (1, settings.batch_size)
        for _ in range(rounds):
            taken = await self.transport.reclaim(
                self.keys, self.consumer, settings.reclaim_min_idle_ms, count, own
            )
            if not taken:
                break
            withdrawn = await self.transport.withdrawn(self.keys, [e[0] for e, _ in taken])
            batch = []
            for entry, deliveries in taken:
                self.redelivered += 1
                self.observer.redelivered()
                if deliveries >= settings.max_deliveries and entry[0] not in withdrawn:
                    await self._dead_letter_poison(entry, deliveries)
                else:
                    batch.append(entry)
            if batch:
                await self.process(batch, withdrawn)
        self._withdrawn = read_ahead  # answering these must not forget the read-ahead checks
        self._next_reclaim = time.monotonic() + settings.reclaim_every_s

    async def _dead_letter_poison(self, entry: Entry, deliveries: int) -> None:
        reason = f"delivered {deliveries} times without an answer"
        await self.transport.dead_letter(self.keys, [entry], reason)
        self.dead_lettered += 1
        self.observer.answered("poison")
        log.error("dead-lettered entry %s of %s: %s", entry[0], self.keys.stream, reason)
        try:
            request: Request | None = parse_request(*entry)
        except MalformedEntry:
            request = None  # no caller that could be told
        if request is not None:
            error = PoisonRequest(f"request {reason}; it sits in the dead-letter stream")
            reply = (request.reply_key, encode_error(request.request_id, error))
            await self.transport.finish(self.keys, [reply], [], self.settings.reply_ttl_s)
        self.observer.replies_sent()

    async def read_batch(self) -> list[Entry]:
        """Everything queued up to batch_size; wait for more only while max_latency allows."""
        settings = self.settings
        keys = self.keys
        entries = await self.transport.read_batch(
            keys, self.consumer, settings.batch_size, settings.block_ms
        )
        if not entries or settings.max_latency_s <= 0:
            return entries
        oldest_ms = entry_time_ms(entries[0][0])
        wait_until_ms = oldest_ms + settings.max_latency_s * 1000
        while len(entries) < settings.batch_size and not self._stopping:
            remaining_ms = int(wait_until_ms - self.clock.now_ms())
            if remaining_ms < 1:
                break
            entries += await self.transport.read_batch(
                keys, self.consumer, settings.batch_size - len(entries), remaining_ms
            )
        return entries

    async def process(self, entries: list[Entry], skip: set[str] | None = None) -> None:
        """Answer every entry of one batch: a result or a typed error each, then ack.

        Entries in ``skip`` were withdrawn by their callers: they are acknowledged, not computed.
        """
        observer = self.observer
        replies: list[tuple[str, bytes]] = []
        dead: list[Entry] = []
        live: list[Request] = []
        items: list[Any] = []
        now_ms = self.clock.now_ms()
        for entry_id, fields in entries:
            if skip and entry_id in skip:
                observer.answered("withdrawn")
                continue
            try:
                request = parse_request(entry_id, fields)
            except MalformedEntry as exc:
                if exc.request_id and exc.reply_key:
                    replies.append((exc.reply_key, encode_error(exc.request_id, exc)))
                else:
                    dead.append((entry_id, fields))
                log.warning("malformed entry %s on %s: %s", entry_id, self.keys.stream, exc)
                observer.answered("malformed")
                continue
            if request.deadline_ms <= now_ms:
                error = DeadlineExceeded("deadline passed before the item was computed")
                replies.append((request.reply_key, encode_error(request.request_id, error)))
                observer.answered("deadline")
                continue
            try:
                items.append(codec.decode(request.data))
            except CodecError as exc:
                replies.append((request.reply_key, encode_error(request.request_id, exc)))
                observer.answered("codec_error")
                continue
            live.append(request)

        if items:
            observer.batch_started(
                len(items),
                [(now_ms - r.arrival_ms) / 1000 for r in live],
                [r.traceparent for r in live if r.traceparent],
            )
            started = time.perf_counter()
            outcomes = self.predict_robust(items)
            observer.batch_finished(len(items), time.perf_counter() - started)
            counts: dict[str, int] = {}
            for request, outcome in zip(live, outcomes, strict=True):
                reply, kind = self._encode_outcome(request, outcome)
                replies.append((request.reply_key, reply))
                counts[kind] = counts.get(kind, 0) + 1
            for kind, count in counts.items():
                observer.answered(kind, count)
            self.batches += 1
            self.items += len(items)

        if dead:
            await self.transport.dead_letter(
                self.keys, dead, "malformed entry: no readable request id or reply key"
            )
        dead_ids = {entry_id for entry_id, _ in dead}
        answered = [entry for entry in entries if entry[0] not in dead_ids]
        await self._send_answers(replies, answered)
        observer.replies_sent()

    async def _send_answers(self, replies: list[tuple[str, bytes]], answered: list[Entry]) -> None:
        """Reply, ack and delete; usually without waiting, so the next batch can start.

        At most one finish is in flight, and it is sent before the next batch computes. When
        callers have withdrawn entries lately, wait instead for the same round trip to say which
        items of the batch read ahead were withdrawn, so that those are not computed.
        """
        await self._settle_finish()
        ttl = self.settings.reply_ttl_s
        if self.transport.cancellations_pending:
            self._withdrawn = await self.transport.finish(
                self.keys, replies, answered, ttl, self._note_checked()
            )
            return
        self._checked = set()
        self._finishing = asyncio.ensure_future(
            self.transport.finish(self.keys, replies, answered, ttl)
        )
        await _let_writes_go_out()

    async def _settle_finish(self) -> None:
        """Wait for the replies in flight (raises BrokerUnavailable if they could not go)."""
        task, self._finishing = self._finishing, None
        if task is not None:
            await task

    def _note_checked(self) -> list[str]:
        ids = self._read_ahead_ids()
        self._checked = set(ids)
        return ids

    def _read_ahead_ids(self) -> list[str]:
        """Entry ids of the batch read ahead while this one computed, if it has arrived."""
        task = self._prefetch
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return []
        return [entry_id for entry_id, _ in task.result()]

    @staticmethod
    def _encode_outcome(request: Request, outcome: Any) -> tuple[bytes, str]:
        """The reply to one computed item, and the name of its outcome."""
        if isinstance(outcome, MicrobatchError):
            kind = "model_error" if isinstance(outcome, ModelError) else "invalid_output"
            return encode_error(request.request_id, outcome), kind
        try:
            return encode_result(request.request_id, outcome), "ok"
        except CodecError as exc:
            error = InvalidOutput(f"cannot send output: {exc}")
            return encode_error(request.request_id, error), "invalid_output"

    def predict_robust(self, items: list[Any]) -> list[Any]:
        """Run the model; on an exception, bisect so only the failing items get ModelError."""
        try:
            outputs = self.predict_fn(items)
        except Exception as exc:
            if len(items) == 1:
                return [ModelError(describe(exc))]
            kind = "out of memory" if is_out_of_memory(exc) else "failed"
            log.warning("batch of %d %s (%s); splitting it", len(items), kind, describe(exc))
            middle = len(items) // 2
            return self.predict_robust(items[:middle]) + self.predict_robust(items[middle:])
        try:
            count = len(outputs)
        except TypeError:
            count = -1
        if count != len(items):
            error = InvalidOutput(
                f"model returned {count if count >= 0 else 'no list of'} outputs "
                f"for a batch of {len(items)}"
            )
            return [error] * len(items)
        return list(outputs)
