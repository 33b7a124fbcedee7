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
