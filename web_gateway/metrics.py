"""Gateway metrics (prometheus-client), safe under gunicorn's several worker processes.

With ``PROMETHEUS_MULTIPROC_DIR`` set (web_gateway/server.py sets it to a fresh directory when
it is not set), every process writes its samples there and ``/metrics`` aggregates all of them;
without it (a single process, e.g. uvicorn alone) the default registry is served.

Requests are counted in plain Python (:class:`ModelMetrics`) and written to prometheus-client
every ``FLUSH_S``, before the scraping process renders, and when the gateway stops: another
process's requests show up within ``FLUSH_S``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from broker import multiproc_metrics
from broker.multiproc_metrics import observe_many

log = logging.getLogger("microbatch.gateway")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
FLUSH_S = 0.1  # how often a process writes its requests' counts to prometheus-client

MAX_PENDING = 10_000  # requests counted before a flush is forced (bounds the memory held)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

REQUESTS = Counter(
    "microbatch_gateway_requests_total",
    "HTTP inference requests answered by the gateway, by model, route and outcome.",
    ["model", "route", "outcome"],
)
ITEMS = Counter(
    "microbatch_gateway_items_total",
    "Items submitted to the broker by the gateway, by model.",
    ["model"],
)
LATENCY = Histogram(
    "microbatch_gateway_request_duration_seconds",
    "Time from a request's arrival to its response, by model and route.",
    ["model", "route"],
    buckets=LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge(
    "microbatch_gateway_in_flight_requests",
    "Inference requests being processed, by model.",
    ["model"],
    multiprocess_mode="livesum",
)


class ModelMetrics:
    """One model's per-request metrics, counted in plain Python and written to prometheus-client
    by :meth:`flush` (every ``FLUSH_S`` from the gateway's loop, before each scrape, at exit).

    Each write to prometheus-client takes a lock and, under gunicorn, writes a memory-mapped
    file: six a request were about 12% of the gateway's CPU. All calls must come from one
    thread (the gateway's event loop).
    """

    def __init__(self, model: str) -> None:
        self.model = model
        # created now, as before buffering: both are exposed (at 0) from the start
        self._in_flight_child = IN_FLIGHT.labels(model)
        self._items_child = ITEMS.labels(model)
        self._in_flight = 0  # requests begun and not answered
        self._in_flight_written = 0  # the part of it written to the gauge
        self._items = 0
        self._answers: dict[tuple[str, str], int] = {}
        self._durations: dict[str, list[float]] = {}
        self._pending = 0  # requests answered since the last flush
        # labels() takes a lock and builds a key: each child is looked up once
        self._requests_children: dict[tuple[str, str], Any] = {}
        self._latency_children: dict[str, Any] = {}

    def begin(self) -> None:
        """A request has begun (in flight until :meth:`answered`)."""
        self._in_flight += 1

    def submitted(self, items: int) -> None:
        """``items`` were submitted to the broker."""
        self._items += items

    def answered(self, route: str, outcome: str, seconds: float) -> None:
        """One request on ``route`` ended with ``outcome`` after ``seconds``."""
        self._in_flight -= 1
        key = (route, outcome)
        self._answers[key] = self._answers.get(key, 0) + 1
        durations = self._durations.get(route)
        if durations is None:
            durations = self._durations[route] = []
        durations.append(seconds)
        self._pending += 1
        if self._pending >= MAX_PENDING:  # no flusher running (e.g. lifespan off): bounded
            self.flush()

    def flush(self) -> None:
        """Write what was counted since the last flush to prometheus-client."""
        if self._in_flight != self._in_flight_written:
            # a delta, not set(): several gateways in one process (tests) share the child
            self._in_flight_child.inc(self._in_flight - self._in_flight_written)
            self._in_flight_written = self._in_flight
        if self._items:
            self._items_child.inc(self._items)
            self._items = 0
        if not self._pending:
            return
        answers, durations = self._answers, self._durations
        self._answers, self._durations, self._pending = {}, {}, 0
        for (route, outcome), count in answers.items():
            requests = self._requests_children.get((route, outcome))
            if requests is None:
                requests = REQUESTS.labels(self.model, route, outcome)
                self._requests_children[route, outcome] = requests
            requests.inc(count)
        for route, seconds in durations.items():
            latency = self._latency_children.get(route)
            if latency is None:
                latency = self._latency_children[route] = LATENCY.labels(self.model, route)
            observe_many(latency, seconds)


async def flush_every(models: list[ModelMetrics], interval: float) -> None:
    """Flush ``models`` every ``interval`` seconds, until cancelled (the caller flushes last)."""
    while True:
        await asyncio.sleep(interval)
        for model in models:
            try:
                model.flush()
            except Exception:
                log.exception("writing the metrics of model %s failed", model.model)


def render() -> tuple[bytes, str]:
    """The exposition text of every gateway process (or of this one without a multiproc dir)."""
    if os.environ.get(MULTIPROC_ENV):
        return generate_latest(multiproc_metrics.registry()), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
