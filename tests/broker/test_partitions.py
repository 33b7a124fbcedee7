"""Partitioned queues: a model's queue spread over several streams, each in its own hash slot."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis

from broker import (
    BrokerUnavailable,
    DeadlineExceeded,
    QueueFull,
    Streamer,
    acl,
    admin,
    codec,
    functions,
)
from broker import client as client_module
from broker.client import ClientCore
from broker.keys import HIGH, MAX_PARTITIONS, ModelKeys
from broker.memory_transport import InMemoryTransport
from broker.partition_reads import PartitionReads
from broker.partitions import split_bound, tag, untag
from broker.protocol import CallRequests, decode_reply, request_fields
from broker.redis_transport import RedisTransport
from broker.transport import UNBOUNDED
from gpu_worker.batching import BatchLoop, BatchSettings
from tests.broker.test_broker_cli import broker_cli
from tests.conftest import wait_for_consumers, worker_process
from tests.models import DELAY_ENV


def slot_tag(key: str) -> str:
    """The text Redis Cluster hashes a key by (between its first '{' and the next '}')."""
    return key[key.index("{") + 1 : key.index("}")]


# -- keys and names ----------------------------------------------------------------------------
def test_partition_zero_keeps_the_model_keys_and_the_others_get_a_slot_of_their_own() -> None:
    keys = ModelKeys("toy", "demo", partitions=3)
    assert keys.stream == "mb:{demo:toy}:requests" == ModelKeys("toy", "demo").stream
    two = keys.of(2)
    assert two.stream == "mb:{demo:toy:p2}:requests"
    for key in (two.stream, two.queued_bytes, two.queue_bound, two.consumers, two.cancelled,
                two.dead_letters, two.heartbeat("w-1"), two.inbox("c1"),
                two.at(HIGH).inbox("c1")):  # fmt: skip
        assert slot_tag(key) == "demo:toy:p2" == two.tag
    # the count stays in the model's slot; each partition has inboxes of its own
    assert two.partitions_key == keys.partitions_key == "mb:{demo:toy}:partitions"
    assert keys.inbox("c1") == ModelKeys("toy", "demo").inbox("c1") == "mb:{demo:toy}:inbox:c1"
    assert two.inbox("c1") == "mb:{demo:toy:p2}:inbox:c1" == two.at(HIGH).inbox("c1")
    assert two.reply_namespaces == ("mb:{demo:toy:p2}:inbox:", "mb:{demo:toy}:inbox:")
    assert keys.reply_namespaces == ("mb:{demo:toy}:inbox:",)
    # partition 2's entries may be answered in its own inboxes or the model's, nothing else
    assert two.may_reply_to("mb:{demo:toy}:inbox:c1")
    assert two.may_reply_to("mb:{demo:toy:p2}:inbox:c1")
    assert two.at(HIGH).may_reply_to("mb:{demo:toy:p2}:inbox:c1")
    for elsewhere in ("mb:{demo:toy:p1}:inbox:c1", "mb:{demo:toy:p22}:inbox:c1",
                      "mb:{demo:toy:p2}:inbox:", "mb:{demo:toy}:inbox:",
                      "mb:{demo:toyx:p2}:inbox:c1", "mb:{demo:other:p2}:inbox:c1",
                      "mb:{demox:toy:p2}:inbox:c1", two.stream, two.at(HIGH).stream):  # fmt: skip
        assert not two.may_reply_to(elsewhere), elsewhere
    assert not keys.may_reply_to("mb:{demo:toy:p2}:inbox:c1")  # partition 0: the model's only
    assert not keys.of(1).may_reply_to("mb:{demo:toy:p2}:inbox:c1")
    assert [k.partition for k in keys.each()] == [0, 1, 2]
    with pytest.raises(ValueError):
        keys.of(3)
    with pytest.raises(ValueError):
        ModelKeys("toy", "demo", partitions=0)


def test_entry_ids_carry_their_partition_and_bounds_split_rounding_up() -> None:
    assert tag("17-0", 0) == "17-0" and untag("17-0") == ("17-0", 0)
    assert tag("17-0", 3) == "17-0@3" and untag("17-0@3") == ("17-0", 3)
    assert split_bound(10, 3) == 4 and split_bound(0, 3) == 0 and split_bound(8, 1) == 8


# -- the in-memory transport behaves the same --------------------------------------------------
def test_in_memory_partitions_are_read_oldest_first_acked_and_withdrawn_per_partition() -> None:
    async def scenario() -> None:
        transport = InMemoryTransport()
        keys = ModelKeys("toy", "mem", partitions=3)
        await transport.ensure_group(keys)
        ids = []
        for k in (2, 0, 1, 2):
            call = CallRequests("mb:{mem:toy}:inbox:c", 1000, [f"r{k}"], [b"x"], None)
            [outcome] = await transport.enqueue(keys.of(k), [call], UNBOUNDED)
            assert isinstance(outcome, list)
            ids.append(tag(outcome[0], k))
        batch = await transport.read_batch(keys, "w", 3, 10)
        assert [entry_id for entry_id, _ in batch] == ids[:3]  # oldest first, any partition
        await transport.cancel(keys.of(2), [(untag(ids[0])[0], 1)])  # read: marked, not deleted
        assert await transport.withdrawn(keys, ids) == {ids[0]}
        await transport.finish(keys, [], batch, 60)
        assert [e for e, _ in await transport.read_batch(keys, "w", 3, 10)] == [ids[3]]

    asyncio.run(scenario())


def test_a_core_follows_the_partition_count_with_an_inbox_and_a_reader_per_partition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One partition: one inbox, one reader, as ever. The count raised, calls name the core's
    inbox in their partition's namespace, each read by a reader of its own; lowered again,
    calls name the one inbox, and the other readers retire once idle."""
    monkeypatch.setattr(client_module, "PARTITIONS_EVERY_S", 0.0)
    monkeypatch.setattr(client_module, "REPLY_WAIT_S", 0.05)

    async def scenario() -> None:
        transport = InMemoryTransport()
        keys = ModelKeys("toy", "mem")
        served = keys.spread(3)
        named: list[str] = []
        enqueue = transport.enqueue

        async def noting(queue: ModelKeys, calls: Any, bound: Any) -> Any:
            named.extend(call.reply_key for call in calls)
            return await enqueue(queue, calls, bound)

        transport.enqueue = noting  # type: ignore[method-assign]
        worker = BatchLoop(lambda items: items, transport, served, "w", BatchSettings(block_ms=5))
        serving = asyncio.ensure_future(worker.run())
        core = ClientCore(keys, transport, asyncio.get_running_loop())
        try:
            assert await core.call([codec.encode(0)], 5) == [0]
            assert named == [core.inbox] and set(core._readers) <= {core.inbox}
            transport.partition_counts[keys.partitions_key] = 3
            named.clear()
            await core.call([codec.encode(1)], 5)  # the count is read again as it goes out
            calls = [core.call([codec.encode(i)], 5) for i in range(6)]
            assert await asyncio.gather(*calls) == [[i] for i in range(6)]
            inboxes = {served.of(k).inbox(core.client_id) for k in range(3)}
            assert set(named[-6:]) == inboxes  # in turn: each partition's inbox
            transport.partition_counts[keys.partitions_key] = 1
            await core.call([codec.encode(7)], 5)
            named.clear()
            assert await core.call([codec.encode(8)], 5) == [8]
            assert named == [core.inbox]
            for _ in range(100):  # the partition inboxes' readers retire once idle
                if set(core._readers) <= {core.inbox}:
                    break
                await asyncio.sleep(0.02)
            assert set(core._readers) <= {core.inbox}
        finally:
            await core.aclose()
            worker.stop()
            await serving

    asyncio.run(scenario())


