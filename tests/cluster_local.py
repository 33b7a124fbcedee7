"""A Redis Cluster on free loopback ports: primaries (and replicas), each its own redis-server
process, joined by ``redis-cli --cluster create`` (the namespace hosts of tests/hosts do the
same across hosts)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import redis

from broker.devserver import RedisServer, find_redis_server, free_port
from tests.sentinel_local import wait_for


def redis_cli() -> str:
    """The redis-cli beside the redis-server the tests run."""
    server = Path(find_redis_server())
    beside = server.with_name("redis-cli")
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    if not found:
        raise FileNotFoundError("redis-cli not found (it comes with redis-server / redis-tools)")
    return found


class LocalCluster:
    """``primaries`` primaries with ``replicas`` replicas each, on 127.0.0.1; ``redis_config``
    goes to every node."""

    def __init__(
        self, primaries: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
        redis_config: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        config = {
            "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": str(node_timeout_ms),
            "repl-diskless-sync-delay": "0",
            **(redis_config or {}),
        }
        self.replicas = replicas
        # (the bus port is set: the default, port + 10000, may be past 65535 or taken)
        self.nodes = [
            RedisServer({**config, "cluster-port": str(free_port())})
            for _ in range(primaries * (1 + replicas))
        ]

    def url(self, credentials: str = "", query: str = "", nodes: int = 1) -> str:
        """The redis+cluster URL naming the first ``nodes`` nodes."""
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[:nodes])
        return f"redis+cluster://{credentials}{hosts}{query}"

    def start(self) -> LocalCluster:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [redis_cli(), "--cluster", "create", *addresses,
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_ok()
        return self

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2)

    def wait_ok(self, timeout: float = 30.0, nodes: list[RedisServer] | None = None) -> None:
        """Until every (live) node says the cluster is ok and agrees on the slot map."""

        def ok() -> bool:
            maps = set()
            for node in nodes or self.nodes:
                with self.client(node.port) as client:
                    if client.cluster("info")["cluster_state"] != "ok":
                        return False
                    maps.add(repr(sorted(tuple(s[:3]) for s in client.execute_command(
                        "CLUSTER", "SLOTS"))))  # fmt: skip
            return len(maps) == 1

        wait_for(ok, timeout, "the cluster to be formed", 0.1)

    def node(self, port: int) -> RedisServer:
        return next(node for node in self.nodes if node.port == port)

    def owner(self, key: str) -> int:
        """The port of the primary serving ``key``'s slot now."""
        with self.client(self.nodes[0].port) as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(primary[1])
        raise LookupError(f"no node serves {key!r}")

    def primaries(self) -> list[int]:
        """The ports of the primaries serving slots now."""
        with self.client(self.nodes[0].port) as client:
            slots = client.execute_command("CLUSTER", "SLOTS")
        return sorted({int(primary[1]) for _, _, primary, *_ in slots})

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
