"""The gateway's ASGI app: ``create_app(settings)`` (or ``create_app()`` to read the environment).

Run it under gunicorn with ``deploy/gunicorn.conf.py`` (``gateway start`` does), or alone with
``uvicorn --factory web_gateway.app:create_app`` for development.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import math
import re
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import numpy as np
import orjson
from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from broker.connections import async_client
from broker.errors import MicrobatchError
from broker.liveness import alive_consumers
from broker.logs import redact_url
from broker.protocol import valid_traceparent
from broker.redis_transport import eviction_warning
from gpu_worker.model import DATATYPES

from . import access_log, kserve, metrics, package_version
from .docs import install_docs
from .errors import (
    HTTP_TYPES,
    HTTPError,
    bad_request,
    error_response,
    from_microbatch,
    model_not_found,
    too_large,
    version_not_found,
)
from .serving import ServedModel, to_json
from .settings import GatewaySettings

log = logging.getLogger("microbatch.gateway")

T = TypeVar("T")

TIMEOUT_HEADER = "x-request-timeout"
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs do
JSON = "application/json"
PING_TIMEOUT_S = 1.0
INLINE_BYTES = 64 * 1024  # bodies up to this size are parsed on the event loop (~0.1 ms)


class ClientGone(Exception):
    """The HTTP client disconnected before its result came back."""


def json_response(
    content: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, default=to_json, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status, headers=headers, media_type=JSON)


class Gateway:
    """Per-process state: the served models, the thread pool and a Redis client for health."""

    def __init__(self, settings: GatewaySettings) -> None:
        if not settings.model:
            raise ValueError(
                "no models to serve: pass --model module:Class (or MICROBATCH_GATEWAY_MODEL)"
            )
        self.settings = settings
        self.models: dict[str, ServedModel] = {}
        for path in settings.model:
            served = ServedModel.load(path, settings)
            if served.name in self.models:
                raise ValueError(f"two models are named {served.name!r}")
            self.models[served.name] = served
        self.tokens = [token.encode() for token in settings.tokens()]
        self.pool: ThreadPoolExecutor | None = None
        self.redis: Any = None

    async def start(self) -> None:
        self.pool = ThreadPoolExecutor(
            self.settings.preprocess_threads, thread_name_prefix="gateway-cpu"
        )
        self.redis = async_client(self.settings.redis_url, socket_timeout=PING_TIMEOUT_S)
        warning = await eviction_warning(self.redis)
        if warning:
            log.warning("%s", warning)
        for served in self.models.values():
            await served.streamer.aconnect()  # the first request need not pay for connecting
        # Everything loaded so far (FastAPI, pydantic, the model classes) lives as long as the
        # process: frozen out of the collector, a full collection no longer walks it (it took
        # 30-40 ms, twice a second under load: the gateway's p99).
        gc.collect()
        gc.freeze()

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for served in self.models.values():
            await loop.run_in_executor(None, served.streamer.close)
        if self.redis is not None:
            await self.redis.aclose()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    async def in_pool(self, func: Callable[..., T], *args: Any) -> T:
        """Run CPU work (parsing, preprocess, postprocess) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, func, *args)

    async def cpu(self, served: ServedModel, size: int, func: Callable[..., T], *args: Any) -> T:
        """Parse and check a body: inline when it is small and the model has no preprocess of
        its own (cheaper than a thread hop, and bounded), else in the thread pool."""
        if size <= INLINE_BYTES and not served.has_preprocess:
            return func(*args)
        return await self.in_pool(func, *args)

    # -- request helpers ----------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if not self.tokens:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() == "bearer" and given:
            # compare with every token, always, so timing tells nothing
            matched = False
            for known in self.tokens:
                matched |= hmac.compare_digest(given, known)
            if matched:
                return
        raise HTTPError(
            401,
            "Unauthorized",
            "a valid bearer token is required",
            {"WWW-Authenticate": 'Bearer realm="microbatch"'},
        )

    def model(self, name: str, version: str | None = None) -> ServedModel:
        """The served model ``name`` (404 if none), at ``version`` when one is named."""
        served = self.models.get(name)
        if served is None:
            raise model_not_found(name)
        if version is not None and version not in kserve.VERSIONS:
            raise version_not_found(name, version, kserve.VERSIONS)
        return served

    def timeout(self, request: Request, fallback: float | None = None) -> float:
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            value = fallback if fallback is not None else self.settings.default_timeout
        else:
            try:
                value = float(raw)
            except ValueError:
                raise bad_request("X-Request-Timeout must be a number of seconds") from None
            if not (value > 0 and math.isfinite(value)):
                raise bad_request("X-Request-Timeout must be a positive number of seconds")
        return min(value, self.settings.max_timeout)

    async def body(self, request: Request) -> bytes:
        """The request body, refused with 413 past ``max_body_bytes`` (and decompressed)."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                if int(declared) > limit:
                    raise too_large(f"request body is over {limit} bytes")
            except ValueError:
                raise bad_request("Content-Length must be an integer") from None
        chunks = []
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(f"request body is over {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:  # gone, or cut off by the body timeout (answered 408)
            raise ClientGone("before its body arrived") from None
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("gzip", "deflate"):
            body = _decompress(body, encoding, limit)
        elif encoding not in ("", "identity"):
            raise HTTPError(415, "UnsupportedMediaType", f"Content-Encoding {encoding!r}")
        request._body = body  # so request.form() parses what was read here
        return body

    def check_items(self, count: int) -> None:
        if count == 0:
            raise bad_request("a request needs at least one item")
        if count > self.settings.max_items:
            raise too_large(f"{count} items is over the limit of {self.settings.max_items}")

    async def predict(
        self, request: Request, served: ServedModel, items: list[Any], timeout: float
    ) -> list[Any]:
        """Submit ``items`` and wait; abandon them (withdrawn from the queue) if the client goes."""
        served.metrics.items.inc(len(items))
        trace = valid_traceparent(request.headers.get("traceparent"))
        loop = asyncio.get_running_loop()
        call = loop.create_task(served.streamer.apredict(items, timeout=timeout, traceparent=trace))
        gone = loop.create_task(_disconnected(request))
        # The client left: cancelling the call withdraws its items from the queue.
        gone.add_done_callback(lambda _: call.cancel())
        try:
            return await call
        except asyncio.CancelledError:
            if gone.done() and not gone.cancelled():
                raise ClientGone from None
            raise  # we are cancelled ourselves (the call is cancelled with us)
        except MicrobatchError as exc:
            raise from_microbatch(exc, self.settings.retry_after) from None
        finally:
            gone.cancel()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise bad_request(f"body is not valid {encoding}: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise too_large(f"decompressed request body is over {limit} bytes")
    return out


# -- OpenAPI descriptions (the bodies are parsed by hand, so the schemas are given here) -------
def _openapi() -> dict[str, dict[str, Any]]:
    timeout_param = {
        "name": "X-Request-Timeout",
        "in": "header",
        "required": False,
        "description": "Seconds to wait for the result (capped by the gateway's max_timeout).",
        "schema": {"type": "number", "exclusiveMinimum": 0},
    }

    def errors_as(schema: str) -> dict[str, Any]:
        ref = {"$ref": f"#/components/schemas/{schema}"}
        return {
            str(code): {"description": text, "content": {JSON: {"schema": ref}}}
            for code, text in codes
        }

    codes = (
        (400, "Malformed request"),
        (401, "Missing or wrong bearer token"),
        (404, "Unknown model"),
        (413, "Body or item count too large"),
        (422, "Input does not fit the model's declared inputs"),
        (500, "The model raised (ModelError)"),
        (503, "Queue full or Redis unavailable (Retry-After)"),
        (504, "Deadline exceeded"),
    )
    errors = errors_as("Error")
    v1 = {
        "parameters": [timeout_param],
        "requestBody": {
            "required": True,
            "content": {
                JSON: {
                    "schema": {
                        "type": "object",
                        "required": ["inputs"],
                        "properties": {
                            "inputs": {
                                "type": "array",
                                "description": "One entry per item: the model's raw input.",
                                "items": {},
                            }
                        },
                    }
                },
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file"],
                        "properties": {
                            "file": {
                                "type": "string",
                                "format": "binary",
                                "description": "One item per file field (models that take bytes).",
                            }
                        },
                    }
                },
            },
        },
        "responses": {
            "200": {
                "description": "One output per item, in order",
                "content": {
                    JSON: {
                        "schema": {
                            "type": "object",
                            "properties": {"outputs": {"type": "array", "items": {}}},
                        }
                    }
                },
            },
            **errors,
        },
    }
    tensor = {
        "type": "object",
        "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"type": "string", "enum": sorted(DATATYPES)},
            "parameters": {"type": "object"},
            "data": {"type": "array", "items": {}},
        },
    }
    v2 = {
        "parameters": [timeout_param],
        "requestBody": {
            "required": True,
            "content": {
                JSON: {
                    "schema": {
                        "type": "object",
                        "required": ["inputs"],
                        "properties": {
                            "id": {"type": "string"},
                            "parameters": {"type": "object"},
                            "inputs": {"type": "array", "items": tensor},
                            "outputs": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {
                                        "name": {"type": "string"},
                                        "parameters": {"type": "object"},
                                    },
                                },
                            },
                        },
                    }
                }
            },
        },
        "responses": {"200": {"description": "Output tensors"}, **errors_as("V2Error")},
    }
    return {"v1": v1, "v2": v2}


V1_PREDICT = re.compile(r"/v1/models/([a-z0-9_-]+)/predict")
FastRoute = Callable[[Request, str], Awaitable[Response]]


class GatewayApp(FastAPI):
    """FastAPI, with the hot route (v1 predict) dispatched before FastAPI's routing.

    FastAPI's middleware, routing and dependency layers cost about as much CPU per request as
    the rest of the request; the v1 predict route runs the same handler without them. The
    route stays declared to FastAPI too, for its OpenAPI docs.
    """

    fast_v1: FastRoute | None = None
    log_access = False  # one line per request (web_gateway.access_log): checked per request

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.log_access and scope["type"] == "http":
            await access_log.logged(self._dispatch, scope, receive, send)
        else:
            await self._dispatch(scope, receive, send)

    async def _dispatch(self, scope: Any, receive: Any, send: Any) -> None:
        if self.fast_v1 is not None and scope["type"] == "http" and scope["method"] == "POST":
            match = V1_PREDICT.fullmatch(scope["path"])
            if match is not None:
                request = Request(scope, receive, send)
                try:
                    response = await self.fast_v1(request, match[1])
                except HTTPError as exc:
                    response = error_response(exc, False)
                except Exception as exc:
                    log.error("unexpected %s on POST %s", type(exc).__name__, scope["path"])
                    response = error_response(HTTPError(500, "InternalError", "internal error"))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_app(settings: GatewaySettings | None = None) -> GatewayApp:
    """Build the gateway app. Imports each model class (never calls init_model)."""
    settings = settings if settings is not None else GatewaySettings()
    gateway = Gateway(settings)
    names = sorted(gateway.models)
    docs = _openapi()
    model_name = Path(description="A model this gateway serves.", json_schema_extra={"enum": names})
    model_version = Path(
        description='A version of the model: each model has one, "1".',
        json_schema_extra={"enum": list(kserve.VERSIONS)},
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        log.info(
            "gateway serving %s under prefix %r from Redis %s%s",
            ", ".join(names),
            settings.prefix,
            redact_url(settings.redis_url),
            " (access log on)" if settings.access_log else "",
        )
        try:
            yield
        finally:
            await gateway.stop()

    app = GatewayApp(
        title="microbatch gateway",
        version=package_version(),
        description="Micro-batching HTTP front for models served by microbatch workers.",
        lifespan=lifespan,
        docs_url=None,  # served by install_docs, without a CDN
        redoc_url=None,
    )
    app.state.gateway = gateway
    app.log_access = settings.access_log
    install_docs(app)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> Response:
        return error_response(exc, _is_v2(request))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = HTTP_TYPES.get(exc.status_code, "HTTPError")
        error = HTTPError(exc.status_code, type_, str(exc.detail), dict(exc.headers or {}))
        return error_response(error, _is_v2(request))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(HTTPError(400, "BadRequest", "malformed request"), _is_v2(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.error("unexpected %s on %s %s", type(exc).__name__, request.method, request.url.path)
        return error_response(HTTPError(500, "InternalError", "internal error"), _is_v2(request))

    async def observed(served: ServedModel, route: str, handler: Callable[[], Any]) -> Response:
        """Run a request handler with metrics; map errors to responses."""
        started = time.perf_counter()
        served.metrics.in_flight.inc()
        outcome = "ok"
        try:
            response: Response = await handler()
            return response
        except HTTPError as exc:
            outcome = exc.type
            return error_response(exc, route == "v2")
        except ClientGone as exc:
            outcome = "ClientGone"
            if exc.args:  # nothing was queued: not worth a line each (the protocol sums them)
                log.debug("client left %s (%s)", exc.args[0], served.name)
            else:
                log.info("client left; its %s request was withdrawn", served.name)
            return Response(status_code=CLIENT_CLOSED)
        finally:
            served.metrics.in_flight.dec()
            served.metrics.answered(route, outcome, time.perf_counter() - started)

    # -- the v1 API ---------------------------------------------------------------------------
    @app.get("/v1/models", tags=["v1"])
    async def list_models(request: Request) -> Response:
        """The models this gateway serves."""
        gateway.authorize(request)
        return json_response({"models": names})

    @app.post("/v1/models/{name}/predict", tags=["v1"], openapi_extra=docs["v1"])
    async def predict(name: str = model_name, *, request: Request) -> Response:
        """Run the model on a list of raw inputs (JSON), or on uploaded files (multipart)."""
        return await v1_predict(request, name)

    async def v1_predict(request: Request, name: str) -> Response:
        gateway.authorize(request)
        served = gateway.model(name)

        async def handle() -> Response:
            timeout = gateway.timeout(request)
            body = await gateway.body(request)
            content_type = request.headers.get("content-type", "").lower()
            if content_type.startswith("multipart/form-data"):
                raw_items = await _uploaded_files(request, settings.max_items)
                gateway.check_items(len(raw_items))
                items = await gateway.in_pool(served.prepare, raw_items)
            else:
                items = await gateway.cpu(
                    served, len(body), _parse_v1_and_prepare, gateway, served, body
                )
            outputs = await gateway.predict(request, served, items, timeout)
            if served.has_postprocess:
                outputs = await gateway.in_pool(served.finish, outputs)
            return json_response({"outputs": outputs})

        return await observed(served, "v1", handle)

    app.fast_v1 = v1_predict

    # -- the Open Inference Protocol (KServe v2) -----------------------------------------------
    @app.get("/v2", tags=["v2"])
    async def server_metadata(request: Request) -> Response:
        """Server metadata."""
        return json_response(
            {
                "name": "microbatch",
                "version": package_version(),
                "extensions": ["binary_tensor_data"],
            }
        )

    @app.get("/v2/health/live", tags=["health"])
    async def live() -> Response:
        """The process is up."""
        return json_response({"live": True})

    @app.get("/v2/health/ready", tags=["health"])
    async def ready() -> Response:
        """Ready when Redis answers (workers scaling to zero does not make the gateway unready)."""
        ok = await _ping(gateway)
        return json_response({"ready": ok}, 200 if ok else 503)

    @app.get("/v2/models/{name}", tags=["v2"])
    async def model_metadata(name: str = model_name, *, request: Request) -> Response:
        """The model's declared inputs and outputs (batch dimension -1) and its versions."""
        return metadata_of(request, name)

    @app.get("/v2/models/{name}/versions/{version}", tags=["v2"])
    async def version_metadata(
        name: str = model_name, version: str = model_version, *, request: Request
    ) -> Response:
        """The metadata of one version of the model (each model has one: "1")."""
        return metadata_of(request, name, version)

    def metadata_of(request: Request, name: str, version: str | None = None) -> Response:
        gateway.authorize(request)
        return json_response(gateway.model(name, version).metadata())

    @app.get("/v2/models/{name}/ready", tags=["health"])
    async def model_ready(name: str = model_name) -> Response:
        """Ready when at least one live worker consumes this model."""
        return await readiness(name)

    @app.get("/v2/models/{name}/versions/{version}/ready", tags=["health"])
    async def version_ready(name: str = model_name, version: str = model_version) -> Response:
        """Ready when at least one live worker consumes this model (its only version: "1")."""
        return await readiness(name, version)

    async def readiness(name: str, version: str | None = None) -> Response:
        served = gateway.model(name, version)
        try:
            consumers = await asyncio.wait_for(
                alive_consumers(gateway.redis, served.streamer.keys), PING_TIMEOUT_S * 2
            )
        except Exception:  # Redis away: not ready
            consumers = []
        ok = bool(consumers)
        return json_response(
            {"name": name, "ready": ok, "workers": len(consumers)}, 200 if ok else 503
        )

    @app.post("/v2/models/{name}/infer", tags=["v2"], openapi_extra=docs["v2"])
    async def infer(name: str = model_name, *, request: Request) -> Response:
        """KServe v2 inference, with Triton's binary tensor data extension."""
        return await v2_infer(request, name)

    @app.post("/v2/models/{name}/versions/{version}/infer", tags=["v2"], openapi_extra=docs["v2"])
    async def version_infer(
        name: str = model_name, version: str = model_version, *, request: Request
    ) -> Response:
        """KServe v2 inference on one version of the model (each model has one: "1")."""
        return await v2_infer(request, name, version)

    async def v2_infer(request: Request, name: str, version: str | None = None) -> Response:
        gateway.authorize(request)
        served = gateway.model(name, version)

        async def handle() -> Response:
            body = await gateway.body(request)
            header_length = request.headers.get(kserve.HEADER_LENGTH)
            parsed, items = await gateway.cpu(
                served, len(body), _parse_v2_and_prepare, gateway, served, body, header_length
            )
            micros = parsed.parameters.get("timeout")
            fallback = None
            if isinstance(micros, int) and not isinstance(micros, bool) and micros > 0:
                fallback = micros / 1e6
            timeout = gateway.timeout(request, fallback)
            outputs = await gateway.predict(request, served, items, timeout)
            if served.has_postprocess or len(body) > INLINE_BYTES:
                content, headers = await gateway.in_pool(_finish_v2, served, parsed, outputs)
            else:
                content, headers = _finish_v2(served, parsed, outputs)
            media = "application/octet-stream" if headers else JSON
            return Response(content, headers=headers, media_type=media)

        return await observed(served, "v2", handle)

    # -- operations ---------------------------------------------------------------------------
    @app.get("/healthz", tags=["health"])
    async def healthz() -> Response:
        """Liveness: the process answers (Redis is not consulted)."""
        return json_response({"status": "ok"})

    @app.get("/metrics", tags=["health"])
    async def metrics_endpoint() -> Response:
        """Prometheus metrics of every gateway process of this server."""
        content, media = await asyncio.get_running_loop().run_in_executor(None, metrics.render)
        return Response(content, media_type=media)

    app.openapi_schema = None
    original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        schema = original_openapi()
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas["V2Error"] = {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "string"}, "type": {"type": "string"}},
        }
        schemas["Error"] = {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["type", "message"],
                    "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
                }
            },
        }
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _is_v2(request: Request) -> bool:
    """Routes of the Open Inference Protocol answer errors in its format."""
    return request.url.path.startswith("/v2/")


