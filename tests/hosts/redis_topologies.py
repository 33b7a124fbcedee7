"""Redis on namespace hosts: one server, a Sentinel trio, or a cluster of primaries and replicas.

Every Redis node runs on its host behind a :class:`~tests.hosts.relay.RelayProcess`: the node
listens on ``127.0.0.1:<port + 1>`` (and on the host's address too where other nodes must reach
its cluster bus), and the relay on ``<host addr>:<port>``, the address the node announces and
clients use. So all client and replication traffic crosses the relay, which adds the network's
delay (unless netem already does) and counts commands and round trips per client host.

A topology gives the product what it needs to reach it (:attr:`RedisTopology.url`), its hosts
(faults are injected on hosts: :meth:`~tests.hosts.netns.Host.kill_all`,
:meth:`~tests.hosts.netns.Host.link_down`) and admin access from inside the network
(:meth:`RedisTopology.admin`). The product speaks :class:`SingleRedis`,
:class:`SentinelRedis` (its ``redis+sentinel://`` URL) and :class:`ClusterRedis` (through
the product's ``redis+cluster://`` URL naming every node.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from broker.cluster_lane import key_slot
from broker.devserver import find_redis_server
from tests.hosts.netns import Host
from tests.hosts.relay import RelayProcess

T = TypeVar("T")
REDIS_PORT = 6379
SENTINEL_PORT = 26379
BUS_OFFSET = 10000  # a cluster node's bus port is its port + this (Redis' default)


def wait_for(check: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> float:
    """Poll ``check`` (exceptions count as "not yet") until true; return how long it took."""
    started = time.monotonic()
    last: Exception | None = None
    while True:
        try:
            if check():
                return time.monotonic() - started
        except Exception as exc:
            last = exc
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{what}: not within {timeout:g} s (last error: {last!r})")
        time.sleep(every)


def with_client(host: Host, url: str, fn: Callable[[redis.Redis], T], **options: Any) -> T:
    """Run ``fn(client)`` on ``host`` with a fresh client of ``url`` (closed afterwards)."""

    def call() -> T:
        client = redis.Redis.from_url(url, socket_timeout=5, **options)
        try:
            return fn(client)
        finally:
            client.close()

    return host.call(call)


class RedisNode:
    """One redis-server on ``host``, reached at ``host.addr:port`` through a relay."""

    def __init__(
        self, host: Host, port: int = REDIS_PORT, config: dict[str, str] | None = None,
        expose: bool = False,
    ) -> None:  # fmt: skip
        """``expose`` also binds the host's address (for a cluster bus), not only loopback."""
        self.host, self.port, self.config, self.expose = host, port, dict(config or {}), expose
        self.internal_port = port + 1
        self.dir = host.network.workdir / f"redis-{host.name}-{port}"
        self.relay = RelayProcess(
            host, port, ("127.0.0.1", self.internal_port), host.network.relay_delay_s,
            label=f"relay{port}",
        )  # fmt: skip

    @property
    def address(self) -> str:
        return f"{self.host.addr}:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.address}/0"

    def start(self) -> RedisNode:
        self.dir.mkdir(parents=True, exist_ok=True)
        bind = f"127.0.0.1 {self.host.addr}" if self.expose else "127.0.0.1"
        args = [find_redis_server(), "--port", str(self.internal_port), "--bind", bind]
        args += ["--dir", str(self.dir), "--daemonize", "no", "--logfile", ""]
        settings = {"save": "", "appendonly": "no", "maxmemory-policy": "noeviction",
                    "protected-mode": "no", **self.config}  # fmt: skip
        for key, value in settings.items():
            args += [f"--{key}", value]
        self.host.popen(args, log=f"redis{self.port}")
        local = f"redis://127.0.0.1:{self.internal_port}/0"
        wait_for(lambda: with_client(self.host, local, lambda r: r.ping()), 20, f"{self} up")
        self.relay.start()
        wait_for(lambda: with_client(self.host, self.url, lambda r: r.ping()), 20, f"{self} relay")
        return self

    def call(self, fn: Callable[[redis.Redis], T], via: Host | None = None) -> T:
        """``fn(client)`` with a client of this node, from ``via`` (default: its own host)."""
        return with_client(via or self.host, self.url, fn)

    def __repr__(self) -> str:
        return f"RedisNode({self.host.name}, {self.address})"


