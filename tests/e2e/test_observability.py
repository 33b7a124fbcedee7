"""Metrics and tracing, checked after real traffic through real processes."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from broker import ModelError, Streamer
from broker.devserver import RedisServer, free_port
from broker.keys import ModelKeys
from tests.conftest import ROOT, wait_for_consumers, wait_until, worker_process
from tests.e2e.test_gateway import gateway_process
from tests.models import INIT_UNTIL_ENV

TOY = "tests.models:Toy"
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text exposition (0 if absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def scrape(port: int) -> str:
    deadline = time.monotonic() + 10
    while True:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_worker_metrics_count_the_batches_the_workers_ran(
    redis_server: RedisServer, prefix: str
) -> None:
    port = free_port()
    args = ("--workers", "2", "--batch-size", "4", "--metrics-port", str(port))
    args += ("--max-queue-items", "0")  # 90 items are submitted at once: no bound here
    with worker_process(redis_server.url, "tests.models:Toy", prefix, *args, expect_consumers=2):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        futures = [streamer.submit([f"{call}-{i}" for i in range(3)]) for call in range(30)]
        outputs = [out for future in futures for out in future.result(timeout=30)]
        with pytest.raises(ModelError):
            streamer.predict([{"fail": "boom"}])
        streamer.close()

        # a batch's metrics are written once its replies are sent, and the supervisor samples
        # the queue gauges every 2 s: wait for both to show
        def counted() -> bool:
            text = scrape(port)
            return (
                sample(text, "microbatch_worker_items_total", model="toy", outcome="model_error")
                == 1
                and sample(text, "microbatch_worker_items_total", model="toy", outcome="ok") == 90
                and sample(text, "microbatch_live_workers", model="toy", prefix=prefix) == 2
            )

        wait_until(counted, 30, "the metrics of every item")
        text = scrape(port)

    batches_run = len({(out["pid"], out["batch_no"]) for out in outputs}) + 1  # + the failing one
    assert sample(text, "microbatch_worker_batch_size_count", model="toy") == batches_run
    assert sample(text, "microbatch_worker_batches_total", model="toy") == batches_run
    assert sample(text, "microbatch_worker_batch_size_sum", model="toy") == len(outputs) + 1
    assert sample(text, "microbatch_worker_items_total", model="toy", outcome="ok") == 90
    assert sample(text, "microbatch_worker_items_total", model="toy", outcome="model_error") == 1
    assert sample(text, "microbatch_worker_queue_wait_seconds_count", model="toy") == 91
    assert sample(text, "microbatch_worker_inference_seconds_count", model="toy") == batches_run
    assert sample(text, "microbatch_live_workers", model="toy", prefix=prefix) == 2
    assert "microbatch_queue_depth" in text and "microbatch_worker_restarts_total" in text


def test_every_dead_letter_is_counted(redis_server: RedisServer, prefix: str) -> None:
    """Entries no caller can be told about (no request id, a reply key outside the model's
    inboxes) are dead-lettered too: the dead-letter counter counts them, not only poison."""
    import redis

    port = free_port()
    keys = ModelKeys("toy", prefix)
    with worker_process(redis_server.url, TOY, prefix, "--metrics-port", str(port)):
        client = redis.Redis.from_url(redis_server.url)
        client.xadd(keys.stream, {"v": "1", "junk": "x"})
        client.xadd(keys.stream, {"v": "1", "id": "r-1", "reply": "elsewhere", "data": "x"})
        wait_until(lambda: client.xlen(keys.dead_letters) == 2, 30, "two dead letters")

        def counted() -> bool:
            text = scrape(port)
            malformed = sample(
                text, "microbatch_worker_items_total", model="toy", outcome="malformed"
            )
            return malformed == 2

        wait_until(counted, 30, "the malformed entries' metrics")
        text = scrape(port)
        client.close()
    assert sample(text, "microbatch_worker_dead_letters_total", model="toy") == 2


def test_the_worker_is_ready_while_a_worker_process_serves_the_model(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """/metrics answers as soon as the supervisor runs: as the Kubernetes startup and readiness
    probe it passed minutes before the model had loaded, and a rolling update (maxUnavailable
    0) stopped the old pod before the new one could serve. /ready says when it can."""
    port = free_port()
    loaded = tmp_path / "loaded"
    ready_url = f"http://127.0.0.1:{port}/ready"
    args = ("--metrics-port", str(port))
    env = {INIT_UNTIL_ENV: str(loaded)}
    with worker_process(
        redis_server.url, TOY, prefix, *args, env=env, expect_consumers=None
    ) as process:
        scrape(port)  # /metrics answers (liveness) while the model loads
        assert httpx.get(ready_url, timeout=5).status_code == 503
        loaded.touch()
        wait_for_consumers(redis_server.url, ModelKeys("toy", prefix), 1)
        wait_until(lambda: httpx.get(ready_url, timeout=5).status_code == 200, 30, "/ready")

        # asked to stop, it finishes its batch, and says it is no longer ready meanwhile
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        future = streamer.submit([{"sleep": 3}])
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(ready_url, timeout=5).status_code == 503, 2, "503 on stop")
        assert len(future.result(timeout=30)) == 1
        streamer.close()


@pytest.mark.slow  # Redis stopped and started
def test_the_queue_gauges_say_unknown_while_redis_is_away(prefix: str) -> None:
    """The supervisor kept the gauges at their last sample through an outage: live workers 1
    and an empty queue while nothing could be known, and nothing said Redis was away."""
    server = RedisServer().start()
    port = free_port()
    labels = {"model": "toy", "prefix": prefix}

    def gauges() -> tuple[float, float, float]:
        text = scrape(port)
        return (
            sample(text, "microbatch_worker_redis_up", **labels),
            sample(text, "microbatch_live_workers", **labels),
            sample(text, "microbatch_queue_depth", **labels),
        )

    try:
        with worker_process(server.url, TOY, prefix, "--metrics-port", str(port)):
            wait_until(lambda: gauges() == (1, 1, 0), 30, "the first sample")
            server.kill()
            wait_until(lambda: gauges()[0] == 0, 30, "microbatch_worker_redis_up 0")
            _, live, depth = gauges()
            assert math.isnan(live) and math.isnan(depth)
            server.start()
            wait_until(lambda: gauges() == (1, 1, 0), 30, "the gauges back")
    finally:
        server.stop()


@pytest.mark.slow
def test_the_worker_stays_live_while_redis_is_silent_or_gone(prefix: str) -> None:
    """/live answers 200 whenever the supervisor's loop goes round: a Redis that answers
    nothing (its process stopped: every command waits for its timeout), then a Redis that is
    gone, must not make it fail, or Kubernetes would restart every worker pod in an outage."""
    server = RedisServer().start()
    port = free_port()
    live_url = f"http://127.0.0.1:{port}/live"
    statuses: list[int] = []

    def probe_for(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            statuses.append(httpx.get(live_url, timeout=5).status_code)
            time.sleep(0.5)

    try:
        with worker_process(server.url, TOY, prefix, "--metrics-port", str(port)):
            probe_for(1)
            assert server.process is not None
            os.kill(server.process.pid, signal.SIGSTOP)
            try:
                probe_for(12)
            finally:
                os.kill(server.process.pid, signal.SIGCONT)
            server.kill()
            probe_for(4)
            server.start()
            probe_for(1)
    finally:
        server.stop()
    assert len(statuses) > 20 and set(statuses) == {200}, statuses


def test_live_fails_once_the_supervisor_s_loop_stalls() -> None:
    from gpu_worker.supervisor import LIVE_STALL_S, Supervisor

    supervisor = object.__new__(Supervisor)  # the probe's state only: no Redis, no children
    supervisor._stopping, supervisor._ticked = False, time.monotonic()
    assert supervisor.alive()
    supervisor._ticked = time.monotonic() - LIVE_STALL_S - 1
    assert not supervisor.alive()
    supervisor._stopping = True  # a stop in progress (draining) is not a stall
    assert supervisor.alive()


@dataclass
class Served:
    """A worker and a gateway serving Toy; both log JSON to their files."""

    base: str
    prefix: str
    redis_url: str
    metrics_port: int
    worker_log: Path
    gateway_log: Path


@pytest.fixture(scope="module")
def served(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One stack for the tests below, which read its logs and metrics after their own requests."""
    logs = tmp_path_factory.mktemp("logs")
    prefix = f"o{uuid.uuid4().hex[:10]}"
    port = free_port()
    worker_args = ("--log-format", "json", "--metrics-port", str(port))
    gateway_env = {"MICROBATCH_GATEWAY_LOG_FORMAT": "json", "MICROBATCH_GATEWAY_LOG_LEVEL": "info"}
    with (
        worker_process(
            redis_server.url,
            TOY,
            prefix,
            *worker_args,
            log_path=logs / "worker.log",
            expect_consumers=None,  # waited for below, once the gateway started meanwhile
        ),
        gateway_process(
            redis_server.url, [TOY], prefix, env=gateway_env, log_path=logs / "gateway.log"
        ) as (base, _),
    ):
        wait_for_consumers(redis_server.url, ModelKeys("toy", prefix), 1)
        yield Served(
            base, prefix, redis_server.url, port, logs / "worker.log", logs / "gateway.log"
        )


