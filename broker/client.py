"""The client: submit items, route replies back, raise typed errors.

One :class:`ClientCore` per process and model does the I/O on a private event loop thread:
concurrent submits are coalesced into one pipelined round trip, and every reply comes through one
inbox list per process, routed to its call by request id. :class:`Streamer` is the public face
(sync, futures and asyncio); it makes its core lazily in each process, so it is safe to create
before gunicorn forks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from . import codec
from .errors import BrokerUnavailable, DeadlineExceeded, MicrobatchError, error_from_wire
from .keys import DEFAULT_PREFIX, ModelKeys
from .loop_thread import LoopThread
from .protocol import Reply, decode_reply, request_fields
from .transport import UNBOUNDED, EntryFields, QueueBound, Transport

log = logging.getLogger("microbatch.client")

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_TIMEOUT_S = 30.0
REPLY_BATCH = 1024
REPLY_WAIT_S = 1.0


class _Call:
    """One predict/submit call: N items, one future."""

    __slots__ = ("entries", "errors", "future", "ids", "remaining", "results", "sizes", "timer")

    def __init__(self, ids: list[str], sizes: list[int]) -> None:
        self.ids = ids
        self.sizes = sizes
        self.entries: list[str] = []  # stream entry ids, once queued
        self.future: Future[list[Any]] = Future()
        self.results: list[Any] = [None] * len(ids)
        self.errors: dict[int, MicrobatchError] = {}
        self.remaining = len(ids)
        self.timer: asyncio.TimerHandle | None = None


class ClientCore:
    """The per-process I/O engine behind a Streamer. Only its loop thread touches its state."""

    def __init__(
        self,
        keys: ModelKeys,
        transport_factory: Callable[[], Transport],
        on_start: Callable[[ClientCore], Any] | None = None,
        bound: QueueBound = UNBOUNDED,
    ) -> None:
        self.keys = keys
        self.bound = bound
        self.client_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.inbox = keys.inbox(self.client_id)
        self._ids = itertools.count()
        self._pending: dict[str, tuple[_Call, int]] = {}
        self._outbox: list[tuple[_Call, list[EntryFields]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.thread = LoopThread(name=f"microbatch-{keys.model}")
        self.transport: Transport = self.thread.submit(_make(transport_factory)).result()
        if on_start is not None:
            self.thread.submit(_call_async(on_start, self)).result()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.thread.loop

    def new_request_ids(self, count: int) -> list[str]:
        """Fresh request ids, unique within this process's inbox (thread-safe under the GIL)."""
        return [f"{self.client_id}.{next(self._ids)}" for _ in range(count)]

    def start_call(self, payloads: Sequence[bytes], timeout_s: float) -> Future[list[Any]]:
        """Queue encoded items; the returned future gets the raw results (any thread)."""
        call = _Call(self.new_request_ids(len(payloads)), [len(p) for p in payloads])
        timeout_ms = max(1, int(timeout_s * 1000))
        entries = [
            request_fields(rid, self.inbox, timeout_ms, payload)
            for rid, payload in zip(call.ids, payloads, strict=True)
        ]
        if call.remaining == 0:
            call.future.set_result([])
            return call.future
        self.thread.call_soon(self._accept, call, entries, timeout_s)
        call.future.add_done_callback(lambda done: self._on_done(done, call))
        return call.future

    # -- everything below runs on the loop thread -------------------------------------------
    def _accept(self, call: _Call, entries: list[EntryFields], timeout_s: float) -> None:
        if call.future.done():  # cancelled before it reached the loop
            return
        for index, rid in enumerate(call.ids):
            self._pending[rid] = (call, index)
        call.timer = self.loop.call_later(timeout_s, self._expire, call, timeout_s)
        self._outbox.append((call, entries))
        if self._flusher is None:
            self._flusher = self.loop.create_task(self._flush())
        if self._reader is None:
            self._reader = self.loop.create_task(self._read_replies())

    async def _flush(self) -> None:
        # Everything submitted while one pipeline is in flight goes out together in the next.
        try:
            while self._outbox:
                batch = [
                    (call, entries) for call, entries in self._outbox if not call.future.done()
                ]
                self._outbox = []
                calls = [call for call, _ in batch]
                if not batch:
                    continue
                try:
                    outcomes = await self.transport.enqueue(
                        self.keys, [entries for _, entries in batch], self.bound
                    )
                except MicrobatchError as exc:
                    self._fail_calls(calls, exc)
                    continue
                except Exception as exc:
                    log.exception("submitting to %s failed", self.keys.stream)
                    self._fail_calls(calls, BrokerUnavailable(f"{type(exc).__name__}: {exc}"))
                    continue
                for call, outcome in zip(calls, outcomes, strict=True):
                    if isinstance(outcome, MicrobatchError):
                        self._fail_calls([call], outcome)
                    else:
                        call.entries = outcome
                        if call.future.cancelled():  # cancelled while being queued
                            self._withdraw(call)
        finally:
            self._flusher = None

    async def _read_replies(self) -> None:
        backoff = 0.05
        try:
            while self._pending:
                try:
                    payloads = await self.transport.pop_replies(
                        self.inbox, REPLY_BATCH, REPLY_WAIT_S
                    )
                except MicrobatchError:
                    # Redis is away: waiting calls keep waiting until their deadlines.
                    await asyncio.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                backoff = 0.05
                for payload in payloads:
                    try:
                        reply = decode_reply(payload)
                    except MicrobatchError as exc:
                        log.warning("dropping an unreadable reply on %s: %s", self.inbox, exc)
                        continue
                    self._resolve(reply)
        finally:
            self._reader = None
            if self._pending:  # a call arrived as the reader was leaving
                self._reader = self.loop.create_task(self._read_replies())

    def _resolve(self, reply: Reply) -> None:
        found = self._pending.pop(reply.request_id, None)
        if found is None:  # a late or duplicate reply: its call is already settled
            return
        call, index = found
        if reply.ok:
            call.results[index] = reply.result
        else:
            call.errors[index] = error_from_wire(reply.error_type, reply.error_message, index=index)
        call.remaining -= 1
        if call.remaining == 0:
            self._settle(call)

    def _settle(self, call: _Call) -> None:
        if call.timer is not None:
            call.timer.cancel()
        if call.future.done():
            return
        if call.errors:
            call.future.set_exception(call.errors[min(call.errors)])
        else:
            call.future.set_result(call.results)

    def _fail_items(self, call: _Call, make_error: Callable[[int], MicrobatchError]) -> None:
        for index, rid in enumerate(call.ids):
            if self._pending.pop(rid, None) is not None:
                call.errors[index] = make_error(index)
                call.remaining -= 1
        self._settle(call)

    def _fail_calls(self, calls: Iterable[_Call], error: MicrobatchError) -> None:
        for call in calls:
            self._fail_items(call, error.with_index)

    def _expire(self, call: _Call, timeout_s: float) -> None:
        message = f"no reply within {timeout_s:g} s"
        self._fail_items(call, lambda index: DeadlineExceeded(message, index=index))

    def _forget(self, call: _Call) -> None:
        """The caller gave up on ``call``: drop it, and withdraw its items still queued."""
        if call.timer is not None:
            call.timer.cancel()
        for rid in call.ids:
            self._pending.pop(rid, None)
        if call.entries:
            self._withdraw(call)

    def _withdraw(self, call: _Call) -> None:
        entries = list(zip(call.entries, call.sizes, strict=True))
        call.entries = []
        task = self.loop.create_task(self._cancel_entries(entries))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel_entries(self, entries: list[tuple[str, int]]) -> None:
        try:
            await self.transport.cancel(self.keys, entries)
        except MicrobatchError as exc:  # best effort: the worker will answer into the void
            log.info("could not withdraw %d cancelled item(s): %s", len(entries), exc)

    def _on_done(self, future: Future[list[Any]], call: _Call) -> None:
        if future.cancelled() and not self.thread.loop.is_closed():
            self.thread.call_soon(self._forget, call)

    def close(self) -> None:
        """Close the transport and stop the loop thread."""
        if self.thread.loop.is_closed():
            return
        try:
            self.thread.submit(self.transport.close()).result(timeout=5)
        except Exception:  # closing is best effort
            log.debug("closing the transport failed", exc_info=True)
        self.thread.stop()


