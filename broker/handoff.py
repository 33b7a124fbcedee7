"""Handing calls to an event loop from other threads, and results back, with few wake-ups.

A blocking caller's call crosses threads twice: into the loop that does the I/O and back to the
thread that waits. :class:`Mailbox` carries the first crossing: callers append to a deque and
only the first of a burst wakes the loop, which then takes everything queued at once.
:class:`Waiter` carries the second: one bare lock per call, released once (a
``concurrent.futures.Future`` takes a condition variable, an RLock and a second lock, and wakes
its waiter while holding the first). A :class:`Relay` hands the waiters settled by one batch of
replies their results at once and wakes only the first; each woken thread wakes the next
before it goes on. So the loop thread, which holds the GIL, does not wake dozens of threads
that would only queue for the GIL it holds (and preempt it on a busy machine); the threads wake
one after another, each while the one before runs. Meanwhile the mailbox holds what they post
and lets it out a few times along the chain (:meth:`Mailbox.let_out`, run by every n-th woken
thread) and at its end, so that their next calls go out in a few round trips, as the calls of
asyncio tasks woken together do, and the first of them are served while the rest still wake.
:class:`CallFuture`, the future ``submit`` returns, puts the threads blocked in its
``result()`` on the same waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures._base import CANCELLED as _CANCELLED  # the state a cancel() sets
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Items posted from any thread, delivered in order to ``deliver`` on the loop thread.

    One ``call_soon_threadsafe`` per burst: a post that finds a delivery already scheduled
    only appends. (The check is safe without a lock: the loop clears the flag before it empties
    the deque, so a post either lands before that emptying or sees the flag cleared.)
    """

    __slots__ = ("_closed", "_deliver", "_held", "_items", "_loop", "_refuse", "_scheduled")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[T], Any],
        refuse: Callable[[T], Any] | None = None,
    ) -> None:
        self._loop = loop
        self._deliver = deliver
        self._refuse = refuse  # what :meth:`close` does with what the loop will not deliver
        self._items: deque[T] = deque()
        self._scheduled = False
        self._held = False
        self._closed = False

    def post(self, item: T) -> None:
        """Hand ``item`` to the loop (from any thread; once :meth:`close` has run, refused in
        the posting thread; raises RuntimeError if the loop is closed)."""
        self._items.append(item)
        if self._closed:
            # Closed before or meanwhile: the loop may stop before delivering it (then nothing
            # would), so it is refused here (close's own sweep may have taken it already).
            self._refuse_left()
            return
        if not self._scheduled and not self._held:
            self._schedule()

    def hold(self) -> None:
        """Keep what is posted from now on until :meth:`release` (it does not wake the loop)."""
        self._held = True

    def release(self) -> None:
        """Deliver what was held back, and what comes next as it comes (from any thread)."""
        self._held = False
        self.let_out()

    def let_out(self) -> None:
        """Deliver what is held so far, and go on holding what is posted next (any thread)."""
        if self._items and not self._scheduled:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to deliver to
                self._schedule()

    def close(self) -> None:
        """Refuse what was posted and not delivered yet, and from now on whatever is posted
        (on the loop thread, as it closes)."""
        self._closed = True
        self._refuse_left()

    def _refuse_left(self) -> None:
        items, refuse = self._items, self._refuse
        while True:
            try:
                item = items.popleft()  # (several threads may sweep at once: each item once)
            except IndexError:
                return
            if refuse is not None:
                refuse(item)

    def _schedule(self) -> None:
        self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except BaseException:
            self._scheduled = False
            raise

    def _drain(self) -> None:
        self._scheduled = False
        items, deliver = self._items, self._deliver
        while items:
            deliver(items.popleft())


class Relay:
    """Settles waiters in batches: results in place at once, then a chain of wake-ups."""

    __slots__ = ("lock",)

    def __init__(self) -> None:
        # Held while a batch is settled and linked, and by a waiter that stops waiting, so that
        # a waiter is either left out of a chain (cancelled first) or in it (settled first).
        self.lock = threading.Lock()

    def settle(
        self,
        outcomes: Iterable[tuple[Waiter, Any, BaseException | None]],
        then: Callable[[], Any] | None = None,
        every: int = 0,
        meanwhile: Callable[[], Any] | None = None,
    ) -> None:
        """Give each waiter its result (or exception) and start waking them, in order.

        ``then`` runs once the last of them is woken, in its thread (at once if none is);
        ``meanwhile`` once each ``every`` of them are woken before that.
        """
        head: Waiter | None = None
        last: Waiter | None = None
        count = 0
        with self.lock:
            for waiter, value, error in outcomes:
                if waiter._cancelled or waiter._set:
                    continue
                waiter._value, waiter._error, waiter._set = value, error, True
                if last is None:
                    head = waiter
                else:
                    last._next = waiter
                    if every and count % every == 0:
                        last._then = meanwhile
                last = waiter
                count += 1
            if last is not None:
                last._then = then
        if head is not None:
            head._lock.release()
        elif then is not None:
            then()


