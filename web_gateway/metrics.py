"""Gateway metrics (prometheus-client), safe under gunicorn's several worker processes.

With ``PROMETHEUS_MULTIPROC_DIR`` set (web_gateway/server.py sets it to a fresh directory when
it is not set), every process writes its samples there and ``/metrics`` aggregates all of them;
without it (a single process, e.g. uvicorn alone) the default registry is served.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

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
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
IN_FLIGHT = Gauge(
    "microbatch_gateway_in_flight_requests",
    "Inference requests being processed, by model.",
    ["model"],
    multiprocess_mode="livesum",
)


class ModelMetrics:
    """One model's metric children, looked up once (``labels()`` takes a lock and builds a key:
    per request, that was a few percent of the gateway's CPU)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.in_flight = IN_FLIGHT.labels(model)
        self.items = ITEMS.labels(model)
        self._latency: dict[str, Any] = {}
        self._requests: dict[tuple[str, str], Any] = {}

    def answered(self, route: str, outcome: str, seconds: float) -> None:
        """One request on ``route`` ended with ``outcome`` after ``seconds``."""
        requests = self._requests.get((route, outcome))
        if requests is None:
            requests = self._requests[route, outcome] = REQUESTS.labels(self.model, route, outcome)
        requests.inc()
        latency = self._latency.get(route)
        if latency is None:
            latency = self._latency[route] = LATENCY.labels(self.model, route)
        latency.observe(seconds)


def render() -> tuple[bytes, str]:
    """The exposition text of every gateway process (or of this one without a multiproc dir)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
