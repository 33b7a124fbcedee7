"""The gunicorn worker class: uvicorn on uvloop with the httptools parser, when installed."""

from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import logging
import os
import signal
import sys
from typing import Any

from gunicorn.arbiter import Arbiter
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

HEARTBEAT_S = 0.5  # under uvicorn's 1 s between checks: a heartbeat at each check


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


_PEER = "microbatch.peer"  # a request scope's key: its peer's address, while proxies are read


class ForwardedClient:
    """uvicorn's ``ProxyHeadersMiddleware`` (a trusted proxy's ``X-Forwarded-For`` and
    ``X-Forwarded-Proto`` read, gunicorn's ``forwarded_allow_ips`` naming the proxies
    trusted), keeping the peer's address where the one it takes is no IP address: uvicorn took
    any text (``not-an-ip``, ``unknown``), and the access log named a client that does not
    exist, as the header's sender chose."""

    def __init__(self, app: Any, trusted_hosts: list[str] | str) -> None:
        self.app = app
        self.proxied = ProxyHeadersMiddleware(self._checked, trusted_hosts)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        scope[_PEER] = scope.get("client")
        await self.proxied(scope, receive, send)

    async def _checked(self, scope: Any, receive: Any, send: Any) -> None:
        peer = scope.pop(_PEER, None)
        client = scope.get("client")
        if client is not peer and not _is_ip_address(client[0]):
            scope["client"] = peer
        await self.app(scope, receive, send)


def _is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class GatewayWorker(UvicornWorker):  # type: ignore[misc]
    """A uvicorn worker with the fastest loop and parser available, lifespan on."""

    CONFIG_KWARGS: dict[str, Any] = {
        "loop": "uvloop" if _have("uvloop") else "asyncio",
        # httptools with read deadlines, a connection cap and one system call per response
        "http": "web_gateway.http_protocol:GatewayHttpProtocol" if _have("httptools") else "h11",
        "lifespan": "on",
        # X-Forwarded-For is read by ForwardedClient (uvicorn's reading, checked), applied in
        # _serve, rather than by uvicorn's own middleware
        "proxy_headers": False,
        # no "server: uvicorn" on every response: it tells a scanner what to try, a client
        # nothing
        "server_header": False,
        # no WebSocket routes: an upgrade request is served as HTTP, never handed to uvicorn's
        # WebSocket protocol (which has none of the connection limits) where one is installed
        "ws": "none",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn_worker beat (told the master it lives) every half of gunicorn's worker
        # timeout, so a loop stalled for just over half of it could be killed; uvicorn checks
        # once a second, and now beats at each check.
        self.config.timeout_notify = HEARTBEAT_S
        self._server: Server | None = None

    async def callback_notify(self) -> None:
        """Tell the master this worker lives; stop gracefully once the master is gone.

        A master killed outright (SIGKILL, the OOM killer) can stop nothing: its workers, which
        gunicorn's own worker types stop on seeing their parent change, served on unwatched,
        holding the port, so a gateway started in its place could not bind it.
        """
        self.notify()
        server = self._server
        if server is None or server.should_exit or os.getppid() == self.ppid:
            return
        self.log.warning("the gunicorn master (pid %s) is gone: stopping", self.ppid)
        server.should_exit = True
        # what the master would have allowed: then the connections still open are dropped
        asyncio.get_running_loop().call_later(self.cfg.graceful_timeout, self._drop_the_rest)

    def _drop_the_rest(self) -> None:
        """The graceful timeout of a worker whose master is gone has passed: exit at once, as
        the master's SIGKILL would have ended it. (uvicorn's forced exit cancelled the requests
        in flight instead, answering each with a 500 and logging its traceback as an error.)"""
        self.log.warning("graceful timeout passed: dropping the connections still open")
        logging.shutdown()
        os._exit(0)

    async def _serve(self) -> None:
        # uvicorn_worker's _serve, handing uvicorn the listening sockets themselves rather than
        # gunicorn's wrappers: uvloop closes the socket object it serves on (ignoring EBADF,
        # libuv having closed the descriptor already), and gunicorn's wrapper logged that
        # EBADF as "Error while closing socket [Errno 9]" at every shutdown.
        self.config.app = ForwardedClient(self.wsgi, self.cfg.forwarded_allow_ips)
        server = self._server = Server(config=self.config)
        asyncio.get_running_loop().add_signal_handler(signal.SIGQUIT, _quit, server)
        await server.serve(sockets=[getattr(sock, "sock", sock) for sock in self.sockets])
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)


def _quit(server: Server) -> None:
    """SIGQUIT, which the master sends its workers on SIGINT or SIGQUIT (gunicorn's "quick
    shutdown", which still waits for them up to the graceful timeout): a graceful stop, as on
    SIGTERM. (uvicorn_worker's handler only set a flag that nothing reads: the worker went on
    accepting connections until the master killed it at that timeout, mid-request.) Never a
    forced one: at a terminal, Ctrl-C reaches the workers too, just before the master's
    SIGQUIT."""
    server.should_exit = True
