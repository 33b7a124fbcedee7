"""gunicorn settings for the gateway, read from the environment, for ``gunicorn -c``.

deploy/gunicorn.conf.py imports everything from here, so this works as well as ``gateway
start`` (which runs gunicorn through its application API with the same settings)::

    MICROBATCH_GATEWAY_MODEL=examples.mlp:MLP gunicorn -c deploy/gunicorn.conf.py

Command-line flags given to gunicorn (``-b``, ``-w``, ...) win over these values, and an app
named on gunicorn's command line wins over ``wsgi_app``. The settings are those of
:class:`web_gateway.settings.GatewaySettings` (``MICROBATCH_GATEWAY_<FIELD>``, ``REDIS_URL``).
"""

from __future__ import annotations

from typing import Any

from broker.cli_common import check_environment

from .server import APP, gunicorn_options, prepare_environment
from .settings import ENV_PREFIX, GatewaySettings

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
    "max_requests",
    "max_requests_jitter",
    "on_exit",
    "on_starting",
    "proc_name",
    "timeout",
    "worker_class",
    "workers",
    "wsgi_app",
]

prepare_environment()
check_environment(  # a misspelt setting is warned of, as by `gateway start`
    "gunicorn -c",
    ENV_PREFIX,
    (f"{ENV_PREFIX}{name.upper()}" for name in GatewaySettings.model_fields),
)
_options = gunicorn_options(GatewaySettings())

wsgi_app = APP
worker_class: str = _options["worker_class"]
bind: list[str] = _options["bind"]
workers: int = _options["workers"]
graceful_timeout: int = _options["graceful_timeout"]
timeout: int = _options["timeout"]
max_requests: int = _options["max_requests"]
max_requests_jitter: int = _options["max_requests_jitter"]
keepalive: int = _options["keepalive"]
backlog: int = _options["backlog"]
loglevel: str = _options["loglevel"]
logconfig_dict: dict[str, Any] = _options["logconfig_dict"]
accesslog: None = _options["accesslog"]
proc_name: str = _options["proc_name"]
control_socket_disable: bool = _options["control_socket_disable"]
on_starting = _options["on_starting"]
child_exit = _options["child_exit"]
on_exit = _options["on_exit"]