def test_partition_reads_keep_what_came_and_never_hand_out_more_than_asked() -> None:
    async def scenario() -> None:
        # ids as the reads hand them: tagged with their lane
        queued = {0: [("5-0", {}), ("9-0", {})], 1: [("7-0@1", {})], 2: []}
        failing = asyncio.Event()

        async def read(partition: int, count: int, block_ms: int, poll_s: float) -> list[Any]:
            if partition == 2:
                await failing.wait()
                raise BrokerUnavailable("gone")
            got, queued[partition] = queued[partition][:count], queued[partition][count:]
            return got

        reads = PartitionReads(3, read)
        first = await reads.take(2, 50)
        await asyncio.sleep(0)
        second = await reads.take(2, 50)
        assert len(first) == 2  # never more than asked for: the rest is kept
        assert [e for e, _ in first + second] == ["5-0", "7-0@1", "9-0"]  # oldest first
        assert await reads.take(2, 20) == []  # partition 2's read is still in flight
        failing.set()
        with pytest.raises(BrokerUnavailable):
            await reads.take(2, 50)
        await reads.close()

    asyncio.run(scenario())


def test_partition_reads_forget_what_a_partition_set_aside_brought() -> None:
    """What reads of a partition set aside brought (either level) is dropped, the rest kept."""

    async def scenario() -> None:
        queued = {0: [("5-0", {}), ("9-0", {})], 1: [("6-0@1", {}), ("7-0@1h", {})]}

        async def read(partition: int, count: int, block_ms: int, poll_s: float) -> list[Any]:
            got, queued[partition] = queued[partition], []  # (more than asked: all kept)
            return got

        reads = PartitionReads(2, read)
        taken = await reads.take(1, 50)
        await asyncio.sleep(0)  # both reads have come back
        assert len(taken + reads.held()) == 4
        reads.forget(1)
        assert reads.held() and all("@" not in entry_id for entry_id in reads.held())
        rest = [entry_id for entry_id, _ in await reads.take(5, 50)]
        assert sorted(rest + [entry_id for entry_id, _ in taken if "@" not in entry_id]) == [
            "5-0",
            "9-0",
        ]
        await reads.close()

    asyncio.run(scenario())


