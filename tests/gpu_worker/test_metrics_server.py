"""gpu_worker.metrics_server: the worker's /metrics endpoint holds a bounded number of threads,
and lets go of connections that send nothing."""

from __future__ import annotations

import socket
import threading
import time

import httpx
from prometheus_client import CollectorRegistry, Counter

from broker.devserver import free_port
from gpu_worker.metrics_server import MAX_CONNECTIONS, start_metrics_server


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_hold_a_bounded_number_of_threads_until_their_timeout() -> None:
    """prometheus_client's start_http_server gave every connection a thread that waited for its
    request for ever: idle connections held threads without bound."""
    registry = CollectorRegistry()
    Counter("microbatch_test", "a counter", registry=registry).inc()
    port = free_port()
    before = threading.active_count()
    server, _ = start_metrics_server(port, registry, host="127.0.0.1", timeout=2.0)
    try:
        idle = [
            socket.create_connection(("127.0.0.1", port), timeout=5)
            for _ in range(MAX_CONNECTIONS + 20)
        ]
        opened = time.monotonic()
        time.sleep(0.3)
        assert threading.active_count() <= before + 1 + MAX_CONNECTIONS  # + the server's own
        while not all(closed(sock) for sock in idle):  # each cut off by its timeout
            assert time.monotonic() - opened < 2.0 + 3.0, "idle connections were kept"
            time.sleep(0.1)
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert response.status_code == 200 and "microbatch_test_total 1.0" in response.text
        settled = time.monotonic() + 5
        while threading.active_count() > before + 1:  # the scrape's thread ends
            assert time.monotonic() < settled, "connection threads were left running"
            time.sleep(0.05)
    finally:
        server.shutdown()
        server.server_close()


def test_clients_trickling_their_requests_are_cut_off_at_the_deadline() -> None:
    """A byte every 0.3 s keeps each read within its timeout: without a deadline for the whole
    connection, such clients held every slot for as long as they kept trickling, and no scrape
    got in."""
    registry = CollectorRegistry()
    Counter("microbatch_test", "a counter", registry=registry).inc()
    port = free_port()
    server, _ = start_metrics_server(port, registry, host="127.0.0.1", timeout=1.0, deadline=2.0)
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000
    tricklers = [
        socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS)
    ]
    for sock in tricklers:
        sock.setblocking(False)  # (with a timeout, recv waits for data despite MSG_DONTWAIT)
    opened = time.monotonic()
    cut_off: set[int] = set()
    try:
        for position in range(len(request)):
            for index, sock in enumerate(tricklers):
                if index in cut_off:
                    continue
                try:
                    sock.send(request[position : position + 1])
                except OSError:
                    cut_off.add(index)
                    continue
                if closed(sock):
                    cut_off.add(index)
            if len(cut_off) == len(tricklers):
                break
            assert time.monotonic() - opened < 2.0 + 3.0, "trickling connections were kept"
            time.sleep(0.3)
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert response.status_code == 200 and "microbatch_test_total 1.0" in response.text
    finally:
        for sock in tricklers:
            sock.close()
        server.shutdown()
        server.server_close()


def test_only_the_metrics_and_probe_paths_answer() -> None:
    """prometheus_client's app served the metrics on any path (`/`, `/anything`, a typo of a
    probe's): a wrong path looked like a scrape target, and a wrong probe path like a probe
    that passed. Only /metrics, /ready and /live answer; any other path is 404."""
    registry = CollectorRegistry()
    Counter("microbatch_test", "a counter", registry=registry).inc()
    port = free_port()
    server, _ = start_metrics_server(
        port, registry, host="127.0.0.1", ready=lambda: False, alive=lambda: True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        scraped = httpx.get(f"{base}/metrics", timeout=5)
        probes = [httpx.get(f"{base}{path}", timeout=5) for path in ("/ready", "/live")]
        others = {
            path: httpx.get(f"{base}{path}", timeout=5)
            for path in ("/", "/metrics/", "/metricsx", "/favicon.ico", "/readyz", "/x/metrics")
        }
    finally:
        server.shutdown()
        server.server_close()
    assert scraped.status_code == 200 and "microbatch_test_total 1.0" in scraped.text
    assert [(p.status_code, p.text) for p in probes] == [(503, "not ready\n"), (200, "alive\n")]
    for path, response in others.items():
        assert response.status_code == 404, path
        assert response.text == "not found: the metrics are at /metrics\n", path
        assert "microbatch_test" not in response.text
