"""The gateway's per-request metrics: counted in plain Python, written to prometheus-client by a
flush (periodic, before each scrape, at shutdown), with the same values ``observe``/``inc``
would have written."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Histogram
from starlette.testclient import TestClient

from broker.devserver import RedisServer
from web_gateway import metrics
from web_gateway.app import create_app
from web_gateway.metrics import LATENCY_BUCKETS, ModelMetrics
from web_gateway.settings import GatewaySettings

DOUBLER = "tests.gateway_models:Doubler"
LATENCY = "microbatch_gateway_request_duration_seconds"
# each bound itself (a bucket's bound belongs to it), around them, and past the last one
DURATIONS = [0.0, 0.0005, 0.001, 0.0011, 0.005, 0.04, 1.0, 29.9, 30.0, 31.0, 1000.0]


def value(name: str, **labels: str) -> float:
    """A sample of the process's default registry (0 when it was never written)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def requests(model: str, route: str = "v1", outcome: str = "ok") -> float:
    labels = {"model": model, "route": route, "outcome": outcome}
    return value("microbatch_gateway_requests_total", **labels)


def in_flight(model: str) -> float:
    return value("microbatch_gateway_in_flight_requests", model=model)


@pytest.fixture
def model() -> str:
    """A model name no other test counts under (the default registry is the process's)."""
    return f"m{uuid.uuid4().hex[:10]}"


def test_nothing_is_written_until_a_flush_and_a_flush_writes_each_count_once(
    model: str,
) -> None:
    counted = ModelMetrics(model)
    # exposed from the start, as the dashboard expects
    for name in ("microbatch_gateway_in_flight_requests", "microbatch_gateway_items_total"):
        assert REGISTRY.get_sample_value(name, {"model": model}) == 0.0
    for _ in range(3):
        counted.begin()
    counted.submitted(5)
    counted.answered("v1", "ok", 0.002)
    counted.answered("v2", "BadRequest", 0.003)
    assert requests(model) == 0 and in_flight(model) == 0
    assert value("microbatch_gateway_items_total", model=model) == 0

    counted.flush()
    assert requests(model) == 1 and requests(model, "v2", "BadRequest") == 1
    assert in_flight(model) == 1  # three began, two were answered
    assert value("microbatch_gateway_items_total", model=model) == 5
    assert value(f"{LATENCY}_count", model=model, route="v1") == 1
    assert value(f"{LATENCY}_sum", model=model, route="v2") == pytest.approx(0.003)

    counted.flush()  # nothing new: nothing changes
    assert requests(model) == 1 and in_flight(model) == 1
    counted.answered("v1", "ok", 0.004)
    counted.flush()
    assert requests(model) == 2 and in_flight(model) == 0
    assert value(f"{LATENCY}_count", model=model, route="v1") == 2


def test_a_flushed_histogram_equals_one_observed_a_request_at_a_time(model: str) -> None:
    counted = ModelMetrics(model)
    reference = Histogram(
        "reference", "observed one at a time", ["model"], buckets=LATENCY_BUCKETS,
        registry=(registry := CollectorRegistry()),
    )  # fmt: skip
    for seconds in DURATIONS:
        counted.begin()
        counted.answered("v1", "ok", seconds)
        reference.labels(model).observe(seconds)
    counted.flush()
    want = {
        (sample.labels.get("le"), sample.name.removeprefix("reference")): sample.value
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    }
    got = {
        (sample.labels.get("le"), sample.name.removeprefix(LATENCY)): sample.value
        for family in REGISTRY.collect()
        if family.name == LATENCY
        for sample in family.samples
        if sample.labels.get("model") == model and not sample.name.endswith("_created")
    }
    assert got == want
    assert got[("+Inf", "_bucket")] == len(DURATIONS)


def test_without_a_flusher_the_counts_held_stay_bounded(model: str) -> None:
    counted = ModelMetrics(model)
    for _ in range(metrics.MAX_PENDING - 1):
        counted.begin()
        counted.answered("v1", "ok", 0.001)
    assert requests(model) == 0
    counted.begin()
    counted.answered("v1", "ok", 0.001)
    assert requests(model) == metrics.MAX_PENDING
    assert value(f"{LATENCY}_count", model=model, route="v1") == metrics.MAX_PENDING


def test_a_scrape_shows_this_process_exactly_in_flight_included(
    redis_server: RedisServer,
) -> None:
    """No flush has run (the periodic one every hour): the scrape flushes first."""
    settings = GatewaySettings(model=[DOUBLER], redis_url=redis_server.url, prefix="metrics")
    app = create_app(settings)
    counted = app.gateway.models["doubler"].metrics
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics, "FLUSH_S", 3600.0)
        with TestClient(app) as http:
            before = requests("doubler", "v1", "BadRequest")
            refused = http.post("/v1/models/doubler/predict", content=b'{"inputs": []}')
            assert refused.status_code == 400
            counted.begin()  # a request in flight (as if it waited for its worker)
            assert scraped(http.get("/metrics").text) == (before + 1, 1.0)
            counted.answered("v1", "ok", 0.001)
            assert scraped(http.get("/metrics").text)[1] == 0.0


def scraped(text: str) -> tuple[float, float]:
    """Doubler's refused v1 requests and its in-flight requests, from exposition text."""
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    refused = 'microbatch_gateway_requests_total{model="doubler",outcome="BadRequest",route="v1"}'
    return float(samples[refused]), float(
        samples['microbatch_gateway_in_flight_requests{model="doubler"}']
    )


def test_the_loop_flushes_periodically_and_the_gateway_flushes_when_it_stops(
    redis_server: RedisServer, model: str
) -> None:
    settings = GatewaySettings(model=[DOUBLER], redis_url=redis_server.url, prefix="metrics")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics, "FLUSH_S", 0.01)
        app = create_app(settings)
        counted = app.gateway.models["doubler"].metrics = ModelMetrics(model)  # this test's own
        with TestClient(app):
            counted.begin()
            counted.answered("v1", "ok", 0.001)
            assert wait_for(lambda: requests(model) == 1)

        patch.setattr(metrics, "FLUSH_S", 3600.0)
        app = create_app(settings)
        counted = app.gateway.models["doubler"].metrics = ModelMetrics(model)
        with TestClient(app):
            counted.begin()
            counted.answered("v1", "ok", 0.001)
            counted.submitted(3)
            assert requests(model) == 1  # not flushed yet
        assert requests(model) == 2  # the gateway's stop flushed it
        assert value("microbatch_gateway_items_total", model=model) == 3
        assert in_flight(model) == 0


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False