# -- over Redis ---------------------------------------------------------------------------------
def entries_added(client: redis.Redis, keys: ModelKeys) -> list[int]:
    """How many entries each partition's stream was ever given (XINFO STREAM)."""
    return [int(client.xinfo_stream(part.stream)["entries-added"]) for part in keys.each()]


def queued_items(client: redis.Redis, keys: ModelKeys) -> int:
    """Items in one partition's stream: its entries and the items multi-item entries hold
    beyond their first (docs/protocol.md, section 5.1)."""
    return int(client.xlen(keys.stream)) + int(client.get(keys.packed_items) or 0)


def test_items_are_spread_over_the_partitions_and_every_one_is_answered(
    redis_server: Any, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix, partitions=3)
    client = redis.Redis.from_url(redis_server.url)
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--partitions", "3"):
        assert client.get(keys.partitions_key) == b"3"
        # one entry per item, so that the entries added show how the calls were spread
        with Streamer("toy", redis_url=redis_server.url, prefix=prefix, entry_items=1) as streamer:
            futures = [streamer.submit([f"a{i}", f"b{i}"]) for i in range(30)]
            for i, future in enumerate(futures):
                assert [out["item"] for out in future.result(timeout=30)] == [f"a{i}", f"b{i}"]
            assert streamer.predict(["one"])[0]["item"] == "one"
        added = entries_added(client, keys)
        assert sum(added) == 61 and all(count >= 20 for count in added)  # calls in turn
        state = admin.status(client, prefix)
        [model] = state
        assert [p.partition for p in model.partitions] == [0, 1, 2]
        assert model.stream_length == 0 and model.pending == 0 and model.queued_bytes == 0
        # the bound of each partition is its share of the model's (8 x batch_size 8 = 64)
        assert {p.queue_bound_items for p in model.partitions} == {22}
        shown = broker_cli("status", "--redis", redis_server.url, "--prefix", prefix)
        assert shown.returncode == 0 and "partitions" in shown.stdout
        assert shown.stdout.count(prefix) == 1 + 3 + 1  # the model, its partitions, a worker
        as_json = json.loads(
            broker_cli("status", "--redis", redis_server.url, "--prefix", prefix, "--json").stdout
        )
        assert [p["stream"] for p in as_json[0]["partitions"]] == [
            part.stream for part in keys.each()
        ]


