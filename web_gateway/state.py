"""One gateway process's state: its settings, served models, thread pool and Redis client."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from broker.connections import async_client
from broker.errors import BrokerUnavailable, MicrobatchError
from broker.keys import NORMAL
from broker.logs import ThrottledWarning
from broker.protocol import valid_traceparent
from broker.redis_transport import cluster_node_misuse, startup_warnings

from . import kserve, metrics, reading
from .disconnects import when_gone
from .errors import (
    ClientGone,
    HTTPError,
    from_microbatch,
    model_not_found,
    outcome_of,
    to_response,
    version_not_found,
)
from .serving import ServedModel
from .settings import GatewaySettings
from .tokens import Tokens

log = logging.getLogger("microbatch.gateway")

T = TypeVar("T")

PING_TIMEOUT_S = 1.0
UNAVAILABLE = BrokerUnavailable.__name__  # its outcome label
UNAVAILABLE_LOG_S = 10.0  # as a worker says its outage: at its start, then every 10 s
GC_YOUNG_THRESHOLD = 10_000  # net allocations between collections of the young generation
INLINE_BYTES = 64 * 1024  # bodies up to this size are parsed on the event loop (~0.1 ms)


class _Gone:
    """Called when a request's client goes: cancels its call (which withdraws its items)."""

    __slots__ = ("call", "gone")

    def __init__(self, call: asyncio.Future[Any]) -> None:
        self.call = call
        self.gone = False

    def __call__(self) -> None:
        self.gone = True
        self.call.cancel()


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
        self.names = sorted(self.models)
        self.tokens = Tokens(settings)
        self.pool: ThreadPoolExecutor | None = None
        self.redis: Any = None
        self.misuse: str | None = None  # what is wrong with the Redis its URL names
        self._unavailable = ThrottledWarning(
            log, "%d request(s) answered 503 BrokerUnavailable; the last: %s", UNAVAILABLE_LOG_S
        )
        self._server_checked = False
        self._flusher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.pool = ThreadPoolExecutor(
            self.settings.preprocess_threads, thread_name_prefix="gateway-cpu"
        )
        self.redis = async_client(self.settings.redis_url, socket_timeout=PING_TIMEOUT_S)
        for warning in await startup_warnings(self.redis, self.settings.redis_url):
            log.warning("%s", warning)
        for served in self.models.values():
            await served.streamer.aconnect()  # the first request need not pay for connecting
        self._flusher = asyncio.get_running_loop().create_task(
            metrics.flush_every(
                [served.metrics for served in self.models.values()], metrics.FLUSH_S
            )
        )
        # Everything loaded so far (FastAPI, pydantic, the model classes) lives as long as the
        # process: frozen out of the collector, a full collection no longer walks it (it took
        # 30-40 ms, twice a second under load: the gateway's p99).
        gc.collect()
        gc.freeze()
        # A served request leaves no cyclic garbage, yet the young generation was collected every
        # 700 allocations (a few requests in flight): ~2% of the CPU, for nothing.
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._flusher is not None:
            self._flusher.cancel()
        for served in self.models.values():
            await loop.run_in_executor(None, served.streamer.close)
        self.flush_metrics()  # the last requests' counts, before the process exits
        if self.redis is not None:
            await self.redis.aclose()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def flush_metrics(self) -> None:
        """Write every model's counted requests to prometheus-client (on the event loop)."""
        for served in self.models.values():
            served.metrics.flush()

    async def in_pool(self, func: Callable[..., T], *args: Any) -> T:
        """Run CPU work (parsing, preprocess, postprocess) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, func, *args)

    @staticmethod
    def inline(served: ServedModel, size: int) -> bool:
        """Whether a body of ``size`` bytes for ``served`` is parsed and checked on the event
        loop: when it is small and the model has no preprocess of its own (cheaper than a
        thread hop, and bounded); else in the thread pool (:meth:`in_pool`)."""
        return size <= INLINE_BYTES and not served.has_preprocess

    def authorize(self, request: Request) -> None:
        tokens = self.tokens.get()
        if tokens:  # auth on
            reading.authorize(request, tokens)

    def model(self, name: str, version: str | None = None) -> ServedModel:
        """The served model ``name`` (404 if none), at ``version`` when one is named."""
        served = self.models.get(name)
        if served is None:
            raise model_not_found(name)
        if version is not None and version not in kserve.VERSIONS:
            raise version_not_found(name, version, kserve.VERSIONS)
        return served

    def timeout(self, request: Request, fallback: float | None = None) -> float:
        """The request's timeout: its header, else ``fallback``, else the default; capped."""
        default = fallback if fallback is not None else self.settings.default_timeout
        return reading.timeout(request, default, self.settings.max_timeout)

    def body(self, request: Request) -> Coroutine[Any, Any, bytes]:
        """The request's body (await it): :func:`web_gateway.reading.body` at this gateway's
        limit (its coroutine, not one around it)."""
        return reading.body(request, self.settings.max_body_bytes)

    def check_items(self, count: int) -> None:
        reading.check_items(count, self.settings.max_items)

    async def predict(
        self,
        request: Request,
        served: ServedModel,
        items: list[Any],
        timeout: float,
        priority: int = NORMAL,
    ) -> list[Any]:
        """Submit ``items`` (at ``priority``'s level) and wait; abandon them (withdrawn from
        the queue) if the client goes."""
        served.metrics.submitted(len(items))
        trace = valid_traceparent(request.headers.get("traceparent"))
        try:
            call = served.streamer.astart(
                items, timeout=timeout, traceparent=trace, priority=priority
            )
        except MicrobatchError as exc:
            raise from_microbatch(exc, self.settings.retry_after) from None
        # The client left: cancelling the call withdraws its items from the queue. Under
        # gateway start, the HTTP protocol says so (no task per request); else a task waits.
        gone = _Gone(call)
        stop = when_gone(request.receive, gone)
        watch = None
        if stop is None:
            watch = asyncio.get_running_loop().create_task(reading.disconnected(request))
            watch.add_done_callback(lambda done: None if done.cancelled() else gone())
        try:
            return await call
        except asyncio.CancelledError:
            if gone.gone:
                raise ClientGone from None
            raise  # we are cancelled ourselves (the call is cancelled with us)
        except MicrobatchError as exc:
            raise from_microbatch(exc, self.settings.retry_after) from None
        finally:
            if stop is not None:
                stop()
            if watch is not None:
                watch.cancel()

    async def observed(
        self,
        request: Request,
        served: ServedModel,
        route: str,
        handler: Callable[..., Awaitable[Response]],
        *args: Any,
    ) -> Response:
        """Run an inference handler (on ``args``) with its model's metrics; any error becomes
        its response."""
        started = time.perf_counter()
        served.metrics.begin()
        outcome = "ok"
        try:
            return await handler(*args)
        except Exception as exc:
            outcome = outcome_of(exc)
            if outcome == UNAVAILABLE and isinstance(exc, HTTPError):  # so do the workers
                self._unavailable.note(exc.detail)
            return to_response(exc, request.scope["method"], request.scope["path"])
        finally:
            served.metrics.answered(route, outcome, time.perf_counter() - started)

    async def ping(self) -> bool:
        """Whether Redis answers, and is the kind of server its URL names (not a Redis Cluster
        node named by a redis:// URL, where most of the models' keys are MOVED:
        :attr:`misuse` then says so)."""
        try:
            return await asyncio.wait_for(self._redis_usable(), PING_TIMEOUT_S)
        except Exception:
            return False

    async def _redis_usable(self) -> bool:
        if not await self.redis.ping():
            return False
        if not self._server_checked:  # once: a server does not turn into a cluster node
            self.misuse = await cluster_node_misuse(self.redis, self.settings.redis_url)
            self._server_checked = True
        return self.misuse is None
