"""The gunicorn worker class: uvicorn on uvloop with the httptools parser, when installed."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import sys
from typing import Any

from gunicorn.arbiter import Arbiter
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

HEARTBEAT_S = 0.5  # under uvicorn's 1 s between checks: a heartbeat at each check


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class GatewayWorker(UvicornWorker):  # type: ignore[misc]
    """A uvicorn worker with the fastest loop and parser available, lifespan on."""

    CONFIG_KWARGS: dict[str, Any] = {
        "loop": "uvloop" if _have("uvloop") else "asyncio",
        # httptools with read deadlines, a connection cap and one system call per response
        "http": "web_gateway.http_protocol:GatewayHttpProtocol" if _have("httptools") else "h11",
        "lifespan": "on",
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
        self.config.app = self.wsgi
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