def test_a_batch_merges_what_several_partitions_hold_up_to_batch_size(
    redis_server: Any, prefix: str, tmp_path: Path
) -> None:
    """Twelve items queued on three partitions while the worker computes: its next batches
    take from several partitions at once, up to the batch size. (A take returns once any
    partition's read has brought entries: on a loaded machine the first read's reply can be
    handled before the others arrive, and that batch holds one partition's alone, as designed;
    so up to three rounds, one of which must merge.)"""
    keys = ModelKeys("toy", prefix, partitions=3)
    client = redis.Redis.from_url(redis_server.url)
    args = ("--partitions", "3", "--batch-size", "8")
    rounds: list[list[int]] = []
    with (
        worker_process(redis_server.url, "tests.models:Toy", prefix, *args),
        Streamer("toy", redis_url=redis_server.url, prefix=prefix) as streamer,
    ):
        for attempt in range(3):
            release = tmp_path / f"release-{attempt}"
            deadline = time.monotonic() + 30
            while sum(queued_items(client, part) for part in keys.each()):  # the last round's
                assert time.monotonic() < deadline
                time.sleep(0.01)
            blocker = streamer.submit([{"until": str(release)}])
            while not _computing(client, keys):  # the worker computes it, alone
                assert time.monotonic() < deadline
                time.sleep(0.01)
            futures = [streamer.submit([i]) for i in range(12)]  # 4 on each partition
            while sum(queued_items(client, part) for part in keys.each()) < 13:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            release.touch()
            assert blocker.result(timeout=30)[0]["batch"] == 1
            sizes = [future.result(timeout=30)[0]["batch"] for future in futures]
            rounds.append(sizes)
            assert max(sizes) <= 8, sizes
            if max(sizes) > 4:  # more than any one partition held
                break
    assert max(rounds[-1]) > 4, rounds


def test_a_stopping_worker_answers_what_its_partition_reads_delivered(
    redis_server: Any, prefix: str, tmp_path: Path
) -> None:
    # While the worker computes, its reads of the other partitions stay in flight and take
    # what arrives; stopped then, it answers those entries too instead of leaving them
    # pending with no other worker to take them over.
    keys = ModelKeys("toy", prefix, partitions=3)
    client = redis.Redis.from_url(redis_server.url)
    release = tmp_path / "release"
    args = ("--partitions", "3", "--batch-size", "2")
    with (
        worker_process(redis_server.url, "tests.models:Toy", prefix, *args) as worker,
        Streamer("toy", redis_url=redis_server.url, prefix=prefix) as streamer,
    ):
        started = tmp_path / "started"
        blocker = streamer.submit([{"until": str(release), "started": str(started)}])
        deadline = time.monotonic() + 30
        while not started.exists():  # computing alone: what comes next waits for it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        futures = [streamer.submit([i]) for i in range(6)]
        while _pending(client, keys) < 2:  # delivered to the reads in flight
            assert time.monotonic() < deadline
            time.sleep(0.01)
        worker.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        release.touch()
        assert blocker.result(timeout=30)[0]["batch"] == 1
        worker.wait(30)
        delivered = [f for f in futures if f.done() and f.exception() is None]
        assert len(delivered) >= 2 and all(f.result()[0]["batch"] <= 2 for f in delivered)
    assert _pending(client, keys) == 0  # nothing left held by the stopped worker


