"""Multi-item stream entries (wire v2): packing in mb_enqueue, items read, answered, withdrawn,
bounded and acknowledged one by one, on a real Redis with real workers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import msgpack
import pytest
import redis

from broker import Streamer, codec
from broker.devserver import RedisServer
from broker.errors import QueueFull
from broker.keys import ModelKeys
from broker.multi_item import (
    ItemAcks,
    check_entry_items,
    data_size,
    expand,
    item_count,
    split,
)
from broker.protocol import CallRequests, parse_request
from broker.redis_transport import RedisTransport
from broker.reply_elements import decode_any
from broker.transport import UNBOUNDED, QueueBound
from tests.conftest import wait_until, worker_process


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


def calls_of(keys: ModelKeys, client: str, items: list[object], timeout_ms: int = 30_000):  # type: ignore[no-untyped-def]
    """One call per item, as concurrent single-item calls of one client."""
    return [
        CallRequests(keys.inbox(client), timeout_ms, [f"{client}.{i}"], [codec.encode(item)])
        for i, item in enumerate(items)
    ]


async def enqueue(url: str, keys: ModelKeys, calls, entry_items: int = 32, bound=UNBOUNDED):  # type: ignore[no-untyped-def]
    transport = RedisTransport(url, entry_items=entry_items)
    try:
        return await transport.enqueue(keys, calls, bound)
    finally:
        await transport.close()


def replies(client, inbox: str, count: int, timeout: float = 30.0) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The next ``count`` replies on an inbox, by request id (results, or error type names)."""
    got: dict[str, object] = {}
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        popped = client.blpop([inbox], timeout=1)
        for reply in decode_any(popped[1]) if popped else ():
            got[reply.request_id] = reply.result if reply.ok else reply.error_type  # type: ignore[union-attr]
    return got


def pending(client, keys: ModelKeys) -> int:  # type: ignore[no-untyped-def]
    """Entries read and not acknowledged (0 until the workers made their group)."""
    try:
        return int(client.xpending(keys.stream, keys.group)["pending"])
    except redis.ResponseError:  # NOGROUP: the worker has not made it yet
        return 0


# -- reading an entry as its items ------------------------------------------------------------
def test_a_v2_entry_reads_as_v1_items_each_with_its_own_fields() -> None:
    fields = {
        b"v": b"2", b"reply": b"mb:{p:m}:inbox:c", b"n": b"2", b"deadline": b"99",
        b"id.0": b"c.1", b"timeout.0": b"100", b"data.0": b"\x01",
        b"id.1": b"c.2", b"timeout.1": b"5", b"data.1": b"\x02\x03",
        b"traceparent.1": b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }  # fmt: skip
    assert item_count(fields) == 2
    items = split("1000-0", fields, 2)
    assert [entry_id for entry_id, _ in items] == ["1000-0#0", "1000-0#1"]
    first, second = (parse_request(*item) for item in items)
    assert (first.request_id, first.data, first.deadline_ms) == ("c.1", b"\x01", 99)
    assert (second.request_id, second.data, second.deadline_ms) == ("c.2", b"\x02\x03", 99)
    assert second.traceparent and first.traceparent is None
    assert first.arrival_ms == 1000 and first.reply_key == "mb:{p:m}:inbox:c"


def _v2(count: int, **extra: bytes) -> dict[bytes, bytes]:
    fields = {b"v": b"2", b"reply": b"mb:{p:m}:inbox:c", b"n": b"%d" % count}
    for i in range(count):
        fields |= {b"id.%d" % i: b"c.%d" % i, b"timeout.%d" % i: b"50", b"data.%d" % i: b"x" * i}
    return fields | {name.replace("_", ".").encode(): value for name, value in extra.items()}


