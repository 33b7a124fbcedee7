"""The batch loop: read up to ``batch_size`` entries, run the model once, reply, ack.

Written once over :class:`broker.transport.Transport`, so the same loop serves Redis workers and
the in-process LocalStreamer.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from broker import codec
from broker.errors import (
    BrokerUnavailable,
    CodecError,
    DeadlineExceeded,
    InvalidInput,
    InvalidOutput,
    MicrobatchError,
    ModelError,
    PoisonRequest,
)
from broker.keys import ModelKeys
from broker.logs import Every
from broker.protocol import (
    MalformedEntry,
    Request,
    encode_error,
    encode_result,
    entry_time_ms,
    parse_request,
)
from broker.transport import Entry, Transport

from .forming import cut
from .model import ItemCheck
from .model_thread import ModelThread

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
CostFn = Callable[[Any], int]

MODEL_THREAD_MODES = ("auto", "on", "off")

# Why an entry with no readable request id or reply key is dead-lettered.
NO_READER = "malformed entry: no readable request id or reply key"
# auto: full batches taking this long (a moving average) move the model to its own thread, so
# that reading the next batch and sending replies overlap it; below the second figure it comes
# back. Short CPU batches lose more to GIL hand-offs between the model's operations than the
# overlap saves (bench/analysis.md).
THREAD_FROM_S = 0.010
INLINE_BELOW_S = 0.005
# With a cost budget, a window of up to this many batches' worth of items is read and cut into
# batches of similar cost (gpu_worker.forming); items due within this many batch times run first.
WINDOW_BATCHES = 2
URGENT_BATCHES = 2


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
    model_thread: str = "auto"  # "on", "off", or "auto": on for batches of 10 ms or more
    busy_poll_s: float = 0.0  # how long a read with nothing in hand polls before it sleeps
    max_batch_cost: int = 0  # the most a batch's items may cost together (0: count items only)


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
        codec_error, invalid_input, malformed, withdrawn or poison."""

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
        self._epoch = transport.clock_epoch

    async def sync(self) -> None:
        self._epoch = self._transport.clock_epoch
        before = time.time()
        server_ms = await self._transport.time_ms()
        after = time.time()
        # time_ms() is floored to the ms: the server's time lay half a ms above it on average
        self._offset_ms = server_ms + 0.5 - (before + after) * 500
        self._synced_at = after

    async def maybe_sync(self, every_s: float) -> None:
        # also as soon as the stream may be on another server (a cluster's slot moved)
        if time.time() - self._synced_at > every_s or self._epoch != self._transport.clock_epoch:
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
        check_item: ItemCheck | None = None,
        item_cost: CostFn | None = None,
    ) -> None:
        self.predict_fn = predict
        # Each decoded item goes through this before the model sees it (the model's declared
        # input, see gpu_worker.model.input_check): it returns the item, or raises InvalidInput.
        self.check_item = check_item
        self.observer = observer or BatchObserver()
        self.transport = transport
        self.keys = keys
        self.consumer = consumer
        self.settings = settings or BatchSettings()
        if self.settings.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.settings.max_batch_cost < 0:
            raise ValueError("max_batch_cost cannot be negative")
        # With a budget, items are costed (each 1 unless the model says) and batches formed by
        # it: a window read at once is cut into batches of similar cost, run one after another.
        self.budget = self.settings.max_batch_cost
        self.item_cost: CostFn = item_cost or (lambda item: 1)
        self._held: list[PreparedBatch] = []  # the window's batches still to run, in order
        self._window = self.settings.batch_size  # entries the last read asked for
        self._mean_cost: float | None = None  # of recent items (a moving average)
        self._batch_s = 0.0  # a moving average of batch times, for what is urgent
        self._backlog = False  # the last window read was full
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
        if self.settings.model_thread not in MODEL_THREAD_MODES:
            raise ValueError(f"model_thread must be one of {', '.join(MODEL_THREAD_MODES)}")
        self._model_thread = ModelThread()
        # The batch the model thread computes while the loop reads the next one (thread mode).
        self._computing: tuple[PreparedBatch, asyncio.Future[tuple[list[Any], float]]] | None
        self._computing = None
        self._full_batch_s: float | None = None  # moving average, for model_thread="auto"
        self._slow_batches = False
        self._outage_log = Every(10.0)  # during a Redis outage: a line every 10 s, not per retry
        self._in_outage = False
        # Why an entry whose reply key is not one of this model's inboxes is dead-lettered.
        self._misdirected = f"reply key outside this model's inboxes ({keys.reply_namespace}*)"
        self._reply_namespace = keys.reply_namespace

    def stop(self) -> None:
        """Stop reading; the batches in hand are finished and answered first."""
        self._stopping = True

    def close(self) -> None:
        """Release the model thread, if one was started."""
        self._model_thread.close()

    @property
    def threaded(self) -> bool:
        """Whether the next batch runs on the model thread (overlapping reads and replies)."""
        mode = self.settings.model_thread
        if mode != "auto":
            return mode == "on"
        return self._computing is not None or self._slow_batches

    async def run(self) -> None:
        """Serve until stopped. Survives broker outages by retrying with backoff.

        When a batch is full (a backlog), the next one is read while the model computes (at
        most one batch is read ahead). Inline, the model runs on this thread and only the read
        overlaps it. On the model thread (:attr:`threaded`), decoding the next batch and
        sending the last one's replies overlap it too, and the next batch, decoded already, is
        handed over the moment the model finishes the current one.
        """
        try:
            await self._serve()
        finally:
            self._model_thread.close()

    async def _serve(self) -> None:
        backoff = 0.05
        ready = False
        while True:
            try:
                if not ready:
                    await self.transport.ensure_group(self.keys)
                    await self.transport.check_functions()
                    await self.clock.sync()
                    if self._in_outage:
                        log.info("broker answers again")
                        self._in_outage = False
                        self._outage_log.reset()
                    ready = True
                    backoff = 0.05  # Redis answers again; a stale pooled connection may still fail
                    # After a start or an outage: answer what this consumer still holds.
                    await self.redeliver(own=True)
                # Also with a batch read ahead: under a backlog there always is one, and a dead
                # worker's entries must not wait for the backlog to drain.
                if time.monotonic() >= self._next_reclaim and not self._stopping:
                    await self.redeliver(own=False)
                skip: set[str] = set()
                if self._held:
                    # The window's next batch (none is read until the window is done); with
                    # the last one, read the next window if this one was full (a backlog).
                    batch = self._take_held(await self._held_withdrawn())
                    read_ahead = not self._held and self._backlog and not self._stopping
                    await self._run(batch, read_ahead)
                    backoff = 0.05
                    continue
                if self._prefetch is not None:
                    task, self._prefetch = self._prefetch, None
                    await self._answer_computing_unless(task)
                    entries = await task
                    skip, self._withdrawn = self._withdrawn, set()
                    # A read ahead usually completes after the last check was sent (the model
                    # held the loop): check what was not checked, if anything is withdrawn.
                    # (The model thread's batches are checked as it takes them.)
                    unchecked = [e[0] for e in entries if e[0] not in self._checked]
                    if unchecked and self.transport.cancellations_pending and not self.threaded:
                        skip |= await self.transport.withdrawn(self.keys, unchecked)
                elif self._stopping:
                    await self._answer_computing()
                    await self._settle_finish()
                    return
                else:
                    # Nothing in hand, nothing computing: the loop may spin (never while the
                    # model thread computes: it would take the GIL from the model).
                    entries = await self.read_batch(self.settings.busy_poll_s)
                if not entries:
                    await self._answer_computing()
                    await self.clock.maybe_sync(self.settings.clock_sync_s)
                    continue
                if self.settings.max_latency_s > 0:
                    # The batch formed over a wait: callers may have withdrawn items meanwhile.
                    skip |= await self.transport.withdrawn(self.keys, [e[0] for e in entries])
                if self.budget:
                    # A full window means a backlog: read the next one while its last batch
                    # computes (with one batch, now).
                    self._backlog = len(entries) >= self._window
                    batch = self._form(entries, skip)
                    await self._run(batch, self._backlog and not self._held and not self._stopping)
                    backoff = 0.05
                    continue
                # A full batch means a backlog: read the next one while this one computes.
                # (After a short batch there is none; new arrivals are left to idle workers.)
                read_ahead = len(entries) >= self.settings.batch_size and not self._stopping
                if self.threaded:
                    await self._pipeline(self.prepare(entries, skip), read_ahead)
                else:
                    if read_ahead:
                        self._start_read_ahead()
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
                self._in_outage = True
                if self._outage_log.due():
                    log.warning("broker unavailable (%s); retrying until it answers", exc)
                ready = False
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)

    def _drop_in_flight(self) -> None:
        """Cancel the batch read ahead and the replies in flight; forget the batch computing
        (the model thread finishes it; its entries are answered when taken back)."""
        computing = self._computing[1] if self._computing is not None else None
        for task in (self._prefetch, self._finishing, computing):
            if task is not None:
                task.cancel()
        self._prefetch = self._finishing = self._computing = None
        self._held = []  # pending for this consumer: taken back as own once Redis answers

    def _start_read_ahead(self) -> None:
        self._prefetch = asyncio.ensure_future(self.read_batch())

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
        # own: at most a batch (with a budget, a window) in hand and one read ahead; else a
        # bounded share per round
        in_hand = 2 * (WINDOW_BATCHES if self.budget else 1)
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
        except Exception:  # MalformedEntry: no caller that could be told
            request = None
        if request is not None and self._may_reply_to(request.reply_key):
            error = PoisonRequest(f"request {reason}; it sits in the dead-letter stream")
            reply = (request.reply_key, encode_error(request.request_id, error))
            await self.transport.finish(self.keys, [reply], [], self.settings.reply_ttl_s)
        self.observer.replies_sent()

    def _read_count(self) -> int:
        """How many entries a read asks for: batch_size; with a budget, a window of
        WINDOW_BATCHES batches' worth, the batch's worth estimated from recent items' costs."""
        size = self.settings.batch_size
        if not self.budget:
            return size
        mean = self._mean_cost
        if mean is not None and mean > 0:
            size = max(1, min(size, int(self.budget / mean)))
        return WINDOW_BATCHES * size

    async def read_batch(self, busy_poll_s: float = 0.0) -> list[Entry]:
        """Everything queued up to batch_size (with a budget: a window's worth); wait for more
        only while max_latency allows, and only until a batch's worth is in hand. The first
        read polls for ``busy_poll_s`` before it sleeps."""
        settings = self.settings
        keys = self.keys
        count = self._window = self._read_count()
        entries = await self.transport.read_batch(
            keys, self.consumer, count, settings.block_ms, busy_poll_s
        )
        if not entries or settings.max_latency_s <= 0:
            return entries
        fill = count // WINDOW_BATCHES if self.budget else count
        oldest_ms = entry_time_ms(entries[0][0])
        wait_until_ms = oldest_ms + settings.max_latency_s * 1000
        while len(entries) < fill and not self._stopping:
            remaining_ms = int(wait_until_ms - self.clock.now_ms())
            if remaining_ms < 1:
                break
            entries += await self.transport.read_batch(
                keys, self.consumer, fill - len(entries), remaining_ms
            )
        return entries

    async def process(self, entries: list[Entry], skip: set[str] | None = None) -> None:
        """Answer every entry of one batch: a result or a typed error each, then ack. (With
        a budget, the entries are cut into batches by it, which run one after another.)

        Entries in ``skip`` were withdrawn by their callers: they are acknowledged, not computed.
        """
        if self.budget:
            for batch in self._cut_window(entries, skip):
                await self._process_prepared(batch)
        else:
            await self._process_prepared(self.prepare(entries, skip))

    async def _run(self, batch: PreparedBatch, read_ahead: bool) -> None:
        """Compute and answer a prepared batch, inline or on the model thread; with
        ``read_ahead``, read the next batch (window) meanwhile."""
        if self.threaded:
            await self._pipeline(batch, read_ahead)
            return
        if read_ahead:
            self._start_read_ahead()
            await _let_writes_go_out()
        await self._process_prepared(batch)

    async def _process_prepared(self, batch: PreparedBatch) -> None:
        if not batch.items:
            outcomes: list[Any] = []
        elif self.threaded:
            await self._answer_computing()  # the model thread takes one batch at a time here
            future = self._model_thread.submit(self.predict_robust, batch.items)
            self._batch_started(batch)
            outcomes = await self._computed(batch, future)
        else:
            self._batch_started(batch)
            started = time.perf_counter()
            outcomes = self.predict_robust(batch.items)
            self._batch_finished(batch, time.perf_counter() - started)
        await self.answer(batch, outcomes)

    async def _pipeline(self, batch: PreparedBatch, read_ahead: bool) -> None:
        """Thread mode: hand this batch (decoded while the model computed the one before) to
        the model thread as soon as that one is done, answer that one while this one computes,
        and (with ``read_ahead``) read the next batch; without, answer this one too, unless
        batches of the window are still held (the next one follows at once)."""
        finished = await self._collect_computing()
        await self._start_computing(batch)
        if finished is not None:
            await self.answer(*finished)
        if read_ahead:
            self._start_read_ahead()
            await _let_writes_go_out()
        elif not self._held:
            await self._answer_computing()

    async def _start_computing(self, batch: PreparedBatch) -> None:
        """Check a batch again just before the model takes it (deadlines, and withdrawals when
        any are pending: it may have waited a whole batch), then hand it to the model thread."""
        withdrawn: set[str] = set()
        if batch.live and self.transport.cancellations_pending:
            ids = [request.entry_id for request in batch.live]
            withdrawn = await self.transport.withdrawn(self.keys, ids)
        self._drop_stale(batch, withdrawn)
        if not batch.items:
            await self.answer(batch, [])
            return
        # Answering the batch before comes next: let the model thread take this one first.
        future = self._model_thread.submit(self.predict_robust, batch.items, wait_started=True)
        self._batch_started(batch)
        self._computing = (batch, future)

    def _drop_stale(self, batch: PreparedBatch, withdrawn: set[str]) -> bool:
        """Take items withdrawn or past their deadline out of a prepared batch (their
        entries stay, to be acknowledged with it); False if there were none."""
        now_ms = self.clock.now_ms()
        stale = [
            request.entry_id in withdrawn or request.deadline_ms <= now_ms for request in batch.live
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
                batch.replies.append(self._expired(request))
        batch.live, batch.items, batch.costs = live, items, kept_costs
        return True

    # -- batches formed by a cost budget ------------------------------------------------------
    def _form(self, entries: list[Entry], skip: set[str]) -> PreparedBatch:
        """Cut a window just read into batches: the first to run now, the rest held."""
        batches = self._cut_window(entries, skip)
        self._held = batches[1:]
        return batches[0]

    def _cut_window(self, entries: list[Entry], skip: set[str] | None) -> list[PreparedBatch]:
        """Prepare and cost a window, and cut it into batches in the order they run
        (gpu_worker.forming.cut). The first carries the window's other answers: errors,
        withdrawn and dead-lettered entries."""
        window = self.prepare(entries, skip)
        self._cost(window)
        if len(window.items) < 2:
            return [window]
        now_ms = window.now_ms
        urgent_before = now_ms + URGENT_BATCHES * self._batch_s * 1000
        deadlines = [request.deadline_ms for request in window.live]
        order = cut(window.costs, deadlines, self.settings.batch_size, self.budget, urgent_before)
        if len(order) == 1:
            return [window]
        by_id = {entry[0]: entry for entry in window.entries}
        live, items, costs = window.live, window.items, window.costs
        batches = []
        for indices in order:
            batch = PreparedBatch(
                [by_id[live[i].entry_id] for i in indices],
                now_ms,
                [],
                [],
                [live[i] for i in indices],
                [items[i] for i in indices],
                [costs[i] for i in indices],
            )
            batches.append(batch)
        computed = {request.entry_id for request in live}
        first = batches[0]
        first.entries += [entry for entry in window.entries if entry[0] not in computed]
        first.replies, first.dead = window.replies, window.dead
        return batches

    def _cost(self, batch: PreparedBatch) -> None:
        """Each item's cost (the model's item_cost); an item it fails on gets ModelError."""
        cost_of = self.item_cost
        live, items, costs = [], [], []
        for request, item in zip(batch.live, batch.items, strict=True):
            try:
                cost = operator.index(cost_of(item))
                if cost < 0:
                    raise ValueError(f"negative cost {cost}")
            except Exception as exc:
                self.observer.answered("model_error")
                error = ModelError(f"item_cost failed: {describe(exc)}")
                batch.replies.append((request.reply_key, encode_error(request.request_id, error)))
                continue
            live.append(request)
            items.append(item)
            costs.append(cost)
        batch.live, batch.items, batch.costs = live, items, costs
        if costs:
            mean = sum(costs) / len(costs)
            previous = self._mean_cost
            self._mean_cost = mean if previous is None else 0.5 * previous + 0.5 * mean

    async def _held_withdrawn(self) -> set[str]:
        """Which held items their callers withdrew: as checked with the last replies, and
        (inline, when any are pending) checked now for the rest."""
        skip, self._withdrawn = self._withdrawn, set()
        if self.transport.cancellations_pending and not self.threaded:
            checked = self._checked
            ids = [r.entry_id for b in self._held for r in b.live if r.entry_id not in checked]
            if ids:
                skip |= await self.transport.withdrawn(self.keys, ids)
        return skip

    def _take_held(self, withdrawn: set[str]) -> PreparedBatch:
        """The next held batch of the window. Items of the batches still held that were
        withdrawn or expired meanwhile are answered with it rather than after their wait."""
        batch = self._held.pop(0)
        batch.now_ms = self.clock.now_ms()
        self._drop_stale(batch, withdrawn)
        for later in self._held:
            if self._drop_stale(later, withdrawn):
                kept = {request.entry_id for request in later.live}
                batch.entries += [entry for entry in later.entries if entry[0] not in kept]
                later.entries = [entry for entry in later.entries if entry[0] in kept]
                batch.replies += later.replies
                later.replies = []
        self._held = [later for later in self._held if later.entries]
        return batch

    def _expired(self, request: Request) -> tuple[str, bytes]:
        """The reply to an item whose deadline passed before it was computed."""
        self.observer.answered("deadline")
        error = DeadlineExceeded("deadline passed before the item was computed")
        return request.reply_key, encode_error(request.request_id, error)

    async def _collect_computing(self) -> tuple[PreparedBatch, list[Any]] | None:
        """Wait for the batch on the model thread, if any: it and its outcomes."""
        if self._computing is None:
            return None
        batch, future = self._computing
        self._computing = None
        return batch, await self._computed(batch, future)

    async def _answer_computing(self) -> None:
        """Wait for the batch on the model thread, if any, and answer it."""
        finished = await self._collect_computing()
        if finished is not None:
            await self.answer(*finished)

    async def _answer_computing_unless(self, read: asyncio.Future[Any]) -> None:
        """Answer the batch computing if it is done before the batch read ahead arrives (then
        there is no backlog, and its callers must not wait for the read's block timeout)."""
        if self._computing is None or read.done():
            return
        await asyncio.wait((read, self._computing[1]), return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            await self._answer_computing()

    async def _computed(
        self, batch: PreparedBatch, future: asyncio.Future[tuple[list[Any], float]]
    ) -> list[Any]:
        outcomes, seconds = await future
        self._batch_finished(batch, seconds)
        return outcomes

    def prepare(self, entries: list[Entry], skip: set[str] | None = None) -> PreparedBatch:
        """Parse, decode and check a batch; the entries that cannot be computed get their
        answer (or, when nobody can be told, a dead letter). Whatever an entry holds, this
        fails that entry alone: it never raises."""
        observer = self.observer
        batch = PreparedBatch(entries, self.clock.now_ms(), [], [], [], [])
        replies, live, items = batch.replies, batch.live, batch.items
        now_ms = batch.now_ms
        check = self.check_item
        if check is not None:  # an item of the input's dtype and shape passes at this cost
            want_dtype, want_shape = check.dtype, check.shape
        for entry in entries:
            if skip and entry[0] in skip:
                observer.answered("withdrawn")
                continue
            try:
                request = parse_request(*entry)
            except Exception as exc:  # MalformedEntry (were it anything else: not fatal)
                self._malformed(entry, exc, batch)
                continue
            if not self._may_reply_to(request.reply_key):
                batch.dead.append((entry, self._misdirected))
                log.warning(
                    "dead-lettered entry %s on %s: its reply key %r is not one of this "
                    "model's inboxes", entry[0], self.keys.stream, request.reply_key[:200],
                )  # fmt: skip
                self.observer.answered("malformed")
                continue
            # Past its deadline: also when the clock estimate lags Redis' a little, an entry is
            # never before its own time (so one of timeout 0 is never computed).
            deadline_ms = request.deadline_ms
            if deadline_ms <= now_ms or deadline_ms <= request.arrival_ms:
                replies.append(self._expired(request))
                continue
            try:
                item = codec.decode(request.data)
                if check is not None and (
                    type(item) is not np.ndarray
                    or item.dtype is not want_dtype
                    or item.shape != want_shape
                ):
                    item = check(item)
            except Exception as exc:  # CodecError, InvalidInput
                replies.append(self._refused(request, exc))
                continue
            items.append(item)
            live.append(request)
        return batch

    def _malformed(self, entry: Entry, exc: Exception, batch: PreparedBatch) -> None:
        """Answer (or dead-letter, when nobody can be told) an entry that is not a request."""
        if not isinstance(exc, MalformedEntry):  # parse_request raises nothing else
            log.error("cannot parse entry %s on %s: %s", entry[0], self.keys.stream, describe(exc))
            exc = MalformedEntry("entry could not be parsed")
        if not exc.request_id or not exc.reply_key:
            batch.dead.append((entry, NO_READER))
        elif self._may_reply_to(exc.reply_key):
            batch.replies.append((exc.reply_key, encode_error(exc.request_id, exc)))
        else:
            batch.dead.append((entry, self._misdirected))
        log.warning("malformed entry %s on %s: %s", entry[0], self.keys.stream, exc)
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

    def _may_reply_to(self, key: str) -> bool:
        """ModelKeys.may_reply_to, without formatting the namespace for every entry."""
        namespace = self._reply_namespace
        return len(key) > len(namespace) and key.startswith(namespace)

    def _batch_started(self, batch: PreparedBatch) -> None:
        now_ms = batch.now_ms
        self.observer.batch_started(
            len(batch.items),
            [(now_ms - r.arrival_ms) / 1000 for r in batch.live],
            [r.traceparent for r in batch.live if r.traceparent],
        )

    def _batch_finished(self, batch: PreparedBatch, seconds: float) -> None:
        size = len(batch.items)
        self.observer.batch_finished(size, seconds)
        self._batch_s = 0.8 * self._batch_s + 0.2 * seconds if self._batch_s else seconds
        # full: batch_size items, or (with a budget) half the budget's cost
        if size >= self.settings.batch_size or (
            self.budget and 2 * sum(batch.costs) >= self.budget
        ):
            average = self._full_batch_s
            self._full_batch_s = seconds if average is None else 0.8 * average + 0.2 * seconds
            bound = INLINE_BELOW_S if self._slow_batches else THREAD_FROM_S
            self._slow_batches = self._full_batch_s >= bound

    async def answer(self, batch: PreparedBatch, outcomes: list[Any]) -> None:
        """Encode the computed items' outcomes, then send every reply and ack the batch."""
        observer = self.observer
        replies = batch.replies
        if batch.items:
            counts: dict[str, int] = {}
            for request, outcome in zip(batch.live, outcomes, strict=True):
                reply, kind = self._encode_outcome(request, outcome)
                replies.append((request.reply_key, reply))
                counts[kind] = counts.get(kind, 0) + 1
            for kind, count in counts.items():
                observer.answered(kind, count)
            self.batches += 1
            self.items += len(batch.items)
        dead = batch.dead
        for reason in dict.fromkeys(reason for _, reason in dead):
            entries = [entry for entry, why in dead if why == reason]
            await self.transport.dead_letter(self.keys, entries, reason)
        dead_ids = {entry_id for (entry_id, _), _ in dead}
        answered = [entry for entry in batch.entries if entry[0] not in dead_ids]
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
        """Entry ids of the batch read ahead while this one computed, if it has arrived, and
        of the items held for the window's next batches."""
        held = [request.entry_id for batch in self._held for request in batch.live]
        task = self._prefetch
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return held
        return held + [entry_id for entry_id, _ in task.result()]

    @staticmethod
    def _encode_outcome(request: Request, outcome: Any) -> tuple[bytes, str]:
        """The reply to one computed item, and the name of its outcome."""
        if isinstance(outcome, MicrobatchError):
            kind = "model_error" if isinstance(outcome, ModelError) else "invalid_output"
            return encode_error(request.request_id, outcome), kind
        try:
            return encode_result(request.request_id, outcome), "ok"
        except Exception as exc:  # CodecError; anything else must not take the worker down
            text = str(exc) if isinstance(exc, CodecError) else describe(exc)
            error = InvalidOutput(f"cannot send output: {text}")
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