def test_the_queue_bound_holds_per_partition(redis_server: Any, prefix: str) -> None:
    keys = ModelKeys("toy", prefix, partitions=2)
    client = redis.Redis.from_url(redis_server.url)
    # a worker stores the count and each partition's share of the bound (4 of 8); they stay
    # when it stops, and with no live worker one worker's worth is queued
    args = ("--partitions", "2", "--max-queue-items", "8")
    with worker_process(redis_server.url, "tests.models:Toy", prefix, *args):
        pass
    assert client.hget(keys.of(1).queue_bound, "items") == b"4"
    streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
    with streamer:
        futures = [streamer.submit([i], timeout=4) for i in range(10)]
        too_big = streamer.submit(list(range(5)), timeout=4)  # more than a partition's share
        queued: list[int] = []
        until = time.monotonic() + 3  # while the accepted calls wait (read before their deadline)
        while queued != [4, 4] and time.monotonic() < until:
            queued = [queued_items(client, part) for part in keys.each()]
            time.sleep(0.01)
        assert queued == [4, 4]
        outcomes = [_outcome(future) for future in futures]
        assert outcomes.count("QueueFull") == 2 and outcomes.count("DeadlineExceeded") == 8
        assert _outcome(too_big) == "QueueFull"
    # at their deadline the expired calls' items were withdrawn
    until = time.monotonic() + 5
    while any(queued_items(client, part) for part in keys.each()) and time.monotonic() < until:
        time.sleep(0.05)
    assert [queued_items(client, part) for part in keys.each()] == [0, 0]


def _outcome(future: Future[Any]) -> str:
    try:
        future.result(timeout=30)
    except (QueueFull, DeadlineExceeded) as exc:
        return type(exc).__name__
    return "answered"


def test_cancelled_calls_are_withdrawn_from_their_own_partitions(
    redis_server: Any, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix, partitions=3)
    client = redis.Redis.from_url(redis_server.url)
    client.set(keys.partitions_key, 3)  # as a worker would store it: callers follow it
    streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
    with streamer:
        futures = [streamer.submit([i, i], timeout=30) for i in range(6)]
        deadline = time.monotonic() + 30
        while sum(queued_items(client, part) for part in keys.each()) < 12:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [queued_items(client, part) for part in keys.each()] == [4, 4, 4]
        for future in futures:
            future.cancel()
        while sum(client.xlen(part.stream) for part in keys.each()) > 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert [int(client.get(part.queued_bytes) or 0) for part in keys.each()] == [0, 0, 0]
    assert [int(client.get(part.packed_items) or 0) for part in keys.each()] == [0, 0, 0]
    assert [client.zcard(part.cancelled) for part in keys.each()] == [0, 0, 0]


def test_a_foreign_client_enqueues_to_partition_k_and_gets_its_reply(
    redis_server: Any, prefix: str
) -> None:
    """A caller written from docs/protocol.md alone: read the count, FCALL mb_enqueue with
    partition k's keys (normal or high level), BLPOP a reply key in partition k's inbox
    namespace, or in the model's (partition 0's) as a caller with one inbox does."""
    client = redis.Redis.from_url(redis_server.url)
    functions.load(client)  # (as an operator would have)
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--partitions", "3"):
        count = int(client.get(f"mb:{{{prefix}:toy}}:partitions") or 1)
        assert count == 3
        for k in range(count):
            tag_k = f"{prefix}:toy" if k == 0 else f"{prefix}:toy:p{k}"
            for level in ("", ":high"):
                own = f"mb:{{{tag_k}}}:inbox:foreign-{k}{level}"
                keys = [f"mb:{{{tag_k}}}:{kind}{level}" for kind in ("requests", "queued-bytes")]
                keys += [f"mb:{{{tag_k}}}:{kind}" for kind in ("queue-bound", "consumers")]
                for reply_key in (own, f"mb:{{{prefix}:toy}}:inbox:one-inbox-{k}{level}"):
                    data = msgpack.packb({"k": k})
                    request_id = f"req-{k}{level}-{reply_key[-12:]}"
                    [result] = client.fcall(
                        "mb_enqueue", 4, *keys, 1, 0, 0, 1, reply_key, 10000, "", request_id, data
                    )
                    assert result[0] == 0
                    popped = client.blpop([reply_key], timeout=10)
                    assert popped is not None
                    reply = decode_reply(popped[1])
                    assert reply.request_id == request_id and reply.ok
                    assert reply.result["item"] == {"k": k}