@pytest.mark.parametrize(
    "fields",
    [
        _v2(3),  # as mb_enqueue writes an entry without trace contexts: the plain way
        _v2(3, traceparent_1=b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        _v2(3, deadline=b"77"),
        {k: v for k, v in _v2(3).items() if k != b"timeout.2"},  # an item lacks a field
        {k: v for k, v in _v2(3).items() if k != b"data.0"} | {b"other": b"y"},
        {k: v for k, v in _v2(3).items() if k != b"reply"} | {b"other": b"y"},
    ],
)
def test_splitting_reads_every_field_an_item_has_and_no_other(fields: dict[bytes, bytes]) -> None:
    """Every way of splitting gives each item exactly its own fields and the shared ones."""
    items = split("9-0", fields, 3)
    for index, (entry_id, item) in enumerate(items):
        assert entry_id == f"9-0#{index}"
        expected = {b"v": b"1"}
        for name in (b"reply", b"deadline"):
            if name in fields:
                expected[name] = fields[name]
        for name in (b"id", b"timeout", b"data", b"traceparent"):
            if name + b".%d" % index in fields:
                expected[name] = fields[name + b".%d" % index]
        assert item == expected and list(item) == list(expected)
    acks = ItemAcks()
    expand([("9-0", fields)], acks)  # hands the entry out with its data bytes counted
    assert acks.settle(["9-0#0", "9-0#1", "9-0#2"]).released == data_size(fields, 3)


def test_settling_items_of_entries_interleaved_completes_each_entry_once() -> None:
    acks = ItemAcks()
    fields = {b"data.0": b"ab", b"data.1": b"c"}
    for entry_id in ("1-0", "2-0", "4-0"):
        acks.hand_out(entry_id, fields, 2)  # type: ignore[arg-type]
    ids = ["1-0#0", "2-0#0", "1-0#x", "9-9#0", "4-0#7", "1-0#1", "3-3", "2-0#0"]
    assert acks.settle(ids) == (["3-3"], ["1-0"], 3, 1, ["2-0#0"], [])
    assert acks.settle(["2-0#1"]) == ([], ["2-0"], 3, 1, [], ["2-0#0", "2-0#1"])
    # none of 4-0's items was answered above: none is marked, so none is unmarked
    assert acks.settle(["4-0#1", "4-0#0"]) == ([], ["4-0"], 3, 1, [], [])


@pytest.mark.parametrize("n", [b"0", b"513", b"-1", b"x", b"", b"99999"])
def test_a_v2_entry_without_a_valid_count_is_not_split(n: bytes) -> None:
    assert item_count({b"v": b"2", b"n": n}) is None
    assert item_count({b"v": b"1", b"n": b"2"}) is None


@pytest.mark.parametrize("n", [b"2", b"02", b"00002", b"0" * 40 + b"2"])
def test_a_count_of_ascii_digits_is_read_whatever_its_leading_zeros(n: bytes) -> None:
    """docs/protocol.md, section 5.1: `n` is ASCII digits, 1 to 512. A worker in another
    language reading it so served "00002" as 2 items, where this one answered ProtocolError."""
    assert item_count({b"v": b"2", b"n": n}) == 2


def test_entry_items_is_checked() -> None:
    assert check_entry_items(1) == 1
    for bad in (0, 513):
        with pytest.raises(ValueError, match="items per entry"):
            check_entry_items(bad)
        with pytest.raises(ValueError):
            RedisTransport("redis://127.0.0.1:1/0", entry_items=bad)


def test_an_entry_is_acknowledged_with_its_last_item_only() -> None:
    acks = ItemAcks()
    fields = {b"data.0": b"ab", b"data.1": b"c", b"data.2": b""}
    acks.hand_out("5-0", fields, 3)  # type: ignore[arg-type]
    # answered items of an open entry are to be marked; the entry done, its marks removed
    assert acks.settle(["5-0#0", "1-1"]) == (["1-1"], [], 0, 0, ["5-0#0"], [])
    assert acks.settle(["5-0#0", "5-0#2"]) == ([], [], 0, 0, ["5-0#2"], [])
    marks = ["5-0#0", "5-0#1", "5-0#2"]
    assert acks.settle(["5-0#1"]) == ([], ["5-0"], 3, 2, [], marks)
    assert acks.settle(["5-0#1"]) == ([], [], 0, 0, [], []) and not len(acks)
    # answered in one go: nothing to mark or unmark (unless handed out again)
    acks.hand_out("6-0", fields, 2)  # type: ignore[arg-type]
    assert acks.settle(["6-0#1", "6-0#0"]) == ([], ["6-0"], 3, 1, [], [])
    acks.hand_out("7-0", fields, 2, again=True)  # type: ignore[arg-type]
    assert acks.settle(["7-0#0", "7-0#1"]) == ([], ["7-0"], 3, 1, [], ["7-0#0", "7-0#1"])


# -- mb_enqueue packs, the worker answers each item ---------------------------------------------
def test_calls_sent_together_share_an_entry_and_each_is_answered(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    calls = calls_of(keys, "c", [f"x{i}" for i in range(70)])
    handles = run(enqueue(redis_server.url, keys, calls, entry_items=32))
    assert [len(h) for h in handles] == [1] * 70  # type: ignore[arg-type]
    entries = client.xrange(keys.stream)
    assert [int(fields[b"n"]) for _, fields in entries] == [32, 32, 6]
    assert handles[33] == [f"{entries[1][0].decode()}#1"]
    assert int(client.get(keys.packed_items)) == 67
    assert int(client.get(keys.queued_bytes)) == sum(len(c.payloads[0]) for c in calls)
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--batch-size", "8"):
        got = replies(client, keys.inbox("c"), 70)
        assert {rid: out["item"] for rid, out in got.items()} == {  # type: ignore[index]
            f"c.{i}": f"x{i}" for i in range(70)
        }
        assert max(out["batch"] for out in got.values()) == 8  # type: ignore[index]
        wait_until(lambda: client.xlen(keys.stream) == 0, 10, "the entries' acks")
    assert int(client.get(keys.packed_items)) == 0
    assert int(client.get(keys.queued_bytes)) == 0
    assert pending(client, keys) == 0


def test_entry_items_1_writes_v1_entries_and_a_lone_item_is_v1(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    run(enqueue(redis_server.url, keys, calls_of(keys, "c", ["a", "b"]), entry_items=1))
    run(enqueue(redis_server.url, keys, calls_of(keys, "d", ["lone"])))
    assert [fields[b"v"] for _, fields in client.xrange(keys.stream)] == [b"1"] * 3
    assert int(client.get(keys.packed_items) or 0) == 0


def test_calls_with_other_reply_keys_get_entries_of_their_own(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix)
    calls = calls_of(keys, "a", [1, 2]) + calls_of(keys, "b", [3, 4, 5]) + calls_of(keys, "a", [6])
    run(enqueue(redis_server.url, keys, calls))
    entries = redis_server.client().xrange(keys.stream)
    assert [(f[b"v"], f.get(b"n")) for _, f in entries] == [
        (b"2", b"2"), (b"2", b"3"), (b"1", None)
    ]  # fmt: skip


def test_a_packed_entry_holds_each_items_own_fields_in_order_across_calls(
    redis_server: RedisServer, prefix: str
) -> None:
    """Items of several calls (and of none that was refused between them) in one entry: each
    with its own request id, data, its call's timeout and its call's traceparent (if any)."""
    keys = ModelKeys("toy", prefix)
    inbox = keys.inbox("c")
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    t = trace.encode()
    calls = [
        CallRequests(inbox, 1000, ["a.0", "a.1"], [b"A0", b"A1"], trace),
        CallRequests(inbox, 2000, ["r.0", "r.1", "r.2"], [b"R0", b"R1", b"R2"]),  # past the bound
        CallRequests(inbox, 3000, ["b.0"], [b"B0"]),
        CallRequests(keys.inbox("other"), 4000, ["o.0"], [b"O0"], trace),
    ]
    handles = run(enqueue(redis_server.url, keys, calls, bound=QueueBound(max_items=4)))
    assert isinstance(handles[1], QueueFull)
    entries = redis_server.client().xrange(keys.stream)
    assert [fields for _, fields in entries] == [
        {
            b"v": b"2", b"reply": inbox.encode(), b"n": b"3",
            b"id.0": b"a.0", b"timeout.0": b"1000", b"data.0": b"A0", b"traceparent.0": t,
            b"id.1": b"a.1", b"timeout.1": b"1000", b"data.1": b"A1", b"traceparent.1": t,
            b"id.2": b"b.0", b"timeout.2": b"3000", b"data.2": b"B0",
        },
        {
            b"v": b"1", b"id": b"o.0", b"reply": keys.inbox("other").encode(),
            b"timeout": b"4000", b"data": b"O0", b"traceparent": t,
        },
    ]  # fmt: skip
    first, lone = (entry_id.decode() for entry_id, _ in entries)
    assert handles[0] == [f"{first}#0", f"{first}#1"]
    assert handles[2] == [f"{first}#2"]
    assert handles[3] == [lone]


def test_the_item_bound_counts_the_items_of_packed_entries(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix)
    queued = run(enqueue(redis_server.url, keys, calls_of(keys, "c", list(range(10)))))
    assert all(isinstance(h, list) for h in queued)
    assert redis_server.client().xlen(keys.stream) == 1
    more = run(enqueue(redis_server.url, keys, calls_of(keys, "d", [1, 2]), bound=QueueBound(11)))
    assert isinstance(more[0], list) and isinstance(more[1], QueueFull)


def test_a_malformed_item_fails_alone_and_a_failing_item_does_not_fail_its_entry_mates(
    redis_server: RedisServer, prefix: str
) -> None:
    """A foreign client's v2 entry: item 1 has no data (ProtocolError), item 2 makes the model
    raise (ModelError, after bisection), items 0 and 3 are answered."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    inbox = keys.inbox("f")
    client.xadd(keys.stream, {
        "v": "2", "reply": inbox, "n": "4",
        "id.0": "f.0", "timeout.0": "30000", "data.0": codec.encode("ok0"),
        "id.1": "f.1", "timeout.1": "30000",
        "id.2": "f.2", "timeout.2": "30000", "data.2": codec.encode({"fail": "boom"}),
        "id.3": "f.3", "timeout.3": "30000", "data.3": codec.encode("ok3"),
    })  # fmt: skip
    client.incrby(keys.packed_items, 3)
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        got = replies(client, inbox, 4)
        wait_until(lambda: client.xlen(keys.stream) == 0, 10, "the entry's ack")
    assert got["f.0"]["item"] == "ok0" and got["f.3"]["item"] == "ok3"  # type: ignore[index]
    assert got["f.1"] == "ProtocolError" and got["f.2"] == "ModelError"
    assert int(client.get(keys.packed_items)) == 0


def test_a_v2_entry_queued_without_its_counts_leaves_no_counter_below_zero(
    redis_server: RedisServer, prefix: str
) -> None:
    """A foreign client that XADDs without the INCRBYs of docs/protocol.md: its entry's release
    took both counters below zero, and a packed-items count below zero let as many later items
    past the queue bound."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    inbox = keys.inbox("f")
    client.xadd(keys.stream, {
        "v": "2", "reply": inbox, "n": "3",
        **{f"{field}.{k}": value for k in range(3) for field, value in (
            ("id", f"f.{k}"), ("timeout", "30000"), ("data", codec.encode(f"ok{k}")))},
    })  # fmt: skip
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        assert len(replies(client, inbox, 3)) == 3
        wait_until(lambda: client.xlen(keys.stream) == 0, 10, "the entry's ack")
        counters = (keys.packed_items, keys.queued_bytes)
        wait_until(lambda: all(int(client.get(key) or 0) == 0 for key in counters), 10, "the floor")


def test_a_v2_entry_without_a_valid_count_is_dead_lettered(
    redis_server: RedisServer, prefix: str
) -> None:
    """... and the bytes its caller counted, as docs/protocol.md says, are released with it
    (the release counted only a `data` field, which such an entry has not)."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    data = codec.encode("x" * 100)
    client.xadd(keys.stream, {"v": "2", "reply": keys.inbox("f"), "n": "0", "id.0": "f.0",
                              "data.0": data, "data.1": data})  # fmt: skip
    client.incrby(keys.queued_bytes, 2 * len(data))
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        wait_until(lambda: client.xlen(keys.dead_letters) == 1, 20, "the dead letter")
        assert client.xlen(keys.stream) == 0
        assert int(client.get(keys.queued_bytes)) == 0


def test_the_dead_letters_of_an_entry_s_items_do_not_copy_a_huge_shared_field(
    redis_server: RedisServer, prefix: str
) -> None:
    """Each item of a v2 entry whose reply key is no inbox was dead-lettered with the whole
    shared reply field: 0.19 MiB written by a caller became 112 MiB in Redis (n = 512)."""
    from broker.admin import DEAD_FIELDS
    from broker.redis_transport import DEAD_FIELD_BYTES

    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    n, huge = 64, "x" * 100_000
    client.xadd(keys.stream, {
        "v": "2", "reply": huge, "n": str(n),
        **{f"{field}.{k}": value for k in range(n) for field, value in (
            ("id", f"f.{k}"), ("timeout", "30000"), ("data", codec.encode("d" * 2000)))},
    })  # fmt: skip
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        wait_until(lambda: client.xlen(keys.dead_letters) == n, 20, "the dead letters")
    for _, record in client.xrange(keys.dead_letters):
        assert record[b"reply"] == huge[:DEAD_FIELD_BYTES].encode()
        assert record[b"dead_cut"] == b"reply" and b"dead_cut" in DEAD_FIELDS
        assert record[b"data"] == codec.encode("d" * 2000)  # the item's own data, whole
        assert record[b"dead_reason"].startswith(b"reply key outside this model's inboxes")


def test_a_withdrawn_call_in_a_shared_entry_is_not_computed(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """Three calls in one entry, the middle one withdrawn before any worker runs: the others
    are computed (as a batch of two) and answered; the withdrawn item never reaches the model."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()

    async def scenario() -> list[object]:
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        # the first call's round trip carries it alone; the next three go together
        first = asyncio.ensure_future(streamer.apredict(["first"], timeout=60))
        await asyncio.sleep(0.2)
        tasks = [asyncio.ensure_future(streamer.apredict([f"x{i}"], timeout=60)) for i in range(3)]
        await asyncio.sleep(0.5)
        tasks[1].cancel()
        await asyncio.sleep(0.5)
        assert client.zcard(keys.cancelled) == 1
        with worker_process(redis_server.url, "tests.models:Toy", prefix):
            done = await asyncio.gather(first, tasks[0], tasks[2])
        streamer.close()
        return done

    first, a, c = run(scenario())
    assert [first[0]["item"], a[0]["item"], c[0]["item"]] == ["first", "x0", "x2"]  # type: ignore[index]
    assert a[0]["batch"] == 3  # type: ignore[index]  # with "first": x1 was not computed
    (member,) = client.zrange(keys.cancelled, 0, -1)
    assert member.decode().endswith("#1")
    assert client.xlen(keys.stream) == 0 and int(client.get(keys.queued_bytes)) == 0


def test_the_streamer_packs_concurrent_calls(redis_server: RedisServer, prefix: str) -> None:
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()

    async def burst(streamer: Streamer) -> list[object]:
        return await asyncio.gather(*(streamer.apredict([i]) for i in range(60)))

    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--batch-size", "16"):
        with Streamer("toy", redis_url=redis_server.url, prefix=prefix) as streamer:
            out = run(burst(streamer))
            assert [r[0]["item"] for r in out] == list(range(60))  # type: ignore[index]
        added = int(client.xinfo_stream(keys.stream)["entries-added"])
        assert added < 60  # calls sent while a round trip was in flight shared entries
        with Streamer("toy", redis_url=redis_server.url, prefix=prefix, entry_items=1) as plain:
            run(burst(plain))
        assert int(client.xinfo_stream(keys.stream)["entries-added"]) == added + 60


@pytest.mark.slow
def test_an_entry_taken_over_from_a_killed_worker_is_split_and_every_item_answered(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """A worker killed (SIGKILL) while it computes a v2 entry's items: a live worker splits
    the entry into one v1 entry per item, keeping their deadlines, and answers all of them."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    release = tmp_path / "release"
    items: list[object] = [{"until": str(release)}] + [f"x{i}" for i in range(1, 5)]
    args = ("--heartbeat-ttl", "1")
    log = tmp_path / "survivor.log"
    with worker_process(redis_server.url, "tests.models:Toy", prefix, *args) as doomed:
        run(enqueue(redis_server.url, keys, calls_of(keys, "k", items, timeout_ms=120_000)))
        wait_until(lambda: pending(client, keys) == 1, 20, "the worker's read")
        children = Path(f"/proc/{doomed.pid}/task/{doomed.pid}/children").read_text().split()
        for pid in [*map(int, children), doomed.pid]:  # the whole `worker start`, at once
            os.kill(pid, signal.SIGKILL)
        doomed.wait()
    release.touch()
    with worker_process(redis_server.url, "tests.models:Toy", prefix, *args, log_path=log):
        got = replies(client, keys.inbox("k"), 5, timeout=60)
        wait_until(lambda: client.xlen(keys.stream) == 0, 20, "the acks")
    assert sorted(got) == [f"k.{i}" for i in range(5)]
    assert [got[f"k.{i}"]["item"] for i in range(1, 5)] == ["x1", "x2", "x3", "x4"]  # type: ignore[index]
    assert "into 5 entries" in log.read_text()
    assert int(client.get(keys.packed_items)) == 0 and int(client.get(keys.queued_bytes)) == 0


def test_a_worker_written_from_the_protocol_dies_mid_entry_and_a_takeover_computes_the_rest(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """A worker in another language, here raw commands as docs/protocol.md states them: it
    vouches for itself (section 11), reads a Streamer's v2 entry, answers two of its items in
    one packed element and marks them answered (sections 5.1, 7.1), then dies. `worker start`
    takes the entry over once its heartbeat lapses, and computes only the other two items."""
    from broker import functions

    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    functions.load(client)
    for stream in (keys.stream, keys.stream + ":high"):
        client.xgroup_create(stream, keys.group, id="0", mkstream=True)
    seconds, micros = client.time()  # type: ignore[misc]
    expires = seconds * 1000 + micros // 1000 + 1000
    client.zadd(keys.consumers, {"foreign-1": expires})
    client.set(keys.heartbeat("foreign-1"), json.dumps({"expires_ms": expires}), px=1000)
    with Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True) as s:
        future = s.submit(["a", "b", "c", "d"], timeout=60)
        read = client.xreadgroup(keys.group, "foreign-1", {keys.stream: ">"}, count=8, block=10_000)
        ((_, ((entry_id, fields),)),) = read
        assert fields[b"v"] == b"2" and fields[b"n"] == b"4"
        handle = entry_id.decode() + "#{}"
        maps = [
            msgpack.packb({"id": fields[f"id.{i}".encode()].decode(), "ok": True, "result": "F"})
            for i in (0, 1)
        ]
        reply_key = fields[b"reply"]
        assert client.fcall("mb_reply", 1, reply_key, 2, 60, 1, b"\x92" + b"".join(maps)) == []  # type: ignore[arg-type]
        mark = {handle.format(i): time.time() * 1000 + 600_000 for i in (0, 1)}
        client.zadd(keys.answered, mark)  # and then it dies, its heartbeat left to lapse
        log = tmp_path / "worker.log"
        with worker_process(redis_server.url, "tests.models:Toy", prefix, log_path=log):
            outputs = future.result(timeout=60)
            wait_until(lambda: client.xlen(keys.stream) == 0, 20, "the acks")
    assert outputs[:2] == ["F", "F"]
    assert [o["item"] for o in outputs[2:]] == ["c", "d"]  # type: ignore[index]
    assert "into 2 entries" in log.read_text()
    assert client.zcard(keys.answered) == 0
    assert int(client.get(keys.packed_items)) == 0 and int(client.get(keys.queued_bytes)) == 0


def test_withdrawing_every_item_of_an_unread_entry_deletes_it_and_some_marks_them(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()

    async def scenario() -> None:
        transport = RedisTransport(redis_server.url, entry_items=32)
        try:
            first = await transport.enqueue(keys, calls_of(keys, "a", [1, 2, 3]), UNBOUNDED)
            second = await transport.enqueue(keys, calls_of(keys, "b", [4, 5]), UNBOUNDED)
            handles = [h[0] for h in first + second]  # type: ignore[index]
            await transport.cancel(keys, [(h, 0) for h in handles[:3]])  # all of the first
            await transport.cancel(keys, [(handles[3], 0)])  # one of the second
        finally:
            await transport.close()

    run(scenario())
    ((entry_id, fields),) = client.xrange(keys.stream)
    assert fields[b"n"] == b"2"
    assert client.zrange(keys.cancelled, 0, -1) == [entry_id + b"#0"]
    assert int(client.get(keys.packed_items)) == 1
    assert int(client.get(keys.queued_bytes)) == len(fields[b"data.0"]) + len(fields[b"data.1"])


def withdraw(client: redis.Redis, keys: ModelKeys, *handles: str) -> int:
    """mb_withdraw as any caller may send it (version 2, with the packed-items counter)."""
    from broker import functions

    return int(client.fcall(  # type: ignore[union-attr]
        functions.WITHDRAW, 4, keys.stream, keys.queued_bytes, keys.cancelled,
        keys.packed_items, functions.VERSION, "workers", *handles,
    ))  # fmt: skip


def test_withdrawing_by_a_forged_item_count_never_loops_over_it(
    redis_server: RedisServer, prefix: str
) -> None:
    """mb_withdraw looped over an entry's `n` as written: one XADD of n = 10**12 held Redis
    (every tenant's) for days, beyond FUNCTION KILL of any generated user. An `n` the workers
    would not take counts no items: the handle is only marked."""
    from broker import functions

    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    functions.load(client)
    bomb = client.xadd(keys.stream, {"v": "2", "n": str(10**12), "reply": "x"})
    quick = redis.Redis(port=redis_server.port, socket_timeout=5)  # a loop would time out
    for n in ("513", "-1", "1.5", "nan", str(10**12)):
        client.xadd(keys.stream, {"v": "2", "n": n, "reply": "x"}, id="*")
    assert withdraw(quick, keys, f"{bomb.decode()}#0", f"{bomb.decode()}#5") == 0
    assert client.zcard(keys.cancelled) == 2 and client.xlen(keys.stream) == 6


@pytest.mark.parametrize("n", [" 2", "2 ", "+2", "2.0", "0x2", "2e0"])
def test_withdrawing_takes_no_count_the_workers_would_not_take(
    redis_server: RedisServer, prefix: str, n: str
) -> None:
    """Lua's tonumber reads ' 2', '2.0' or '0x2' as 2, where the workers see no valid `n` and
    answer the entry ProtocolError: mb_withdraw deleted it unread, unanswered, and released
    its count. Such an entry's handles are only marked, as any other count it cannot read."""
    from broker import functions

    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    functions.load(client)
    fields = {"v": "2", "n": n, "reply": keys.inbox("c"), "data.0": b"\x01", "data.1": b"\x02"}
    entry = client.xadd(keys.stream, fields).decode()  # type: ignore[arg-type]
    padded = client.xadd(keys.stream, {**fields, "n": "0002"}).decode()  # type: ignore[arg-type]
    assert withdraw(client, keys, f"{entry}#0", f"{entry}#1") == 0
    assert client.xlen(keys.stream) == 2 and client.zcard(keys.cancelled) == 2
    assert withdraw(client, keys, f"{padded}#0", f"{padded}#1") == 2
    assert client.xlen(keys.stream) == 1


@pytest.mark.parametrize("index", ["1.0", " 1", "1e0", "0x1", "+1"])
def test_an_item_handle_s_index_is_digits_only(
    redis_server: RedisServer, prefix: str, index: str
) -> None:
    """Lua's tonumber read `<entry id>#1.0` or `# 1` as item 1, a handle no caller was given
    (the workers know items by `#<digits>`). Such a handle withdraws nothing."""
    from broker import functions

    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    functions.load(client)
    fields = {"v": "2", "n": "2", "reply": keys.inbox("c"), "data.0": b"\x01", "data.1": b"\x02"}
    entry = client.xadd(keys.stream, fields).decode()  # type: ignore[arg-type]
    assert withdraw(client, keys, f"{entry}#0", f"{entry}#{index}") == 0
    assert client.xlen(keys.stream) == 1
    assert client.zrange(keys.cancelled, 0, -1) == [f"{entry}#0".encode()]
    assert withdraw(client, keys, f"{entry}#1") == 2  # the handle as given: all withdrawn
    assert client.xlen(keys.stream) == 0


def test_withdrawing_a_v2_entry_by_its_id_releases_its_bytes_and_items(
    redis_server: RedisServer, prefix: str
) -> None:
    """A bare entry id of a v2 entry deleted the entry but released neither its data bytes
    (only fields named `data` were counted) nor its packed items: the queue bound then stood
    lower by that much, for good."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    run(enqueue(redis_server.url, keys, calls_of(keys, "a", [1, 2, 3])))
    ((entry_id, fields),) = client.xrange(keys.stream)
    assert fields[b"n"] == b"3" and int(client.get(keys.packed_items)) == 2
    size = sum(len(fields[f"data.{i}".encode()]) for i in range(3))
    assert withdraw(client, keys, entry_id.decode()) == size
    assert client.xlen(keys.stream) == 0
    assert int(client.get(keys.queued_bytes)) == 0 and int(client.get(keys.packed_items)) == 0


def test_a_withdraw_call_spends_a_bounded_number_of_steps_on_multi_item_entries(
    redis_server: RedisServer, prefix: str
) -> None:
    """Each handle of an unread v2 entry made mb_withdraw check the entry's other items, one
    ZSCORE each: 4096 handles of entries of 512 items (any caller may XADD them) held Redis,
    for every tenant, 2.6 s per call. Past MAX_WITHDRAW_STEPS a handle is only marked."""
    from broker import functions

    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    functions.load(client)
    entries = 2 * functions.MAX_WITHDRAW_STEPS // (functions.MAX_ENTRY_ITEMS - 1) + 1
    adding = client.pipeline(transaction=False)
    for _ in range(entries):
        adding.xadd(keys.stream, {"v": "2", "n": str(functions.MAX_ENTRY_ITEMS), "reply": "x"})
    handles = [f"{entry.decode()}#0" for entry in adding.execute()]
    client.config_resetstat()
    assert withdraw(client, keys, *handles) == 0
    stats = client.info("commandstats")
    steps = sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("zscore", "zrem"))
    assert steps <= functions.MAX_WITHDRAW_STEPS
    assert client.zcard(keys.cancelled) == entries  # every handle marked for the workers
    whole = [handle.partition("#")[0] for handle in handles]
    client.config_resetstat()
    withdraw(client, keys, *whole)
    stats = client.info("commandstats")
    assert stats.get("cmdstat_zrem", {}).get("calls", 0) <= functions.MAX_WITHDRAW_STEPS
