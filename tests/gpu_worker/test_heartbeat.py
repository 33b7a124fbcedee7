"""Heartbeats against a real Redis: the supervisor's pruning of the model's expiry-scored sets."""

from __future__ import annotations

import logging
import time

import pytest

from broker.connections import sync_client
from broker.devserver import RedisServer
from broker.keys import HIGH, ModelKeys
from gpu_worker.heartbeat import Heartbeats


def test_the_supervisor_prunes_expired_marks_that_no_withdrawal_would_prune(
    redis_server: RedisServer, prefix: str
) -> None:
    """After the last withdrawal, the cancelled and withdrawn sets kept their members for good
    (callers prune them only when they withdraw again), and nothing ever pruned the answered
    set: a burst of cancelled calls left its marks in Redis for good. The supervisor's
    renewals now remove the expired ones (at most once a minute), each lane's and the
    model's, and leave the members still to expire."""
    url = redis_server.url
    keys = ModelKeys("m", prefix, partitions=2)
    client = sync_client(url)
    now_ms = int(time.time() * 1000)
    past, future = now_ms - 1000, now_ms + 600_000
    lanes = keys.lanes()
    assert len(lanes) == 4  # two partitions, two levels each
    for lane in lanes:
        client.zadd(lane.cancelled, {"1-0": past, "2-0#3": past})
        client.zadd(lane.answered, {"3-0#0": past})
    client.zadd(keys.withdrawn, {"old.1": past, "new.2": future})
    kept = lanes[1].at(HIGH).cancelled  # partition 1's high level
    client.zadd(kept, {"4-0": future})
    child = Heartbeats(url, keys)  # a child's first renewal (no queue bound) prunes nothing
    supervisor = Heartbeats(url, keys, queue_bound=(8, 0))
    try:
        assert child.renew({"w": {}})
        assert client.zcard(keys.withdrawn) == 2
        assert all(client.exists(lane.cancelled, lane.answered) == 2 for lane in lanes)

        assert supervisor.renew({"w": {}})
        assert client.zrange(keys.withdrawn, 0, -1) == [b"new.2"]
        assert client.zrange(kept, 0, -1) == [b"4-0"]
        emptied = [lane.cancelled for lane in lanes if lane.cancelled != kept]
        emptied += [lane.answered for lane in lanes]
        assert client.exists(*emptied) == 0  # emptied sets are gone, not left empty

        client.zadd(keys.withdrawn, {"old.3": past})
        assert supervisor.renew({"w": {}})  # within the minute: not again
        assert client.zcard(keys.withdrawn) == 2
        supervisor._prune.reset()
        assert supervisor.renew({"w": {}})
        assert client.zrange(keys.withdrawn, 0, -1) == [b"new.2"]
    finally:
        child.close()
        supervisor.close()
        client.close()


def test_heartbeats_refused_to_the_user_say_so_not_that_redis_is_unreachable(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis_server.client()
    user = f"nobeat-{prefix}"
    admin.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-set")
    beats = Heartbeats(redis_server.url.replace("redis://", f"redis://{user}:pw@"),
                       ModelKeys("m", prefix))  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="microbatch.heartbeat"):
            assert not beats.renew({"w": {}})
        (record,) = caplog.records
        assert record.getMessage().startswith(
            "cannot renew heartbeats (Redis refused them to this user): "
        )
    finally:
        beats.close()
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


def test_a_worker_started_with_fewer_partitions_than_in_use_warns(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Lowering --partitions by a rolling restart, under load, lost every call queued to the
    dropped partitions once the last worker reading them stopped (DeadlineExceeded), and the
    new worker said nothing. It now warns at start while a live worker still reads more
    partitions, or while the dropped ones hold entries, and says to drain first."""
    url = redis_server.url
    old = Heartbeats(url, ModelKeys("m", prefix, partitions=2), queue_bound=(8, 0))
    same = Heartbeats(url, ModelKeys("m", prefix, partitions=2), queue_bound=(8, 0))
    new = Heartbeats(url, ModelKeys("m", prefix, partitions=1), queue_bound=(8, 0))
    try:
        assert old.renew({"old-worker": {}})
        with caplog.at_level(logging.WARNING, logger="microbatch.heartbeat"):
            same.warn_if_partitions_lowered()
            assert not caplog.records
            new.warn_if_partitions_lowered()
        [record] = caplog.records
        message = record.getMessage()
        assert "--partitions 1" in message and "2 partitions" in message
        assert "a live worker reads them" in message and "drain" in message

        old.retire("old-worker")  # the old worker stopped, leaving entries in partition 1
        sync_client(url).xadd(ModelKeys("m", prefix, partition=1, partitions=2).stream, {"a": 1})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="microbatch.heartbeat"):
            new.warn_if_partitions_lowered()
        [record] = caplog.records
        assert "hold 1 entries" in record.getMessage()
    finally:
        for heartbeats in (old, same, new):
            heartbeats.close()