async def _uploaded_files(request: Request, max_items: int) -> list[bytes]:
    try:
        form = await request.form(max_files=max_items + 1, max_fields=max_items + 1)
    except StarletteHTTPException as exc:
        raise bad_request(f"malformed multipart body: {exc.detail}") from None
    except Exception as exc:  # python-multipart's own parse errors
        raise bad_request(f"malformed multipart body: {type(exc).__name__}") from None
    try:
        uploads = [value for value in form.getlist("file") if isinstance(value, UploadFile)]
        if not uploads:
            raise bad_request("multipart body needs one or more 'file' fields")
        return [await upload.read() for upload in uploads]
    finally:
        await form.close()


def _parse_v1_and_prepare(gateway: Gateway, served: ServedModel, body: bytes) -> list[Any]:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), list):
        raise bad_request('the body must be a JSON object {"inputs": [item, ...]}')
    raw_items = document["inputs"]
    gateway.check_items(len(raw_items))
    if served.float_input and _only_numbers(body):
        # Every value is a JSON number: as float64 arrays (exact for what orjson parsed) they
        # skip the model's per-value type scan (~7 us for 256 values); same results and errors.
        # (ragged lists, or an integer past float range: left as they are, for the model's
        # checks to say where)
        with contextlib.suppress(ValueError, OverflowError):
            raw_items = [np.asarray(item, dtype=np.float64) for item in raw_items]
    return served.prepare(raw_items)


def _only_numbers(body: bytes) -> bool:
    """True if a JSON object's only string is its one key, and it has no true, false or null.

    (Elsewhere a JSON document has only numbers, brackets, commas and white space.)
    """
    if body.count(b'"') != 2:
        return False
    start = body.rindex(b'"')
    return body.find(b"n", start) < 0 and body.find(b"t", start) < 0 and body.find(b"f", start) < 0


def _parse_v2_and_prepare(
    gateway: Gateway, served: ServedModel, body: bytes, header_length: str | None
) -> tuple[kserve.InferRequest, list[Any]]:
    parsed = kserve.parse_request(body, header_length)
    gateway.check_items(parsed.batch_size)
    kserve.check_inputs(parsed, served.inputs, strict_datatypes=not served.has_preprocess)
    return parsed, served.prepare(parsed.items())


def _finish_v2(
    served: ServedModel, parsed: kserve.InferRequest, outputs: list[Any]
) -> tuple[bytes, dict[str, str]]:
    return kserve.build_response(served.name, parsed, served.finish(outputs), served.outputs)


async def _ping(gateway: Gateway) -> bool:
    try:
        return bool(await asyncio.wait_for(gateway.redis.ping(), PING_TIMEOUT_S))
    except Exception:
        return False
