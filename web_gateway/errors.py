"""HTTP errors: every failure becomes ``{"error": {"type": ..., "message": ...}}`` with its status
(on /v2 routes the Open Inference Protocol's ``{"error": "<Type>: <message>"}``), in one place:
:func:`to_response`.

The mapping (see docs/gateway.md):

=========================  ======  ========================================================
error                      status  when
=========================  ======  ========================================================
BadRequest                 400     malformed body, header or binary framing
Unauthorized               401     bearer auth is on and the token is missing or wrong
ModelNotFound / NotFound   404     unknown model or route
PayloadTooLarge            413     body over ``max_body_bytes`` or more than ``max_items``
InvalidInput, CodecError   422     input does not fit the model's declared inputs
PoisonRequest              422     the item was dead-lettered: it kept killing the worker
ModelError                 500     the model raised on this item (the model's message)
InvalidOutput, Protocol..  500     the model or the deployment misbehaved (never the input)
QueueFull                  503     the model's queue is at its bound (Retry-After)
BrokerUnavailable          503     Redis cannot be reached (Retry-After)
NoWorkers                  503     no live worker has consumed the model for a while (Retry-After)
DeadlineExceeded           504     no result within the request's timeout
=========================  ======  ========================================================
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from broker.errors import (
    BrokerUnavailable,
    CodecError,
    DeadlineExceeded,
    InvalidInput,
    InvalidOutput,
    MicrobatchError,
    ModelError,
    NoWorkers,
    PoisonRequest,
    ProtocolError,
    QueueFull,
)
from broker.logs import ThrottledWarning

log = logging.getLogger("microbatch.gateway")

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the logs do


# A client (or a load tool stopping) can leave thousands of requests a second: one line each
# flooded the log. Those after the last line are in the metrics' ClientGone outcome.
withdrawals = ThrottledWarning(
    log,
    "clients left before their answers: %d request(s) withdrawn since the last such line "
    "(the latest to %s); at most one such line every 10 s",
    every_s=10.0,
    level=logging.INFO,
)

UNAVAILABLE_MESSAGE = "Redis, which queues the requests, is unavailable just now: retry later"

STATUS_BY_ERROR: dict[type[MicrobatchError], int] = {
    InvalidInput: 422,
    CodecError: 422,
    PoisonRequest: 422,
    ModelError: 500,
    InvalidOutput: 500,
    ProtocolError: 500,
    QueueFull: 503,
    BrokerUnavailable: 503,
    NoWorkers: 503,
    DeadlineExceeded: 504,
}


class ClientGone(Exception):
    """The HTTP client disconnected before its result came back (``args``: what was missed,
    when nothing was queued yet)."""


class HTTPError(Exception):
    """An error answered with ``status`` and a JSON body; raised anywhere in a request."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        headers: dict[str, str] | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.headers = headers or {}
        self.detail = message if detail is None else detail  # for the gateway's log only


SHOWN_CHARS = 40  # the most characters of a client's value an error message quotes


def _shortened(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 3]}..."


def shown(value: Any) -> str:
    """A value of a request's JSON as its client wrote it, for an error message: a string in
    single quotes (as the messages quote names), anything else as JSON (``false``,
    ``["a","b"]``, never Python's ``False`` or ``['a', 'b']``); shortened past
    ``SHOWN_CHARS``."""
    if isinstance(value, str):
        return f"'{_shortened(value)}'"
    try:
        text = orjson.dumps(value).decode()
    except TypeError:  # not from JSON (a caller's own object): named by its type
        text = f"a {type(value).__name__}"
    return _shortened(text)


def shown_header(value: str) -> str:
    """A header's value as its client sent it, for an error message: its bytes read as UTF-8
    (starlette reads them as Latin-1), in single quotes, shortened past ``SHOWN_CHARS``."""
    text = value.encode("latin-1").decode("utf-8", "backslashreplace")
    return f"'{_shortened(text)}'"


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, "BadRequest", message)


def too_large(message: str) -> HTTPError:
    return HTTPError(413, "PayloadTooLarge", message)


