"""A Sentinel failover under load, on loopback: a master, a replica and a sentinel on free ports,
a worker and a Streamer given the redis+sentinel:// URL, and a graceful ``SENTINEL FAILOVER``
while an open-loop load runs. Nothing is lost (every call ends in an answer or a typed error),
no answer is wrong, and service comes back by itself on the new master.

The multi-host version (the master's host killed) is tests/hosts/test_multihost.py's.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from broker.connections import sync_client
from broker.keys import ModelKeys
from broker.resp_lane import DRAIN_S
from tests.conftest import worker_process
from tests.hosts import load
from tests.hosts.services import MODEL, MODEL_NAME, figures
from tests.models import TAG_ENV
from tests.sentinel_local import LocalSentinel, log_tail

pytestmark = pytest.mark.slow

RATE, SECONDS, TIMEOUT = 60, 8.0, 5.0


def run_load(url: str, prefix: str, workdir: Path) -> dict[str, Any]:
    """tests/hosts/load.py's open-loop load (a Streamer on ``url``), in this process."""
    config = {
        "redis_url": url, "prefix": prefix, "model": MODEL_NAME, "targets": ["redis"],
        "rate": RATE, "seconds": SECONDS, "timeout": TIMEOUT, "tag": 7.0,
        "started_path": str(workdir / "load.started"), "out": str(workdir / "load.json"),
    }  # fmt: skip
    return asyncio.run(load.run(config))


def clients_left(setup: LocalSentinel, port: int) -> tuple[list[str], str]:
    """The product's connections still open to the Redis at ``port`` (not the sentinel's,
    replication's or this one), and that Redis' role."""
    with setup.node(port).client(socket_timeout=2) as client:
        clients = client.client_list(_type="normal")
        role = client.role()[0].decode()
    # (an idle connection of redis-py's pool whose last command was a counter's floor may
    # stay until the pool is next used: it carries corrections, never requests or replies)
    ours = [
        c
        for c in clients
        if not c["name"].startswith("sentinel-") and c["cmd"] not in ("client|list", "incrby")
    ]
    return [f"{c['addr']} {c['cmd']}" for c in ours], role


def test_a_graceful_failover_under_load_loses_nothing(prefix: str, tmp_path: Path) -> None:
    with LocalSentinel(replicas=1, sentinels=1) as setup:
        url = setup.url()
        keys = ModelKeys(MODEL_NAME, prefix)
        with worker_process(url, MODEL, prefix, "--heartbeat-ttl", "2", env={TAG_ENV: "1"}), \
                ThreadPoolExecutor(1) as pool:  # fmt: skip
            running = pool.submit(run_load, url, prefix, tmp_path)
            started_path = tmp_path / "load.started"
            deadline = time.monotonic() + 30
            while not started_path.exists():
                assert time.monotonic() < deadline and not running.done(), "no load"
                time.sleep(0.02)
            started = float(json.loads(started_path.read_text()))
            time.sleep(max(0.0, started + 2.5 - time.monotonic()))
            fault = time.monotonic()
            try:
                old, new = setup.failover()
            except TimeoutError:
                pytest.fail(f"the failover did not complete\n{log_tail(setup)}")
            switched = time.monotonic()
            # The old master still takes writes (Sentinel demotes it seconds later): the
            # worker's and the Streamer's connections must have left it by themselves, but
            # for those that drain it a while (non-blocking reads of what late writers put
            # there), which let go DRAIN_S after they left.
            time.sleep(max(0.0, switched + 2.5 - time.monotonic()))
            draining, _ = clients_left(setup, old)
            time.sleep(max(0.0, switched + 2.5 + DRAIN_S - time.monotonic()))
            left_behind, old_role = clients_left(setup, old)
            results = running.result(timeout=SECONDS + TIMEOUT + 60)
        dropped = sum(1 for c in results["calls"] if c["error"] == "DeadlineExceeded")
        numbers = figures(
            "sentinel-graceful-failover-loopback", results, {1.0}, fault,
            failover_s=round(switched - fault, 2), dropped_by_failover=dropped,
            clients_left_on_old_master=len(left_behind), old_master_role_then=old_role,
        )  # fmt: skip
        with sync_client(url) as client:
            master = client.role()[0]
            queue = (client.xlen(keys.stream), client.xpending(keys.stream, keys.group)["pending"])
    assert old != new and master == b"master"
    assert numbers.sent == RATE * SECONDS
    assert numbers.lost == 0 and numbers.wrong == 0
    assert all(c.split()[1] in ("lpop", "xreadgroup") for c in draining), draining
    assert left_behind == [], f"still on the old master ({old_role}): {left_behind}"
    # the only errors: fail-fast while no master was known; nothing the old master took after
    # the switch was left unread there (DeadlineExceeded)
    assert set(numbers.errors) <= {"BrokerUnavailable"}, numbers.errors
    assert numbers.recovery_s is not None and numbers.recovery_s < float("inf")
    # service came back by itself: every call sent once the failover was done (and the
    # connections had a second to follow it) was answered
    late = [c for c in results["calls"] if c["sent"] > switched + 2.0]
    assert late and all(c["error"] is None for c in late), [c for c in late if c["error"]][:3]
    assert queue == (0, 0)
