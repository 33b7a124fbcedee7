"""The client: submit items, route replies back, raise typed errors.

A :class:`ClientCore` does the I/O of one Streamer on one event loop: concurrent submits are
coalesced into one round trip, and every reply comes through one inbox list (with a
partitioned queue, one per partition in use), routed to its call by request id. Synchronous
callers share a core on a private loop thread (their calls and results cross threads through
:mod:`broker.handoff`, a few wake-ups per batch rather than a chain of futures per call);
asyncio callers get a core on their own running loop, so ``apredict`` never crosses threads.
:class:`Streamer` makes its cores lazily in each process, so it is safe to create before
gunicorn forks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import numbers
import os
import random
import socket
import threading
import uuid
import warnings
import weakref
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

from . import codec
from .deadlines import Deadlines
from .errors import (
    BrokerUnavailable,
    DeadlineExceeded,
    MicrobatchError,
    NoWorkers,
    QueueFull,
    describe_error,
    error_from_wire,
)
from .handoff import CallFuture, Mailbox, Relay, Waiter
from .keys import MAX_PARTITIONS, NORMAL, ModelKeys, check_name
from .logs import Every, ThrottledWarning, redact_url
from .loop_thread import LoopThread
from .partitions import split_bound
from .priorities import parse_priority
from .protocol import CallRequests, Reply
from .reply_elements import decode_any
from .stage_check import StageCheck, stage_names
from .transport import UNBOUNDED, QueueBound, RepliesRefused, Transport
from .worker_watch import CHECK_EVERY_S, WorkerWatch

if TYPE_CHECKING:
    from typing_extensions import Self  # (typing's from Python 3.11)

    from .client_settings import ClientSettings

log = logging.getLogger("microbatch.client")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_TIMEOUT_S = 30.0
REPLY_BATCH = 1024
REPLY_WAIT_S = 1.0
LOG_EVERY_S = 60.0  # garbage flooding an inbox logs a line a minute, not one per reply
PARTITIONS_EVERY_S = 5.0  # how often a busy core reads the model's partition count again
# A partition whose enqueue has gone unanswered this long (its primary gone silent: stopped,
# its host frozen or cut off without a reset) takes no new calls while another partition
# does not wait so; the calls sent to it wait for that enqueue's end (an answer, or
# BrokerUnavailable at the connection's 10 s reply timeout) or their deadline.
SEND_STALLED_S = 1.0

AnyFuture = Future[list[Any]] | asyncio.Future[list[Any]]
Outcome = AnyFuture | Waiter  # where a call's results go: a future, or a blocked thread's waiter
# The threads one batch of replies wakes (in turn) let their next calls out in two halves of the
# batch, of at least this many, rather than all once the last is woken: the worker starts on
# the first half while the rest still wake, where the client and the worker took turns.
LET_OUT_AT_LEAST = 16
STUCK_S = 5.0  # a blocked caller gives up this long after its deadline if the loop never answers
# The longest timeout a call may have: a year, far below what thread waits accept
# (threading.TIMEOUT_MAX) and what a request's timeout field holds.
MAX_TIMEOUT_S = 365 * 24 * 3600.0
CLOSE_WITHDRAW_S = 2.0  # the longest a closing client waits for its withdrawals to go out
CLOSED_WHILE_WAITING = "the Streamer was closed while the call waited (its items are withdrawn)"

# Bumped in a forked child: a Streamer made before the fork must not use its parent's loop
# thread or connections. (Cheaper than comparing os.getpid(), a system call, on every call.)
_fork_generation = 0
# Held while a Streamer forgets its parent's state in a child, so that the child's threads
# reset it once (made anew in the child: a thread of the parent may have held it at the fork).
_fork_lock = threading.Lock()


def _forked() -> None:
    global _fork_generation, _fork_lock
    _fork_generation += 1
    _fork_lock = threading.Lock()


os.register_at_fork(after_in_child=_forked)


class _Call:
    """One predict/submit call: N items, one future."""

    __slots__ = (
        "abandoned", "accepted_at", "deadline", "entries", "errors", "future", "ids", "level",
        "post", "queue", "remaining", "requests", "results", "timeout_s",
    )  # fmt: skip

    def __init__(
        self,
        requests: CallRequests,
        future: Outcome,
        timeout_s: float,
        post: Callable[[list[Any]], list[Any]] | None = None,
        level: int = NORMAL,
    ) -> None:
        self.requests = requests
        self.level = level  # its priority level (broker.keys.LEVELS)
        self.ids = ids = requests.request_ids
        self.future = future
        self.timeout_s = timeout_s
        self.post = post  # applied to the results before the future gets them
        self.entries: list[str] = []  # stream entry ids, once queued
        self.queue: ModelKeys | None = None  # the keys of the partition it was queued to
        self.results: list[Any] = [None] * len(ids)
        self.errors: dict[int, MicrobatchError] = {}
        self.remaining = len(ids)
        self.deadline: int | None = None  # its key in the core's Deadlines, once accepted
        self.accepted_at = 0.0  # loop time (set when the core watches for workers)
        self.abandoned = False  # failed while being queued: withdraw its items once queued


class ClientCore:
    """The I/O engine of one Streamer on one event loop. Only that loop touches its state."""

    def __init__(
        self,
        keys: ModelKeys,
        transport: Transport,
        loop: asyncio.AbstractEventLoop,
        bound: QueueBound = UNBOUNDED,
        watch: WorkerWatch | None = None,
        stages: Sequence[str] = (),
    ) -> None:
        self.keys = keys
        self.transport = transport
        self.loop = loop
        self.bound = bound
        self.client_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # The inbox of the calls queued to partition 0 (all of them, with one partition); a
        # call queued to partition k names this client's inbox in partition k's namespace.
        self.inbox = keys.inbox(self.client_id)
        self._inboxes: dict[int, str] = {0: self.inbox}
        self._ids = itertools.count()
        self._pending: dict[str, tuple[_Call, int]] = {}
        self._outbox: list[_Call] = []
        # calls from other threads; those posted once it is closing are refused in their own
        self._incoming: Mailbox[_Call] = Mailbox(loop, self._accept, self._refuse_closed)
        self._relay = Relay()  # wakes the blocked threads of one batch of replies in turn
        self._waking: list[tuple[Waiter, Any, BaseException | None]] | None = None
        self._flusher: asyncio.Task[None] | None = None
        # A partitioned queue's calls go out per lane (each level of each partition), one
        # enqueue in flight per lane, so that a partition whose primary does not answer
        # holds back no other: the calls waiting for each lane, the keys and bound they go
        # with, its sender, and the loop time its enqueue in flight was sent.
        self._lane_outbox: dict[int, list[_Call]] = {}
        self._lane_target: dict[int, tuple[ModelKeys, QueueBound]] = {}
        self._lane_senders: dict[int, asyncio.Task[None]] = {}
        self._lane_sent_at: dict[int, float] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}  # one per inbox with calls waiting
        self._background: set[asyncio.Task[None]] = set()
        self._deadlines: Deadlines[_Call] = Deadlines(loop, self._expire)
        self._closing = False
        self._closed = False  # aclose() went to its end (the transport is closed)
        inboxes = f"{self.inbox} (or its partitions')"
        self._unreadable = ThrottledWarning(
            log, f"dropped %d unreadable reply(ies) on {inboxes}; the last: %s", LOG_EVERY_S
        )
        self._unpoppable = ThrottledWarning(
            log, f"%d failed read(s) of replies from {inboxes}; the last: %s", LOG_EVERY_S
        )
        # NoWorkers: None where callers wait for workers however long (wait_for_workers).
        self._watch = watch
        self._watch_timer: asyncio.TimerHandle | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._watch_log = Every(10.0)
        # A pipeline's (its stage names given): what names a later stage without workers in
        # the errors of calls that wait on it.
        self._stages = StageCheck(keys, stages, transport, loop) if len(stages) > 1 else None
        # The model's partition count, read before the first send and again every
        # PARTITIONS_EVERY_S while calls go out; calls go to partitions in turn, from a
        # random one, so that many callers spread evenly.
        self._partitions = 1
        self._partitions_due: float | None = None  # loop time of the next read (None: never read)
        self._partitions_task: asyncio.Task[MicrobatchError | None] | None = None
        self._turn = random.randrange(1 << 16)
        self._shutdown_hook: AsyncGenerator[None, None] | None = None  # close_at_loop_shutdown

    def close_at_loop_shutdown(self) -> None:
        """Close this core when its event loop shuts down, before the loop is closed (call it
        on that loop). asyncio.run() (and any runner that calls ``loop.shutdown_asyncgens()``,
        as asyncio.Runner, uvloop.run() and IsolatedAsyncioTestCase do) closes the loop's
        async generators still open once it has cancelled its tasks, and this core holds one.
        Without it, each asyncio.run() of a shared Streamer left its loop's connections open
        until the garbage collector found them: one Redis connection and one file descriptor
        per call for as long as the collector let them be (for good with it off)."""
        hook = self._shutdown_hook = _close_at_shutdown(self)
        starting: Any = hook.asend(None)  # run to its yield: the loop now knows of it
        with contextlib.suppress(StopIteration):
            starting.send(None)

    def _new_call(
        self,
        payloads: Sequence[bytes],
        future: Outcome,
        timeout_s: float,
        trace: str | None,
        post: Callable[[list[Any]], list[Any]] | None = None,
        level: int = NORMAL,
    ) -> _Call:
        ids = [f"{self.client_id}.{next(self._ids)}" for _ in payloads]
        timeout_ms = max(1, int(timeout_s * 1000))
        requests = CallRequests(self.inbox, timeout_ms, ids, payloads, trace)
        return _Call(requests, future, timeout_s, post, level)

    async def call(
        self,
        payloads: Sequence[bytes],
        timeout_s: float,
        trace: str | None = None,
        level: int = NORMAL,
    ) -> list[Any]:
        """Run a call on this core's loop and return its raw results.

        Cancelled (the caller's task), the call is withdrawn.
        """
        if not payloads:
            return []
        future: asyncio.Future[list[Any]] = self.loop.create_future()
        call = self._new_call(payloads, future, timeout_s, trace, level=level)
        self._accept(call)
        try:
            return await future
        except asyncio.CancelledError:
            # The task ends once its items are withdrawn: asyncio.run() and a loop's shutdown
            # wait for cancelled tasks, never for a task they did not cancel.
            withdrawal = self._forget(call)
            if withdrawal is not None:
                await asyncio.wait([withdrawal], timeout=CLOSE_WITHDRAW_S)
            raise

    def start_call(
        self,
        payloads: Sequence[bytes],
        timeout_s: float,
        trace: str | None = None,
        post: Callable[[list[Any]], list[Any]] | None = None,
        level: int = NORMAL,
    ) -> asyncio.Future[list[Any]]:
        """Queue encoded items; must be called on this core's loop. The future gets the raw
        results, or what ``post`` makes of them; cancelling it withdraws the call."""
        future: asyncio.Future[list[Any]] = self.loop.create_future()
        if not payloads:
            future.set_result([])
            return future
        call = self._new_call(payloads, future, timeout_s, trace, post, level)
        future.add_done_callback(lambda done: self._forget(call) if done.cancelled() else None)
        self._accept(call)
        return future

    def call_blocking(
        self,
        payloads: Sequence[bytes],
        timeout_s: float,
        trace: str | None = None,
        level: int = NORMAL,
    ) -> list[Any]:
        """Run a call from any thread but the loop's and wait for its raw results.

        Interrupted (KeyboardInterrupt, ...), the call is withdrawn before the error goes on.
        """
        if not payloads:
            return []
        if asyncio._get_running_loop() is self.loop:
            # A callback of a submit() future runs here: blocking would stop every call of
            # this Streamer until the timeout, its own reply included.
            raise RuntimeError(
                "predict() cannot wait on the Streamer's own thread, where the callbacks of "
                "submit() futures run: it would wait for itself. Use submit() there, or call "
                "predict() from another thread"
            )
        waiter = Waiter(self._relay)
        call = self._new_call(payloads, waiter, timeout_s, trace, level=level)
        try:
            self._incoming.post(call)
            results: list[Any] = waiter.wait(timeout_s + STUCK_S)
        except TimeoutError:  # the loop never answered: its thread is stuck or gone
            self._forget_threadsafe(call)
            raise DeadlineExceeded(f"no reply within {timeout_s:g} s", index=0) from None
        except BaseException:
            waiter.abandon()
            if waiter.cancelled():
                self._forget_threadsafe(call)
            raise
        return results

    def _forget_threadsafe(self, call: _Call) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop has nothing left to withdraw
            self.loop.call_soon_threadsafe(self._forget, call)

    def start_call_threadsafe(
        self,
        payloads: Sequence[bytes],
        timeout_s: float,
        trace: str | None = None,
        post: Callable[[list[Any]], list[Any]] | None = None,
        level: int = NORMAL,
    ) -> Future[list[Any]]:
        """Queue encoded items from any thread; the future gets the raw results, or what
        ``post`` (run on the loop thread) makes of them. Cancelling it withdraws the call."""
        future: CallFuture[list[Any]] = CallFuture(self._relay, loop=self.loop)
        if not payloads:
            future.set_result([])
            return future
        call = self._new_call(payloads, future, timeout_s, trace, post, level)
        future.on_cancel = lambda: self._on_cancelled(call)
        self._incoming.post(call)
        return future

    def _accept(self, call: _Call) -> None:
        if call.future.done():  # cancelled before it reached the loop
            return
        if self._closing:  # nothing was queued
            self._refuse(call, BrokerUnavailable(CLOSED_WHILE_WAITING))
            return
        for index, rid in enumerate(call.ids):
            self._pending[rid] = (call, index)
        watch = self._watch
        if watch is not None:
            now = call.accepted_at = self.loop.time()
            if watch.known_dead(now):  # fail at once: nothing queued, nothing to withdraw
                self._fail_calls([call], self._no_workers())
                return
            if self._watch_timer is None and self._watch_task is None:
                wait = watch.due(now, self._oldest_call_at())
                self._watch_timer = self.loop.call_later(wait, self._watch_tick)
        call.deadline = self._deadlines.add(call, call.timeout_s)
        self._outbox.append(call)
        if self._flusher is None:
            self._flusher = self.loop.create_task(self._flush())
        self._start_reader(call.requests.reply_key)

    async def _flush(self) -> None:
        # Everything submitted while one round trip is in flight goes out together in the next.
        try:
            while self._outbox:
                batch = [call for call in self._outbox if not call.future.done()]
                self._outbox = []
                if batch:
                    await self._send(batch)
        finally:
            self._flusher = None

    async def _send(self, calls: list[_Call]) -> None:
        due = self._partitions_due
        if due is None:
            unavailable = await self._read_partitions()
            if unavailable is not None:  # the enqueue would only wait as long again
                self._fail_calls(calls, unavailable)
                return
        elif due <= self.loop.time() and self._partitions_task is None:
            self._partitions_task = self.loop.create_task(self._read_partitions())
        count = self._partitions
        if count == 1 and all(call.level == NORMAL for call in calls):
            await self._send_to(self.keys, calls, self.bound)
            return
        # Each call goes whole to one partition (so it is still queued whole or not at all),
        # the calls in turn, to the stream of its level there; each partition's bound is its
        # share of the model's (each level has it).
        # A call queued to partition k names this client's inbox in k's namespace (in k's
        # slot), read by a reader of its own.
        by_lane: dict[int, list[_Call]] = {}
        queue = self.keys.spread(count)
        stalled = self._stalled_partitions(count) if self._lane_sent_at else set()
        for call in calls:
            self._turn += 1
            partition = self._turn % count
            while partition in stalled:  # (some partition is not: see _stalled_partitions)
                self._turn += 1
                partition = self._turn % count
            lane = queue.of(partition).at(call.level).lane
            by_lane.setdefault(lane, []).append(call)
            call.requests.reply_key = inbox = self._inbox(queue, partition)
            self._start_reader(inbox)
        bound = QueueBound(
            split_bound(self.bound.max_items, count), split_bound(self.bound.max_bytes, count)
        )
        for lane, part in by_lane.items():
            self._lane_outbox.setdefault(lane, []).extend(part)
            self._lane_target[lane] = (queue.of(lane), bound)
            if lane not in self._lane_senders:
                self._lane_senders[lane] = self.loop.create_task(self._send_lane(lane))

    def _stalled_partitions(self, count: int) -> set[int]:
        """The partitions (of ``count``) whose enqueue in flight has waited SEND_STALLED_S or
        more; none where that is every one (the calls then go in turn, as ever)."""
        since = self.loop.time() - SEND_STALLED_S
        stalled = {
            lane % MAX_PARTITIONS
            for lane, sent_at in self._lane_sent_at.items()
            if sent_at <= since and lane % MAX_PARTITIONS < count
        }
        return stalled if len(stalled) < count else set()

    async def _send_lane(self, lane: int) -> None:
        """Send a lane's calls, those that come while an enqueue is in flight together in
        the next, until none waits."""
        try:
            while self._lane_outbox.get(lane):
                calls = [call for call in self._lane_outbox.pop(lane) if not call.future.done()]
                if not calls:
                    continue
                queue, bound = self._lane_target[lane]
                self._lane_sent_at[lane] = self.loop.time()
                try:
                    await self._send_to(queue, calls, bound)
                finally:
                    del self._lane_sent_at[lane]
        finally:
            del self._lane_senders[lane]

    def _inbox(self, queue: ModelKeys, partition: int) -> str:
        """This client's inbox in partition ``partition``'s namespace."""
        inbox = self._inboxes.get(partition)
        if inbox is None:
            inbox = self._inboxes[partition] = queue.of(partition).inbox(self.client_id)
        return inbox

    async def _read_partitions(self) -> MicrobatchError | None:
        """Read the model's partition count (kept as it was if Redis does not answer). The
        first read's failure to reach Redis is returned (it is read first again next time)."""
        try:
            self._partitions = await self.transport.partition_count(self.keys)
        except MicrobatchError as exc:  # Redis is away
            log.debug("could not read the partition count of %s: %s", self.keys.stream, exc)
            if self._partitions_due is None:
                return exc
        except Exception as exc:  # e.g. an ACL without GET on it: partition 0 is always read
            if self._partitions_due is None:
                log.warning(
                    "cannot read the partition count of model %s (%s): sending to partition "
                    "0 only", self.keys.model, exc,
                )  # fmt: skip
        finally:
            self._partitions_task = None
        self._partitions_due = self.loop.time() + PARTITIONS_EVERY_S
        return None

    async def _send_to(self, queue: ModelKeys, calls: list[_Call], bound: QueueBound) -> None:
        try:
            outcomes = await self.transport.enqueue(queue, [call.requests for call in calls], bound)
        except MicrobatchError as exc:
            self._fail_calls(calls, exc)
            return
        except Exception as exc:
            log.exception("submitting to %s failed", queue.stream)
            self._fail_calls(calls, BrokerUnavailable(f"{type(exc).__name__}: {exc}"))
            return
        for call, outcome in zip(calls, outcomes, strict=True):
            if isinstance(outcome, QueueFull):
                self._give_up_naming_stage(call, outcome)
            elif isinstance(outcome, MicrobatchError):
                self._fail_calls([call], outcome)
            else:
                call.entries, call.queue = outcome, queue
                if call.future.cancelled() or call.abandoned:  # gave up while being queued
                    self._withdraw(call)

    def _start_reader(self, inbox: str) -> None:
        """Read ``inbox`` unless a reader already does."""
        if inbox not in self._readers and not self._closing:
            self._readers[inbox] = self.loop.create_task(self._read_replies(inbox))

    def _waiting_on(self, inbox: str) -> bool:
        """Whether a call in flight waits for replies on ``inbox``."""
        if inbox == self.inbox and len(self._inboxes) == 1:
            return bool(self._pending)  # one partition: every call does
        return any(call.requests.reply_key == inbox for call, _ in self._pending.values())

    def _calls_on(self, inbox: str) -> list[_Call]:
        """The calls in flight waiting for replies on ``inbox``, each once."""
        calls = {id(call): call for call, _ in self._pending.values()}
        return [call for call in calls.values() if call.requests.reply_key == inbox]

    def _read_failed(self, inbox: str, exc: Exception) -> None:
        """A read of ``inbox`` failed: with Redis away its calls keep waiting (until their
        deadlines); refused to this user, they fail now, as waiting will not help."""
        if isinstance(exc, RepliesRefused):
            self._unpoppable.note(exc.message[:200])
            for call in self._calls_on(inbox):
                self._give_up(call, exc.with_index)
        elif not isinstance(exc, MicrobatchError):  # e.g. the inbox is not a list
            self._unpoppable.note(f"{type(exc).__name__}: {exc}"[:200])

    async def _read_replies(self, inbox: str) -> None:
        # A reader outlives the calls in flight on its inbox by one idle wait (REPLY_WAIT_S),
        # so that a caller sending one call after another finds a read already waiting in
        # Redis. (BLMPOP of several keys must keep to one slot: each inbox has its reader.)
        backoff = 0.05
        try:
            while not self._closing:
                try:
                    payloads = await self.transport.pop_replies(inbox, REPLY_BATCH, REPLY_WAIT_S)
                except Exception as exc:
                    self._read_failed(inbox, exc)
                    if not self._waiting_on(inbox):
                        break
                    # Redis is away: waiting calls keep waiting until their deadlines.
                    await asyncio.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                if not payloads and not self._waiting_on(inbox):
                    break
                backoff = 0.05
                self._waking = waking = []  # type: ignore[var-annotated]
                try:
                    self._take(payloads)
                finally:
                    self._waking = None
                    if waking:  # once this task has sent its next read, as asyncio would
                        self.loop.call_soon(self._wake, waking)
        finally:
            del self._readers[inbox]
            if not self._closing and self._waiting_on(inbox):  # a call came as it left
                self._start_reader(inbox)

    def _take(self, elements: list[bytes]) -> None:
        """Resolve the replies of elements popped from an inbox: each a reply map or a packed
        element of several (docs/protocol.md, section 7.1)."""
        resolve = self._resolve
        for element in elements:
            try:
                replies = decode_any(element)
            except Exception as exc:  # nothing routes it: its call ends at its deadline
                self._unreadable.note(describe_error(exc))
                continue
            for reply in replies:
                if isinstance(reply, Reply):
                    resolve(reply)
                else:  # an entry of a packed element that nothing routes
                    self._unreadable.note(describe_error(reply))

    def _wake(self, waking: list[tuple[Waiter, Any, BaseException | None]]) -> None:
        # Calls the woken threads make next go out together, half the batch at a time
        # (LET_OUT_AT_LEAST), as asyncio callers' do: the last thread of each lets them go.
        self._incoming.hold()
        every = max(LET_OUT_AT_LEAST, -(-len(waking) // 2))
        self._relay.settle(
            waking, self._incoming.release, every=every, meanwhile=self._incoming.let_out
        )

    def _resolve(self, reply: Reply) -> None:
        found = self._pending.pop(reply.request_id, None)
        if found is None:  # a late or duplicate reply: its call is already settled
            return
        call, index = found
        if reply.ok:
            call.results[index] = reply.result
        else:
            call.errors[index] = error_from_wire(
                reply.error_type, reply.error_message, index=index, stage=reply.error_stage
            )
        call.remaining -= 1
        if call.remaining == 0:
            self._settle(call)

    def _settle(self, call: _Call) -> None:
        if call.deadline is not None:
            self._deadlines.discard(call, call.deadline)
        future = call.future
        if future.done():
            return
        results: Any = call.results
        error: BaseException | None = call.errors[min(call.errors)] if call.errors else None
        if error is None and call.post is not None:
            try:
                results = call.post(results)
            except Exception as exc:
                error = exc
        waking = self._waking
        if waking is not None and isinstance(future, Waiter):
            waking.append((future, results, error))  # woken with the whole batch
        elif waking is not None and isinstance(future, CallFuture):
            waking += [(waiter, None, None) for waiter in future.settle_quietly(results, error)]
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(results)

    def _refuse_closed(self, call: _Call) -> None:
        """Fail a call posted from another thread once this core is closing: nothing of it was
        queued. (It may run in the posting thread: the future is set directly, not through a
        batch of replies being woken.)"""
        future = call.future
        call.remaining = 0
        with contextlib.suppress(InvalidStateError):  # a submit() future cancelled meanwhile
            if not future.done():
                future.set_exception(BrokerUnavailable(CLOSED_WHILE_WAITING, index=0))

    def _fail_items(self, call: _Call, make_error: Callable[[int], MicrobatchError]) -> None:
        for index, rid in enumerate(call.ids):
            if self._pending.pop(rid, None) is not None:
                call.errors[index] = make_error(index)
                call.remaining -= 1
        self._settle(call)

    def _refuse(self, call: _Call, error: MicrobatchError) -> None:
        """Fail a call that was never accepted (nothing of it is queued)."""
        for index in range(len(call.ids)):
            call.errors[index] = error.with_index(index)
        call.remaining = 0
        self._settle(call)

    def _fail_calls(self, calls: Iterable[_Call], error: MicrobatchError) -> None:
        for call in calls:
            self._fail_items(call, error.with_index)

    def _expire(self, call: _Call) -> None:
        """The call's deadline passed: its unanswered items fail and are withdrawn (a worker
        would only skip them, and until then they count against the queue bound: with no
        worker reading, expired items alone could fill it)."""
        self._give_up_naming_stage(call, DeadlineExceeded(f"no reply within {call.timeout_s:g} s"))

    def _give_up_naming_stage(self, call: _Call, error: MicrobatchError) -> None:
        """:meth:`_give_up` with ``error``; a pipeline's, once it names the later stages
        that have no live worker (a round trip, shared by the calls failing meanwhile)."""
        if self._stages is None:
            self._give_up(call, error.with_index)
            return
        task = self.loop.create_task(self._name_stage_and_give_up(call, error, self._stages))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _name_stage_and_give_up(
        self, call: _Call, error: MicrobatchError, stages: StageCheck
    ) -> None:
        named = await stages.name_stage(error)
        self._give_up(call, named.with_index)

    def _give_up(self, call: _Call, make_error: Callable[[int], MicrobatchError]) -> None:
        """Fail ``call``'s unanswered items with ``make_error`` and withdraw them (a call still
        being queued is withdrawn once it is)."""
        unanswered = self._unanswered(call)
        call.abandoned = True
        self._fail_items(call, make_error)
        if call.entries and unanswered:
            self._withdraw(call, unanswered)

    def _unanswered(self, call: _Call) -> list[int]:
        """The indexes of ``call``'s items still waiting for a reply: the ones to withdraw
        (marks for answered items would stand in the cancelled set for nothing, and cost
        workers a check per batch while they stand)."""
        pending = self._pending
        return [index for index, rid in enumerate(call.ids) if rid in pending]

    # -- NoWorkers ---------------------------------------------------------------------------
    def _no_workers(self) -> NoWorkers:
        assert self._watch is not None
        keys = self.keys
        first = "" if self._stages is None else f" (its first stage, {self._stages.first!r})"
        return NoWorkers(
            f"no live worker has consumed model {keys.model!r}{first} under prefix "
            f"{keys.prefix!r} for over {self._watch.grace_s:g} s: check that a worker serves it "
            "(`worker start "
            "--model ...`, or for a pipeline's first stage `worker start --model ... --stage "
            "...`) with the same --prefix and --redis as this caller (`broker status` lists the "
            "live workers); if one does, its workers may be exiting as they start or serve: see "
            "its log",
            stage=None if self._stages is None else self._stages.first,
        )

    def _oldest_call_at(self) -> float:
        call, _ = next(iter(self._pending.values()))  # insertion order: the oldest first
        return call.accepted_at

    def _watch_tick(self) -> None:
        self._watch_timer = None
        if not self._pending or self._closing or self._watch is None:
            return  # the next call accepted starts watching again
        oldest = self._oldest_call_at()
        wait = self._watch.due(self.loop.time(), oldest)
        if wait > 0:
            self._watch_timer = self.loop.call_later(wait, self._watch_tick)
        else:
            self._watch_task = self.loop.create_task(self._check_workers(oldest))

    async def _check_workers(self, oldest_call_at: float) -> None:
        watch = self._watch
        assert watch is not None
        try:
            asked_at = self.loop.time()
            try:
                lapsed = await self.transport.workers_lapsed_s(self.keys)
            except MicrobatchError:  # Redis is away: that says nothing about the workers
                watch.unreachable(self.loop.time())
                return
            except Exception as exc:  # e.g. a Redis user without ZRANGEBYSCORE
                if self._watch_log.due():
                    log.warning("cannot check for live workers of %s: %s", self.keys.stream, exc)
                watch.unreachable(self.loop.time())
                return
            now = self.loop.time()
            if now - asked_at > CHECK_EVERY_S:
                # A slow answer: Redis stalled meanwhile, and no supervisor could renew a
                # heartbeat then, so the lapse it reports says nothing about the workers.
                watch.unreachable(now)
            watch.observe(now, lapsed, oldest_call_at)
            if watch.expired(now):
                self._fail_without_workers()
        finally:
            self._watch_task = None
            if self._pending and not self._closing and self._watch_timer is None:
                self._watch_timer = self.loop.call_later(CHECK_EVERY_S, self._watch_tick)

    def _fail_without_workers(self) -> None:
        """Fail every call in flight with NoWorkers and withdraw their queued items."""
        calls = list({id(call): call for call, _ in self._pending.values()}.values())
        error = self._no_workers()
        if self._watch_log.due():
            log.warning("%s; failing %d call(s)", error.message, len(calls))
        for call in calls:
            self._give_up(call, error.with_index)

    def _on_cancelled(self, call: _Call) -> None:
        if not self.loop.is_closed():
            self._forget_threadsafe(call)

    def _forget(self, call: _Call) -> asyncio.Task[None] | None:
        """The caller gave up on ``call``: drop it, and withdraw its items still queued (the
        withdrawal's task, if any)."""
        if call.remaining == 0:  # settled meanwhile: nothing of it is left in Redis
            return None
        if call.deadline is not None:
            self._deadlines.discard(call, call.deadline)
        unanswered = self._unanswered(call)
        for rid in call.ids:
            self._pending.pop(rid, None)
        if call.entries and unanswered:
            return self._withdraw(call, unanswered)
        return None

    def _withdraw(self, call: _Call, indexes: Sequence[int] | None = None) -> asyncio.Task[None]:
        """Take back the call's queued items: those at ``indexes``, or all of them."""
        entries = list(zip(call.entries, map(len, call.requests.payloads), strict=True))
        ids = call.ids
        if indexes is not None:
            entries, ids = [entries[i] for i in indexes], [ids[i] for i in indexes]
        call.entries = []
        task = self.loop.create_task(self._cancel_entries(call.queue or self.keys, entries, ids))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _cancel_entries(
        self, queue: ModelKeys, entries: list[tuple[str, int]], request_ids: list[str]
    ) -> None:
        try:
            await self.transport.cancel(queue, entries, request_ids)
        except MicrobatchError as exc:  # best effort: the worker will answer into the void
            log.info("could not withdraw %d cancelled item(s): %s", len(entries), exc)
        except Exception as exc:  # e.g. a Redis error reply: the same, but worth a warning
            log.warning(
                "could not withdraw %d item(s) from %s: %s", len(entries), queue.stream, exc
            )

    async def settled(self) -> None:
        """Return once no call is waiting: each ends by its deadline (plus a second for its
        reply or withdrawal), so this ends by the latest deadline of the calls now waiting."""
        if not self._pending:
            return
        latest = max(call.timeout_s for call, _ in self._pending.values())
        until = self.loop.time() + latest + 1.0
        while self._pending and self.loop.time() < until:
            await asyncio.sleep(0.01)

    @property
    def closing(self) -> bool:
        """Whether :meth:`aclose` has begun."""
        return self._closing

    async def aclose(self) -> None:
        """Fail the calls still waiting with :class:`BrokerUnavailable` and withdraw what
        they queued (nobody will read their replies now), then stop reading replies and close
        the transport (on this core's loop). Withdrawals get up to ``CLOSE_WITHDRAW_S``."""
        self._closing = True
        if self._watch_timer is not None:
            self._watch_timer.cancel()
        closed = BrokerUnavailable(CLOSED_WHILE_WAITING)
        self._incoming.close()
        for call in list({id(call): call for call, _ in self._pending.values()}.values()):
            self._give_up(call, closed.with_index)
        # An enqueue still in flight withdraws its calls once they are queued; then every
        # withdrawal (of those, of the calls given up on now or before) goes out.
        if self._flusher is not None:
            await asyncio.wait([self._flusher], timeout=CLOSE_WITHDRAW_S)
        if self._lane_senders:
            await asyncio.wait(list(self._lane_senders.values()), timeout=CLOSE_WITHDRAW_S)
        if self._background:
            await asyncio.wait(list(self._background), timeout=CLOSE_WITHDRAW_S)
        running = (
            *self._readers.values(), self._flusher, self._watch_task, self._partitions_task,
            *self._lane_senders.values(), *self._background,
        )  # fmt: skip
        tasks = [task for task in running if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.transport.close()
        self._closed = True


async def _close_at_shutdown(core: ClientCore) -> AsyncGenerator[None, None]:
    """Waits at its yield until its loop shuts down (or the core is dropped), then closes
    ``core`` unless it is closed already (:meth:`ClientCore.close_at_loop_shutdown`)."""
    try:
        yield
    finally:
        # Also a core whose aclose() began but was cut short: a sync close() on the loop's
        # thread only starts it, and asyncio.run() cancels that task before this runs.
        if not core._closed:
            try:
                await core.aclose()
            except Exception:  # closing is best effort
                log.debug("closing the client as its event loop shut down failed", exc_info=True)


def _caller_side_model(model: Any) -> Any:
    """``model`` (a class is instantiated) if it can prepare items and postprocess outputs, as
    a ManagedModel can; else TypeError, rather than an AttributeError at every call."""
    if model is None:
        return None
    if not _is_model(model):
        what = model.__name__ if isinstance(model, type) else type(model).__name__
        raise TypeError(
            f"model= takes a ManagedModel subclass or instance (or a Pipeline), not {what}: "
            "import the class and pass it"
        )
    return model() if isinstance(model, type) else model


def _is_model(model: Any) -> bool:
    """Whether ``model`` (a class or an instance) has what the caller's side calls."""
    prepares = callable(getattr(model, "prepare_items", None)) or callable(
        getattr(model, "preprocess", None)
    )
    return prepares and callable(getattr(model, "postprocess", None))


class Streamer:
    """Send items to a model's workers through Redis and get their results back.

    ``Streamer("mlp", redis_url=..., prefix=...)`` talks to every worker serving model ``mlp``
    under ``prefix``. With ``model=MLP`` (a ManagedModel class or instance) the model's
    caller-side prepare (``preprocess``, then the check against its declared inputs: a value
    that does not fit raises :class:`InvalidInput` before anything is sent) runs on the items
    and ``postprocess`` on each result, so Python callers send the same raw inputs as HTTP
    callers and are refused the same way. A call that would take the model's queue over its
    bound (stored with the model by its workers: `worker start
    --max-queue-items/--max-queue-bytes`) is refused at once with :class:`QueueFull`, checked
    atomically with the enqueue; ``max_queue_items`` and ``max_queue_bytes`` add a stricter cap
    of this caller's own (0: none).

    A call whose model has had no live worker for ``workers_grace`` seconds (default 10: twice
    the workers' default heartbeat TTL) fails with :class:`NoWorkers`, and its items are
    withdrawn; with ``wait_for_workers=True`` calls wait for a worker until their timeout
    instead (e.g. while workers scale up from zero). Safe to share between threads, and across
    fork: each process makes its own connections on first use. Close it (``close()``, or use
    it as a context manager); one garbage-collected unclosed is closed then, with a
    ResourceWarning.

    ``priority`` (``"normal"``, the default, or ``"high"``; also 0 or 1) is the calls' default
    priority; each call may name its own. Under load, workers batch high items first
    (docs/protocol.md, "Priorities"). An invalid priority raises ValueError.

    ``entry_items`` (default 32) is the most items that calls submitted together (within one
    enqueue round trip) share one stream entry: one entry, ack and pending record for many
    items (docs/protocol.md, "Multi-item entries"). 1 sends one entry per item, for workers
    that read only wire v1.

    For a pipeline (docs/pipelines.md), ``stages`` are its stage names in declaration order
    (default: those of ``model``, when it is a Pipeline): a call that times out
    (:class:`DeadlineExceeded`) or is refused (:class:`QueueFull`) while a later stage has no
    live worker names that stage, in its message and its ``stage``; :class:`NoWorkers` names
    the first stage.

    Every keyword argument but ``model`` and ``stages`` is a field of
    :class:`broker.client_settings.ClientSettings` (``client_settings``): each one given wins
    over ``settings=``, which defaults to the environment (``MICROBATCH_CLIENT_<FIELD>``;
    ``REDIS_URL`` too) and the defaults.
    """

    # Whether apredict may run on the caller's loop (False where the transport lives on the
    # private loop thread, as with the in-memory transport of LocalStreamer).
    native_async = True

    def __init__(
        self,
        name: str,
        redis_url: str | None = None,
        prefix: str | None = None,
        model: Any = None,
        *,
        timeout: float | None = None,
        max_queue_items: int | None = None,
        max_queue_bytes: int | None = None,
        wait_for_workers: bool | None = None,
        workers_grace: float | None = None,
        priority: str | int | None = None,
        entry_items: int | None = None,
        settings: ClientSettings | None = None,
        stages: Sequence[str] | None = None,
    ) -> None:
        from .client_settings import ClientSettings

        # Each argument given wins over ``settings`` (default: the environment's
        # MICROBATCH_CLIENT_*, REDIS_URL, then the defaults); a bad one raises a ValueError here.
        self.client_settings = config = ClientSettings.resolve(
            settings,
            redis_url=redis_url,
            prefix=prefix,
            timeout=timeout,
            max_queue_items=max_queue_items,
            max_queue_bytes=max_queue_bytes,
            wait_for_workers=wait_for_workers,
            workers_grace=workers_grace,
            priority=priority,
            entry_items=entry_items,
        )
        # a model's (or pipeline's) name: a later stage's keys are its previous stage's to fill
        self.keys = ModelKeys(check_name(name), config.prefix)
        self.level = parse_priority(config.priority)  # the calls' default priority level
        self.bound = QueueBound(config.max_queue_items, config.max_queue_bytes)
        self.wait_for_workers = config.wait_for_workers
        self.workers_grace = config.workers_grace
        self.redis_url = config.redis_url
        self.timeout = config.timeout
        self.model = _caller_side_model(model)
        self.stages = [check_name(s) for s in stages] if stages else stage_names(self.model)
        self._reset_for_process()

    def _reset_for_process(self) -> None:
        abandoned = getattr(self, "_abandoned", None)
        if abandoned is not None:  # the parent's loop thread: not in this process
            abandoned.detach()
        self._lock = threading.Lock()
        self._thread: LoopThread | None = None
        self._thread_core: ClientCore | None = None
        # closes the loop thread of a Streamer dropped without close() (a Streamer made per
        # request would otherwise leave a thread and its connections behind each time)
        self._abandoned: weakref.finalize[Any, Any] | None = None
        self._loop_cores: dict[asyncio.AbstractEventLoop, ClientCore] = {}
        # Last: a thread that finds the generation current (without the lock) finds the state
        # of this process, never the parent's core.
        self._generation = _fork_generation

    @property
    def name(self) -> str:
        """The model's name, as its workers serve it."""
        return self.keys.model

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A Streamer holds this process's connections and threads: it crosses a fork, not
        a pickle (a spawned process's arguments)."""
        raise TypeError(
            f"a {type(self).__name__} cannot be pickled (to a spawned process, say): make one in "
            f"the process that uses it ({type(self).__name__}({self.name!r}, ...)), or share one "
            "across fork"
        )

    def __repr__(self) -> str:  # never the URL's password
        url, prefix = redact_url(self.redis_url), self.keys.prefix
        return f"{type(self).__name__}({self.name!r}, redis_url={url!r}, prefix={prefix!r})"

    def _make_transport(self) -> Transport:
        from .redis_transport import RedisTransport

        return RedisTransport(self.redis_url, entry_items=self.client_settings.entry_items)

    def _on_core_start(self, core: ClientCore) -> Any:
        """Hook run once on the loop thread when its core starts (used by LocalStreamer)."""
        return None

    def _new_watch(self) -> WorkerWatch | None:
        return None if self.wait_for_workers else WorkerWatch(self.workers_grace)

    def _new_core(self, loop: asyncio.AbstractEventLoop) -> ClientCore:
        watch = self._new_watch()
        return ClientCore(self.keys, self._make_transport(), loop, self.bound, watch, self.stages)

    def _check_process(self) -> None:
        if self._generation != _fork_generation:  # forked: the parent's loop thread is not here
            with _fork_lock:  # the child's first calls may come from many threads at once
                if self._generation != _fork_generation:
                    self._reset_for_process()

    def _get_thread_core(self) -> ClientCore:
        self._check_process()
        core = self._thread_core
        if core is None:
            with self._lock:
                core = self._thread_core
                if core is None:
                    thread = LoopThread(name=f"microbatch-{self.name}", on_exit=self._close_at_exit)
                    core = thread.submit(self._start_core(thread.loop)).result()
                    self._thread, self._thread_core = thread, core
                    self._abandoned = weakref.finalize(self, _close_abandoned, thread, core)
                    self._abandoned.atexit = False  # at exit, _close_at_exit does it
        return core

    async def _start_core(self, loop: asyncio.AbstractEventLoop) -> ClientCore:
        core = self._new_core(loop)
        started = self._on_core_start(core)
        if asyncio.iscoroutine(started):
            await started
        return core

    def _get_loop_core(self) -> ClientCore:
        self._check_process()
        loop = _running_loop()
        core = self._loop_cores.get(loop)
        if core is None or core.closing:  # (closed as the loop shut down its async generators)
            core = self._new_loop_core(loop)
        return core

    def _new_loop_core(self, loop: asyncio.AbstractEventLoop) -> ClientCore:
        # Under the lock: event loops in other threads (asyncio.run() in each) make theirs at
        # the same time, and an unlocked scan of the cores raised "dictionary changed size".
        with self._lock:
            cores = self._loop_cores
            core = cores.get(loop)
            if core is not None and not core.closing:
                return core
            for old in [old for old in cores if old.is_closed()]:
                del cores[old]  # cores of loops that asyncio.run() already closed
            core = cores[loop] = self._new_core(loop)
        core.close_at_loop_shutdown()  # asyncio.run() closes its connections, not the GC
        return core

    def _encode(self, batch: Sequence[Any]) -> list[bytes]:
        if type(batch) is not list and (
            isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence)
        ):
            # (a numpy array or a tensor: a batch as the model's own predict would take it)
            rows = " (pass list(array): one item per row)" if hasattr(batch, "shape") else ""
            raise TypeError(
                "predict, submit, apredict and astart take a list (or tuple) of items, not "
                f"{type(batch).__name__}{rows}"
            )
        if self.model is None:
            try:
                return [codec.encode(item) for item in batch]
            except MicrobatchError:
                pass  # the loop below says which item
        # The model's caller-side prepare (preprocess and its input checks, as the gateway runs
        # them; raises InvalidInput naming the item), or else its bare preprocess.
        prepare = getattr(self.model, "prepare_items", None)
        if prepare is not None:
            batch = prepare(batch)
        payloads = []
        for index, item in enumerate(batch):
            try:
                if self.model is not None and prepare is None:
                    item = self.model.preprocess(item)
                payloads.append(codec.encode(item))
            except MicrobatchError as exc:
                raise exc.with_index(index) from exc
        return payloads

    def _postprocess(self, outputs: list[Any]) -> list[Any]:
        if self.model is None:
            return outputs
        finish = getattr(self.model, "finish_outputs", None)  # a ManagedModel's
        if finish is None:
            return [self.model.postprocess(output) for output in outputs]
        result: list[Any] = finish(outputs)
        return result

    def _level(self, priority: str | int | None) -> int:
        return self.level if priority is None else parse_priority(priority)

    def submit(
        self,
        batch: Sequence[Any],
        timeout: float | None = None,
        *,
        traceparent: str | None = None,
        priority: str | int | None = None,
    ) -> Future[list[Any]]:
        """Submit a list (or tuple) of items at once and return a future of their outputs, one
        per item, in order (cancelling it withdraws the items).

        Takes what :meth:`predict` takes. Errors of the input raise here: TypeError (a batch
        that is no list or tuple, a timeout that is no number), ValueError (a timeout or
        priority out of range), and :class:`InvalidInput` or :class:`CodecError` naming the
        item (``index``). The future's ``result()`` raises the typed error, a
        :class:`MicrobatchError`, of the first failing item. Its callbacks run on the
        Streamer's own thread, where ``predict()`` and waiting on a pending future raise
        RuntimeError."""
        timeout_s = self.timeout if timeout is None else check_timeout(timeout)
        check_traceparent(traceparent)
        level = self._level(priority)
        post = None if self.model is None else self._postprocess
        return self._get_thread_core().start_call_threadsafe(
            self._encode(batch), timeout_s, traceparent, post, level
        )

    def predict(
        self,
        batch: Sequence[Any],
        timeout: float | None = None,
        *,
        traceparent: str | None = None,
        priority: str | int | None = None,
    ) -> list[Any]:
        """Run the model on a list (or tuple) of items and return one output per item, in order.

        ``timeout``: the seconds the call may wait for all its outputs (default: the
        Streamer's, 30 s unless set). ``traceparent`` (W3C) travels with the items and appears
        in the worker's log line for their batch. ``priority`` (``"high"`` or ``"normal"``)
        overrides the Streamer's.

        Raises TypeError for a batch that is no list or tuple (a string, an array, a
        generator), a timeout that is no number or a traceparent that is no str; ValueError
        for a timeout that is not positive or over a year, or an unknown priority; else the
        typed error, a
        :class:`MicrobatchError` (ModelError, DeadlineExceeded, QueueFull, NoWorkers,
        InvalidInput, ...), of the first failing item, whose ``index`` names it. RuntimeError
        on the Streamer's own thread (a callback of a :meth:`submit` future).
        """
        timeout_s = self.timeout if timeout is None else check_timeout(timeout)
        check_traceparent(traceparent)
        level = self._level(priority)
        core = self._get_thread_core()
        outputs = core.call_blocking(self._encode(batch), timeout_s, traceparent, level)
        return self._postprocess(outputs)

    async def apredict(
        self,
        batch: Sequence[Any],
        timeout: float | None = None,
        *,
        traceparent: str | None = None,
        priority: str | int | None = None,
    ) -> list[Any]:
        """:meth:`predict` for asyncio callers: the same arguments (``timeout`` in seconds)
        and errors (TypeError, ValueError, the first failing item's :class:`MicrobatchError`
        naming its ``index``). Cancelling the task withdraws the call's items. RuntimeError
        without a running asyncio event loop."""
        timeout_s = self.timeout if timeout is None else check_timeout(timeout)
        check_traceparent(traceparent)
        level = self._level(priority)
        payloads = self._encode(batch)
        if self.native_async:
            outputs = await self._get_loop_core().call(payloads, timeout_s, traceparent, level)
        else:
            thread_core = self._get_thread_core()
            future = thread_core.start_call_threadsafe(
                payloads, timeout_s, traceparent, level=level
            )
            outputs = await asyncio.wrap_future(future)
        return self._postprocess(outputs)

    def astart(
        self,
        batch: Sequence[Any],
        timeout: float | None = None,
        *,
        traceparent: str | None = None,
        priority: str | int | None = None,
    ) -> asyncio.Future[list[Any]]:
        """``apredict`` without a coroutine: submit now, from the running loop's thread, and
        return a future of that loop for the outputs. Cancelling the future withdraws the
        call's items. Takes what :meth:`predict` takes (``timeout`` in seconds). Errors of
        the input raise here (TypeError, ValueError, :class:`InvalidInput` or
        :class:`CodecError` naming the item's ``index``); the first failing item's
        :class:`MicrobatchError` comes from the future."""
        timeout_s = self.timeout if timeout is None else check_timeout(timeout)
        check_traceparent(traceparent)
        level = self._level(priority)
        payloads = self._encode(batch)
        post = None if self.model is None else self._postprocess
        if self.native_async:
            return self._get_loop_core().start_call(payloads, timeout_s, traceparent, post, level)
        future = self._get_thread_core().start_call_threadsafe(
            payloads, timeout_s, traceparent, post, level
        )
        return asyncio.wrap_future(future)  # cancelling it cancels ``future``: withdrawn

    async def aconnect(self) -> bool:
        """Connect now from this event loop (so the first call does not pay for it).

        Returns whether the broker answered; a broker that is down is not an error here.
        """
        return await self._get_loop_core().transport.ping()

    def _close_at_exit(self) -> None:
        """At interpreter exit, before the threads left are joined: the calls those threads
        wait on end first (by their deadlines at the latest), then the Streamer closes."""
        thread, core = self._thread, self._thread_core
        if thread is not None and core is not None and _threads_left_to_join():
            try:
                thread.submit(core.settled()).result()
            except Exception:  # closing goes on whatever happened
                log.debug("waiting for the calls in flight at exit failed", exc_info=True)
        self.close()

    def close(self) -> None:
        """Release this process's connections and loop thread (the Streamer can be reused).
        Calls still waiting fail with :class:`BrokerUnavailable` and their queued items are
        withdrawn."""
        if self._generation != _fork_generation:
            self._check_process()
            return
        with self._lock:
            thread, core = self._thread, self._thread_core
            loop_cores, self._loop_cores = self._loop_cores, {}
            self._thread = self._thread_core = None
            if self._abandoned is not None:
                self._abandoned.detach()
                self._abandoned = None
        if thread is not None and core is not None:
            _close_thread_core(thread, core)
        for loop, loop_core in loop_cores.items():
            if loop.is_closed():
                continue
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                task = loop.create_task(loop_core.aclose())
                _closing_tasks.add(task)  # (the loop holds its tasks weakly)
                task.add_done_callback(_closing_tasks.discard)
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(loop_core.aclose(), loop)

    async def aclose(self) -> None:
        """Close from asyncio code: the running loop's connections are closed before return."""
        core = self._loop_cores.pop(_running_loop(), None)
        if core is not None:
            await core.aclose()
        await asyncio.to_thread(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


_closing_tasks: set[asyncio.Task[None]] = set()  # the aclose() tasks a sync close() started


def _running_loop() -> asyncio.AbstractEventLoop:
    """The running asyncio loop; a RuntimeError that says what to do where there is none (trio,
    or a coroutine driven by hand), rather than asyncio's bare "no running event loop"."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "apredict, astart, aconnect and aclose need a running asyncio event loop (asyncio, "
            "uvloop, or anyio's asyncio backend); under trio, or from a thread, call the "
            "blocking predict() in a worker thread (trio.to_thread.run_sync, "
            "anyio.to_thread.run_sync) or use submit()"
        ) from None


def _close_thread_core(thread: LoopThread, core: ClientCore) -> None:
    """Close a Streamer's loop thread and its core: wait for that from any other thread; from
    the loop's own (a submit() future's callback), which cannot wait for itself, only begin."""
    if thread.in_loop_thread:
        thread.stop_soon(core.aclose(), timeout=2 * CLOSE_WITHDRAW_S + 5)
        return
    try:
        thread.submit(core.aclose()).result(timeout=2 * CLOSE_WITHDRAW_S + 5)
    except Exception:  # closing is best effort
        log.debug("closing the client failed", exc_info=True)
    thread.stop()


def _close_abandoned(thread: LoopThread, core: ClientCore) -> None:
    """A Streamer was garbage-collected unclosed: close its connections and end its loop
    thread, without waiting (this runs wherever the collector does)."""
    warnings.warn(
        "a Streamer was dropped without close(): its connections and loop thread are closed "
        "now (close it, or use it as a context manager)",
        ResourceWarning,
        stacklevel=2,
    )
    thread.stop_soon(core.aclose(), timeout=2 * CLOSE_WITHDRAW_S + 5)


def _threads_left_to_join() -> bool:
    """Whether threads other than this one and the main thread will be joined at exit."""
    current, main = threading.current_thread(), threading.main_thread()
    return any(
        thread.is_alive() and not thread.daemon and thread not in (current, main)
        for thread in threading.enumerate()
    )


def check_traceparent(traceparent: str | None) -> str | None:
    """``traceparent`` if it is None or a str (one that is no W3C traceparent is dropped where
    it is read), else TypeError."""
    if traceparent is not None and not isinstance(traceparent, str):
        raise TypeError(
            "traceparent must be a str (a W3C traceparent header), not "
            f"{type(traceparent).__name__}"
        )
    return traceparent


def check_timeout(timeout: float) -> float:
    """``timeout`` as seconds (float): TypeError unless it is a number (bool is not), and
    ValueError unless it is positive and at most ``MAX_TIMEOUT_S``."""
    kind = type(timeout)
    if (
        kind is not float
        and kind is not int
        and (kind is bool or not isinstance(timeout, numbers.Real))
    ):
        raise TypeError(f"timeout must be a number of seconds, not {timeout!r}")
    if not 0 < timeout <= MAX_TIMEOUT_S:  # (NaN fails both)
        raise ValueError(
            f"timeout must be a positive number of seconds, not {timeout!r} (at most "
            f"{MAX_TIMEOUT_S:g}: a year)"
        )
    return float(timeout)
