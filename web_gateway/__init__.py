"""The stateless HTTP gateway: FastAPI app, KServe v2 routes, gunicorn config and CLI.

``web_gateway.app.create_app(settings)`` builds the ASGI app; ``gateway start`` serves it under
gunicorn. Importing this package imports no web framework (and never torch).

The modules, one job each: ``settings`` (the one settings object), ``cli`` (``gateway start``),
``server`` (gunicorn through its application API; ``gunicorn_conf`` for ``gunicorn -c``),
``workers`` and ``http_protocol`` (the uvicorn worker and its connection limits), ``app`` (the
ASGI app and the hot routes' dispatch), ``state`` (a process's models, pool and Redis client),
``reading`` (auth, timeout, body of one request), ``v1``, ``v2`` and ``operations`` (the
routes), ``kserve`` (v2 bodies), ``serving`` (one served model: its caller-side prepare),
``errors`` (every exception to its response), ``responses`` (JSON), ``openapi``, ``docs``,
``metrics``, ``access_log``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app", "package_version"]


def package_version() -> str:
    """The installed microbatch version, as every command's ``--version`` prints it."""
    from broker.cli_common import version

    return version()


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "GatewaySettings":
        from .settings import GatewaySettings

        return GatewaySettings
    raise AttributeError(name)