def test_replies_only_to_the_partition_s_inboxes_or_the_model_s(
    redis_server: Any, prefix: str
) -> None:
    """An entry of partition k may name an inbox of partition k or of the model (partition
    0); one naming another partition's inbox, another model's (of any partition) or a bare
    namespace is dead-lettered unanswered, and nothing is written to that key."""
    keys = ModelKeys("toy", prefix, partitions=3)
    one, two = keys.of(1), keys.of(2)
    other = ModelKeys("other", prefix, partitions=3)
    client = redis.Redis.from_url(redis_server.url)
    answered = {  # (lane keys, reply key)
        "own": (one, one.inbox("c")),
        "model": (one, keys.inbox("c")),
        "high-own": (one.at(HIGH), one.inbox("h")),
        "p0": (keys, keys.inbox("p0")),
    }
    refused = {
        "sibling": (one, two.inbox("c")),
        "sibling-high": (one.at(HIGH), two.inbox("h")),
        "p0-to-p1": (keys, one.inbox("c")),
        "other-model": (one, other.of(1).inbox("c")),
        "other-model-0": (one, other.inbox("c")),
        "bare": (one, one.reply_namespace),
        "stream": (one, two.stream),
    }
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--partitions", "3"):
        for name, (lane, reply_key) in {**answered, **refused}.items():
            fields = request_fields(name, reply_key, 10_000, codec.encode(name))
            client.xadd(lane.stream, fields)  # type: ignore[arg-type]
        for name, (_, reply_key) in answered.items():
            popped = client.blpop([reply_key], timeout=10)
            assert popped is not None, name
            reply = decode_reply(popped[1])
            assert reply.request_id == name and reply.ok and reply.result["item"] == name
        deadline = time.monotonic() + 30
        while sum(client.xlen(part.dead_letters) for part in keys.lanes()) < len(refused):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    for name, (lane, reply_key) in refused.items():
        letters = {fields[b"id"].decode(): fields for _, fields in client.xrange(lane.dead_letters)}
        namespaces = " or ".join(f"{n}*" for n in lane.reply_namespaces)
        reason = f"reply key outside this model's inboxes ({namespaces})"
        assert letters[name][b"dead_reason"].decode() == reason, name
        if reply_key != two.stream:
            assert not client.exists(reply_key), name
    assert client.xlen(two.stream) == 0  # nothing was written to it
    assert client.xlen(keys.of(1).dead_letters) == 5


class _Recording(RedisTransport):
    """A caller's transport that notes the inboxes replies came from."""

    def __init__(self, url: str, popped: list[str]) -> None:
        super().__init__(url)
        self.popped = popped

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        got = await super().pop_replies(inbox, count, timeout_s)
        self.popped += [inbox] * len(got)
        return got