def test_a_traced_request_is_found_in_the_workers_log_line_for_its_batch(served: Served) -> None:
    streamer = Streamer("toy", redis_url=served.redis_url, prefix=served.prefix)
    streamer.predict(["untraced"])
    streamer.predict(["traced"], traceparent=TRACE)
    streamer.close()
    http_trace = TRACE.replace("00f067aa0ba902b7", "1111111111111111")
    response = httpx.post(
        f"{served.base}/v1/models/toy/predict",
        json={"inputs": ["via http"]},
        headers={"traceparent": http_trace},
        timeout=10,
    )
    assert response.status_code == 200
    forged = httpx.post(
        f"{served.base}/v1/models/toy/predict",
        json={"inputs": ["forged"]},
        headers={"traceparent": "00-INJECTED-not-w3c"},
        timeout=10,
    )
    assert forged.status_code == 200
    # a batch's line is written as it starts, before its replies
    lines = served.worker_log.read_text().splitlines()
    assert [line for line in lines if TRACE in line and "batch of 1" in line]
    assert [line for line in lines if http_trace in line]
    assert not [line for line in lines if "INJECTED" in line]


def test_json_logs_are_one_object_per_line(served: Served) -> None:
    response = httpx.post(
        f"{served.base}/v1/models/toy/predict",
        json={"inputs": ["secret-payload"]},
        headers={"traceparent": TRACE},
        timeout=10,
    )
    assert response.status_code == 200
    for path in (served.worker_log, served.gateway_log):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        assert lines, f"{path.name} is empty"
        events = [json.loads(line) for line in lines]
        assert all({"time", "level", "logger", "pid", "message"} <= set(e) for e in events)
        assert "secret-payload" not in path.read_text()  # never payloads
    worker_events = [json.loads(line) for line in served.worker_log.read_text().splitlines()]
    assert any(TRACE in event["message"] for event in worker_events)


