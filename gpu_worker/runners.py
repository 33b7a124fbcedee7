"""Running the model on a prepared batch: inline, on the model's own thread, or either (auto).

One small interface, chosen once when the batch loop starts (``model_thread``): the loop hands
a runner each batch and says whether to read the next one meanwhile; the runner computes it
and has the loop answer it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

from .config import MODEL_THREAD_MODES
from .model_thread import ModelThread
from .outcomes import (
    PendingOutputs,
    PredictFn,
    finish_predict,
    predict_robust,
    start_predict,
)
from .preparing import PreparedBatch

# auto: full batches taking this long (a moving average) move the model to its own thread, so
# that reading the next batch and sending replies overlap it; below the second figure it comes
# back. Short CPU batches lose more to GIL hand-offs between the model's operations than the
# overlap saves (bench/analysis.md).
THREAD_FROM_S = 0.010
INLINE_BELOW_S = 0.005

# Pending outputs are polled while the read ahead is out (nothing tells the loop when a GPU's
# copy lands): every loop turn for this long, as a GPU's batch takes a few ms at most, then
# every PENDING_POLL_S.
PENDING_SPIN_S = 0.002
PENDING_POLL_S = 0.001

BatchSource = Callable[[], PreparedBatch]
Computed = tuple[PreparedBatch, list[Any]]


class RunnerHost(Protocol):
    """What a runner asks of the batch loop."""

    @property
    def holds_more(self) -> bool:
        """Batches of the window are held, to run next."""

    async def read_ahead(self) -> None:
        """Start reading the next batch (and let the command go out)."""

    async def recheck(self, batch: PreparedBatch) -> None:
        """Take out items withdrawn or expired since the batch was prepared."""

    def batch_started(self, batch: PreparedBatch) -> None: ...

    def batch_finished(self, batch: PreparedBatch, seconds: float) -> None: ...

    async def answer(self, batch: PreparedBatch, outcomes: list[Any]) -> None: ...


class ModelRunner(Protocol):
    """Where and when the model computes a batch."""

    @property
    def busy(self) -> bool:
        """A batch computes on the model thread now (the loop must not spin meanwhile)."""

    @property
    def checks_when_taken(self) -> bool:
        """Withdrawals are checked as the model takes a batch (so not when it is read)."""

    async def run(self, batch: BatchSource, read_ahead: bool) -> None:
        """Compute and answer a batch (``batch()`` prepares it); with ``read_ahead``, read
        the next batch meanwhile."""

    async def process(self, batch: PreparedBatch) -> None:
        """Compute and answer a batch before returning."""

    async def drain(self) -> None:
        """Answer the batch computing, if any."""

    async def drain_unless(self, read: asyncio.Future[Any]) -> None:
        """Answer the batch computing if it is done before ``read`` completes."""

    def full_batch_took(self, seconds: float) -> None:
        """A full batch took ``seconds`` to compute."""

    def drop(self) -> None:
        """Forget the batch computing (its entries are taken back after an outage)."""

    def close(self) -> None: ...


class InlineRunner:
    """The model runs on the loop's thread: only a read ahead overlaps it, unless ``predict``
    returns :class:`~gpu_worker.outcomes.PendingOutputs` (outputs a GPU still computes).

    Then, with more batches in hand or a backlog, the batch stays pending while the loop takes
    the next one (read ahead as it was handed over), prepares it and hands it to the model;
    only then are the pending outputs taken and answered. The device always has the next
    batch queued behind the one it computes, and the loop's Redis and Python work overlaps the
    device's, in one thread. At most one batch is pending (so at most three in hand: it, the
    one handed over, the one read ahead); it is answered as soon as nothing follows it.
    """

    busy = False
    checks_when_taken = False

    def __init__(self, predict: PredictFn, host: RunnerHost) -> None:
        self._predict = predict
        self._host = host
        # The model's outputs came pending, not done: it computes asynchronously (so "auto"
        # never moves it to the model thread).
        self.defers = False
        # The batch whose outputs are pending, and when the model took it.
        self._pending: tuple[PreparedBatch, PendingOutputs, float] | None = None

    async def run(self, batch: BatchSource, read_ahead: bool) -> None:
        more = read_ahead or self._host.holds_more
        if read_ahead:
            await self._host.read_ahead()  # goes out while the model computes
        prepared = batch()
        if not prepared.items:
            await self.drain()
            await self._host.answer(prepared, [])
            return
        # The host hears of one batch at a time (its watchdog watches one): this one starts
        # when the pending one, if any, is answered; until then that one counts as computing.
        follows_pending = self._pending is not None
        if not follows_pending:
            self._host.batch_started(prepared)
        started = time.perf_counter()
        launched = start_predict(self._predict, prepared.items)
        await self.drain()  # the batch before: the device computed it ahead of this one
        if follows_pending:
            self._host.batch_started(prepared)
        if not isinstance(launched, list) and not launched.done():
            self.defers = True  # computing asynchronously, not just wrapped
            if more:
                self._pending = (prepared, launched, started)
                return
        await self._answer(prepared, launched, started)

    async def process(self, batch: PreparedBatch) -> None:
        await self.drain()
        if not batch.items:
            await self._host.answer(batch, [])
            return
        self._host.batch_started(batch)
        started = time.perf_counter()
        await self._answer(batch, start_predict(self._predict, batch.items), started)

    async def drain(self) -> None:
        """Take the pending batch's outputs (waiting for them) and answer it."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await self._answer(*pending)

    async def _answer(
        self, batch: PreparedBatch, launched: list[Any] | PendingOutputs, started: float
    ) -> None:
        """Take a computed batch's outcomes (pending outputs waited for) and answer it."""
        if isinstance(launched, list):
            outcomes = launched
        else:
            outcomes = finish_predict(self._predict, batch.items, launched)
        self._host.batch_finished(batch, time.perf_counter() - started)
        await self._host.answer(batch, outcomes)

    async def drain_unless(self, read: asyncio.Future[Any]) -> None:
        """Answer the pending batch if its outputs are ready before the read ahead arrives
        (then nothing is queued, and its callers must not wait for the read's block timeout)."""
        if self._pending is None:
            return
        outputs = self._pending[1]
        spin_until = time.perf_counter() + PENDING_SPIN_S
        while not read.done():
            if outputs.done():
                await self.drain()
                return
            if time.perf_counter() < spin_until:
                await asyncio.sleep(0)
            else:  # computing takes long: poll without holding a core (and the GIL) meanwhile
                await asyncio.wait((read,), timeout=PENDING_POLL_S)

    def full_batch_took(self, seconds: float) -> None:
        return

    def drop(self) -> None:
        """Forget the pending batch (its entries are taken back after an outage)."""
        self._pending = None

    def close(self) -> None:
        return


