"""The v1 API: ``GET /v1/models`` and ``POST /v1/models/{name}/predict`` (the hot route).

``handle_predict`` is called straight from :class:`web_gateway.app.GatewayApp`'s dispatch, without
FastAPI's routing or validation; it is declared to FastAPI too, for the OpenAPI schema.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Awaitable
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Path, Request
from starlette.responses import Response

from gpu_worker.model import TensorSpec

from . import reading
from .errors import HTTPError, bad_request
from .openapi import MODELS, V1_PREDICT
from .responses import json_response
from .serving import ServedModel
from .state import Gateway

PREDICT_PATH = re.compile(r"/v1/models/([a-z0-9_-]+)/predict")
MODEL_NAME = Path(description="A model this gateway serves.")

router = APIRouter(tags=["v1"])


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


@router.get("/v1/models", responses=MODELS)
async def list_models(request: Request) -> Response:
    """The models this gateway serves."""
    gateway = _gateway(request)
    gateway.authorize(request)
    return json_response({"models": gateway.names})


@router.post("/v1/models/{name}/predict", openapi_extra=V1_PREDICT)
async def predict(name: str = MODEL_NAME, *, request: Request) -> Response:
    """Run the model on a list of raw inputs (JSON), or on uploaded files (multipart)."""
    return await handle_predict(_gateway(request), request, name)


def handle_predict(gateway: Gateway, request: Request, name: str) -> Awaitable[Response]:
    """The v1 predict route (await it): 401 and 404 raised at once; errors past them become
    the response."""
    gateway.authorize(request)
    served = gateway.model(name)
    return gateway.observed(request, served, "v1", _predict, gateway, request, served)


async def _predict(gateway: Gateway, request: Request, served: ServedModel) -> Response:
    timeout = gateway.timeout(request)
    priority = reading.priority(request)
    body = await gateway.body(request)
    content_type = request.headers.get("content-type", "").lower()
    if content_type.startswith("multipart/form-data"):
        raw_items = await reading.uploaded_files(request, gateway.settings.max_items)
        gateway.check_items(len(raw_items))
        items = await gateway.in_pool(served.prepare, raw_items)
    else:
        settings = gateway.settings
        max_items, max_containers = settings.max_items, settings.max_json_containers
        if gateway.inline(served, len(body)):  # no coroutine for the common case
            items = parse_and_prepare(served, body, max_items, max_containers)
        else:
            items = await gateway.in_pool(
                parse_and_prepare, served, body, max_items, max_containers
            )
    outputs = await gateway.predict(request, served, items, timeout, priority)
    if served.has_postprocess:
        outputs = await gateway.in_pool(served.finish, outputs)
    return outputs_response(outputs)


def outputs_response(outputs: list[Any]) -> Response:
    """The answer ``{"outputs": [...]}``; 500 InvalidOutput (not InternalError) for outputs
    JSON cannot hold."""
    try:
        return json_response({"outputs": outputs})
    except orjson.JSONEncodeError:
        pass
    # Map keys other than strings (ints, floats, None) written as strings, the only keys JSON
    # has, as json.dumps writes them; anything else (complex numbers, bytes keys) says so.
    try:
        return json_response({"outputs": outputs}, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError as exc:
        message = f"model outputs cannot be written as JSON: {exc}"
        raise HTTPError(500, "InvalidOutput", message) from None


def parse_and_prepare(
    served: ServedModel,
    body: bytes,
    max_items: int,
    max_containers: int = reading.DEFAULT_MAX_JSON_CONTAINERS,
) -> list[Any]:
    """A v1 JSON body's items, prepared for ``served`` (400, 413 or 422 if they cannot be)."""
    document = reading.json_document(body, max_containers)
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), list):
        raise bad_request('the body must be a JSON object {"inputs": [item, ...]}')
    raw_items = document["inputs"]
    reading.check_items(len(raw_items), max_items)
    if served.float_input and only_numbers(body):
        # Every value is a JSON number: as float64 arrays (exact for what orjson parsed) they
        # skip the model's per-value type scan (~7 us for 256 values); same results and errors.
        # (ragged lists, or an integer past float range: left as they are, for the model's
        # checks to say where). Items of one shape: converted together, as one array.
        rows = as_rows(raw_items, served.inputs[0])
        if rows is not None:
            return rows
        with contextlib.suppress(ValueError, OverflowError, TypeError):
            raw_items = [np.asarray(item, dtype=np.float64) for item in raw_items]
    return served.prepare(raw_items)


_FLOAT_MAX = {np.dtype(name): float(np.finfo(name).max) for name in ("float16", "float32")}


def as_rows(raw_items: list[Any], spec: TensorSpec) -> list[Any] | None:
    """Items of equal shape (each a list), as rows of one array of ``spec``'s float dtype,
    when they all fit ``spec`` (what its check would return for each); None where each item
    must be converted and checked alone (items of different shapes or of a shape ``spec``
    does not take, or a value out of the dtype's range: the per-item checks say which)."""
    dtype = spec.numpy_dtype
    if dtype is None:
        return None
    try:
        wide = np.asarray(raw_items, dtype=np.float64)
    except (ValueError, OverflowError, TypeError):  # ragged, an integer past float range, {}
        return None
    if wide.ndim < 2:
        return None  # scalar items, left to the model's checks
    shape = wide.shape[1:]
    if not spec.takes_shape(shape):
        return None  # a shape the model's checks refuse
    if dtype.itemsize == 8:
        return list(wide)
    limit = _FLOAT_MAX[dtype]
    if np.abs(wide).max(initial=0.0) > limit:  # one reduction
        return None
    return list(wide.astype(dtype))


def only_numbers(body: bytes) -> bool:
    """True if a JSON object's only string is its one key, and it has no true, false or null.

    (Elsewhere a JSON document has only numbers, brackets, commas and white space, or objects
    without keys, ``{}``, which numpy refuses: the model's checks then say where.)
    """
    if body.count(b'"') != 2:
        return False
    start = body.rindex(b'"')
    return body.find(b"n", start) < 0 and body.find(b"t", start) < 0 and body.find(b"f", start) < 0
