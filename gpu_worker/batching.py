"""The batch loop: read up to ``batch_size`` entries, run the model once, reply, ack.

Written once over :class:`broker.transport.Transport`, so the same loop serves Redis workers and
the in-process LocalStreamer. Its parts: :mod:`.preparing` turns entries into items,
:mod:`.read_ahead` holds what is read beyond the batch computing, :mod:`.windows` forms batches
by a cost budget, and :mod:`.runners` runs the model (inline or on its own thread).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from broker.errors import BrokerUnavailable, PoisonRequest
from broker.keys import ModelKeys
from broker.logs import Every
from broker.multi_item import ITEM_MARK
from broker.protocol import Request, encode_error, entry_time_ms, parse_request
from broker.transport import Entry, PartitionsChanged, Transport

from .config import MODEL_THREAD_MODES, BatchSettings
from .model import ItemCheck
from .observer import BatchObserver
from .outcomes import OutcomeEncoder, PredictFn
from .polling import AutoBusyPoll
from .preparing import PreparedBatch, Preparer, in_chunks
from .read_ahead import ReadAhead
from .runners import THREAD_FROM_S, make_runner
from .windows import WINDOW_BATCHES, CostFn, CostWindows

__all__ = [
    "MODEL_THREAD_MODES",
    "THREAD_FROM_S",
    "WINDOW_BATCHES",
    "BatchLoop",
    "BatchObserver",
    "BatchSettings",
    "BrokerClock",
    "PreparedBatch",
]

log = logging.getLogger("microbatch.worker")

# Event-loop turns a command started as a task needs to be written (the transport's lanes write
# in the task's first step; 1 more covers a task that first awaits something already done).
PREFETCH_TURNS = 2
OUTAGE_LOG_EVERY_S = 10.0  # during a Redis outage: a line this often, not one per retry
# An item of a full batch due within the shortest of the last RECENT_BATCHES batch times is
# not computed (its answer would come too late), while a batch has finished within
# ESTIMATE_FRESH_S.
RECENT_BATCHES = 4
ESTIMATE_FRESH_S = 1.0


async def _let_writes_go_out() -> None:
    """Yield so that a command just started as a task is written before the model holds the
    loop (a read ahead, or the replies of the last batch)."""
    for _ in range(PREFETCH_TURNS):
        await asyncio.sleep(0)


class BrokerClock:
    """The broker's clock, estimated from one TIME round trip and refreshed now and then.

    Deadlines are stamped by the broker (entry ids), so workers compare them with its clock.
    Between syncs the estimate runs on this host's monotonic clock, never on its wall clock:
    a step of the wall clock (NTP, an operator) would otherwise shift every deadline by the
    step until the next sync, refusing valid items as expired or computing stale ones.
    """

    def __init__(
        self,
        transport: Transport,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._transport = transport
        self._monotonic = monotonic
        # until the first sync: this host's wall clock
        self._base_ms = wall() * 1000
        self._base_at = monotonic()
        self._synced_at = float("-inf")
        self._epoch = transport.clock_epoch

    async def sync(self) -> None:
        self._epoch = self._transport.clock_epoch
        before = self._monotonic()
        server_ms = await self._transport.time_ms()
        after = self._monotonic()
        # time_ms() is floored to the ms: the server's time lay half a ms above it on average
        self._base_ms = server_ms + 0.5
        self._base_at = (before + after) / 2
        self._synced_at = after

    async def maybe_sync(self, every_s: float) -> None:
        # also as soon as the stream may be on another server (a cluster's slot moved)
        due = self._monotonic() - self._synced_at > every_s
        if due or self._epoch != self._transport.clock_epoch:
            await self.sync()

    def now_ms(self) -> float:
        return self._base_ms + (self._monotonic() - self._base_at) * 1000


class BatchLoop:
    """Consume one model's stream as ``consumer`` until :meth:`stop` is called.

    When a batch is full (a backlog), the next one is read while the model computes (at most
    one batch is read ahead: :attr:`ahead`). Where the model runs is the :attr:`runner`'s
    business (``settings.model_thread``).
    """

    def __init__(
        self,
        predict: PredictFn,
        transport: Transport,
        keys: ModelKeys,
        consumer: str,
        settings: BatchSettings | None = None,
        observer: BatchObserver | None = None,
        check_item: ItemCheck | None = None,
        item_cost: CostFn | None = None,
    ) -> None:
        self.observer = observer or BatchObserver()
        self.transport = transport
        self.keys = keys
        self.consumer = consumer
        self.settings = settings = settings or BatchSettings()
        if settings.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if settings.max_batch_cost < 0:
            raise ValueError("max_batch_cost cannot be negative")
        self.clock = BrokerClock(transport)
        self._recent_s: deque[float] = deque(maxlen=RECENT_BATCHES)  # batch times, seconds
        self._finished_at = float("-inf")  # time.monotonic() when the last batch finished
        self.preparer = Preparer(
            keys, self.observer, self.clock.now_ms, check_item, self._compute_ms
        )
        # With a budget, items are costed (each 1 unless the model says) and batches formed by
        # it: a window read at once is cut into batches of similar cost, run one after another.
        self.windows: CostWindows | None = None
        if settings.max_batch_cost:
            cost = item_cost or (lambda item: 1)
            self.windows = CostWindows(
                settings.batch_size, settings.max_batch_cost, cost, self.observer
            )
        self.ahead = ReadAhead()
        # busy_poll_s None: polling decided read by read from the arrivals and the spare cores.
        self.auto_poll = AutoBusyPoll() if settings.busy_poll_s is None else None
        self.runner = make_runner(settings.model_thread, predict, self)
        self._encoder = OutcomeEncoder()
        self.batches = 0
        self.items = 0
        self.redelivered = 0
        self.dead_lettered = 0
        self._batch_s = 0.0  # a moving average of batch times, for what is urgent
        self._stopping = False
        self._finishing: asyncio.Task[set[str]] | None = None  # replies on their way
        self._next_reclaim = 0.0
        self._outage_log = Every(OUTAGE_LOG_EVERY_S)
        self._in_outage = False

    def stop(self) -> None:
        """Stop reading; the batches in hand are finished and answered first."""
        self._stopping = True

    def close(self) -> None:
        """Release the model thread, if one was started."""
        self.runner.close()

    async def run(self) -> None:
        """Serve until stopped. Survives broker outages by retrying with backoff."""
        try:
            await self._serve()
        finally:
            self.runner.close()

    async def _serve(self) -> None:
        backoff = 0.05
        ready = False
        while True:
            try:
                if not ready:
                    await self._get_ready()
                    ready = True
                    backoff = 0.05  # Redis answers again; a stale pooled connection may still fail
                    # After a start or an outage: answer what this consumer still holds.
                    await self.redeliver(own=True)
                if not await self._turn():
                    return
            except BrokerUnavailable as exc:
                # What the read ahead and the replies in flight read or answered without an ack
                # is taken back (as own, once Redis is back; by others once this worker's
                # heartbeat lapses); a reply sent twice is ignored by its caller.
                self._drop_in_flight()
                if self._stopping:
                    log.warning("broker unavailable (%s) while stopping; stopping now", exc)
                    return
                if isinstance(exc, PartitionsChanged):  # (the transport said which, and why)
                    ready = False  # this consumer's pending entries are taken back at once
                    continue
                self._in_outage = True
                if self._outage_log.due():
                    log.warning("broker unavailable (%s); retrying until it answers", exc)
                ready = False
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)

    async def _get_ready(self) -> None:
        await self.transport.ensure_group(self.keys)
        await self.transport.check_functions()
        await self.clock.sync()
        if self._in_outage:
            log.info("broker answers again")
            self._in_outage = False
            self._outage_log.reset()

    async def _turn(self) -> bool:
        """Read (or take from what is in hand) one batch, compute it and answer it; False once
        stopped with nothing left in hand."""
        await self._settle_finished()
        # Also with a batch read ahead: under a backlog there always is one, and a dead
        # worker's entries must not wait for the backlog to drain.
        if time.monotonic() >= self._next_reclaim and not self._stopping:
            await self.redeliver(own=False)
        # Also under a backlog, where no read comes back empty: the broker's clock may have
        # been stepped, and this host's monotonic clock drifts from it.
        await self.clock.maybe_sync(self.settings.clock_sync_s)
        if self.ahead.held:
            await self._run_held()
            return True
        if self.ahead.reading:
            entries, skip = await self._take_read_ahead()
        elif self._stopping:
            # What reads of a partitioned queue delivered, not yet handed out, is answered too.
            rest = await self.transport.read_rest(self.keys, self.consumer, self._read_count())
            if rest:
                await self._run_new(rest, set())
                return True
            await self.runner.drain()
            await self._settle_finish()
            return False
        else:
            entries, skip = await self.read_batch(), set()
        if not entries:
            await self.runner.drain()
            return True
        if self.settings.max_latency > 0:
            # The batch formed over a wait: callers may have withdrawn items meanwhile.
            skip |= await self.transport.withdrawn(self.keys, [e[0] for e in entries])
        elif self.transport.cancellations_pending:
            # A withdrawn entry is deleted unless read, but an item of a multi-item entry is
            # only marked (its entry holds others): check the items of a fresh read.
            items = [entry_id for entry_id, _ in entries if ITEM_MARK in entry_id]
            if items:
                skip |= await self.transport.withdrawn(self.keys, items)
        await self._run_new(entries, skip)
        return True

    async def _run_new(self, entries: list[Entry], skip: set[str]) -> None:
        windows = self.windows
        if windows is None:
            # A full batch means a backlog: read the next one while this one computes.
            # (After a short batch there is none; new arrivals are left to idle workers.)
            read_ahead = len(entries) >= self.settings.batch_size and not self._stopping
            await self.runner.run(lambda: self.prepare(entries, skip), read_ahead)
            return
        # A full window means a backlog: read the next one while its last batch computes
        # (with one batch, now). The window's other batches are held, to run next.
        windows.backlog = len(entries) >= windows.asked
        first, *self.ahead.held = windows.cut(self.prepare(entries, skip), self._batch_s)
        read_ahead = windows.backlog and not self.ahead.held and not self._stopping
        await self.runner.run(lambda: first, read_ahead)

    async def _run_held(self) -> None:
        """Run the window's next batch (none is read until the window is done); with the last
        one, read the next window if this one was full (a backlog)."""
        assert self.windows is not None
        withdrawn = await self._held_withdrawn()
        ahead = self.ahead
        batch = ahead.take_held(self.clock.now_ms(), withdrawn, self.preparer.drop_stale)
        read_ahead = not ahead.held and self.windows.backlog and not self._stopping
        await self.runner.run(lambda: batch, read_ahead)

    async def _take_read_ahead(self) -> tuple[list[Entry], set[str]]:
        """The batch read ahead (once it arrives), and which of its entries were withdrawn."""
        task = self.ahead.take_read()
        await self.runner.drain_unless(task)
        entries = await task
        skip = self.ahead.take_withdrawn()
        # A read ahead usually completes after the last check was sent (the model held the
        # loop): check what was not checked, if anything is withdrawn. (A runner that checks
        # batches as the model takes them does it then.)
        if self.transport.cancellations_pending and not self.runner.checks_when_taken:
            unchecked = self.ahead.unchecked(entry[0] for entry in entries)
            if unchecked:
                skip |= await self.transport.withdrawn(self.keys, unchecked)
        return entries, skip

    async def _held_withdrawn(self) -> set[str]:
        """Which held items their callers withdrew: as checked with the last replies, and
        (unless the runner checks as it takes a batch, when any are pending) checked now."""
        skip = self.ahead.take_withdrawn()
        if self.transport.cancellations_pending and not self.runner.checks_when_taken:
            ids = self.ahead.unchecked(self.ahead.held_ids())
            if ids:
                skip |= await self.transport.withdrawn(self.keys, ids)
        return skip

    def _drop_in_flight(self) -> None:
        """Cancel the batch read ahead and the replies in flight; forget the batch computing
        (the model thread finishes it; its entries are answered when taken back)."""
        self.ahead.drop()
        self.runner.drop()
        if self._finishing is not None:
            self._finishing.cancel()
        self._finishing = None

    # -- reading ------------------------------------------------------------------------------
    def _busy_poll_s(self, ahead: bool) -> float:
        """How long a read polls before it sleeps: the one place that decides. Only a read
        with nothing in hand and nothing computing spins (a read ahead waits while the model
        computes, and a spinning loop would take the GIL from the model's thread)."""
        if ahead or self.runner.busy:
            return 0.0
        if self.auto_poll is not None:
            return self.auto_poll.seconds()
        return self.settings.busy_poll_s or 0.0

    def _read_count(self) -> int:
        """How many entries a read asks for: batch_size; with a budget, a window's worth."""
        windows = self.windows
        if windows is None:
            return self.settings.batch_size
        windows.asked = windows.read_count()
        return windows.asked

    async def read_batch(self, ahead: bool = False) -> list[Entry]:
        """Everything queued up to batch_size (with a budget: a window's worth); wait for more
        only while max_latency allows, and only until a batch's worth is in hand. ``ahead``:
        read while the model computes the batch in hand."""
        settings, keys = self.settings, self.keys
        windows = self.windows
        count = self._read_count()
        entries = await self.transport.read_batch(
            keys, self.consumer, count, settings.block_ms, self._busy_poll_s(ahead)
        )
        if not entries or settings.max_latency <= 0:
            self._observe_arrivals(entries)
            return entries
        fill = count // WINDOW_BATCHES if windows is not None else count
        # From the first entry's time, but never past max_latency from now: a caller may XADD
        # with an id of its choosing, one from the future (and Redis then gives every later
        # entry a later id still).
        now_ms = self.clock.now_ms()
        wait_until_ms = min(entry_time_ms(entries[0][0]), now_ms) + settings.max_latency * 1000
        while len(entries) < fill and not self._stopping:
            remaining_ms = int(wait_until_ms - now_ms)
            if remaining_ms < 1:
                break
            entries += await self.transport.read_batch(
                keys, self.consumer, fill - len(entries), remaining_ms
            )
            now_ms = self.clock.now_ms()
        self._observe_arrivals(entries)
        return entries

    def _observe_arrivals(self, entries: list[Entry]) -> None:
        if self.auto_poll is not None and entries:
            self.auto_poll.observe(entries[-1][0], len(entries))

    def prepare(self, entries: list[Entry], skip: set[str] | None = None) -> PreparedBatch:
        """Parse, decode and check a batch (see :meth:`Preparer.prepare`)."""
        return self.preparer.prepare(entries, skip)

    async def process(self, entries: list[Entry], skip: set[str] | None = None) -> None:
        """Answer every entry of one batch: a result or a typed error each, then ack. (With
        a budget, the entries are cut into batches by it, which run one after another.)

        Entries in ``skip`` were withdrawn by their callers: they are acknowledged, not computed.
        """
        batch = self.prepare(entries, skip)
        if self.windows is None:
            for part in in_chunks(batch, self.settings.batch_size):
                await self.runner.process(part)
            return
        for part in self.windows.cut(batch, self._batch_s):
            await self.runner.process(part)

    # -- what the runner asks of the loop -----------------------------------------------------
    @property
    def holds_more(self) -> bool:
        return bool(self.ahead.held)

    async def read_ahead(self) -> None:
        self.ahead.start(self.read_batch(ahead=True))
        await _let_writes_go_out()

    async def recheck(self, batch: PreparedBatch) -> None:
        """Take out a batch's items expired since it was prepared, and (when any are pending)
        withdrawn: it may have waited a whole batch."""
        withdrawn: set[str] = set()
        if batch.live and self.transport.cancellations_pending:
            ids = [request.entry_id for request in batch.live]
            withdrawn = await self.transport.withdrawn(self.keys, ids)
        self.preparer.drop_stale(batch, withdrawn)

    def _compute_ms(self, items: int) -> float:
        """How long a batch of ``items`` takes, at least: for a full one (the queue is backed
        up), the shortest of the last few full ones, in ms. 0 for a smaller one (a lone item
        after a run of full batches is computed far sooner than they were), and once none
        has finished for ESTIMATE_FRESH_S: an estimate from a model that was slow then
        (warming up, a busy device) must not keep refusing items it could now answer."""
        if items < self.settings.batch_size or not self._recent_s:
            return 0.0
        if time.monotonic() - self._finished_at > ESTIMATE_FRESH_S:
            return 0.0
        return min(self._recent_s) * 1000

    def batch_started(self, batch: PreparedBatch) -> None:
        now_ms = batch.now_ms
        self.observer.batch_started(
            len(batch.items),
            [(now_ms - r.arrival_ms) / 1000 for r in batch.live],
            [r.traceparent for r in batch.live if r.traceparent],
        )

    def batch_finished(self, batch: PreparedBatch, seconds: float) -> None:
        self.observer.batch_finished(len(batch.items), seconds)
        self._finished_at = time.monotonic()
        self._batch_s = 0.8 * self._batch_s + 0.2 * seconds if self._batch_s else seconds
        windows = self.windows
        full = windows.is_full(batch) if windows else len(batch.items) >= self.settings.batch_size
        if full:
            self.runner.full_batch_took(seconds)
            self._recent_s.append(seconds)

    async def answer(self, batch: PreparedBatch, outcomes: list[Any]) -> None:
        """Encode the computed items' outcomes, then send every reply and ack the batch."""
        replies = batch.replies
        if batch.items:
            counts: dict[str, int] = {}
            replies += self._encoder.encode(batch.live, outcomes, counts)
            for kind, count in counts.items():
                self.observer.answered(kind, count)
            self.batches += 1
            self.items += len(batch.items)
        dead = batch.dead
        answered = batch.entries
        if dead:
            for reason in dict.fromkeys(reason for _, reason in dead):
                entries = [entry for entry, why in dead if why == reason]
                await self.transport.dead_letter(self.keys, entries, reason)
            self.dead_lettered += len(dead)
            self.observer.dead_lettered(len(dead))
            dead_ids = {entry_id for (entry_id, _), _ in dead}
            answered = [entry for entry in answered if entry[0] not in dead_ids]
        await self._send_answers(replies, answered)
        self.observer.replies_sent()

    # -- replying -----------------------------------------------------------------------------
    async def _send_answers(self, replies: list[tuple[str, bytes]], answered: list[Entry]) -> None:
        """Reply, ack and delete; usually without waiting, so the next batch can start.

        At most one finish is in flight, and it is sent before the next batch computes. When
        callers have withdrawn entries lately, wait instead for the same round trip to say which
        items of the batch read ahead were withdrawn, so that those are not computed.
        """
        await self._settle_finish()
        ttl = self.settings.reply_ttl_s
        if self.transport.cancellations_pending:
            self.ahead.withdrawn = await self.transport.finish(
                self.keys, replies, answered, ttl, self.ahead.note_checked()
            )
            return
        self.ahead.forget_checked()
        self._finishing = asyncio.ensure_future(
            self.transport.finish(self.keys, replies, answered, ttl)
        )
        await _let_writes_go_out()

    async def _settle_finished(self) -> None:
        """Settle the replies in flight if they have gone (or failed) already: replies that
        could not go (BrokerUnavailable: Redis away, the library gone or older than this code)
        say so at the next turn, not after the next batch has computed, and the outage's wait
        for Redis and the library then writes the replies of what was acknowledged."""
        if self._finishing is not None and self._finishing.done():
            await self._settle_finish()

    async def _settle_finish(self) -> None:
        """Wait for the replies in flight (raises BrokerUnavailable if they could not go)."""
        task, self._finishing = self._finishing, None
        if task is not None:
            await task

    # -- taking over entries ------------------------------------------------------------------
    async def redeliver(self, own: bool) -> None:
        """Take over entries of dead consumers (or, with ``own``, this one's) and answer them.

        Entries are claimed and answered one at a time: a request that kills its worker then
        takes no innocent entry down with it (claiming counts as a delivery), and each runs
        alone. One delivered ``max_deliveries`` times already is dead-lettered and its caller
        gets PoisonRequest. This worker's own entries (after an outage) are the exception:
        none of them killed a worker (this one is alive), so they run together, as batches.
        """
        settings = self.settings
        read_ahead = self.ahead.withdrawn
        # own: at most a batch (with a budget, a window) in hand and one read ahead; else a
        # bounded share per round
        in_hand = 2 * (WINDOW_BATCHES if self.windows is not None else 1)
        count, rounds = (settings.batch_size, in_hand) if own else (1, settings.batch_size)
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
        self.ahead.withdrawn = read_ahead  # answering these must not forget the read-ahead checks
        self._next_reclaim = time.monotonic() + settings.reclaim_every_s

    async def _dead_letter_poison(self, entry: Entry, deliveries: int) -> None:
        reason = f"delivered {deliveries} times without an answer"
        await self.transport.dead_letter(self.keys, [entry], reason)
        self.dead_lettered += 1
        self.observer.answered("poison")
        self.observer.dead_lettered(1)
        log.error("dead-lettered entry %s of %s: %s", entry[0], self.keys.stream, reason)
        try:
            request: Request | None = parse_request(*entry)
        except Exception:  # MalformedEntry: no caller that could be told
            request = None
        if request is not None and self.preparer.may_reply_to(request.reply_key, entry[0]):
            error = PoisonRequest(f"request {reason}; it sits in the dead-letter stream")
            reply = (request.reply_key, encode_error(request.request_id, error))
            await self.transport.finish(self.keys, [reply], [], self.settings.reply_ttl_s)
        self.observer.replies_sent()