class Waiter:
    """A one-shot result for one blocked thread, set from another thread.

    The loop thread sets it once, with :meth:`set_result` / :meth:`set_exception` (woken at
    once) or through its :class:`Relay` (woken by the thread woken before it), unless
    :meth:`done` says it is already done. The waiting thread calls :meth:`wait` once.
    """

    __slots__ = ("_cancelled", "_error", "_lock", "_next", "_relay", "_set", "_then", "_value")

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self._lock = threading.Lock()
        self._lock.acquire()  # released once, when the result is set
        self._set = False
        self._cancelled = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._next: Waiter | None = None  # the waiter this one's thread wakes next
        self._then: Callable[[], Any] | None = None  # what it runs then (see Relay.settle)

    def done(self) -> bool:
        return self._set or self._cancelled

    def cancelled(self) -> bool:
        """Whether the waiting thread gave up before the result was set."""
        return self._cancelled

    def set_result(self, value: Any) -> None:
        self._value, self._set = value, True
        self._lock.release()

    def set_exception(self, error: BaseException) -> None:
        self._error, self._set = error, True
        self._lock.release()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the result is set; return it or raise its exception.

        Raises TimeoutError once ``timeout`` seconds have passed without a result. Whatever
        ends the wait without a result (that timeout, or KeyboardInterrupt) cancels the waiter.
        """
        woken = False
        try:
            woken = self._lock.acquire(timeout=-1 if timeout is None else timeout)
        finally:
            if not woken:
                woken = self._stop_waiting()
            following, then = self._next, self._then
            if following is not None:  # wake the next thread of this batch before going on
                self._next = None
                following._lock.release()
            if then is not None:
                self._then = None
                then()
        if not woken:
            raise TimeoutError("no result within the timeout")
        if self._error is not None:
            raise self._error
        return self._value

    def abandon(self) -> None:
        """Leave without the result (the waiting thread, on its way out with an error, waiting
        or not): cancel the waiter unless its result is set, and pass on its batch's wake-up."""
        if not self._cancelled:
            with contextlib.suppress(Exception):  # TimeoutError, or the result's own error
                self.wait(0)

    def _stop_waiting(self) -> bool:
        """Cancel, unless the result came meanwhile (then True: the wait may return it)."""
        with self._relay.lock:
            if self._set:
                return True
            self._cancelled = True
            return False


class CallFuture(Future[T]):
    """A ``concurrent.futures.Future`` whose blocked ``result()`` callers wake like waiters.

    A plain Future's waiter sleeps on a condition variable that its setter notifies while
    holding the condition's lock (the woken thread wakes only to wait for that lock, then for
    the GIL), and an event loop settling a batch of them wakes every thread itself. Here each
    thread blocked in :meth:`result` or :meth:`exception` waits on a :class:`Waiter` of the
    future's :class:`Relay`, so a batch settled with :meth:`settle_quietly` wakes its threads
    in turn. Everything else (``concurrent.futures.wait``, ``as_completed``, callbacks,
    ``asyncio.wrap_future``) works as on any Future. ``on_cancel`` runs once, in the
    cancelling thread, if :meth:`cancel` cancels the future.
    """

    def __init__(
        self,
        relay: Relay,
        on_cancel: Callable[[], Any] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__()
        self._relay = relay
        self._loop = loop  # the loop that settles it: waiting there would wait for itself
        self._sleepers: list[Waiter] = []
        self._quiet = False
        self.on_cancel = on_cancel

    def settle_quietly(self, value: Any, error: BaseException | None) -> list[Waiter]:
        """Set the result (or exception) without waking the threads blocked on it; return
        their waiters, for the caller to wake (with :meth:`Relay.settle`)."""
        self._quiet = True
        try:
            if error is None:
                self.set_result(value)
            else:
                self.set_exception(error)
        except InvalidStateError:  # cancelled meanwhile: its threads are woken all the same
            pass
        finally:
            self._quiet = False
        return self._take_sleepers()

    def _take_sleepers(self) -> list[Waiter]:
        with self._condition:
            sleepers, self._sleepers = self._sleepers, []
        return sleepers

    def _invoke_callbacks(self) -> None:
        # Every transition to done (set_result, set_exception, a cancel) passes here once.
        self.on_cancel = None  # it may refer to this future: no cycle left for the GC
        if not self._quiet:
            for waiter in self._take_sleepers():
                waiter.set_result(None)
        super()._invoke_callbacks()  # type: ignore[misc]

    def cancel(self) -> bool:
        on_cancel = self.on_cancel
        cancelled = super().cancel()
        if cancelled:
            # As an executor does with a cancelled task: concurrent.futures.wait and
            # as_completed count a cancelled future as done only once notified (once: it
            # raises when notified again).
            with self._condition:
                if self._state == _CANCELLED:
                    self.set_running_or_notify_cancel()
            if on_cancel is not None:
                on_cancel()
        return cancelled

    def _wait(self, timeout: float | None) -> None:
        if self.done():
            return
        if self._loop is not None and asyncio._get_running_loop() is self._loop:
            raise RuntimeError(
                "the result of a pending submit() future cannot be waited for on the "
                "Streamer's own thread, where the callbacks of its futures run: it would wait "
                "for itself. Wait for it from another thread"
            )
        waiter = Waiter(self._relay)
        with self._condition:
            if self.done():
                return
            self._sleepers.append(waiter)
        try:
            waiter.wait(None if timeout is None else max(0.0, timeout))
        except TimeoutError:  # the caller's result(0) below raises it, unless done meanwhile
            pass
        finally:
            if not waiter._set:
                with self._condition, contextlib.suppress(ValueError):
                    self._sleepers.remove(waiter)

    def result(self, timeout: float | None = None) -> T:
        self._wait(timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return super().exception(0)
