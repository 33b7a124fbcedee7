"""Worker metrics (prometheus-client), aggregated over a `worker start`'s processes.

The supervisor points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory before it starts any
child; every process writes its samples there, and the supervisor's ``--metrics-port`` serves
them all as one endpoint. Names are documented in docs/metrics.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from broker.multiproc_metrics import observe_many

from .batch_state import BatchState
from .observer import BatchObserver

log = logging.getLogger("microbatch.worker")

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                   10, 30, 60)  # fmt: skip

BATCHES = Counter("microbatch_worker_batches_total", "Batches the model ran.", ["model"])
ITEMS = Counter(
    "microbatch_worker_items_total",
    "Items answered by workers, by outcome (ok, model_error, invalid_output, deadline, "
    "codec_error, invalid_input, malformed, withdrawn, poison).",
    ["model", "outcome"],
)
BATCH_SIZE = Histogram(
    "microbatch_worker_batch_size", "Items per model call.", ["model"], buckets=BATCH_SIZE_BUCKETS
)
QUEUE_WAIT = Histogram(
    "microbatch_worker_queue_wait_seconds",
    "Time from an item's arrival in the stream to the start of its batch.",
    ["model"],
    buckets=SECONDS_BUCKETS,
)
INFERENCE = Histogram(
    "microbatch_worker_inference_seconds",
    "Time the model took per batch.",
    ["model"],
    buckets=SECONDS_BUCKETS,
)
REDELIVERIES = Counter(
    "microbatch_worker_redeliveries_total",
    "Entries taken over from dead consumers (or from the worker itself after an outage).",
    ["model"],
)
DEAD_LETTERS = Counter(
    "microbatch_worker_dead_letters_total",
    "Entries dead-lettered: poison, or entries no caller can be answered for.",
    ["model"],
)
RESTARTS = Counter(
    "microbatch_worker_restarts_total", "Worker processes restarted by the supervisor.", ["model"]
)
QUEUE_DEPTH = Gauge(
    "microbatch_queue_depth",
    "Entries in the model's stream (waiting or being computed).",
    ["model", "prefix"],
    multiprocess_mode="mostrecent",
)
QUEUE_ITEMS = Gauge(
    "microbatch_queue_items",
    "Items in the model's stream (waiting or being computed): its entries plus the items its "
    "multi-item entries hold beyond their first.",
    ["model", "prefix"],
    multiprocess_mode="mostrecent",
)
QUEUE_PENDING = Gauge(
    "microbatch_queue_pending",
    "Entries delivered to a worker and not yet answered.",
    ["model", "prefix"],
    multiprocess_mode="mostrecent",
)
LIVE_WORKERS = Gauge(
    "microbatch_live_workers",
    "Worker consumers with a live heartbeat.",
    ["model", "prefix"],
    multiprocess_mode="mostrecent",
)

REDIS_UP = Gauge(
    "microbatch_worker_redis_up",
    "1 if the supervisor's last sample of the queue (every 2 s) reached Redis, else 0.",
    ["model", "prefix"],
    multiprocess_mode="mostrecent",
)


class WorkerObserver(BatchObserver):
    """Feeds the metrics, tells the supervisor when a batch starts and ends (its watchdog),
    and logs the traceparent of traced requests with their batch.

    Metric updates wait until the batch's replies have been sent (:meth:`replies_sent`): each
    is a locked write to a memory-mapped file, together ~15 us a batch, which would otherwise
    delay every reply by as much.
    """

    def __init__(self, model: str, consumer: str, state: BatchState | None = None) -> None:
        self.model = model
        self.consumer = consumer
        self.state = state
        self.batch_size = BATCH_SIZE.labels(model)
        self.queue_wait = QUEUE_WAIT.labels(model)
        self.inference = INFERENCE.labels(model)
        self.batches = BATCHES.labels(model)
        self.redeliveries = REDELIVERIES.labels(model)
        self.dead_letters = DEAD_LETTERS.labels(model)  # exported as 0 until one happens
        self._sizes: list[float] = []
        self._waits: list[float] = []
        self._inference: list[float] = []
        self._outcomes: dict[str, int] = {}
        self._dead = 0
        self._items: dict[str, Any] = {}  # ITEMS' child of each outcome

    def batch_started(
        self, size: int, queue_waits_s: Sequence[float], traces: Sequence[str]
    ) -> None:
        if self.state is not None:
            self.state.busy(size)
        self._sizes.append(size)
        self._waits.extend(queue_waits_s)
        if traces:
            log.info(
                "batch of %d on %s for %s; traceparent %s",
                size, self.consumer, self.model, " ".join(traces),
            )  # fmt: skip

    def batch_finished(self, size: int, inference_s: float) -> None:
        if self.state is not None:
            self.state.idle()
        self._inference.append(inference_s)

    def answered(self, outcome: str, count: int = 1) -> None:
        self._outcomes[outcome] = self._outcomes.get(outcome, 0) + count

    def dead_lettered(self, count: int) -> None:
        self._dead += count

    def redelivered(self) -> None:
        self.redeliveries.inc()

    def replies_sent(self) -> None:
        self.flush()

    def flush(self) -> None:
        """Write the metric updates held back so far."""
        sizes, self._sizes = self._sizes, []
        waits, self._waits = self._waits, []
        inference, self._inference = self._inference, []
        outcomes, self._outcomes = self._outcomes, {}
        dead, self._dead = self._dead, 0
        if sizes:
            observe_many(self.batch_size, sizes)
        if waits:
            if min(waits) < 0:  # the broker's clock, estimated, ran a little ahead
                waits = [max(0.0, wait) for wait in waits]
            observe_many(self.queue_wait, waits)
        if inference:
            self.batches.inc(len(inference))
            observe_many(self.inference, inference)
        for outcome, count in outcomes.items():
            counter = self._items.get(outcome)
            if counter is None:
                counter = self._items[outcome] = ITEMS.labels(self.model, outcome)
            counter.inc(count)
        if dead:
            self.dead_letters.inc(dead)
