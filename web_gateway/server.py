"""The gateway under gunicorn: its gunicorn settings, and the process ``gateway start`` runs.

``serve(settings)`` runs gunicorn in this process through its application API: the settings
object travels to the worker processes whole (they are forked from this one), and no
configuration file or repository path is needed. ``gunicorn -c deploy/gunicorn.conf.py`` reads
the same gunicorn settings (``gunicorn_options``), from the environment.

Metrics: prometheus-client's multiprocess mode needs ``PROMETHEUS_MULTIPROC_DIR`` set before
any worker starts. If it is not set, a fresh temporary directory is made (and removed at exit);
if it is set, stale files in it are removed at start. ``child_exit`` marks a dead worker's gauges.
"""

from __future__ import annotations

import errno
import importlib.util
import math
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication

from broker import multiproc_metrics
from broker.logs import dict_config

from .settings import GatewaySettings

APP = "web_gateway.app:create_app()"
WORKER_CLASS = "web_gateway.workers.GatewayWorker"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_own_dir: str | None = None  # the metrics directory this process made (removed at exit)


def prepare_environment() -> None:
    """What the worker processes must find in their environment, set before any starts."""
    # With several workers, uvloop (libuv) accepts every pending connection in one go: whichever
    # worker wakes first takes a burst of new connections (seen: 48 of 64 in one of two
    # workers), and its clients wait longer. One accept per wake-up spreads them over the workers.
    os.environ.setdefault("UV_TCP_SINGLE_ACCEPT", "1")
    global _own_dir
    if not os.environ.get(MULTIPROC_ENV):
        _own_dir = os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(
            prefix="microbatch-gateway-metrics-"
        )


def on_starting(server: Any) -> None:
    directory = Path(os.environ[MULTIPROC_ENV])
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()


def child_exit(server: Any, worker: Any) -> None:
    multiproc_metrics.process_gone(worker.pid)


def on_exit(server: Any) -> None:
    if _own_dir is not None:
        shutil.rmtree(_own_dir, ignore_errors=True)


def _log_config(level: str, fmt: str) -> dict[str, Any]:
    """The same log format as `worker start` (broker.logs), for gunicorn's, uvicorn's and the
    app's loggers alike."""
    config: dict[str, Any] = dict_config(level, fmt, loggers=("gunicorn.error",))
    # --access-log: the app's own access log (web_gateway.access_log), whatever the level
    config["loggers"]["microbatch.gateway.access"] = {
        "level": "INFO",
        "handlers": ["stderr"],
        "propagate": False,
    }
    return config


def bind_host(host: str) -> str:
    """``host`` as gunicorn's bind takes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_address(host: str, port: int) -> None:
    """Raise ValueError, in one line naming the option, where gunicorn could not listen on
    ``host:port`` (gunicorn would retry for 5 s, log each try and exit 1). Not where gunicorn
    is handed its sockets already bound (a USR2 upgrade's new master, systemd's sockets)."""
    if os.environ.get("GUNICORN_FD") or os.environ.get("LISTEN_FDS"):
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as gunicorn chooses it
    address = host.strip("[]")
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn binds
            probe.bind((address, port))
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: {exc.strerror or exc}") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {host}: {reason}") from None
        raise ValueError(f"--port {port}: {reason} ({bind_host(host)}:{port})") from None


def gunicorn_options(settings: GatewaySettings) -> dict[str, Any]:
    """gunicorn's settings for a gateway with ``settings`` (names as in gunicorn's config)."""
    return {
        "worker_class": WORKER_CLASS,
        "bind": [f"{bind_host(settings.host)}:{settings.port}"],
        "workers": settings.workers,
        # SIGTERM: stop accepting, let in-flight requests finish for up to this long, then exit
        # (gunicorn takes whole seconds: rounded up, never less than asked).
        "graceful_timeout": math.ceil(settings.graceful_timeout),
        "max_requests": settings.max_requests,
        "max_requests_jitter": settings.max_requests_jitter,
        "timeout": 60,  # a worker whose event loop stops answering gunicorn this long restarts
        # uvicorn's keep-alive timer is replaced by the idle deadline of
        # web_gateway.http_protocol, which enforces keepalive_timeout (and the read deadlines).
        "keepalive": max(1, math.ceil(settings.keepalive_timeout)),
        "backlog": 2048,
        "loglevel": settings.log_level,
        "logconfig_dict": _log_config(settings.log_level, settings.log_format),
        "accesslog": None,  # gunicorn's own: unused (uvicorn workers); see --access-log instead
        "proc_name": "microbatch-gateway",
        # gunicorn >= 24 opens a control socket at one fixed path per user, which several
        # gateways on one host would fight over; gateways are driven by signals instead.
        "control_socket_disable": True,
        "on_starting": on_starting,
        "child_exit": child_exit,
        "on_exit": on_exit,
    }


def _connection_limits(settings: GatewaySettings) -> None:
    """Hand the connection limits to the HTTP protocol (its workers are forked from here)."""
    if importlib.util.find_spec("httptools") is None:
        return
    from .http_protocol import ConnectionLimits, GatewayHttpProtocol

    GatewayHttpProtocol.limits = ConnectionLimits.of(settings)


class GatewayServer(BaseApplication):  # type: ignore[misc]
    """gunicorn's arbiter serving ``create_app(settings)`` in each worker process."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        super().__init__()

    def load_config(self) -> None:
        for key, value in gunicorn_options(self.settings).items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        from .app import create_app

        return create_app(self.settings)


def serve(settings: GatewaySettings) -> None:
    """Run the gateway under gunicorn in this process until SIGTERM or Ctrl-C."""
    prepare_environment()
    _connection_limits(settings)
    GatewayServer(settings).run()