class RedisTopology:
    """Where Redis runs. Subclasses start their nodes in :meth:`start` and say which URL the
    product is given."""

    nodes: list[RedisNode]

    @property
    def hosts(self) -> list[Host]:
        return [node.host for node in self.nodes]

    @property
    def url(self) -> str:
        """What ``--redis`` gets."""
        raise NotImplementedError

    def start(self) -> RedisTopology:
        raise NotImplementedError

    def admin(self, fn: Callable[[redis.Redis], T], via: Host | None = None) -> T:
        """``fn(client)`` against the node that serves the product's keys, from ``via``."""
        return self.nodes[0].call(fn, via)

    def relay_stats(self, fresh_after: float | None = None) -> dict[str, Any]:
        """Every node's relay counters, by node address."""
        return {node.address: node.relay.stats(fresh_after) for node in self.nodes}


class SingleRedis(RedisTopology):
    """One redis-server on its own host: what the product speaks today."""

    def __init__(self, host: Host, config: dict[str, str] | None = None) -> None:
        self.nodes = [RedisNode(host, config=config)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> SingleRedis:
        self.nodes[0].start()
        return self


class SentinelRedis(RedisTopology):
    """A master and replicas, one per host, and a sentinel on each of those hosts (a trio by
    default: quorum 2, so the two survivors of a dead host fail over).

    :attr:`url` is the product's ``redis+sentinel://`` URL of it; :attr:`sentinels` and
    :attr:`service` are what redis-py's Sentinel client needs. :meth:`admin` reaches the master
    the sentinels name now (another node after a failover).
    """

    def __init__(
        self, hosts: list[Host], service: str = "mymaster", down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:  # fmt: skip
        self.service = service
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        master = hosts[0]
        self.nodes = [RedisNode(master, config=self._announce(master))]
        for host in hosts[1:]:
            config = {**self._announce(host), "replicaof": f"{master.addr} {REDIS_PORT}"}
            self.nodes.append(RedisNode(host, config=config))
        self.quorum = len(hosts) // 2 + 1

    @staticmethod
    def _announce(host: Host) -> dict[str, str]:
        # (a replica's first sync starts at once, not after the default 5 s diskless delay)
        return {"replica-announce-ip": host.addr, "replica-announce-port": str(REDIS_PORT),
                "repl-diskless-sync-delay": "0"}  # fmt: skip

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [(node.host.addr, SENTINEL_PORT) for node in self.nodes]

    @property
    def url(self) -> str:
        hosts = ",".join(f"{addr}:{port}" for addr, port in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def master_node(self, via: Host | None = None) -> RedisNode:
        """The node the sentinels name as master now (asked from ``via``, default: the
        first of the topology's hosts that still runs something)."""
        address = self.master_address(via or self._alive_host())
        return next(node for node in self.nodes if (node.host.addr, node.port) == address)

    def admin(self, fn: Callable[[redis.Redis], T], via: Host | None = None) -> T:
        via = via or self._alive_host()
        return self.master_node(via).call(fn, via)

    def _alive_host(self) -> Host:
        return next((node.host for node in self.nodes if node.host.pids()), self.nodes[0].host)

    def start(self) -> SentinelRedis:
        for node in self.nodes:
            node.start()
        master = self.nodes[0]
        for node in self.nodes:
            conf = node.dir / "sentinel.conf"
            conf.write_text(
                f"port {SENTINEL_PORT}\nbind 127.0.0.1 {node.host.addr}\nprotected-mode no\n"
                f"daemonize no\ndir {node.dir}\nsentinel announce-ip {node.host.addr}\n"
                f"sentinel monitor {self.service} {master.host.addr} {REDIS_PORT} {self.quorum}\n"
                f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.service} 1\n"
            )
            node.host.popen([find_redis_server(), str(conf), "--sentinel"], log="sentinel")
        self.wait_formed(master.host)
        return self

    def sentinel_call(self, via: Host, fn: Callable[[Sentinel], T]) -> T:
        """``fn(sentinel_client)`` on ``via``."""

        def call() -> T:
            # a dead sentinel (its host gone) costs one 1 s connect, not redis-py's retries
            quick = {
                "socket_timeout": 2,
                "socket_connect_timeout": 1,
                "retry": Retry(NoBackoff(), 0),
            }
            client = Sentinel(self.sentinels, sentinel_kwargs=quick, socket_timeout=2)
            try:
                return fn(client)
            finally:
                for each in client.sentinels:
                    each.close()

        return via.call(call)

    def master_address(self, via: Host) -> tuple[str, int]:
        """The master as the sentinels see it now."""
        return self.sentinel_call(via, lambda s: s.discover_master(self.service))

    def wait_formed(self, via: Host, timeout: float = 30.0) -> None:
        """Every sentinel knows the master, every replica and the other sentinels, and every
        replica's link to the master is up."""
        others, replicas = len(self.nodes) - 1, len(self.nodes) - 1

        def formed() -> bool:
            for addr, port in self.sentinels:

                def ask(r: redis.Redis) -> bool:
                    known: list[Any] = r.sentinel_sentinels(self.service)  # type: ignore[assignment]
                    slaves: list[Any] = r.sentinel_slaves(self.service)
                    return len(known) >= others and len(slaves) >= replicas

                if not with_client(via, f"redis://{addr}:{port}", ask):
                    return False
            for node in self.nodes[1:]:
                info = node.call(lambda r: r.info("replication"), via)
                if info.get("master_link_status") != "up":
                    return False
            return True

        wait_for(formed, timeout, "the Sentinel trio to form", every=0.25)


class ClusterRedis(RedisTopology):
    """A Redis Cluster, one node per host: ``primaries`` primaries, each with ``replicas``
    replicas (3 and 1: six hosts), formed with ``redis-cli --cluster create``.

    :attr:`url` is the product's ``redis+cluster://`` URL naming every node (any one is an
    entry point); :meth:`admin` hands redis-py's cluster client to its function, so that each
    command reaches the primary serving its key now (another node after a failover or a
    reshard).
    """

    def __init__(
        self, hosts: list[Host], primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 2000
    ) -> None:
        if len(hosts) != primaries * (1 + replicas):
            raise ValueError(f"{primaries} primaries x {1 + replicas} need that many hosts")
        self.primaries, self.replicas = primaries, replicas
        self.nodes = [
            RedisNode(host, config=self._config(host, node_timeout_ms), expose=True)
            for host in hosts
        ]

    @staticmethod
    def _config(host: Host, node_timeout_ms: int) -> dict[str, str]:
        # clients and other nodes use the relay's port; the bus listens on the host's address
        return {
            "cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
            "cluster-node-timeout": str(node_timeout_ms),
            "cluster-port": str(REDIS_PORT + BUS_OFFSET),
            "cluster-announce-ip": host.addr, "cluster-announce-port": str(REDIS_PORT),
            "cluster-announce-bus-port": str(REDIS_PORT + BUS_OFFSET),
        }  # fmt: skip

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def admin(self, fn: Callable[[redis.Redis], T], via: Host | None = None) -> T:
        return self.cluster_call(via or self._alive_host(), fn)  # type: ignore[arg-type]

    def _alive_host(self) -> Host:
        return next((node.host for node in self.nodes if node.host.pids()), self.nodes[0].host)

    def start(self) -> ClusterRedis:
        for node in self.nodes:
            node.start()
        created = self.nodes[0].host.run(
            ["redis-cli", "--cluster", "create", *(node.address for node in self.nodes),
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=False, timeout=60,
        )  # fmt: skip
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout[-3000:]}")
        self.wait_formed(self.nodes[0].host)
        return self

    def wait_formed(self, via: Host, timeout: float = 30.0) -> None:
        """Every node says the cluster is ok, knows every other node and sees the primaries
        and replicas asked for; every replica's link to its primary is up."""
        expected = {"master": self.primaries, "slave": self.primaries * self.replicas}
        expected = {role: count for role, count in expected.items() if count}

        def formed() -> bool:
            for node in self.nodes:
                info = node.call(lambda r: r.cluster("info"), via)
                known = int(info["cluster_known_nodes"])
                if info["cluster_state"] != "ok" or known != len(self.nodes):
                    return False
                if dict(Counter(self.roles(via, node).values())) != expected:
                    return False
                replication = node.call(lambda r: r.info("replication"), via)
                if replication["role"] == "slave" and replication["master_link_status"] != "up":
                    return False
            return True

        wait_for(formed, timeout, "the cluster to form", every=0.25)

    def cluster_call(self, via: Host, fn: Callable[[RedisCluster], T]) -> T:
        """``fn(cluster_client)`` on ``via`` (redis-py's cluster client, entering anywhere)."""

        def call() -> T:
            live = [node for node in self.nodes if node.host.pids()] or self.nodes
            startup = [ClusterNode(node.host.addr, node.port) for node in live]
            client = RedisCluster(startup_nodes=startup, socket_timeout=5)
            try:
                return fn(client)
            finally:
                client.close()

        return via.call(call)

    def roles(self, via: Host, seen_by: RedisNode | None = None) -> dict[str, str]:
        """Each node's role (``master`` or ``slave``), by address, as ``seen_by`` (default:
        the first node) sees it."""

        def nodes(r: redis.Redis) -> dict[str, str]:
            return {
                address.split("@")[0]: "master" if "master" in node["flags"] else "slave"
                for address, node in r.cluster("nodes").items()
            }

        return (seen_by or self.nodes[0]).call(nodes, via)

    def owner(self, key: str, via: Host) -> RedisNode:
        """The primary serving ``key``'s slot now, as a live node sees it."""
        return self.owner_of_slot(key_slot(key), via)

    def migrate_slot(
        self, slot: int, target: RedisNode, via: Host, keys_per_step: int = 1, pause_s: float = 0.0,
        ending_pause_s: float = 0.0,
    ) -> int:  # fmt: skip
        """Move ``slot`` to ``target`` the way `redis-cli --cluster reshard` does: IMPORTING on
        the target, MIGRATING on the source, MIGRATE of its keys ``keys_per_step`` at a time
        (``pause_s`` between steps, so that clients meet the slot half-migrated), then SETSLOT
        NODE on every primary: the source first and, ``ending_pause_s`` later, the others (the
        target among them): meanwhile the source sends commands to the target, which sends
        them back. Returns how many keys moved."""
        source = self.owner_of_slot(slot, via)
        target_id = target.call(lambda r: r.execute_command("CLUSTER", "MYID"), via)
        source_id = source.call(lambda r: r.execute_command("CLUSTER", "MYID"), via)
        target.call(lambda r: r.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING",
                                                source_id), via)  # fmt: skip
        source.call(lambda r: r.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING",
                                                target_id), via)  # fmt: skip
        moved = 0
        while True:
            names = source.call(
                lambda r: r.execute_command("CLUSTER", "GETKEYSINSLOT", slot, keys_per_step), via
            )
            if not names:
                break
            command = ("MIGRATE", target.host.addr, target.port, "", 0, 10000, "KEYS", *names)
            source.call(lambda r, command=command: r.execute_command(*command), via)
            moved += len(names)
            time.sleep(pause_s)
        primaries = [node for node in self.nodes if self.roles(via).get(node.address) == "master"]
        for node in sorted(primaries, key=lambda node: node is not source):
            node.call(lambda r: r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id),
                      via)  # fmt: skip
            if node is source:
                time.sleep(ending_pause_s)
        return moved

    def owner_of_slot(self, slot: int, via: Host) -> RedisNode:
        """The primary serving ``slot`` now."""

        def find(r: redis.Redis) -> Any:
            for start, end, primary, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return (primary[0].decode(), int(primary[1]))
            return None

        live = next(node for node in self.nodes if node.host.pids())
        address = live.call(find, via)
        return next(node for node in self.nodes if (node.host.addr, node.port) == address)
