"""A Redis Cluster on namespace hosts (one node per host), the product given its
``redis+cluster://`` URL: the model's hash slot migrated under load, and the primary serving
it killed under load (its replica promoted). Two worker hosts, two gateway hosts and a client
host, as in test_multihost.py; each test prints one ``FIGURES`` line (docs/reliability.md)::

    .venv/bin/python -m pytest -q -s tests/hosts/test_cluster_hosts.py
"""

from __future__ import annotations

import time

import pytest

from broker.cluster_lane import key_slot
from broker.keys import ModelKeys
from tests.hosts.netns import Network
from tests.hosts.redis_topologies import ClusterRedis, wait_for
from tests.hosts.services import MODEL_NAME, Load, figures, queue_state
from tests.hosts.test_multihost import answered_by, build_stack

pytestmark = pytest.mark.slow


def test_the_model_s_slot_migrated_under_load_loses_nothing(network: Network, prefix: str) -> None:
    """Three primaries; while the load runs, the slot of every key of the model (stream,
    inboxes, heartbeats, counters) moves to another primary a key at a time, the way
    `redis-cli --cluster reshard` moves it, then back: callers and workers meet MOVED, ASK and
    TRYAGAIN, and follow them. Each move ends on the source 0.3 s before the others, a moment
    when the source and the target send every command of the slot to each other."""
    cluster = ClusterRedis([network.host(f"c{i}") for i in (1, 2, 3)], replicas=0).start()
    stack = build_stack(network, prefix, batch_delay=0.02, batch_size=16, redis=cluster)
    keys = ModelKeys(MODEL_NAME, prefix)
    slot = key_slot(keys.stream)
    home = cluster.owner(keys.stream, stack.client)
    away = next(node for node in cluster.nodes if node is not home)
    serving = [*stack.workers, *stack.gateways]
    pids = {host.name: sorted(host.pids()) for host in serving}
    load = Load(stack.client, cluster.url, prefix, stack.targets, rate=80, seconds=14, timeout=10)
    started = load.wait_started()
    time.sleep(max(0.0, started + 3.0 - time.monotonic()))
    moves: list[tuple[float, float, int]] = []  # (start, end, keys moved)
    for target in (away, home):
        begun = time.monotonic()
        count = cluster.migrate_slot(slot, target, stack.client, pause_s=0.05, ending_pause_s=0.3)
        moves.append((begun, time.monotonic(), count))
        assert cluster.owner(keys.stream, stack.client) is target
        time.sleep(2.0)
    results = load.result()
    calls = results["calls"]
    during = [c for c in calls if any(a <= c["sent"] <= b for a, b, _ in moves)]
    numbers = figures(
        "hosts-cluster-slot-migrated", results, {1.0, 2.0}, moves[0][0],
        link_delay=stack.delay(network), migrations=len(moves),
        keys_moved=[count for _, _, count in moves],
        migration_s=[round(b - a, 2) for a, b, _ in moves], calls_during_migration=len(during),
        answered_after_by=sorted({answered_by(c) for c in calls if c["sent"] > moves[-1][1]}),
    )  # fmt: skip
    assert all(count > 0 for _, _, count in moves), "the slot held no key to migrate"
    assert during, "no call was sent while the slot migrated"
    assert numbers.lost == 0 and numbers.wrong == 0
    # none refused either: TRYAGAIN and the MOVED back and forth while the nodes learn the
    # slot's new owner one at a time are waited out
    refused = [(c["target"], c["message"]) for c in calls if c["error"]]
    assert not refused, refused[:5]
    # and no worker or gateway process died and was restarted meanwhile
    assert {host.name: sorted(host.pids()) for host in serving} == pids
    assert numbers.answered + sum(numbers.errors.values()) == numbers.sent == 14 * 80
    assert queue_state(cluster, prefix) == (0, 0, 0)


def test_the_primary_of_the_model_killed_under_load_fails_over_and_loses_nothing(
    network: Network, prefix: str
) -> None:
    """Three primaries with a replica each (six hosts). The host of the primary serving the
    model's slot dies (every process on it) under load; its replica is promoted by the other
    primaries' vote, and every worker, gateway and caller moves to it by itself."""
    cluster = ClusterRedis([network.host(f"c{i}") for i in range(1, 7)], node_timeout_ms=1000)
    cluster.start()
    stack = build_stack(network, prefix, batch_delay=0.05, batch_size=16, redis=cluster)
    keys = ModelKeys(MODEL_NAME, prefix)
    old = cluster.owner(keys.stream, stack.client)
    serving = [*stack.workers, *stack.gateways]
    pids = {host.name: sorted(host.pids()) for host in serving}
    load = Load(stack.client, cluster.url, prefix, stack.targets, rate=80, seconds=14, timeout=8)
    started = load.wait_started()
    time.sleep(max(0.0, started + 3.0 - time.monotonic()))
    killed = old.host.kill_all()
    fault = time.monotonic()
    promoted = wait_for(
        lambda: cluster.owner(keys.stream, stack.client) is not old, 30, "the failover",
        every=0.05,
    )  # fmt: skip
    new = cluster.owner(keys.stream, stack.client)
    results = load.result()
    calls = results["calls"]
    dropped = [c for c in calls if c["error"] == "DeadlineExceeded"]
    numbers = figures(
        "hosts-cluster-primary-killed", results, {1.0, 2.0}, fault,
        link_delay=stack.delay(network), processes_killed=len(killed), failover_s=promoted,
        replication_dropped=len(dropped), new_primary=new.host.name,
    )  # fmt: skip
    assert new.host is not old.host and old.host.pids() == []
    assert numbers.lost == 0 and numbers.wrong == 0
    assert numbers.answered + sum(numbers.errors.values()) == numbers.sent == 14 * 80
    allowed = {"BrokerUnavailable", "DeadlineExceeded", "QueueFull"}
    assert set(numbers.errors) <= allowed, numbers.errors
    assert all(c["sent"] < fault for c in dropped), [c for c in dropped if c["sent"] >= fault]
    late = [c for c in calls if c["sent"] > fault + promoted + 3.0]
    assert late and all(c["error"] is None for c in late), [c for c in late if c["error"]][:5]
    assert numbers.recovery_s is not None and numbers.recovery_s < float("inf")
    assert {host.name: sorted(host.pids()) for host in serving} == pids
    assert queue_state(cluster, prefix) == (0, 0, 0)
