"""The namespace-host harness itself: isolation, faults, cleanup, the relay, and the Redis
topologies that later client work will speak (Sentinel, Cluster). Tests that make namespaces
are slow-marked and fail (never skip) where namespaces cannot be made."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from broker.devserver import RedisServer, free_port
from tests.hosts.netns import PREFIX, Host, NamespacesUnavailable, Network, namespace_pids
from tests.hosts.redis_topologies import ClusterRedis, SentinelRedis, wait_for
from tests.hosts.relay import RespCounter

ECHO = """
import socket, threading
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", 7000))
server.listen()
def echo(conn):
    while data := conn.recv(1024):
        conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split(" ", 1)[0] for line in listed.splitlines() if line]


def connect(addr: str, port: int) -> socket.socket:
    return socket.create_connection((addr, port), timeout=2)


def echo_connection(client: Host, server: Host, timeout: float = 10.0) -> socket.socket:
    """A connection from ``client`` to the echo server on ``server`` (once it listens)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.call(connect, server.addr, 7000)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("missing", ["root", "ip"])
def test_without_root_or_ip_a_network_fails_saying_why(
    network: Network, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    if missing == "root":
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
    else:
        monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(NamespacesUnavailable, match="need root" if missing == "root" else "`ip`"):
        network.host("a")
    assert network.hosts == {}


@pytest.mark.slow
def test_hosts_reach_each_other_and_nothing_else(network: Network) -> None:
    a, b = network.host("a"), network.host("b")
    assert (a.addr, b.addr) == ("10.213.0.1", "10.213.0.2")
    b.popen([sys.executable, "-c", ECHO], log="echo")
    conn = echo_connection(a, b)
    conn.sendall(b"ping")
    assert conn.recv(10) == b"ping"
    conn.close()
    # a host's only route is its subnet's; the root namespace has none of its addresses
    assert a.run(["ip", "route"]).stdout.split() == [
        "10.213.0.0/24", "dev", "eth0", "proto", "kernel", "scope", "link", "src", a.addr,
    ]  # fmt: skip
    root = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert "10.213.0." not in root
    with pytest.raises(OSError) as refused:  # TEST-NET-1: refused locally, nothing is sent
        a.call(connect, "192.0.2.1", 9)
    assert refused.value.errno == errno.ENETUNREACH
    print(f"\nlink delay by: {network.delay_method}")


@pytest.mark.slow
def test_link_down_stalls_a_connection_and_link_up_heals_it(network: Network) -> None:
    a, b = network.host("a"), network.host("b")
    b.popen([sys.executable, "-c", ECHO], log="echo")
    conn = echo_connection(a, b)
    a.link_down()
    conn.settimeout(1.0)
    conn.sendall(b"during")
    with pytest.raises(TimeoutError):
        conn.recv(10)
    with pytest.raises(OSError):  # nor can a new connection be made
        a.call(connect, b.addr, 7000)
    a.link_up()
    conn.settimeout(10.0)
    assert conn.recv(10) == b"during"  # the same connection, retransmitted after the cut
    conn.close()


@pytest.mark.slow
def test_kill_all_kills_every_process_and_close_leaves_nothing(network: Network) -> None:
    a = network.host("a")
    a.popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], log="sleepers")
    wait_for(lambda: len(a.pids()) == 3, 10, "three processes")
    killed = a.kill_all()
    assert len(killed) == 3 and a.pids() == []
    a.popen(["sleep", "300"], log="again")
    wait_for(lambda: len(a.pids()) == 1, 10, "a process")
    [pid] = a.pids()
    names = {host.namespace for host in network.hosts.values()} | {network.switch}
    network.close()
    assert not names & set(namespaces())
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.slow
def test_namespaces_of_a_crashed_run_are_removed_by_the_next(network: Network) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"{PREFIX}{gone.pid}n0-old"  # as a run whose process is gone would have left it
    subprocess.run(["ip", "netns", "add", stale], check=True)
    orphan = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "300"])
    try:
        wait_for(lambda: namespace_pids(stale) == [orphan.pid], 10, "the orphan")
        network.host("a")
        assert stale not in namespaces()
        assert orphan.wait(10) == -9
    finally:
        if orphan.poll() is None:
            orphan.kill()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_resp_counter_counts_commands_split_anywhere() -> None:
    tricky = b"\r\n*1\r\n$4\r\nPING\r\n"  # a payload that looks like a command
    stream = (
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nhello\r\n"
        + b"*2\r\n$4\r\nxadd\r\n$%d\r\n%s\r\n" % (len(tricky), tricky)
        + b"*1\r\n$0\r\n\r\n"  # an empty name
        + b"PING\r\n"  # an inline command
        + b"*1\r\n$4\r\nEXEC\r\n"
    )
    for size in (1, 2, 3, 7, len(stream)):
        counter = RespCounter()
        for start in range(0, len(stream), size):
            counter.feed(stream[start : start + size])
        assert counter.commands == {"SET": 1, "XADD": 1, "": 1, "PING": 1, "EXEC": 1}, size


def fresh_counters(path: Path) -> dict[str, Any]:
    """A relay's counters, as written after now."""
    now = time.monotonic()
    wait_for(lambda: json.loads(path.read_text())["written_at"] > now, 5, "fresh counters")
    counters: dict[str, Any] = json.loads(path.read_text())
    return counters


