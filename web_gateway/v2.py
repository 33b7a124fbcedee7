"""The Open Inference Protocol (KServe v2): server and model metadata, health, inference
(with Triton's binary tensor data extension)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from broker.liveness import alive_consumers

from . import kserve, package_version, reading
from .errors import bad_request, shown
from .openapi import METADATA, MODEL_READY, SERVER_READY, V2_INFER
from .responses import JSONBody, json_response
from .serving import ServedModel
from .state import INLINE_BYTES, PING_TIMEOUT_S, Gateway

MODEL_NAME = Path(description="A model this gateway serves.")
MODEL_VERSION = Path(description='A version of the model: each model has one, "1".')

# The inference routes, dispatched straight to handle_infer (as v1 predict is; web_gateway.app)
INFER_PATH = re.compile(r"/v2/models/([a-z0-9_-]+)(?:/versions/([^/]+))?/infer")

router = APIRouter()


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


@router.get("/v2", tags=["v2"])
async def server_metadata() -> Response:
    """Server metadata."""
    return json_response(
        {"name": "microbatch", "version": package_version(), "extensions": list(kserve.EXTENSIONS)}
    )


@router.get("/v2/health/live", tags=["health"])
async def live() -> Response:
    """The process is up."""
    return json_response({"live": True})


@router.get("/v2/health/ready", tags=["health"], responses=SERVER_READY)
async def ready(request: Request) -> Response:
    """Ready when Redis answers (workers scaling to zero does not make the gateway unready),
    and is no Redis Cluster node named by a redis:// URL."""
    gateway = _gateway(request)
    ok = await gateway.ping()
    body: dict[str, Any] = {"ready": ok}
    if gateway.misuse:  # an open route: the log names the address, not this answer
        body["error"] = "the gateway's Redis is a Redis Cluster node: give a redis+cluster:// URL"
    return json_response(body, 200 if ok else 503)


@router.get("/v2/models/{name}", tags=["v2"], responses=METADATA)
async def model_metadata(name: str = MODEL_NAME, *, request: Request) -> Response:
    """The model's declared inputs and outputs (batch dimension -1) and its versions."""
    return _metadata(request, name)


@router.get("/v2/models/{name}/versions/{version}", tags=["v2"], responses=METADATA)
async def version_metadata(
    name: str = MODEL_NAME, version: str = MODEL_VERSION, *, request: Request
) -> Response:
    """The metadata of one version of the model (each model has one: "1")."""
    return _metadata(request, name, version)


def _metadata(request: Request, name: str, version: str | None = None) -> Response:
    gateway = _gateway(request)
    gateway.authorize(request)
    return json_response(gateway.model(name, version).metadata())


@router.get("/v2/models/{name}/ready", tags=["health"], responses=MODEL_READY)
async def model_ready(name: str = MODEL_NAME, *, request: Request) -> Response:
    """Ready when at least one live worker consumes this model."""
    return await _readiness(_gateway(request), name)


@router.get("/v2/models/{name}/versions/{version}/ready", tags=["health"], responses=MODEL_READY)
async def version_ready(
    name: str = MODEL_NAME, version: str = MODEL_VERSION, *, request: Request
) -> Response:
    """Ready when at least one live worker consumes this model (its only version: "1")."""
    return await _readiness(_gateway(request), name, version)


async def _readiness(gateway: Gateway, name: str, version: str | None = None) -> Response:
    served = gateway.model(name, version)
    try:  # a pipeline: a live worker of every stage
        stages = await asyncio.wait_for(
            asyncio.gather(*(alive_consumers(gateway.redis, k) for k in served.stage_keys)),
            PING_TIMEOUT_S * 2,
        )
    except Exception:  # Redis away: not ready
        stages = [[]]
    ok = all(stages)
    body = {"name": name, "ready": ok, "workers": len(stages[0])}
    return json_response(body, 200 if ok else 503)


MAX_TIMEOUT_MICROS = 10**15  # far past any --max-timeout, within a float's whole numbers