class ThreadRunner:
    """The model runs on its own thread (:class:`ModelThread`): decoding the next batch and
    sending the last one's replies overlap it, and the next batch, decoded already, is handed
    over the moment the model finishes the current one."""

    checks_when_taken = True

    def __init__(self, predict: PredictFn, host: RunnerHost) -> None:
        self._robust = functools.partial(predict_robust, predict)
        self._host = host
        self._thread = ModelThread()
        # The batch the model thread computes while the loop reads the next one.
        self._computing: tuple[PreparedBatch, asyncio.Future[tuple[list[Any], float]]] | None
        self._computing = None

    @property
    def busy(self) -> bool:
        return self._computing is not None

    async def run(self, batch: BatchSource, read_ahead: bool) -> None:
        """Hand this batch to the model thread as soon as the one before is done, answer that
        one while this one computes, and (with ``read_ahead``) read the next batch; without,
        answer this one too, unless batches of the window are still held (the next one follows
        at once)."""
        prepared = batch()
        finished = await self._collect()
        await self._start(prepared)
        if finished is not None:
            await self._host.answer(*finished)
        if read_ahead:
            await self._host.read_ahead()
        elif not self._host.holds_more:
            await self.drain()

    async def process(self, batch: PreparedBatch) -> None:
        if not batch.items:
            await self._host.answer(batch, [])
            return
        await self.drain()  # the model thread takes one batch at a time here
        future = self._thread.submit(self._robust, batch.items)
        self._host.batch_started(batch)
        outcomes = await self._computed(batch, future)
        await self._host.answer(batch, outcomes)

    async def _start(self, batch: PreparedBatch) -> None:
        """Check a batch again just before the model takes it (it may have waited a whole
        batch), then hand it to the model thread."""
        await self._host.recheck(batch)
        if not batch.items:
            await self._host.answer(batch, [])
            return
        # Answering the batch before comes next: let the model thread take this one first.
        future = self._thread.submit(self._robust, batch.items, wait_started=True)
        self._host.batch_started(batch)
        self._computing = (batch, future)

    async def _collect(self) -> Computed | None:
        """Wait for the batch on the model thread, if any: it and its outcomes."""
        if self._computing is None:
            return None
        batch, future = self._computing
        self._computing = None
        return batch, await self._computed(batch, future)

    async def _computed(
        self, batch: PreparedBatch, future: asyncio.Future[tuple[list[Any], float]]
    ) -> list[Any]:
        outcomes, seconds = await future
        self._host.batch_finished(batch, seconds)
        return outcomes

    async def drain(self) -> None:
        finished = await self._collect()
        if finished is not None:
            await self._host.answer(*finished)

    async def drain_unless(self, read: asyncio.Future[Any]) -> None:
        """Answer the batch computing if it is done before the batch read ahead arrives (then
        there is no backlog, and its callers must not wait for the read's block timeout)."""
        if self._computing is None or read.done():
            return
        await asyncio.wait((read, self._computing[1]), return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            await self.drain()

    def full_batch_took(self, seconds: float) -> None:
        return

    def drop(self) -> None:
        """The model thread finishes the batch computing; its result is ignored."""
        if self._computing is not None:
            self._computing[1].cancel()
        self._computing = None

    def close(self) -> None:
        self._thread.close()


class AutoRunner:
    """``model_thread="auto"``: inline while full batches are quick, on the model thread
    while they take THREAD_FROM_S or more (back below INLINE_BELOW_S)."""

    def __init__(self, inline: InlineRunner, threaded: ThreadRunner) -> None:
        self._inline = inline
        self._threaded = threaded
        self._full_batch_s: float | None = None  # a moving average
        self._slow = False

    @property
    def _current(self) -> ModelRunner:
        threaded, inline = self._threaded, self._inline
        if threaded.busy or (self._slow and not inline.defers):
            return threaded
        return inline  # also for a model whose outputs come pending: it computes on its own

    @property
    def busy(self) -> bool:
        return self._threaded.busy

    @property
    def checks_when_taken(self) -> bool:
        return self._current.checks_when_taken

    async def run(self, batch: BatchSource, read_ahead: bool) -> None:
        await self._current.run(batch, read_ahead)

    async def process(self, batch: PreparedBatch) -> None:
        await self._current.process(batch)

    async def drain(self) -> None:
        await self._inline.drain()
        await self._threaded.drain()

    async def drain_unless(self, read: asyncio.Future[Any]) -> None:
        await self._inline.drain_unless(read)
        await self._threaded.drain_unless(read)

    def full_batch_took(self, seconds: float) -> None:
        average = self._full_batch_s
        self._full_batch_s = seconds if average is None else 0.8 * average + 0.2 * seconds
        self._slow = self._full_batch_s >= (INLINE_BELOW_S if self._slow else THREAD_FROM_S)

    def drop(self) -> None:
        self._inline.drop()
        self._threaded.drop()

    def close(self) -> None:
        self._threaded.close()


def make_runner(mode: str, predict: PredictFn, host: RunnerHost) -> ModelRunner:
    """The runner for a ``model_thread`` mode: off, on or auto."""
    if mode == "off":
        return InlineRunner(predict, host)
    if mode == "on":
        return ThreadRunner(predict, host)
    if mode == "auto":
        return AutoRunner(InlineRunner(predict, host), ThreadRunner(predict, host))
    raise ValueError(f"model_thread must be one of {', '.join(MODEL_THREAD_MODES)}")