def test_a_call_queued_to_partition_k_names_the_caller_s_inbox_in_k_s_namespace(
    redis_server: Any, prefix: str
) -> None:
    """The Python client: a call on partition k (either level) names its inbox in partition
    k's namespace, whose reader gets its replies; once idle, the readers retire."""
    keys = ModelKeys("toy", prefix, partitions=3)
    client = redis.Redis.from_url(redis_server.url)
    client.set(keys.partitions_key, 3)  # as a worker would store it: callers follow it
    popped: list[str] = []

    class Recorded(Streamer):
        def _make_transport(self) -> RedisTransport:
            return _Recording(self.redis_url, popped)

    with Recorded("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True) as st:
        futures = [
            st.submit([i, i], timeout=30, priority="high" if i % 2 else "normal") for i in range(12)
        ]
        deadline = time.monotonic() + 30
        while sum(client.xlen(part.stream) for part in keys.lanes()) < 24:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        clients = set()
        for part in keys.lanes():
            entries = client.xrange(part.stream)
            assert entries, part.stream  # each level of each partition got calls
            for _, fields in entries:
                reply = fields[b"reply"].decode()
                assert reply.startswith(part.reply_namespace), (part.stream, reply)
                clients.add(reply.removeprefix(part.reply_namespace))
        assert len(clients) == 1  # one client: its inbox in each partition's namespace
        [client_id] = clients
        with worker_process(redis_server.url, "tests.models:Toy", prefix, "--partitions", "3"):
            for i, future in enumerate(futures):
                assert [out["item"] for out in future.result(timeout=30)] == [i, i]
        assert sorted(set(popped)) == sorted(part.inbox(client_id) for part in keys.each())
        assert len(popped) == 24
        core = st._thread_core
        assert core is not None
        while core._readers:  # each reader retires after one idle wait
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_the_acl_users_pop_and_push_every_partition_s_inboxes(
    redis_server: Any, prefix: str
) -> None:
    """The users `broker acl` prints: the gateway may BLMPOP, and the worker's mb_reply may
    TYPE, PTTL, RPUSH and EXPIRE, the inboxes of every partition (ACL DRYRUN); the worker
    may not RPUSH to a stream, and neither may touch another prefix's inboxes."""
    lines, _ = acl.render([prefix], environ={})
    admin_client = redis_server.client()
    names = []
    try:
        for line in lines:
            _, name, rules = line.split(" ", 2)
            names.append(name)
            admin_client.execute_command(
                "ACL", "SETUSER", name, *re.findall(r"\([^)]*\)|\S+", rules)
            )
        keys = ModelKeys("toy", prefix, partitions=3)

        def dryrun(user: str, *command: str) -> bytes:
            return admin_client.execute_command("ACL", "DRYRUN", f"{prefix}-{user}", *command)

        for part in keys.lanes():
            inbox = part.inbox("c1")
            assert dryrun("gateway", "BLMPOP", "1", "1", inbox, "LEFT") == b"OK", inbox
            for command in (("TYPE", inbox), ("PTTL", inbox), ("RPUSH", inbox, "r"),
                            ("EXPIRE", inbox, "60")):  # fmt: skip
                assert dryrun("worker", *command) == b"OK", command
            assert dryrun("worker", "RPUSH", part.stream, "r") != b"OK"
            theirs = ModelKeys("toy", f"{prefix}x", part.partition, 3).inbox("c1")  # a tenant's
            assert dryrun("gateway", "BLMPOP", "1", "1", theirs, "LEFT") != b"OK"
            assert dryrun("worker", "RPUSH", theirs, "r") != b"OK"
    finally:
        for name in names:
            if name != "default":
                admin_client.acl_deluser(name)
        admin_client.close()


def test_an_entry_dead_lettered_in_partition_k_is_listed_and_replayed_there(
    redis_server: Any, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix, partitions=2)
    client = redis.Redis.from_url(redis_server.url)
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--partitions", "2"):
        # an entry whose reply key is no inbox of the model: dead-lettered unanswered
        fields = {"v": "1", "id": "odd", "reply": "elsewhere", "timeout": "5000", "data": b"\xc0"}
        client.xadd(keys.of(1).stream, fields)  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while not client.xlen(keys.of(1).dead_letters):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert client.xlen(keys.dead_letters) == 0
        [letter] = admin.dead_letters(client, admin.model_keys(client, "toy", prefix))
        assert letter.partition == 1 and letter.dead_id.endswith("@1")
        assert letter.request_id == "odd" and letter.entry_id.endswith("@1")
    # replayed onto its own partition's stream (no worker now: it stays queued there)
    assert admin.replay_dead_letters(client, keys, [letter.dead_id]).replayed == 1
    assert (client.xlen(keys.stream), client.xlen(keys.of(1).stream)) == (0, 1)
    assert client.xlen(keys.of(1).dead_letters) == 0


@pytest.mark.slow
def test_a_worker_killed_mid_batch_with_partitions_loses_nothing(
    redis_server: Any, prefix: str, tmp_path: Path
) -> None:
    keys = ModelKeys("toy", prefix, partitions=3)
    client = redis.Redis.from_url(redis_server.url)
    args = (
        "--partitions",
        "3",
        "--heartbeat-ttl",
        "2",
        "--batch-size",
        "4",
        "--max-queue-items",
        "0",
    )
    env = {DELAY_ENV: "0.2"}  # each batch takes a while: a worker dies holding some
    with (
        worker_process(redis_server.url, "tests.models:Toy", prefix, *args, env=env),
        worker_process(
            redis_server.url, "tests.models:Toy", prefix, *args, env=env, expect_consumers=2
        ) as second,
    ):
        victim = _children(second.pid)[0]
        consumer = next(
            name.decode() for name in client.zrange(keys.consumers, 0, -1)
            if name.decode().endswith(f"-{victim}")
        )  # fmt: skip
        # entries of up to a batch's items: enough entries that both workers get some
        # (80 calls sent together would otherwise fill only a few large entries)
        with Streamer("toy", redis_url=redis_server.url, prefix=prefix, entry_items=4) as streamer:
            futures = [streamer.submit([f"x{i}"], timeout=60) for i in range(80)]
            deadline = time.monotonic() + 30
            while not _holds(client, keys, consumer):  # in the middle of a batch
                assert time.monotonic() < deadline
                time.sleep(0.005)
            held = _held_items(client, keys, consumer)
            os.kill(victim, signal.SIGKILL)
            results = [future.result(timeout=60) for future in futures]
        assert [r[0]["item"] for r in results] == [f"x{i}" for i in range(80)]
        by_item = {r[0]["item"]: r[0] for r in results}
        # what it held when it died was computed again by the other worker
        assert held and any(by_item[item]["pid"] != victim for item in held)
        wait_for_consumers(redis_server.url, keys, 2)
    assert sum(client.xlen(part.stream) for part in keys.each()) == 0


def _computing(client: redis.Redis, keys: ModelKeys) -> bool:
    """Whether a worker of the model is computing a batch (as its supervisor vouches)."""
    return any(c.current_batch for c in admin.model_status(client, keys).consumers)


def _pending(client: redis.Redis, keys: ModelKeys) -> int:
    """How many entries the model's workers hold, over every partition."""
    held = 0
    for part in keys.each():
        with contextlib.suppress(redis.ResponseError):  # no group yet
            summary: Any = client.xpending(part.stream, "workers")
            held += int(summary["pending"])
    return held


def _holds(client: redis.Redis, keys: ModelKeys, consumer: str) -> bool:
    for part in keys.each():
        try:
            pending: Any = client.xpending_range(part.stream, "workers", "-", "+", 1, consumer)
        except redis.ResponseError:
            continue
        if pending:
            return True
    return False


def _held_items(client: redis.Redis, keys: ModelKeys, consumer: str) -> list[Any]:
    """The items a consumer holds, in every partition: delivered to it, not answered."""
    items = []
    for part in keys.each():
        pending: Any = client.xpending_range(part.stream, "workers", "-", "+", 1000, consumer)
        for row in pending:
            for _, fields in client.xrange(part.stream, row["message_id"], row["message_id"]):
                if b"n" in fields:  # a multi-item entry (docs/protocol.md, section 5.1)
                    n = int(fields[b"n"])
                    items += [codec.decode(fields[b"data.%d" % i]) for i in range(n)]
                else:
                    items.append(codec.decode(fields[b"data"]))
    return items


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def test_a_lanes_keys_are_made_once_and_name_the_same_keys_as_fresh_ones() -> None:
    keys = ModelKeys("toy", "demo", partitions=3)
    for lane in (1, 2, MAX_PARTITIONS, MAX_PARTITIONS + 2):
        other = keys.of(lane)
        assert other is keys.of(lane)
        fresh = ModelKeys("toy", "demo", lane % MAX_PARTITIONS, 3, lane // MAX_PARTITIONS)
        assert other == fresh and other.lane == lane
        for name in ("stream", "cancelled", "queued_bytes", "packed_items", "answered", "tag"):
            assert getattr(other, name) == getattr(fresh, name)
        assert other.reply_namespaces == fresh.reply_namespaces
    assert keys.of(1).stream != keys.of(2).stream != keys.at(HIGH).stream
    with pytest.raises(ValueError):
        keys.of(5)  # no partition 5 of 3
