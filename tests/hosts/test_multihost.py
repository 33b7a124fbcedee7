"""Many hosts, really: Redis, two worker hosts, two gateway hosts and a client host, each its own
network namespace (tests/hosts/netns.py), the product's real commands on each.

The client host runs the load generator (tests/hosts/load.py): open-loop single-item calls,
spread over a Streamer talking to Redis and the two gateways over HTTP. Every input is distinct
and every answer is checked against its own input, and says which worker host computed it.
Each test prints one ``FIGURES`` line (docs/reliability.md carries them)::

    .venv/bin/python -m pytest -q -s tests/hosts/test_multihost.py

*lost*: a call that ended with neither an answer nor a typed error; *recovery_s*: from the
fault to the first right answer after it; *takeover_s*: from the fault to the answer of the
last item the faulty host held; *dup_replies*: replies the client's inbox got twice and dropped.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest

from broker.resp_lane import FOLLOW_EVERY_S
from tests.hosts.netns import Host, Network
from tests.hosts.redis_topologies import RedisTopology, SentinelRedis, SingleRedis, wait_for
from tests.hosts.services import (
    Load,
    by_index,
    figures,
    held_entries,
    held_inputs,
    queue_state,
    start_gateway,
    start_worker,
    still_pending,
    wait_for_gateway,
    wait_for_workers,
    worker_consumers,
)

pytestmark = pytest.mark.slow

HEARTBEAT_TTL = "2"  # a dead or cut-off worker host is noticed after 2 s


@dataclass
class Stack:
    redis: RedisTopology
    workers: list[Host]
    gateways: list[Host]
    bases: list[str]
    client: Host

    @property
    def targets(self) -> list[str]:
        """Where the load goes, call after call: the Streamer, then each gateway."""
        return ["redis", *self.bases]

    def delay(self, network: Network) -> str:
        return f"{network.delay_method}:{network.delay_s * 1000:g}ms"


def build_stack(
    network: Network, prefix: str, batch_delay: float, batch_size: int = 8,
    redis: RedisTopology | None = None,
) -> Stack:  # fmt: skip
    """Redis (one on its host, unless another topology, started, is given), two worker hosts
    (tags 1 and 2), two gateway hosts and a client host, running."""
    if redis is None:
        redis = SingleRedis(network.host("redis")).start()
    workers = [network.host("w1"), network.host("w2")]
    gateways = [network.host("gw1"), network.host("gw2")]
    client = network.host("client")
    for tag, host in enumerate(workers, start=1):
        args = ("--heartbeat-ttl", HEARTBEAT_TTL, "--batch-size", str(batch_size))
        start_worker(host, redis.url, prefix, tag, *args, batch_delay=batch_delay)
    bases = [start_gateway(host, redis.url, prefix) for host in gateways]
    wait_for_workers(redis, prefix, 2)
    for base in bases:
        wait_for_gateway(base, client)
    return Stack(redis, workers, gateways, bases, client)


def answered_by(call: dict[str, Any]) -> float:
    """The tag of the worker host that answered a call (0 if it got no answer)."""
    output = call["output"]
    return float(output[2]) if call["error"] is None and isinstance(output, list) else 0.0


def test_two_worker_hosts_and_two_gateway_hosts_answer_every_call_right(
    network: Network, prefix: str
) -> None:
    stack = build_stack(network, prefix, batch_delay=0.0)
    before = time.monotonic()
    load = Load(
        stack.client, stack.redis.url, prefix, stack.targets, rate=100, seconds=6, timeout=10
    )
    results = load.result()
    relay = stack.redis.nodes[0].relay.stats(fresh_after=time.monotonic())
    calls = results["calls"]
    per_target = {t: sum(1 for c in calls if c["target"] == t) for t in stack.targets}
    peers = relay["peers"]
    client_trips = peers.get(stack.client.addr, {}).get("round_trips", 0)
    gateway_trips = sum(peers.get(h.addr, {}).get("round_trips", 0) for h in stack.gateways)
    worker_trips = sum(peers.get(h.addr, {}).get("round_trips", 0) for h in stack.workers)
    hosts_used = sorted({answered_by(c) for c in calls} - {0.0})
    numbers = figures(
        "hosts-topology", results, {1.0, 2.0}, link_delay=stack.delay(network),
        worker_hosts_used=hosts_used,
        streamer_round_trips_per_call=round(client_trips / per_target["redis"], 2),
        gateway_round_trips_per_call=round(
            gateway_trips / sum(per_target[b] for b in stack.bases), 2
        ),
        worker_round_trips_per_item=round(worker_trips / len(calls), 2),
        redis_commands=relay["total"]["command_count"],
        load_s=round(results["ended"] - results["started"], 2),
    )  # fmt: skip
    assert before < results["started"]
    assert numbers.lost == 0 and numbers.wrong == 0 and numbers.errors == {}
    assert numbers.answered == numbers.sent == 600
    assert hosts_used == [1.0, 2.0], "both worker hosts should have computed some"
    for target in stack.targets:  # the Streamer and both gateways answered their share
        assert per_target[target] == 200
    assert client_trips > 0 and gateway_trips > 0  # the relay saw each caller host's traffic
    assert queue_state(stack.redis, prefix) == (0, 0, 0)


def hold_then(stack: Stack, prefix: str, victim: Host, want: int = 4) -> list[str]:
    """Wait until ``victim``'s workers hold ``want`` items (for up to 5 s, then any will do, for
    up to 5 s more); return their consumers."""
    consumers = worker_consumers(stack.redis, prefix, victim)
    assert consumers, f"no consumer of the model runs on {victim}"
    deadline = time.monotonic() + 5.0
    wait_for(
        lambda: len(held_inputs(stack.redis, prefix, consumers))
        >= (want if time.monotonic() < deadline else 1),
        10.0, f"{victim} to hold items", every=0.01,
    )  # fmt: skip
    return consumers


def frozen_holding(stack: Stack, prefix: str, victim: Host) -> tuple[list[str], list[int]]:
    """Wait until ``victim`` holds items (:func:`hold_then`), then stop (SIGSTOP) its processes
    while it still does, so that the fault that follows finds them held: a 0.1 s batch could
    end between the check and a kill or a cut (seen: "holding nothing"). Returns its consumers
    and the pids stopped (SIGCONT them, or kill them)."""
    for _ in range(5):
        consumers = hold_then(stack, prefix, victim)
        pids = victim.pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        if held_inputs(stack.redis, prefix, consumers):
            return consumers, pids
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"{victim} never held items when stopped")


def test_a_worker_host_killed_under_load_loses_nothing(network: Network, prefix: str) -> None:
    stack = build_stack(network, prefix, batch_delay=0.1, batch_size=16)
    victim = stack.workers[0]
    load = Load(
        stack.client, stack.redis.url, prefix, stack.targets, rate=80, seconds=10, timeout=15
    )
    started = load.wait_started()
    time.sleep(max(0.0, started + 3.0 - time.monotonic()))
    consumers, _ = frozen_holding(stack, prefix, victim)
    killed = victim.kill_all()
    fault = time.monotonic()
    held = held_inputs(stack.redis, prefix, consumers)  # nobody else can claim them for 2 s
    results = load.result()
    calls = by_index(results)
    takeover = max(calls[i]["done"] for i in held) - fault if held else float("nan")
    numbers = figures(
        "hosts-kill-worker-host", results, {1.0, 2.0}, fault, link_delay=stack.delay(network),
        processes_killed=len(killed), held_by_victim=len(held), takeover_s=takeover,
        answered_after_fault_by=sorted(
            {answered_by(c) for c in results["calls"] if c["sent"] > fault} - {0.0}
        ),
    )  # fmt: skip
    assert len(killed) >= 2 and victim.pids() == []  # the supervisor and its worker, at least
    assert held, "the host was killed holding nothing"
    assert numbers.lost == 0 and numbers.wrong == 0 and numbers.errors == {}
    assert numbers.answered == numbers.sent == 800
    for i in held:  # each item the dead host held was answered by the other one
        assert answered_by(calls[i]) == 2.0, calls[i]
    assert queue_state(stack.redis, prefix) == (0, 0, 0)
    assert all(gateway.pids() for gateway in stack.gateways)


def test_a_worker_host_cut_off_and_healed_is_taken_over_without_a_wrong_answer(
    network: Network, prefix: str
) -> None:
    stack = build_stack(network, prefix, batch_delay=0.1, batch_size=16)
    victim = stack.workers[0]
    load = Load(
        stack.client, stack.redis.url, prefix, stack.targets, rate=80, seconds=14, timeout=15
    )
    started = load.wait_started()
    time.sleep(max(0.0, started + 3.0 - time.monotonic()))
    consumers, frozen = frozen_holding(stack, prefix, victim)
    pids = sorted(frozen)
    victim.link_down()
    cut = time.monotonic()
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    time.sleep(0.3)  # what was in flight when the cable was pulled is lost or stuck
    entries = held_entries(stack.redis, prefix, consumers)
    held = sorted(entries.values())
    # heal once the other host has taken over and answered all of them (bounded)
    taken = wait_for(
        lambda: not still_pending(stack.redis, prefix, list(entries)), 20, "the takeover",
        every=0.05,
    )  # fmt: skip
    victim.link_up()
    healed = time.monotonic()
    results = load.result()
    calls = by_index(results)
    takeover = max(calls[i]["done"] for i in held) - cut if held else float("nan")
    back = [c["done"] for c in results["calls"] if c["sent"] > healed and answered_by(c) == 1.0]
    numbers = figures(
        "hosts-cut-worker-host", results, {1.0, 2.0}, cut, link_delay=stack.delay(network),
        held_by_cut_host=len(held), takeover_s=takeover, cut_s=healed - cut,
        cut_host_serving_again_s=min(back) - healed if back else None,
        cut_host_processes_unchanged=sorted(victim.pids()) == pids,
    )  # fmt: skip
    assert held, "the host was cut off holding nothing"
    assert taken < 20
    assert numbers.lost == 0 and numbers.wrong == 0 and numbers.errors == {}
    assert numbers.answered == numbers.sent == 14 * 80
    for i in held:  # answered by the other host (unless answered before the cut), whose
        # answer came first: the cut host's, sent after healing, is a duplicate reply
        assert answered_by(calls[i]) == 2.0 or calls[i]["done"] < cut, calls[i]
    assert sorted(victim.pids()) == pids, "a process of the cut-off host died or restarted"
    assert back, "the cut-off host never answered again after the link was healed"
    assert queue_state(stack.redis, prefix) == (0, 0, 0)


@pytest.mark.parametrize("lag", [0.0, 0.3], ids=["killed", "host-lost-replicas-behind"])
def test_the_sentinel_master_s_host_killed_under_load_fails_over_and_loses_nothing(
    network: Network, prefix: str, lag: float
) -> None:
    """A Sentinel trio (master and two replicas, a sentinel on each of their hosts); the
    product is given the redis+sentinel:// URL. The master's host dies (every process on it:
    Redis, its relay, its sentinel) under load; the two other sentinels promote a replica, and
    every worker, gateway and caller moves to it by itself.

    With ``lag``, the host is lost as in a power cut (its cable pulled as its processes die:
    no FIN or RST reaches anyone, its connections just go silent), and the replicas are that
    far behind when it goes (their hosts cut off that long before, plugged back after): the
    writes of that window are lost with the master, as asynchronous replication allows, and
    their callers end with DeadlineExceeded."""
    sentinel = SentinelRedis([network.host(f"redis{i}") for i in (1, 2, 3)]).start()
    stack = build_stack(network, prefix, batch_delay=0.05, batch_size=16, redis=sentinel)
    old = sentinel.master_node(stack.client)
    replicas = [node.host for node in sentinel.nodes if node is not old]
    serving = [*stack.workers, *stack.gateways]
    pids = {host.name: sorted(host.pids()) for host in serving}
    load = Load(stack.client, sentinel.url, prefix, stack.targets, rate=80, seconds=14, timeout=8)
    started = load.wait_started()
    time.sleep(max(0.0, started + 3.0 - time.monotonic()))
    try:
        if lag:
            for host in replicas:
                host.link_down()
            time.sleep(lag)
            old.host.link_down()  # a host that dies says nothing more: not even its kernel
        killed = old.host.kill_all()
        fault = time.monotonic()
    finally:
        if lag:
            for host in replicas:
                host.link_up()
    promoted = wait_for(
        lambda: sentinel.master_address(stack.client)[0] != old.host.addr, 30, "the failover",
        every=0.05,
    )  # fmt: skip
    new = sentinel.master_node(stack.client)
    results = load.result()
    calls = results["calls"]
    dropped = [c for c in calls if c["error"] == "DeadlineExceeded"]
    name = "host-lost-replicas-behind" if lag else "killed"
    numbers = figures(
        f"hosts-sentinel-master-{name}", results, {1.0, 2.0}, fault,
        link_delay=stack.delay(network), processes_killed=len(killed), failover_s=promoted,
        replication_dropped=len(dropped), new_master=new.host.name,
    )  # fmt: skip
    assert new.host is not old.host and old.host.pids() == []
    assert numbers.lost == 0 and numbers.wrong == 0
    assert numbers.answered + sum(numbers.errors.values()) == numbers.sent == 14 * 80
    # fail-fast while no master was known, the calls whose writes the dead master took
    # without passing them on (asynchronous replication): sent before it died, and refusals
    # of the model's queue bound while the backlog of the outage was over it
    allowed = {"BrokerUnavailable", "DeadlineExceeded", "QueueFull"}
    assert set(numbers.errors) <= allowed, numbers.errors
    # Killed, the host's kernel resets every connection: only calls already sent are dropped.
    # Lost silently (lag), nothing tells anyone: until the sentinels name the new master and
    # each connection asks them again (once a second), writes still go to the dead master and
    # are dropped with it, as its unreplicated writes are.
    blind = promoted + FOLLOW_EVERY_S if lag else 0.0
    assert all(c["sent"] < fault + blind for c in dropped), [
        c for c in dropped if c["sent"] >= fault + blind
    ]
    if lag:  # the calls in flight when it died had written only to the master
        assert dropped, "no write was lost with the master, though the replicas lagged"
    # back by itself: every call sent once the failover was done (and connections had 3 s
    # to follow it) was answered right, or refused at once while the outage's backlog still
    # held the queue over its bound; the last 2 s of calls were all answered right
    late = [c for c in calls if c["sent"] > fault + promoted + 3.0]
    assert late and all(c["error"] in (None, "QueueFull") for c in late), [
        c for c in late if c["error"] not in (None, "QueueFull")
    ][:5]
    last = [c for c in calls if c["sent"] > results["started"] + 14 - 2.0]
    assert last and all(c["error"] is None for c in last), [c for c in last if c["error"]][:5]
    assert numbers.recovery_s is not None and numbers.recovery_s < float("inf")
    # no process on a worker or gateway host died, hung or was restarted
    assert {host.name: sorted(host.pids()) for host in serving} == pids
    assert queue_state(sentinel, prefix) == (0, 0, 0)