DELAY_MS = 2.0


def test_relay_delays_each_direction_and_counts_round_trips(tmp_path: Path) -> None:
    """On loopback (no namespace needed): the relay's added latency and its counters."""
    medians = {}
    with RedisServer() as server:
        # a delay well above a loaded machine's own jitter (0.25 ms was within it)
        for delay_ms in (0.0, DELAY_MS):
            port, stats = free_port(), tmp_path / f"relay-{delay_ms}.json"
            relay = subprocess.Popen(
                [sys.executable, "-m", "tests.hosts.relay", "--listen", f"127.0.0.1:{port}",
                 "--target", f"127.0.0.1:{server.port}", "--delay-ms", str(delay_ms),
                 "--stats", str(stats)],
            )  # fmt: skip
            try:
                wait_for(stats.exists, 20, "the relay")
                client = redis.Redis(port=port)
                client.ping()
                latencies = []
                for _ in range(200):
                    started = time.perf_counter()
                    client.set("k", "v")
                    latencies.append(time.perf_counter() - started)
                pipe = client.pipeline(transaction=False)
                for _ in range(50):
                    pipe.incr("n")
                pipe.execute()
                client.close()
                medians[delay_ms] = statistics.median(latencies)
                peer = fresh_counters(stats)["peers"]["127.0.0.1"]
            finally:
                relay.terminate()
                relay.wait(10)
            commands = peer["commands"]
            assert commands["SET"] == 200 and commands["INCRBY"] == 50
            # 200 SETs, 1 pipeline, and one for each command before them (PING, set-up)
            set_up = sum(n for name, n in commands.items() if name not in ("SET", "INCRBY"))
            assert peer["round_trips"] == 201 + set_up, peer
            assert peer["connections"] == 1 and peer["open"] == 0
    added = (medians[DELAY_MS] - medians[0.0]) * 1000
    print(
        f"\nrelay: median SET {medians[0.0] * 1000:.3f} ms without delay, "
        f"{medians[DELAY_MS] * 1000:.3f} ms with {DELAY_MS} ms per direction (+{added:.3f} ms)"
    )
    assert added > DELAY_MS  # two directions of DELAY_MS, generously


@pytest.mark.slow
def test_a_sentinel_trio_forms_and_fails_over_when_its_master_host_dies(
    network: Network,
) -> None:
    hosts = [network.host(f"s{i}") for i in range(1, 4)]
    client = network.host("client")
    started = time.monotonic()
    sentinel = SentinelRedis(hosts).start()
    formed = time.monotonic() - started
    assert sentinel.master_address(client) == (hosts[0].addr, 6379)
    sentinel.sentinel_call(client, lambda s: s.master_for("mymaster").set("before", 1))
    hosts[0].kill_all()
    killed = time.monotonic()
    wait_for(
        lambda: sentinel.master_address(client)[0] != hosts[0].addr, 30, "a failover", every=0.1
    )
    failed_over = time.monotonic() - killed
    new_master = sentinel.master_address(client)
    assert new_master in {(h.addr, 6379) for h in hosts[1:]}

    def write_and_read(s: Sentinel) -> bytes | None:
        master = s.master_for("mymaster")
        master.set("after", 2)
        return master.get("before")  # replicated before the old master died

    assert sentinel.sentinel_call(client, write_and_read) == b"1"
    print(f"\nsentinel: formed in {formed:.1f} s, failed over in {failed_over:.1f} s "
          f"to {new_master[0]}")  # fmt: skip


@pytest.mark.slow
def test_a_three_primary_cluster_with_replicas_forms_and_serves_a_cluster_client(
    network: Network,
) -> None:
    hosts = [network.host(f"c{i}") for i in range(1, 7)]
    client = network.host("client")
    started = time.monotonic()
    cluster = ClusterRedis(hosts).start()
    formed = time.monotonic() - started
    roles = cluster.roles(client)
    assert sorted(roles.values()) == ["master"] * 3 + ["slave"] * 3

    def spread(rc: RedisCluster) -> list[int]:
        for i in range(60):
            rc.set(f"key{i}", i)  # each key to the primary owning its slot (MOVED followed)
        return [int(rc.get(f"key{i}")) for i in range(60)]

    assert cluster.cluster_call(client, spread) == list(range(60))
    per_primary = {
        address: node.call(lambda r: r.dbsize(), client)
        for node in cluster.nodes
        if roles[address := node.address] == "master"
    }
    assert len(per_primary) == 3 and all(count > 0 for count in per_primary.values())
    assert sum(per_primary.values()) == 60
    print(f"\ncluster: formed in {formed:.1f} s; keys per primary {per_primary}")
