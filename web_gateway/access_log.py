"""The access log: one line per HTTP request, only when asked for (``--access-log``).

A line names the client address, the method, the path (raw, without its query string, where
tokens sometimes travel), the HTTP version, the status and the time to the last byte. Never a
body, a header or a query string.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

logger = logging.getLogger("microbatch.gateway.access")


async def logged(app: ASGIApp, scope: Any, receive: Any, send: Any) -> None:
    """Run ``app`` on one HTTP request and log it when it is done."""
    started = time.perf_counter()
    status = 0

    async def sending(message: Any) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    try:
        await app(scope, receive, sending)
    finally:
        client = scope.get("client")
        where = f"{client[0]}:{client[1]}" if client else "-"
        raw = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "replace")
        path = raw.decode("ascii", "backslashreplace")
        logger.info(
            '%s "%s %s HTTP/%s" %d %.1f ms',
            where,
            scope.get("method", "-"),
            path,
            scope.get("http_version", "1.1"),
            status or 500,  # the app raised before answering
            (time.perf_counter() - started) * 1e3,
        )
