"""The worker's ``/metrics`` endpoint (and ``/ready`` and ``/live``, its probes):
prometheus_client's WSGI app on a threaded server whose connections time out and are capped.
Any other path is 404 (prometheus_client's app serves the metrics on every path).

prometheus_client's ``start_http_server`` gives each connection a thread that waits for its
request without a timeout: 1,000 connections that sent nothing held 1,000 threads of a
`worker start` process for ever. Here a connection has ``timeout`` seconds for each read and
write and ``deadline`` seconds in all (a client trickling its request a byte at a time is cut
off too), and past ``max_connections`` at once a new one is closed unanswered.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("microbatch.metrics")

TIMEOUT_S = 10.0  # for each read and write
DEADLINE_S = 10.0  # for a connection in all (Prometheus's own default scrape timeout)
MAX_CONNECTIONS = 32


class _QuietHandler(WSGIRequestHandler):
    """No line per request on stderr (as prometheus_client's own handler)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` of them, each cut off
    ``deadline`` seconds after it was accepted."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS
    deadline = DEADLINE_S
    request_queue_size = 64  # the listen backlog (socketserver's 5 made connects wait 1 s)

    def server_bind(self) -> None:
        super().server_bind()
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._lock = threading.Lock()
        self._deadlines: dict[socket.socket, float] = {}

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap: closed at once
            return
        with self._lock:
            self._deadlines[request] = time.monotonic() + self.deadline
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._let_go(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._let_go(request)

    def _let_go(self, request: Any) -> None:
        with self._lock:
            self._deadlines.pop(request, None)
        self._slots.release()

    def service_actions(self) -> None:
        """Run by ``serve_forever`` between polls (every 0.5 s): a connection past its deadline
        is shut down, which ends its thread's blocked read or write."""
        now = time.monotonic()
        with self._lock:
            expired = [sock for sock, deadline in self._deadlines.items() if deadline <= now]
        for sock in expired:
            with contextlib.suppress(OSError):  # closed meanwhile
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that timed out or went away; socketserver would print a traceback
        log.debug("metrics connection from %s failed", client_address, exc_info=True)


METRICS_PATH = "/metrics"
NOT_FOUND = f"not found: the metrics are at {METRICS_PATH}"


class MetricsServer6(MetricsServer):
    """:class:`MetricsServer` on an IPv6 address (``::1``, ``::``)."""

    address_family = socket.AF_INET6


def with_probes(app: Any, probes: dict[str, tuple[Callable[[], bool], str, str]]) -> Any:
    """``app`` (WSGI, the metrics) on ``/metrics`` alone, with each probe's path answered 200
    and its first word while its check is true, else 503 and its second:
    ``{"/ready": (ready, "ready", "not ready")}``; any other path 404."""

    def serve(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == METRICS_PATH:
            result: Iterable[bytes] = app(environ, start_response)
            return result
        probe = probes.get(path)
        if probe is None:
            return _text(start_response, "404 Not Found", NOT_FOUND)
        check, yes, no = probe
        if check():
            return _text(start_response, "200 OK", yes)
        return _text(start_response, "503 Service Unavailable", no)

    return serve


def _text(start_response: Any, status: str, text: str) -> list[bytes]:
    """A plain-text answer: ``text`` on a line of its own."""
    body = f"{text}\n".encode()
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def start_metrics_server(
    port: int,
    registry: CollectorRegistry,
    host: str = "0.0.0.0",
    timeout: float = TIMEOUT_S,
    deadline: float = DEADLINE_S,
    ready: Callable[[], bool] | None = None,
    alive: Callable[[], bool] | None = None,
) -> tuple[MetricsServer, threading.Thread]:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread, and, given
    ``ready`` and ``alive``, ``/ready`` and ``/live``: 200 while each returns true, else 503.
    Any other path is 404."""
    handler = type("Handler", (_QuietHandler,), {"timeout": timeout})
    app = make_wsgi_app(registry)
    probes = {}
    if ready is not None:
        probes["/ready"] = (ready, "ready", "not ready")
    if alive is not None:
        probes["/live"] = (alive, "alive", "stalled")
    app = with_probes(app, probes)
    server_class = MetricsServer6 if ":" in host else MetricsServer
    server: Any = make_server(host, port, app, server_class=server_class, handler_class=handler)
    server.deadline = deadline
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    return server, thread