def test_every_metric_the_dashboard_queries_exists(served: Served) -> None:
    dashboard = (ROOT / "deploy" / "grafana" / "microbatch.json").read_text()
    queried = {
        re.sub(r"_(bucket|sum|count)$", "", name)
        for name in re.findall(r"\b(microbatch_[a-z_]+)", dashboard)
    }
    assert queried
    for i in range(5):
        response = httpx.post(
            f"{served.base}/v1/models/toy/predict", json={"inputs": [f"x{i}"]}, timeout=10
        )
        assert response.status_code == 200

    def declared() -> set[str]:
        exposed = scrape(served.metrics_port) + httpx.get(f"{served.base}/metrics", timeout=5).text
        return set(re.findall(r"^# TYPE (\w+) ", exposed, flags=re.MULTILINE))

    # the queue gauges appear with the supervisor's first sample (every 2 s)
    with contextlib.suppress(AssertionError):
        wait_until(lambda: queried <= declared(), 30, "every metric the dashboard queries")
    assert queried <= declared(), f"missing: {sorted(queried - declared())}"


def test_bulk_observations_equal_one_observe_per_value() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from broker.multiproc_metrics import observe_many
    from gpu_worker.metrics import SECONDS_BUCKETS

    values = [0.0, 0.0005, 0.0007, 0.001, 0.3, 2.5, 59.0, 60.0, 61.0, 1e9] * 3
    values += [-0.001, float("inf"), 0.0004, 2.5, 0.0005, 30.0]  # in no order

    def exposition(bulk: bool) -> list[str]:
        registry = CollectorRegistry()
        histogram = Histogram("wait", "w", ["model"], buckets=SECONDS_BUCKETS, registry=registry)
        child = histogram.labels("m")
        if bulk:
            observe_many(child, values)
        else:
            for value in values:
                child.observe(value)
        text = generate_latest(registry).decode()
        return [line for line in text.splitlines() if "_created" not in line]

    assert exposition(bulk=True) == exposition(bulk=False)
    assert "wait_count" in "\n".join(exposition(bulk=True))


def test_worker_metrics_are_written_once_the_batchs_replies_are_sent() -> None:
    from prometheus_client import REGISTRY

    from gpu_worker.metrics import WorkerObserver

    model = f"held-{uuid.uuid4().hex[:8]}"
    observer = WorkerObserver(model, "consumer-1")

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"model": model, **labels}) or 0.0

    for _ in range(2):
        observer.batch_started(3, [0.001, 0.002, 0.003], [])
        observer.batch_finished(3, 0.004)
        observer.answered("ok", 2)
        observer.answered("model_error")
    # the replies are not out yet: nothing written
    assert sample("microbatch_worker_batches_total") == 0
    assert sample("microbatch_worker_items_total", outcome="ok") == 0
    observer.replies_sent()
    assert sample("microbatch_worker_batches_total") == 2
    assert sample("microbatch_worker_items_total", outcome="ok") == 4
    assert sample("microbatch_worker_items_total", outcome="model_error") == 2
    assert sample("microbatch_worker_batch_size_count") == 2
    assert sample("microbatch_worker_batch_size_sum") == 6
    assert sample("microbatch_worker_queue_wait_seconds_count") == 6
    assert sample("microbatch_worker_inference_seconds_sum") == pytest.approx(0.008)
    observer.replies_sent()  # nothing new: nothing written twice
    assert sample("microbatch_worker_batches_total") == 2
