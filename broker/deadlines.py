"""Deadlines of many calls on one event loop, one timer per slice of time instead of per call.

A timer per call costs a libuv timer started and stopped each time; calls whose deadlines fall
in the same few milliseconds share one here, and are set apart by a set operation.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)

SLICE_S = 0.005
"""Deadlines are rounded up to this; an expiry comes at most this late."""


class Deadlines(Generic[T]):
    """Calls ``expire(item)`` once ``item``'s deadline has passed, unless it was discarded."""

    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[T], None]) -> None:
        self.loop = loop
        self.expire = expire
        self._slices: dict[int, tuple[set[T], asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return sum(len(items) for items, _ in self._slices.values())

    def add(self, item: T, timeout_s: float) -> int:
        """Watch ``item`` for ``timeout_s`` from now; returns the key to discard it by."""
        key = math.ceil((self.loop.time() + timeout_s) / SLICE_S)
        found = self._slices.get(key)
        if found is None:
            timer = self.loop.call_at(key * SLICE_S, self._fire, key)
            self._slices[key] = ({item}, timer)
        else:
            found[0].add(item)
        return key

    def discard(self, item: T, key: int) -> None:
        """Stop watching ``item`` (no-op if it is not watched)."""
        found = self._slices.get(key)
        if found is not None:
            items, timer = found
            items.discard(item)
            if not items:
                timer.cancel()
                del self._slices[key]

    def _fire(self, key: int) -> None:
        items, _ = self._slices.pop(key, (set(), None))
        for item in items:
            self.expire(item)
