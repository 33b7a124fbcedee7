"""Telling the app that a request's client has gone, without a task waiting on ``receive()``.

The gateway's HTTP protocol (:mod:`web_gateway.http_protocol`) marks each request cycle it
makes with :data:`ON_GONE` and calls :func:`gone` when the cycle's client goes (its connection
lost, or cut by a read deadline): the moments ``receive()`` starts answering
``http.disconnect``. The same mark is how the app finds such a cycle behind its ASGI
``receive`` or ``send`` (:func:`gateway_cycle`). Without uvicorn imports, so the app runs where
httptools is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# The attribute of a request cycle (uvicorn's RequestResponseCycle) that holds the callback to
# run when its client goes; the gateway's protocol sets it (to None) on each cycle it makes.
ON_GONE = "microbatch_on_gone"


def gateway_cycle(asgi_callable: Any) -> Any:
    """The request cycle (a :class:`web_gateway.http_protocol.GatewayCycle`) whose bound
    ``receive`` or ``send`` this is; None where the request did not come through the gateway's
    HTTP protocol (another server, or a test client)."""
    cycle = getattr(asgi_callable, "__self__", None)
    return cycle if ON_GONE in getattr(cycle, "__dict__", ()) else None


def when_gone(receive: Any, callback: Callable[[], object]) -> Callable[[], None] | None:
    """Run ``callback`` once the client of the request whose ASGI ``receive`` this is goes
    away (what ``receive()`` would then answer with ``http.disconnect``), without a task
    waiting on ``receive``. Returns a function that stops watching; None where the request
    did not come through :class:`web_gateway.http_protocol.GatewayHttpProtocol` (the caller
    then watches ``receive`` itself)."""
    cycle = gateway_cycle(receive)
    if cycle is None:
        return None
    if cycle.disconnected:
        callback()
        return _nothing
    setattr(cycle, ON_GONE, callback)
    return lambda: setattr(cycle, ON_GONE, None)


def _nothing() -> None:
    pass


def gone(cycle: Any) -> None:
    """The client of ``cycle`` has gone: run its callback, once."""
    callback = cycle.__dict__.get(ON_GONE)
    if callback is not None:
        setattr(cycle, ON_GONE, None)
        callback()
