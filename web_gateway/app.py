"""The gateway's ASGI app: ``create_app(settings)`` (or ``create_app()`` to read the environment).

Run it with ``gateway start`` (gunicorn through its application API), under ``gunicorn -c
deploy/gunicorn.conf.py``, or alone with ``uvicorn --factory web_gateway.app:create_app`` for
development. The routes live in :mod:`.v1`, :mod:`.v2` and :mod:`.operations`, the process
state in :mod:`.state`, the OpenAPI additions in :mod:`.openapi`, and every error becomes its
response in one place, :func:`web_gateway.errors.to_response`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from broker.logs import redact_url

from . import access_log, operations, package_version, reading, v1, v2
from .descriptors import raise_descriptor_limit
from .disconnects import gateway_cycle
from .docs import install_docs
from .errors import HTTPError, bad_request, to_response
from .http_protocol import report_closed_connections
from .openapi import install_openapi
from .responses import JSONBody
from .settings import GatewaySettings
from .state import Gateway

log = logging.getLogger("microbatch.gateway")
# python-multipart logs a warning for every multipart body it cannot parse: a client sending
# such bodies would write a line a request. The gateway answers them 400, saying what is wrong.
QUIETED_LOGGERS = ("python_multipart",)


class GatewayApp(FastAPI):
    """FastAPI, with the hot routes (v1 predict, v2 infer) dispatched before FastAPI's routing.

    FastAPI's middleware, routing and dependency layers cost about as much CPU per request as
    the rest of the request; the inference routes run the same handlers without them. They
    stay declared to FastAPI too, for its OpenAPI docs.
    """

    gateway: Gateway
    log_access = False  # one line per request (web_gateway.access_log): checked per request

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.log_access and scope["type"] == "http":
            await access_log.logged(self._dispatch, scope, receive, send)
        else:
            await self._dispatch(scope, receive, send)

    async def _dispatch(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            v1_match = v1.PREDICT_PATH.fullmatch(path)
            v2_match = None if v1_match is not None else v2.INFER_PATH.fullmatch(path)
            if v1_match is not None or v2_match is not None:
                request = reading.GatewayRequest(scope, receive, send)
                try:
                    if v1_match is not None:
                        response = await v1.handle_predict(self.gateway, request, v1_match[1])
                    else:
                        assert v2_match is not None
                        response = await v2.handle_infer(
                            self.gateway, request, v2_match[1], v2_match[2]
                        )
                except Exception as exc:
                    response = to_response(exc, "POST", path)
                if type(response) is JSONBody:
                    # under the gateway's HTTP protocol, written without the ASGI messages
                    cycle = gateway_cycle(send)
                    if cycle is not None and cycle.answer_json(response.status_code, response.body):
                        return
                await response(scope, receive, send)
                return
        if scope["type"] == "http" and scope["path"] == "*":
            await _asterisk(scope["method"])(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "HEAD":
            # HEAD is GET without the body (the server leaves it out): load balancers and
            # uptime checks probe /healthz with it, and FastAPI routes answer GET alone
            scope = {**scope, "method": "GET"}
        await super().__call__(scope, receive, send)


def _asterisk(method: str) -> Response:
    """The answer to a request whose target is ``*``: for OPTIONS, the server's own options
    (RFC 9110, 9.3.7), the methods of its routes; for any other method, whose target it cannot
    be (RFC 9112, 3.2.4), a 400."""
    if method == "OPTIONS":
        return Response(headers={"Allow": "GET, HEAD, POST"})
    return to_response(bad_request("'*' is the target of OPTIONS alone"), method, "*")


# Exceptions the routes end with (the last, the unexpected, is also logged by the server).
HANDLED = (HTTPError, StarletteHTTPException, RequestValidationError, Exception)


async def _any_error(request: Request, exc: Exception) -> Response:
    return to_response(exc, request.method, request.scope["path"])


def create_app(settings: GatewaySettings | None = None) -> GatewayApp:
    """Build the gateway app. Imports each model class (never calls init_model)."""
    settings = settings if settings is not None else GatewaySettings()
    for name in QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    gateway = Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        raise_descriptor_limit(settings.max_connections, len(gateway.names))
        await gateway.start()
        log.info(
            "gateway serving %s under prefix %r from Redis %s%s",
            ", ".join(gateway.names),
            settings.prefix,
            redact_url(settings.redis_url),
            " (access log on)" if settings.access_log else "",
        )
        try:
            yield
        finally:
            await gateway.stop()
            report_closed_connections()

    app = GatewayApp(
        title="microbatch gateway",
        version=package_version(),
        description="Micro-batching HTTP front for models served by microbatch workers.",
        lifespan=lifespan,
        docs_url=None,  # served by install_docs, without a CDN
        redoc_url=None,
        # a path with a trailing slash is an unknown route (404), not a 307 to
        # http://<Host header>/...: a host and scheme a client behind a proxy may not reach
        redirect_slashes=False,
        exception_handlers=dict.fromkeys(HANDLED, _any_error),
    )
    app.gateway = app.state.gateway = gateway
    app.log_access = settings.access_log
    install_docs(app)
    for router in (v1.router, v2.router, operations.router):
        app.include_router(router)
    install_openapi(app, gateway.names)
    return app
