"""Batches formed by a cost budget: a window of items read at once, cut into batches.

A model declares what an item costs (``ManagedModel.item_cost``, e.g. its tokens) and a budget
per batch (``max_batch_cost``); the worker then reads a window of up to WINDOW_BATCHES batches'
worth and cuts it (:func:`gpu_worker.forming.cut`) into batches of similar cost.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from broker.errors import ModelError
from broker.protocol import encode_error

from .forming import cut
from .observer import BatchObserver
from .outcomes import describe
from .preparing import PreparedBatch

CostFn = Callable[[Any], int]

# A window holds up to this many batches' worth of items; items due within this many batch
# times run first.
WINDOW_BATCHES = 2
URGENT_BATCHES = 2


class CostWindows:
    """How many entries a read asks for, and how a window read is cut into batches."""

    def __init__(
        self, batch_size: int, budget: int, item_cost: CostFn, observer: BatchObserver
    ) -> None:
        self.batch_size = batch_size
        self.budget = budget
        self.item_cost = item_cost
        self.observer = observer
        self.asked = batch_size  # entries the last read asked for
        self.backlog = False  # the last window read was full
        self._mean_cost: float | None = None  # of recent items (a moving average)

    def read_count(self) -> int:
        """A window: WINDOW_BATCHES batches' worth, a batch's worth estimated from recent
        items' costs."""
        size = self.batch_size
        mean = self._mean_cost
        if mean is not None and mean > 0:
            size = max(1, min(size, int(self.budget / mean)))
        return WINDOW_BATCHES * size

    def is_full(self, batch: PreparedBatch) -> bool:
        """Half the budget's cost (or batch_size items) is a full batch."""
        return len(batch.items) >= self.batch_size or 2 * sum(batch.costs) >= self.budget

    def cut(self, window: PreparedBatch, batch_s: float) -> list[PreparedBatch]:
        """Cost a prepared window and cut it into batches in the order they run. The first
        carries the window's other answers: errors, withdrawn and dead-lettered entries.
        ``batch_s`` is how long a batch takes lately (for what is urgent)."""
        self._cost(window)
        if len(window.items) < 2:
            return [window]
        now_ms = window.now_ms
        urgent_before = now_ms + URGENT_BATCHES * batch_s * 1000
        deadlines = [request.deadline_ms for request in window.live]
        order = cut(window.costs, deadlines, self.batch_size, self.budget, urgent_before)
        if len(order) == 1:
            return [window]
        by_id = {entry[0]: entry for entry in window.entries}
        live, items, costs = window.live, window.items, window.costs
        batches = [
            PreparedBatch(
                [by_id[live[i].entry_id] for i in indices],
                now_ms,
                [],
                [],
                [live[i] for i in indices],
                [items[i] for i in indices],
                [costs[i] for i in indices],
            )
            for indices in order
        ]
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
