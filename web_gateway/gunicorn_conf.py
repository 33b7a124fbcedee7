"""gunicorn settings for the gateway, read from the environment (``gateway start`` sets it).

deploy/gunicorn.conf.py imports everything from here, so both of these work::

    gateway start --model examples.mlp:MLP --workers 4
    MICROBATCH_GATEWAY_MODEL=examples.mlp:MLP gunicorn -c deploy/gunicorn.conf.py

Command-line flags given to gunicorn (``-b``, ``-w``, ...) win over these values, and an app
named on gunicorn's command line wins over ``wsgi_app``.

Metrics: prometheus-client's multiprocess mode needs ``PROMETHEUS_MULTIPROC_DIR`` set before
any worker starts. If it is not set, a fresh temporary directory is made (and removed at exit);
if it is set, stale files in it are removed at start. ``child_exit`` marks a dead worker's gauges.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from broker.logs import FORMATS, TEXT_FORMAT, check_level

__all__ = [
    "accesslog",
    "backlog",
    "bind",
    "child_exit",
    "control_socket_disable",
    "graceful_timeout",
    "keepalive",
    "logconfig_dict",
    "loglevel",
    "on_exit",
    "on_starting",
    "proc_name",
    "timeout",
    "worker_class",
    "workers",
    "wsgi_app",
]

_ENV = "MICROBATCH_GATEWAY_"


def _env(name: str, default: str) -> str:
    return os.environ.get(_ENV + name, default)


wsgi_app = "web_gateway.app:create_app()"
worker_class = "web_gateway.workers.GatewayWorker"
bind = [f"{_env('HOST', '127.0.0.1')}:{_env('PORT', '8000')}"]
workers = int(_env("WORKERS", "1"))
# SIGTERM: stop accepting, let in-flight requests finish for up to this long, then exit.
graceful_timeout = int(float(_env("GRACEFUL_TIMEOUT", "30")))
timeout = 60  # a worker whose event loop stops answering gunicorn for this long is restarted
# uvicorn's keep-alive timer is replaced by the idle deadline of web_gateway.http_protocol,
# which reads KEEPALIVE_TIMEOUT (with HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS) itself.
keepalive = max(1, math.ceil(float(_env("KEEPALIVE_TIMEOUT", "5"))))
backlog = 2048
# The same log format as `worker start` (broker.logs): text lines, or JSON objects with
# LOG_FORMAT=json, for gunicorn's, uvicorn's and the app's loggers alike.
loglevel = check_level(_env("LOG_LEVEL", "info")).lower()
_FORMAT = _env("LOG_FORMAT", "text")
if _FORMAT not in FORMATS:
    raise ValueError(f"{_ENV}LOG_FORMAT must be one of {', '.join(FORMATS)}, not {_FORMAT!r}")
_STDERR = {
    "class": "logging.StreamHandler",
    "formatter": "microbatch",
    "stream": "ext://sys.stderr",
}
logconfig_dict: dict[str, Any] = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "microbatch": {"()": "broker.logs.JsonFormatter"}
        if _FORMAT == "json"
        else {"format": TEXT_FORMAT}
    },
    "handlers": {"stderr": _STDERR},
    "root": {"level": loglevel.upper(), "handlers": ["stderr"]},
    "loggers": {
        "gunicorn.error": {"level": loglevel.upper(), "handlers": ["stderr"], "propagate": False},
        # --access-log: the app's own access log (web_gateway.access_log), whatever the level
        "microbatch.gateway.access": {
            "level": "INFO",
            "handlers": ["stderr"],
            "propagate": False,
        },
    },
}
accesslog = None  # gunicorn's own: unused (uvicorn workers); see --access-log instead
proc_name = "microbatch-gateway"
# gunicorn >= 24 opens a control socket at one fixed path per user, which several gateways on
# one host would fight over; gateways are driven by signals instead.
control_socket_disable = True

# With several workers, uvloop (libuv) accepts every pending connection in one go: whichever
# worker wakes first takes a burst of new connections (seen: 48 of 64 in one of two workers),
# and its clients wait longer. One accept per wake-up spreads them over the workers.
os.environ.setdefault("UV_TCP_SINGLE_ACCEPT", "1")

_MULTIPROC = "PROMETHEUS_MULTIPROC_DIR"
_OWN_DIR = False
if not os.environ.get(_MULTIPROC):
    os.environ[_MULTIPROC] = tempfile.mkdtemp(prefix="microbatch-gateway-metrics-")
    _OWN_DIR = True


def on_starting(server: Any) -> None:
    directory = Path(os.environ[_MULTIPROC])
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()


def child_exit(server: Any, worker: Any) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def on_exit(server: Any) -> None:
    if _OWN_DIR:
        shutil.rmtree(os.environ[_MULTIPROC], ignore_errors=True)