async def _make(factory: Callable[[], Transport]) -> Transport:
    return factory()


async def _call_async(func: Callable[[ClientCore], Any], core: ClientCore) -> None:
    result = func(core)
    if asyncio.iscoroutine(result):
        await result


class Streamer:
    """Send items to a model's workers through Redis and get their results back.

    ``Streamer("mlp", redis_url=..., prefix=...)`` talks to every worker serving model ``mlp``
    under ``prefix``. With ``model=MLP`` (a ManagedModel class or instance) the model's
    ``preprocess`` runs on each item before it is sent and ``postprocess`` on each result, so
    Python callers send the same raw inputs as HTTP callers. With ``max_queue_items`` or
    ``max_queue_bytes``, a call that would take the model's queue over either bound is refused
    at once with :class:`QueueFull` (checked atomically with the enqueue). Safe to share
    between threads, and across fork: each process makes its own connections on first use.
    """

    def __init__(
        self,
        name: str,
        redis_url: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        model: Any = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_queue_items: int = 0,
        max_queue_bytes: int = 0,
    ) -> None:
        self.keys = ModelKeys(name, prefix)
        self.bound = QueueBound(max_queue_items, max_queue_bytes)
        self.redis_url = redis_url or os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
        self.timeout = _check_timeout(timeout)
        self.model = model() if isinstance(model, type) else model
        self._core: ClientCore | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.keys.model

    def _make_transport(self) -> Transport:
        from .redis_transport import RedisTransport

        return RedisTransport(self.redis_url)

    def _on_core_start(self, core: ClientCore) -> Any:
        """Hook run once on the core's loop thread after it starts (used by LocalStreamer)."""
        return None

    def _get_core(self) -> ClientCore:
        if self._pid != os.getpid():  # forked: the parent's loop thread does not exist here
            self._lock = threading.Lock()
            self._core = None
            self._pid = os.getpid()
        core = self._core
        if core is None:
            with self._lock:
                core = self._core
                if core is None:
                    core = self._core = ClientCore(
                        self.keys, self._make_transport, self._on_core_start, self.bound
                    )
        return core

    def _encode(self, batch: Sequence[Any]) -> list[bytes]:
        if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence):
            raise TypeError("predict/submit take a list of items")
        payloads = []
        for index, item in enumerate(batch):
            try:
                if self.model is not None:
                    item = self.model.preprocess(item)
                payloads.append(codec.encode(item))
            except MicrobatchError as exc:
                raise exc.with_index(index) from exc
        return payloads

    def _postprocess(self, outputs: list[Any]) -> list[Any]:
        if self.model is None:
            return outputs
        return [self.model.postprocess(output) for output in outputs]

    def submit(self, batch: Sequence[Any], timeout: float | None = None) -> Future[list[Any]]:
        """Submit a list of items; the future's result is their outputs, in order."""
        timeout_s = self.timeout if timeout is None else _check_timeout(timeout)
        raw = self._get_core().start_call(self._encode(batch), timeout_s)
        if self.model is None:
            return raw
        result: Future[list[Any]] = Future()

        def chain(done: Future[list[Any]]) -> None:
            if done.cancelled():
                result.cancel()
            elif (error := done.exception()) is not None:
                result.set_exception(error)
            else:
                try:
                    result.set_result(self._postprocess(done.result()))
                except Exception as exc:
                    result.set_exception(exc)

        raw.add_done_callback(chain)
        result.add_done_callback(lambda f: raw.cancel() if f.cancelled() else None)
        return result

    def predict(self, batch: Sequence[Any], timeout: float | None = None) -> list[Any]:
        """Run the model on a list of items and return one output per item, in order.

        Raises the typed error (ModelError, DeadlineExceeded, ...) of the first failing item.
        """
        timeout_s = self.timeout if timeout is None else _check_timeout(timeout)
        future = self._get_core().start_call(self._encode(batch), timeout_s)
        return self._postprocess(future.result())

    async def apredict(self, batch: Sequence[Any], timeout: float | None = None) -> list[Any]:
        """``predict`` for asyncio callers; cancelling the task abandons the call."""
        timeout_s = self.timeout if timeout is None else _check_timeout(timeout)
        future = self._get_core().start_call(self._encode(batch), timeout_s)
        outputs = await asyncio.wrap_future(future)
        return self._postprocess(outputs)

    def close(self) -> None:
        """Release this process's connections and loop thread (the Streamer can be reused)."""
        with self._lock:
            core, self._core = self._core, None
        if core is not None and self._pid == os.getpid():
            core.close()

    def __enter__(self) -> Streamer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_timeout(timeout: float) -> float:
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return float(timeout)
