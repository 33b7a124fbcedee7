"""The gunicorn worker class: uvicorn on uvloop with the httptools parser, when installed."""

from __future__ import annotations

import importlib.util
from typing import Any

from uvicorn_worker import UvicornWorker


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class GatewayWorker(UvicornWorker):  # type: ignore[misc]
    """A uvicorn worker with the fastest loop and parser available, lifespan on."""

    CONFIG_KWARGS: dict[str, Any] = {
        "loop": "uvloop" if _have("uvloop") else "asyncio",
        # httptools, writing each response in one system call (web_gateway.http_protocol)
        "http": "web_gateway.http_protocol:CoalescingHttpToolsProtocol"
        if _have("httptools")
        else "h11",
        "lifespan": "on",
    }