@router.post("/v2/models/{name}/infer", tags=["v2"], openapi_extra=V2_INFER)
async def infer(name: str = MODEL_NAME, *, request: Request) -> Response:
    """KServe v2 inference, with Triton's binary tensor data extension."""
    return await handle_infer(_gateway(request), request, name)


@router.post("/v2/models/{name}/versions/{version}/infer", tags=["v2"], openapi_extra=V2_INFER)
async def version_infer(
    name: str = MODEL_NAME, version: str = MODEL_VERSION, *, request: Request
) -> Response:
    """KServe v2 inference on one version of the model (each model has one: "1")."""
    return await handle_infer(_gateway(request), request, name, version)


def handle_infer(
    gateway: Gateway, request: Request, name: str, version: str | None = None
) -> Awaitable[Response]:
    """The v2 infer routes (await it): 401 and 404 raised at once; errors past them become the
    response."""
    gateway.authorize(request)
    served = gateway.model(name, version)
    return gateway.observed(request, served, "v2", _infer, gateway, request, served)


async def _infer(gateway: Gateway, request: Request, served: ServedModel) -> Response:
    body = await gateway.body(request)
    header_length = reading.single(request.headers, kserve.HEADER_LENGTH)
    settings = gateway.settings
    max_items, max_containers = settings.max_items, settings.max_json_containers
    if gateway.inline(served, len(body)):  # no coroutine for the common case
        parsed, items = parse_and_prepare(served, body, header_length, max_items, max_containers)
    else:
        parsed, items = await gateway.in_pool(
            parse_and_prepare, served, body, header_length, max_items, max_containers
        )
    timeout = gateway.timeout(request, _timeout_parameter(parsed))
    priority = reading.priority(request, parsed.parameters.get("priority"))
    outputs = await gateway.predict(request, served, items, timeout, priority)
    if served.has_postprocess or len(body) > INLINE_BYTES:
        content, headers = await gateway.in_pool(finish, served, parsed, outputs)
    else:
        content, headers = finish(served, parsed, outputs)
    if not headers:
        return JSONBody(content)  # what Response(content, media_type=JSON) would send
    return Response(content, headers=headers, media_type="application/octet-stream")


def _timeout_parameter(parsed: kserve.InferRequest) -> float | None:
    """The request's ``timeout`` parameter (whole microseconds, as Triton's) in seconds; None
    where it is absent or 0 (Triton's "no timeout of the request's own"); 400 for anything
    else, as a bad ``X-Request-Timeout`` is."""
    micros = given = parsed.parameters.get("timeout")
    if type(micros) is float and micros.is_integer():
        # a whole number written 1e3 or 1000.0, or one past 64 bits (which JSON parsing gives
        # as a float): capped as any other
        micros = int(min(micros, MAX_TIMEOUT_MICROS)) if micros >= 0 else -1
    if micros is None or (type(micros) is int and micros == 0):
        return None
    if type(micros) is not int or micros < 0:
        raise bad_request(
            f"the 'timeout' parameter must be a whole number of microseconds, not {shown(given)}"
        )
    return min(micros, MAX_TIMEOUT_MICROS) / 1e6


def parse_and_prepare(
    served: ServedModel,
    body: bytes,
    header_length: str | None,
    max_items: int,
    max_containers: int = reading.DEFAULT_MAX_JSON_CONTAINERS,
) -> tuple[kserve.InferRequest, list[Any]]:
    """A v2 body parsed, checked against ``served``'s inputs, and its items prepared."""
    parsed = kserve.parse_request(body, header_length, max_containers)
    reading.check_items(parsed.batch_size, max_items)
    kserve.check_inputs(parsed, served.request_inputs, strict_datatypes=not served.has_preprocess)
    kserve.check_outputs(parsed, served.outputs)
    return parsed, served.prepare(parsed.items())


def finish(
    served: ServedModel, parsed: kserve.InferRequest, outputs: list[Any]
) -> tuple[bytes, dict[str, str]]:
    """The response body (and headers) of ``outputs``, postprocessed."""
    return kserve.build_response(served.name, parsed, served.finish(outputs), served.outputs)
