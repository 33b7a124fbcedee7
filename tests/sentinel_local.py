"""A Sentinel setup on free loopback ports: a master, replicas and sentinels, each its own
redis-server process (the namespace hosts of tests/hosts do the same across hosts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from broker.devserver import RedisServer, find_redis_server, free_port

SERVICE = "mbmaster"


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll ``check`` (exceptions count as "not yet") until truthy; return its value."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:
            last = exc
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:g} s (last error: {last!r})")


class LocalSentinel:
    """A master and ``replicas`` replicas, watched by ``sentinels`` sentinels (quorum: a
    majority). ``sentinel_password`` makes the sentinels require one; ``redis_config`` goes to
    every data node (e.g. an ACL file)."""

    def __init__(
        self, replicas: int = 1, sentinels: int = 1, down_after_ms: int = 1000,
        sentinel_password: str | None = None, redis_config: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        config = {"repl-diskless-sync-delay": "0", **(redis_config or {})}  # replicas sync now
        self.master = RedisServer(config)
        self.replicas = [RedisServer(config) for _ in range(replicas)]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinel_password = sentinel_password
        self.down_after_ms = down_after_ms
        self.dir = Path(tempfile.mkdtemp(prefix="microbatch-sentinel-"))
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def nodes(self) -> list[RedisServer]:
        return [self.master, *self.replicas]

    def url(self, credentials: str = "", query: str = "") -> str:
        """The redis+sentinel URL of the service (``credentials``: ``user:password@``)."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{credentials}{hosts}/{SERVICE}/0{query}"

    def start(self) -> LocalSentinel:
        self.master.start()
        for replica in self.replicas:
            replica.config["replicaof"] = f"127.0.0.1 {self.master.port}"
            replica.start()
        quorum = len(self.sentinel_ports) // 2 + 1
        for port in self.sentinel_ports:
            conf = self.dir / f"sentinel-{port}.conf"
            lines = [
                f"port {port}", "bind 127.0.0.1", "daemonize no", f"dir {self.dir}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} {quorum}",
                f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}",
                f"sentinel failover-timeout {SERVICE} 5000",
                f"sentinel parallel-syncs {SERVICE} 1",
            ]  # fmt: skip
            if self.sentinel_password:
                lines.append(f"requirepass {self.sentinel_password}")
            conf.write_text("\n".join(lines) + "\n")
            log = open(self.dir / f"sentinel-{port}.log", "wb")  # noqa: SIM115
            args = [find_redis_server(), str(conf), "--sentinel"]
            self.processes.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        self.wait_formed()
        return self

    def sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=self.sentinel_password, socket_timeout=2)

    def ask(self, fn: Callable[[redis.Redis], Any]) -> list[Any]:
        """``fn(client)`` of every sentinel."""
        answers = []
        for port in self.sentinel_ports:
            with self.sentinel(port) as client:
                answers.append(fn(client))
        return answers

    def wait_formed(self, timeout: float = 30.0) -> None:
        """Every sentinel knows the master, the live replicas and the other sentinels."""
        others = len(self.sentinel_ports) - 1

        def formed() -> bool:
            for known in self.ask(lambda c: (c.sentinel_slaves(SERVICE),
                                             c.sentinel_sentinels(SERVICE))):  # fmt: skip
                replicas, sentinels = known
                up = [r for r in replicas if not r["is_sdown"] and r["master-link-status"] == "ok"]
                if len(up) < len(self.replicas) or len(sentinels) < others:
                    return False
            return True

        wait_for(formed, timeout, "the sentinels to know the replicas and each other", 0.1)

    def master_port(self) -> int:
        """The master's port as the first sentinel sees it."""
        with self.sentinel(self.sentinel_ports[0]) as client:
            return int(client.sentinel_get_master_addr_by_name(SERVICE)[1])

    def node(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def failover(self, timeout: float = 30.0) -> tuple[int, int]:
        """``SENTINEL FAILOVER`` (graceful: the master is alive); wait until every sentinel
        names the new master and it says it is one. Returns (old, new) master ports."""
        old = self.master_port()
        with self.sentinel(self.sentinel_ports[0]) as client:
            client.execute_command("SENTINEL", "FAILOVER", SERVICE)
        new = self.wait_new_master(old, timeout)
        return old, new

    def wait_new_master(self, old: int, timeout: float = 30.0) -> int:
        """Until every sentinel names a master other than ``old`` that says it is one."""

        def moved() -> int | None:
            ports = {
                int(a[1]) for a in self.ask(lambda c: c.sentinel_get_master_addr_by_name(SERVICE))
            }
            if len(ports) != 1 or old in ports:
                return None
            (port,) = ports
            with self.node(port).client(socket_timeout=2) as client:
                return port if client.role()[0] == b"master" else None

        port: int = wait_for(moved, timeout, "the failover", 0.05)
        return port

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalSentinel:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def log_tail(setup: LocalSentinel, lines: int = 30) -> str:
    """The end of every sentinel's log (for a failing test's message)."""
    out = []
    for path in sorted(setup.dir.glob("*.log")):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name}\n" + "\n".join(text))
    return "\n".join(out) if out else f"(no logs in {setup.dir}; pid {os.getpid()})"