def invalid_input(message: str) -> HTTPError:
    return HTTPError(422, "InvalidInput", message)


def model_not_found(name: str) -> HTTPError:
    return HTTPError(404, "ModelNotFound", f"no model named {name!r} is served here")


def version_not_found(name: str, version: str, versions: Sequence[str]) -> HTTPError:
    known = ", ".join(repr(v) for v in versions)
    return HTTPError(
        404, "ModelNotFound", f"model {name!r} has no version {version!r} (its versions: {known})"
    )


def from_microbatch(exc: MicrobatchError, retry_after: int) -> HTTPError:
    """The HTTP error for a typed broker error (503 ones carry Retry-After)."""
    status = 500
    for cls in type(exc).__mro__:
        if cls in STATUS_BY_ERROR:
            status = STATUS_BY_ERROR[cls]
            break
    headers = {"Retry-After": str(retry_after)} if status == 503 else None
    if isinstance(exc, BrokerUnavailable):
        # what failed names the gateway's Redis (its address, its ACL user, a cluster node's
        # MOVED): the gateway's log says it, the client is told to retry
        return HTTPError(status, exc.type, UNAVAILABLE_MESSAGE, headers, detail=str(exc))
    return HTTPError(status, exc.type, str(exc), headers)


def error_body(type_: str, message: str) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message}}


def v2_error_body(type_: str, message: str) -> dict[str, Any]:
    """The Open Inference Protocol's error body (``error`` is a string), plus the type."""
    return {"error": f"{type_}: {message}", "type": type_}


def is_v2(path: str) -> bool:
    """Routes of the Open Inference Protocol answer errors in its format."""
    return path == "/v2" or path.startswith("/v2/")


def error_response(error: HTTPError, v2: bool = False) -> Response:
    """``error`` as a response: the v1 body, or the Open Inference Protocol's with ``v2``."""
    body = v2_error_body if v2 else error_body
    return Response(
        orjson.dumps(body(error.type, error.message)),
        status_code=error.status,
        headers=error.headers,
        media_type="application/json",
    )


HTTP_TYPES = {
    400: "BadRequest",
    401: "Unauthorized",
    404: "NotFound",
    405: "MethodNotAllowed",
    413: "PayloadTooLarge",
    422: "InvalidInput",
}


def as_http_error(exc: Exception) -> HTTPError:
    """The HTTP error for any exception a request can end with (500 for the unexpected)."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, StarletteHTTPException):  # routing: 404, 405
        type_ = HTTP_TYPES.get(exc.status_code, "HTTPError")
        headers = dict(exc.headers or {})
        if "Allow" in headers:
            headers["Allow"] = _with_head(headers["Allow"])
        return HTTPError(exc.status_code, type_, str(exc.detail), headers)
    if type(exc).__name__ == "RequestValidationError":  # FastAPI's, for a path parameter
        return bad_request("malformed request")
    return HTTPError(500, "InternalError", "internal error")


def _with_head(allow: str) -> str:
    """A 405's Allow with HEAD wherever GET is (the app answers HEAD as GET; FastAPI's routes
    list GET alone)."""
    methods = allow.split(", ")
    return allow if "GET" not in methods or "HEAD" in methods else f"{allow}, HEAD"


def outcome_of(exc: Exception) -> str:
    """The outcome label of a request that ended with ``exc`` (its error type)."""
    if isinstance(exc, HTTPError):
        return exc.type
    return "ClientGone" if isinstance(exc, ClientGone) else as_http_error(exc).type


def to_response(exc: Exception, method: str, path: str) -> Response:
    """The one exception-to-response mapping of every route (the hot one included)."""
    if isinstance(exc, ClientGone):
        if exc.args:  # nothing was queued: not worth a line each (the protocol sums them)
            log.debug("client left %s (%s %s)", exc.args[0], method, path)
        else:
            withdrawals.note(path)
        return Response(status_code=CLIENT_CLOSED)
    error = as_http_error(exc)
    if error.status == 500 and not isinstance(exc, HTTPError):
        log.error("unexpected %s on %s %s", type(exc).__name__, method, path)
    return error_response(error, is_v2(path))
