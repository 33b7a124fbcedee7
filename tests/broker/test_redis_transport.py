"""RedisTransport and the functions library it calls (broker/functions.py), on a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from broker import Streamer, functions, liveness, redis_transport
from broker.devserver import RedisServer
from broker.errors import BrokerUnavailable, InvalidInput, QueueFull
from broker.keys import ModelKeys
from broker.protocol import CallRequests, request_fields
from broker.redis_transport import EnqueuePacker, RedisTransport, _within_caps
from broker.transport import UNBOUNDED, QueueBound

if TYPE_CHECKING:
    from gpu_worker.batching import BatchLoop

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


@contextlib.asynccontextmanager
async def echo_worker(url: str, keys: ModelKeys) -> AsyncIterator[BatchLoop]:
    """A worker's batch loop serving ``keys`` with a model that returns its items, on this
    event loop, until the block ends."""
    from gpu_worker.batching import BatchLoop, BatchSettings

    transport = RedisTransport(url)
    loop = BatchLoop(lambda items: items, transport, keys, "w", BatchSettings(block_ms=50))
    serving = asyncio.ensure_future(loop.run())
    try:
        yield loop
    finally:
        loop.stop()
        await serving
        await transport.close()


@pytest.fixture
def restricted(redis_server: RedisServer) -> Iterator[str]:
    """The URL of a user that may call the functions and do a worker's and a caller's work,
    but not load functions (as the users of deploy/ ACLs)."""
    name, password = f"u{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = redis_server.client()
    admin.acl_setuser(
        name, enabled=True, passwords=[f"+{password}"], keys=["mb:*"],
        commands=["-@all", "+fcall", "+ping", "+time", "+info", "+blmpop", "+xgroup|create",
                  "+xreadgroup", "+xack", "+xdel", "+xadd", "+xlen", "+get", "+incrby",
                  "+decrby", "+hmget", "+zcount", "+type", "+pttl", "+rpush", "+expire",
                  "+zmscore", "+zcard", "+xpending", "+xinfo|consumers", "+exists"],
    )  # fmt: skip
    try:
        yield f"redis://{name}:{password}@127.0.0.1:{redis_server.port}/0"
    finally:
        admin.acl_deluser(name)
        functions.load(admin)  # as the other tests expect to find it (or load it themselves)
        admin.close()


def test_enqueue_commands_are_packed_as_hiredis_would() -> None:
    import hiredis

    keys = ModelKeys("m", "p")
    calls = [
        CallRequests(keys.inbox("a"), 30_000, ["a.1"], [b"\x93\x01\x02\x03"]),
        CallRequests(keys.inbox("a"), 30_000, ["a.2", "a.3"], [b"", b"x" * 70_000], TRACE),
        CallRequests(keys.inbox("b"), 5, ["b.1"], [b"\r\n$3\r\n"]),  # RESP-like bytes
        CallRequests(keys.inbox("\u00e9"), 1, ["\u00e9.1"], [b"\x00"]),  # non-ASCII
    ]
    packer = EnqueuePacker(entry_items=16)
    for bound in (UNBOUNDED, QueueBound(7, 9)):
        for group in (calls, calls[:1], calls[1:3]):  # twice: templates made, then reused
            for _ in range(2):
                args: list[object] = [
                    "FCALL", functions.ENQUEUE, 5, keys.stream, keys.queued_bytes,
                    keys.queue_bound, keys.consumers, keys.packed_items, functions.VERSION,
                    bound.max_items, bound.max_bytes, 16,
                ]  # fmt: skip
                for call in group:
                    args += [len(call.request_ids), call.reply_key, call.timeout_ms]
                    args.append(call.traceparent or "")
                    for rid, data in zip(call.request_ids, call.payloads, strict=True):
                        args += [rid, data]
                assert packer.pack(keys, group, bound) == hiredis.pack_command(tuple(args))
    for timeout_ms in range(1, 3 * EnqueuePacker.MAX_TEMPLATES):  # templates stay bounded
        packer.pack(keys, [CallRequests(keys.inbox("a"), timeout_ms, ["a.1"], [b"x"])], UNBOUNDED)
    assert len(packer._templates) <= EnqueuePacker.MAX_TEMPLATES


def test_enqueued_entries_are_the_documented_fields(redis_server: RedisServer) -> None:
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    calls = [
        CallRequests(keys.inbox("a"), 30_000, ["a.1"], [b"\x93\x01\x02\x03"]),
        CallRequests(keys.inbox("a"), 5, ["a.2", "a.3"], [b"", b"x" * 70_000], TRACE),
        CallRequests(keys.inbox("\u00e9"), 1, ["\u00e9.1"], [b"\r\n$3\r\n"]),  # RESP-like bytes
    ]

    async def main() -> list[list[str]]:
        transport = RedisTransport(redis_server.url)
        try:
            outcomes = await transport.enqueue(keys, calls, UNBOUNDED)
        finally:
            await transport.close()
        assert all(isinstance(outcome, list) for outcome in outcomes)
        return outcomes  # type: ignore[return-value]

    outcomes = run(main())
    client = redis_server.client()
    entries = client.xrange(keys.stream)
    assert [entry_id.decode() for entry_id, _ in entries] == [i for ids in outcomes for i in ids]
    expected = [
        {name.encode(): value if isinstance(value, bytes) else value.encode()
         for name, value in request_fields(rid, call.reply_key, call.timeout_ms, data,
                                           call.traceparent).items()}
        for call in calls
        for rid, data in zip(call.request_ids, call.payloads, strict=True)
    ]  # fmt: skip
    assert [fields for _, fields in entries] == expected
    assert [list(fields) for _, fields in entries] == [list(fields) for fields in expected]
    assert int(client.get(keys.queued_bytes) or 0) == sum(len(d) for c in calls for d in c.payloads)


def test_the_caller_bound_refuses_whole_calls(redis_server: RedisServer) -> None:
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")

    def call(n: int, size: int = 1) -> CallRequests:
        return CallRequests(keys.inbox("a"), 1000, [f"a.{i}" for i in range(n)], [b"x" * size] * n)

    async def main() -> list[object]:
        transport = RedisTransport(redis_server.url)
        try:
            first = await transport.enqueue(keys, [call(3), call(3), call(1)], QueueBound(4, 0))
            second = await transport.enqueue(keys, [call(1, 10)], QueueBound(0, 12))
            return [*first, *second]
        finally:
            await transport.close()

    ok, refused, fits, over_bytes = run(main())
    assert isinstance(ok, list) and len(ok) == 3 and isinstance(fits, list) and len(fits) == 1
    assert "bound of 4 items" in str(refused)
    assert "bound of 12 bytes" in str(over_bytes)
    assert redis_server.client().xlen(keys.stream) == 4


def test_the_models_bound_scales_with_its_live_workers_and_callers_may_only_tighten_it(
    redis_server: RedisServer,
) -> None:
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    client = redis_server.client()
    client.hset(keys.queue_bound, mapping={"items": 3, "bytes": 100})

    def call(n: int, size: int = 1) -> CallRequests:
        return CallRequests(keys.inbox("a"), 1000, [f"a.{i}" for i in range(n)], [b"x" * size] * n)

    async def enqueue(calls: list[CallRequests], bound: QueueBound = UNBOUNDED) -> list[object]:
        transport = RedisTransport(redis_server.url)
        try:
            return list(await transport.enqueue(keys, calls, bound))
        finally:
            await transport.close()

    def fits(outcomes: list[object]) -> list[bool]:
        return [isinstance(outcome, list) for outcome in outcomes]

    # no live worker: the bound of one (so that callers can queue while workers start)
    assert fits(run(enqueue([call(2), call(2)]))) == [True, False]
    now_ms = int(client.time()[0]) * 1000
    client.zadd(keys.consumers, {"w1": now_ms + 60_000, "w2": now_ms + 60_000, "old": 1})
    refused = run(enqueue([call(2), call(3), call(2)]))  # 2 live workers: 6 items
    assert fits(refused) == [True, False, True] and "bound of 6 items" in str(refused[1])
    assert client.xlen(keys.stream) == 6
    assert int(client.get(keys.queued_bytes) or 0) == 6  # a refused call's bytes given back
    # a caller's own bound is an extra, stricter cap; a looser one changes nothing
    assert fits(run(enqueue([call(1)], QueueBound(100, 0)))) == [False]
    client.delete(keys.stream, keys.queued_bytes)
    assert fits(run(enqueue([call(3), call(3)], QueueBound(5, 0)))) == [True, False]
    over = run(enqueue([call(1, 95), call(1, 5)], QueueBound(0, 1000)))  # 100 bytes in all
    assert fits(over) == [True, False] and "bound of 100 bytes" in str(over[1])
    assert int(client.get(keys.queued_bytes) or 0) == 3 + 95
    client.delete(keys.queue_bound)  # no bound stored: only the caller's
    assert fits(run(enqueue([call(10)]))) == [True]


def test_a_worker_whose_heartbeat_just_lapsed_still_counts_towards_the_bound(
    redis_server: RedisServer,
) -> None:
    """After Redis stalled for longer than the heartbeat TTL, every heartbeat's expiry was past
    until the supervisors renewed it: the calls that had waited out the stall met a bound of
    one worker's share (a quarter of it, with four workers)."""
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    client = redis_server.client()
    client.hset(keys.queue_bound, mapping={"items": 2, "bytes": 0})
    now_ms = int(client.time()[0]) * 1000
    lapsed = {f"w{i}": now_ms - 500 for i in range(3)}  # expired half a second ago
    client.zadd(keys.consumers, {**lapsed, "gone": now_ms - 60_000})

    async def enqueue(items: int) -> object:
        transport = RedisTransport(redis_server.url)
        call = CallRequests(keys.inbox("a"), 1000, [f"a.{i}" for i in range(items)], [b"x"] * items)
        try:
            return (await transport.enqueue(keys, [call], UNBOUNDED))[0]
        finally:
            await transport.close()

    assert isinstance(run(enqueue(6)), list)  # 3 workers (not the one gone a minute ago): 6
    refused = run(enqueue(1))
    assert isinstance(refused, QueueFull) and "bound of 6 items" in str(refused)


def test_counters_left_beside_an_empty_stream_go_back_to_zero(redis_server: RedisServer) -> None:
    """A worker older than multi-item entries (wire v1 only) dead-letters each v2 entry a
    caller of this version writes during a rolling upgrade, acknowledging and deleting it
    without releasing its packed items or its data.<i> bytes: the counters kept them for
    good, and once they reached the item bound every later call was QueueFull, on upgraded
    workers too. An enqueue that finds the stream empty takes them back to zero first."""
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    client = redis_server.client()

    def call(n: int) -> CallRequests:
        return CallRequests(keys.inbox("a"), 1000, [f"a.{i}" for i in range(n)], [b"xy"] * n)

    async def enqueue(calls: list[CallRequests]) -> list[object]:
        transport = RedisTransport(redis_server.url, entry_items=32)
        try:
            return list(await transport.enqueue(keys, calls, UNBOUNDED))
        finally:
            await transport.close()

    def old_worker_dead_letters_everything() -> None:
        """What a v1-only worker did with a v2 entry: no id field, so dead-lettered; its
        acknowledgement released len(data), which a v2 entry has not: nothing."""
        client.xgroup_create(keys.stream, "workers", id="0", mkstream=True)
        for _, entries in client.xreadgroup("workers", "old", {keys.stream: ">"}):
            for entry_id, fields in entries:
                client.xadd(keys.dead_letters, fields)
                client.xack(keys.stream, "workers", entry_id)
                client.xdel(keys.stream, entry_id)
                client.decrby(keys.queued_bytes, len(fields.get(b"data", b"")))

    assert all(isinstance(o, list) for o in run(enqueue([call(1)] * 4)))  # one v2 entry of 4
    old_worker_dead_letters_everything()
    assert client.xlen(keys.stream) == 0
    assert int(client.get(keys.packed_items)) == 3 and int(client.get(keys.queued_bytes)) == 8
    client.hset(keys.queue_bound, mapping={"items": 3, "bytes": 9})
    # 3 packed items left over + 2 would pass the bound of 3, 8 bytes + 4 that of 9 bytes
    (ok,) = run(enqueue([call(2)]))
    assert isinstance(ok, list) and len(ok) == 2
    assert int(client.get(keys.packed_items)) == 1 and int(client.get(keys.queued_bytes)) == 4
    # beside a stream that holds entries, the counters are theirs: left as they are
    client.incrby(keys.packed_items, 5)
    (refused,) = run(enqueue([call(1)]))
    assert "bound of 3 items" in str(refused)
    assert int(client.get(keys.packed_items)) == 6 and int(client.get(keys.queued_bytes)) == 4


def test_calls_are_split_within_the_per_call_caps_and_one_too_large_is_refused(
    redis_server: RedisServer,
) -> None:
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    big = functions.MAX_CALL_ENTRIES // 2 + 1

    def call(n: int) -> CallRequests:
        return CallRequests(keys.inbox("a"), 1000, [f"a.{i}" for i in range(n)], [b"x"] * n)

    calls = [call(big), call(big), call(1), call(functions.MAX_CALL_ENTRIES + 1)]
    assert _within_caps(range(3), calls) == [[0], [1, 2]]

    async def main() -> list[object]:
        transport = RedisTransport(redis_server.url)
        try:
            return list(await transport.enqueue(keys, calls, UNBOUNDED))
        finally:
            await transport.close()

    outcomes = run(main())
    assert [len(o) for o in outcomes[:3]] == [big, big, 1]  # type: ignore[arg-type]
    assert isinstance(outcomes[3], InvalidInput) and "split it" in str(outcomes[3])
    assert redis_server.client().xlen(keys.stream) == 2 * big + 1
    # what a foreign caller sending one mb_enqueue over the caps gets: refused, nothing queued
    args = [1, 0, 0, functions.MAX_CALL_ENTRIES + 1, keys.inbox("b"), 1000, ""]
    args += ["id", "x"] * (functions.MAX_CALL_ENTRIES + 1)
    with pytest.raises(redis.ResponseError, match="MBLIMIT"):
        redis_server.client().fcall(
            functions.ENQUEUE, 4, keys.stream, keys.queued_bytes, keys.queue_bound,
            keys.consumers, *args,
        )  # fmt: skip
    assert redis_server.client().xlen(keys.stream) == 2 * big + 1


def test_missing_functions_are_loaded_by_a_user_who_may(redis_server: RedisServer) -> None:
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    admin = redis_server.client()
    admin.function_flush()
    call = CallRequests(keys.inbox("a"), 1000, ["a.0"], [b"x"])

    async def main() -> None:
        transport = RedisTransport(redis_server.url)  # the default user: may load
        try:
            (ids,) = await transport.enqueue(keys, [call], UNBOUNDED)
            assert isinstance(ids, list)
        finally:
            await transport.close()

    run(main())
    assert functions.loaded_version(admin) == functions.VERSION
    # An older library (its version below this code's) is detected and replaced the same way.
    older = functions.VERSION - 1
    admin.function_load(
        library_code(older),
        True,
    )
    assert functions.loaded_version(admin) == older
    run(main())
    assert functions.loaded_version(admin) == functions.VERSION
    assert admin.xlen(keys.stream) == 2


def library_code(version: int, revision: int | None = None) -> str:
    """The library's code as another release wrote it (revision None: one from before
    revisions, without mb_release, which reads as revision 0)."""
    if revision is not None:
        return functions.CODE.replace(
            f"local VERSION, REVISION = {functions.VERSION}, {functions.REVISION}\n",
            f"local VERSION, REVISION = {version}, {revision}\n",
        )
    code = functions.CODE.replace(
        f"local VERSION, REVISION = {functions.VERSION}, {functions.REVISION}\n",
        f"local VERSION = {version}\n",
    )
    return re.sub(
        r"redis.register_function\{function_name='mb_release'.*?'\}\n", "", code, flags=re.S
    )


def _older_revision() -> str:
    return library_code(functions.VERSION)


def test_an_older_revision_of_the_library_is_replaced_by_a_worker_who_may(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A fix of the library's code that kept its version stayed out of Redis until someone
    ran `broker functions load`: every call was accepted by the old code."""
    admin = redis_server.client()
    admin.function_load(_older_revision(), True)
    assert functions.loaded_release(admin) == (functions.VERSION, 0)

    async def main() -> None:
        transport = RedisTransport(redis_server.url)  # the default user: may load
        try:
            await transport.check_functions()  # what a worker does before it reads
        finally:
            await transport.close()

    with caplog.at_level(logging.INFO, logger="microbatch.redis"):
        run(main())
    assert functions.loaded_release(admin) == (functions.VERSION, functions.REVISION)
    said = [r.getMessage() for r in caplog.records if "replaced the microbatch" in r.getMessage()]
    assert said == [
        f"replaced the microbatch library (version {functions.VERSION} revision 0) by "
        f"version {functions.VERSION} revision {functions.REVISION}"
    ]
    # a newer revision (a later release's) is left alone
    admin.function_load(library_code(functions.VERSION, functions.REVISION + 1), True)
    run(main())
    assert functions.loaded_release(admin) == (functions.VERSION, functions.REVISION + 1)


def test_an_older_revision_is_reported_once_to_a_user_who_may_not_load(
    redis_server: RedisServer, restricted: str, caplog: pytest.LogCaptureFixture
) -> None:
    admin = redis_server.client()
    admin.function_load(_older_revision(), True)

    async def main() -> None:
        transport = RedisTransport(restricted)
        try:
            for _ in range(3):  # a start and two outages
                await transport.check_functions()
        finally:
            await transport.close()

    with caplog.at_level(logging.INFO, logger="microbatch.redis"):
        run(main())
    assert functions.loaded_release(admin) == (functions.VERSION, 0)  # still there: it serves
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broker functions load" in warnings[0], warnings
    assert f"(version {functions.VERSION} revision 0) is older" in warnings[0]
    # what the ACL log holds of it: the one refused load, no other command
    user = restricted.split("//")[1].split(":")[0]
    refused = {
        entry["object"]
        for entry in admin.acl_log()
        if entry["reason"] == "command" and entry["username"] == user
    }
    assert refused <= {"function|load"}, refused


def test_missing_functions_are_a_clear_broker_unavailable_for_a_user_who_may_not(
    redis_server: RedisServer, restricted: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    admin = redis_server.client()
    admin.function_flush()
    call = CallRequests(keys.inbox("a"), 1000, ["a.0"], [b"x"])

    async def main() -> None:
        transport = RedisTransport(restricted)
        try:
            for _ in range(5):
                with pytest.raises(BrokerUnavailable, match="broker functions load"):
                    await transport.enqueue(keys, [call], UNBOUNDED)
            with pytest.raises(BrokerUnavailable, match="broker functions load"):
                await transport.check_functions()  # what a worker waits on before reading
            functions.load(admin)  # the operator runs `broker functions load`
            (ids,) = await transport.enqueue(keys, [call], UNBOUNDED)
            assert isinstance(ids, list)
            await transport.check_functions()
        finally:
            await transport.close()

    with caplog.at_level(logging.INFO, logger="microbatch.redis"):
        run(main())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # one line, not one per call
    assert "broker functions load" in warnings[0].getMessage() and not warnings[0].exc_info
    assert admin.xlen(keys.stream) == 1
    user = restricted.split("//")[1].split(":")[0]
    tries = [e for e in admin.acl_log() if e["username"] == user and e["object"] == "function|load"]
    assert len(tries) == 1  # it tried to load the library once, then only said what to do


def test_replies_never_touch_a_key_that_is_not_a_list_nor_set_a_ttl_they_did_not_make(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    client = redis_server.client()
    client.hset(keys.inbox("hash"), "f", "v")
    client.rpush(keys.inbox("persistent"), b"mine")
    replies = [
        (keys.inbox("new"), b"r1"),
        (keys.inbox("hash"), b"r2"),
        (keys.inbox("persistent"), b"r3"),
        (keys.inbox("new"), b"r4"),
    ]

    async def main() -> None:
        transport = RedisTransport(redis_server.url)
        try:
            await transport.finish(keys, replies, [], 60)  # the first: alone, then checked
            await transport.finish(keys, replies[:2], [], 60)  # pipelined with the acks
        finally:
            await transport.close()

    with caplog.at_level(logging.WARNING, logger="microbatch.redis"):
        run(main())
    assert client.lrange(keys.inbox("new"), 0, -1) == [b"r1", b"r4", b"r1"]
    assert 0 < client.ttl(keys.inbox("new")) <= 60
    assert client.type(keys.inbox("hash")) == b"hash" and client.ttl(keys.inbox("hash")) == -1
    assert client.hgetall(keys.inbox("hash")) == {b"f": b"v"}
    assert client.lrange(keys.inbox("persistent"), 0, -1) == [b"mine", b"r3"]
    assert client.ttl(keys.inbox("persistent")) == -1
    refused = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert refused == [f"replies to {keys.inbox('hash')} were not delivered: it holds a hash, "
                       "not a list"] * 2  # fmt: skip


def test_a_worker_without_the_functions_reads_nothing_until_they_are_loaded(
    redis_server: RedisServer, restricted: str, caplog: pytest.LogCaptureFixture
) -> None:
    from broker.protocol import decode_reply

    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    admin = redis_server.client()
    admin.function_flush()
    fields = request_fields("r.1", keys.inbox("c"), 30_000, b"\xa2hi")
    admin.xadd(keys.stream, fields)  # type: ignore[arg-type]

    async def main() -> tuple[int, int]:
        async with echo_worker(restricted, keys) as loop:
            await asyncio.sleep(1.5)  # several retries
            pending = int(admin.xpending(keys.stream, keys.group)["pending"])
            functions.load(admin)  # the operator's `broker functions load`
            popped = await asyncio.to_thread(admin.blpop, [keys.inbox("c")], 10)
            assert popped is not None and decode_reply(popped[1]).result == "hi"
            return pending, loop.batches

    with caplog.at_level(logging.INFO):
        pending, batches = run(main())
    assert pending == 0  # nothing was read while the library was missing
    assert batches == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broker functions load" in warnings[0], warnings
    assert "broker answers again" in [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("library", ["older", "flushed"])
def test_replies_of_acknowledged_entries_wait_for_the_library_rather_than_being_lost(
    redis_server: RedisServer, restricted: str, library: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's replies ride with its acknowledgements once its connection has answered an
    mb_reply. If the library is replaced by an older one under it (`broker functions load` of
    an older release, as a rollback's first gateway pod runs) or flushed, that mb_reply fails
    after the entries were acknowledged, and a user who may not load the library could not
    write the replies again: they were dropped and their callers waited out their deadlines.
    They are kept, and written as soon as the operator loads the library."""
    from broker.protocol import decode_reply

    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    admin = redis_server.client()
    functions.load(admin)

    def send(rid: str) -> None:
        fields = request_fields(rid, keys.inbox("c"), 60_000, b"\xa2hi")
        admin.xadd(keys.stream, fields)  # type: ignore[arg-type]

    async def main() -> tuple[list[str], int]:
        got: list[str] = []
        async with echo_worker(restricted, keys):
            send("r.1")  # answered alone, then the connection's replies ride with the acks
            popped = await asyncio.to_thread(admin.blpop, [keys.inbox("c")], 10)
            assert popped is not None
            got.append(decode_reply(popped[1]).request_id)
            if library == "older":
                older = functions.VERSION - 1
                admin.function_load(
                    library_code(older),
                    True,
                )
            else:
                admin.function_flush()
            send("r.2")
            await asyncio.sleep(1.5)  # computed, acknowledged, its reply refused: retries
            pending = int(admin.xpending(keys.stream, keys.group)["pending"])
            assert admin.llen(keys.inbox("c")) == 0
            functions.load(admin)  # the operator's `broker functions load`
            popped = await asyncio.to_thread(admin.blpop, [keys.inbox("c")], 4)
            assert popped is not None, "the reply of r.2 was lost"
            got.append(decode_reply(popped[1]).request_id)
            return got, pending

    with caplog.at_level(logging.INFO):
        got, pending = run(main())
    assert got == ["r.1", "r.2"]
    assert pending == 0  # r.2 had been acknowledged before its reply failed
    assert admin.xlen(keys.stream) == 0 and admin.llen(keys.inbox("c")) == 0  # once each
    assert any("acknowledged already" in r.getMessage() for r in caplog.records)
    assert any("late" in r.getMessage() for r in caplog.records)


def _enqueued_alone(url: str, keys: ModelKeys, call: CallRequests) -> object:
    """The outcome of enqueueing ``call`` alone, with no bound of the caller's."""

    async def main() -> object:
        transport = RedisTransport(url)
        try:
            (outcome,) = await transport.enqueue(keys, [call], UNBOUNDED)
            return outcome
        finally:
            await transport.close()

    return run(main())


def test_a_call_larger_than_the_whole_bound_says_it_can_never_fit(
    redis_server: RedisServer,
) -> None:
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}")
    redis_server.client().hset(keys.queue_bound, mapping={"items": 4, "bytes": 0})
    call = CallRequests(keys.inbox("a"), 1000, [f"a.{i}" for i in range(5)], [b"x"] * 5)

    outcome = _enqueued_alone(redis_server.url, keys, call)
    assert "more items than the queue bound of 4 items" in str(outcome)
    assert "split it" in str(outcome) and redis_server.client().xlen(keys.stream) == 0


def test_a_call_larger_than_a_partition_s_share_of_the_bound_names_the_partitions(
    redis_server: RedisServer,
) -> None:
    """With partitions, a call is queued whole on one partition, whose bound is the model's
    split over them: the refusal says so, rather than quoting a bound the model never set."""
    keys = ModelKeys("m", f"t{uuid.uuid4().hex[:8]}", partition=2, partitions=6)
    redis_server.client().hset(keys.queue_bound, mapping={"items": 22, "bytes": 0})
    call = CallRequests(keys.inbox("a"), 1000, [f"a.{i}" for i in range(30)], [b"x"] * 30)

    message = str(_enqueued_alone(redis_server.url, keys, call))
    assert "queue bound of 22 items" in message
    assert "6 partitions" in message and "split it" in message


@pytest.mark.slow
def test_redis_loading_its_data_is_broker_unavailable_with_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real Redis restarted on a big RDB answers LOADING for seconds: callers (lean lanes),
    redis-py paths, a worker's loop and the heartbeats each say so once, with no traceback,
    and all carry on by themselves once it is done."""
    import subprocess

    from broker import Streamer
    from broker.devserver import find_redis_server, free_port
    from gpu_worker.batching import OUTAGE_LOG_EVERY_S
    from gpu_worker.heartbeat import Heartbeats

    port, keys = free_port(), ModelKeys("m", "loading")
    base = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--dir",
            str(tmp_path), "--save", "", "--appendonly", "no", "--logfile", ""]  # fmt: skip
    first = subprocess.Popen([*base, "--enable-debug-command", "yes"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=10)
    try:
        _wait_for(lambda: client.ping(), "redis-server")
        client.execute_command("DEBUG", "POPULATE", 200_000)  # seconds to load, slowed below
        functions.load(client)
        client.save()
    finally:
        first.terminate()
        first.wait(10)
    # the same data, loaded slowly (4 s or more): every key waits 20 us, clients served meanwhile
    slow = ["--key-load-delay", "20", "--loading-process-events-interval-bytes", "1024"]
    server = subprocess.Popen([*base, *slow], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    loaded_s = 0.0
    try:
        _wait_for(lambda: _loading(client), "LOADING")
        started = time.monotonic()

        async def during_and_after() -> bytes:
            nonlocal loaded_s
            streamer = Streamer("m", redis_url=url, prefix="loading", timeout=30)
            beats = Heartbeats(url, keys)
            async with echo_worker(url, keys):  # the worker
                try:
                    for _ in range(5):  # the caller: lean lanes
                        with pytest.raises(BrokerUnavailable, match="loading its data"):
                            await asyncio.to_thread(streamer.predict, ["x"])
                    other = RedisTransport(url)  # a redis-py path
                    with pytest.raises(BrokerUnavailable, match="loading its data"):
                        await other.ensure_group(keys)
                    assert not await other.ping()
                    await other.close()
                    for _ in range(3):
                        assert not beats.renew({"w": {}})
                    assert _loading(client), "Redis finished loading during the test: slow it more"
                    print(f"\nFIGURES loading: checks done {time.monotonic() - started:.1f} s in")
                    await asyncio.to_thread(_wait_for, lambda: not _loading(client), "loaded", 60)
                    loaded_s = time.monotonic() - started
                    print(f"FIGURES loading: loaded {loaded_s:.1f} s in")
                    assert beats.renew({"w": {}})
                    outputs = await asyncio.to_thread(streamer.predict, ["after"])
                    return outputs[0]  # type: ignore[no-any-return]
                finally:
                    beats.close()
                    await streamer.aclose()

        with caplog.at_level(logging.INFO):
            assert run(during_and_after()) == "after"
    finally:
        client.close()
        server.terminate()
        server.wait(10)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    by_logger = {r.name: 0 for r in warnings}
    for record in warnings:
        by_logger[record.name] += 1
    # the worker's loop retries all along and says so once every OUTAGE_LOG_EVERY_S
    worker_lines = by_logger.pop("microbatch.worker", 0)
    lines = [r.getMessage() for r in warnings]
    assert 1 <= worker_lines <= 1 + int(loaded_s // OUTAGE_LOG_EVERY_S), lines
    assert by_logger == {
        "microbatch.redis": 1,  # the caller: 5 failed calls
        "microbatch.heartbeat": 1,  # 3 failed renewals
    }, lines
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    infos = {r.getMessage() for r in caplog.records if r.levelno == logging.INFO}
    assert {"broker answers again", "heartbeats renewed again"} <= infos
    assert "Redis has loaded its data: requests are taken again" in infos


def _loading(client: redis.Redis) -> bool:
    try:
        client.ping()
    except redis.exceptions.BusyLoadingError:
        return True
    return False


def _wait_for(check: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except redis.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_redis_busy_running_a_script_is_unavailable_for_a_while(prefix: str) -> None:
    """BUSY (a script past Redis's busy threshold: Redis answers nothing else until it ends)
    was an error reply like any other: the worker's XGROUP CREATE raised it and the worker
    died and was restarted until the script ended. It is Redis not available yet."""
    import contextlib
    import threading

    server = RedisServer({"busy-reply-threshold": "50"}).start()
    keys = ModelKeys("toy", prefix)
    admin = server.client()

    def hold() -> None:
        with contextlib.suppress(redis.RedisError):  # killed, as meant
            redis.Redis(port=server.port).eval("while true do end", 0)

    blocker = threading.Thread(target=hold)
    try:
        blocker.start()
        deadline = time.monotonic() + 10
        while True:  # until Redis says BUSY
            try:
                admin.ping()
            except redis.ResponseError as exc:
                assert str(exc).startswith("BUSY ")
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)

        async def worker_side() -> list[str]:
            transport = RedisTransport(server.url)
            said = []
            try:
                for attempt in (
                    lambda: transport.ensure_group(keys),
                    lambda: transport.read_batch(keys, "w", 8, 10),
                ):
                    with pytest.raises(BrokerUnavailable) as failed:
                        await attempt()
                    said.append(str(failed.value))
            finally:
                await transport.close()
            return said

        for message in run(worker_side()):
            assert message.startswith("Redis is busy running a script or function: BUSY ")
        admin.script_kill()
        blocker.join(10)

        async def once_it_ends() -> None:
            transport = RedisTransport(server.url)
            try:
                await transport.ensure_group(keys)
            finally:
                await transport.close()

        run(once_it_ends())
        assert admin.xinfo_groups(keys.stream)[0]["name"] == keys.group.encode()
    finally:
        server.stop()
        blocker.join(10)


def test_a_heartbeat_lapsed_by_a_stalled_redis_is_not_taken_over_before_it_is_renewed(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Redis stalled for longer than the TTL (stopped, swapping, running a long script)
    finds every heartbeat lapsed when it answers again, before the supervisors renew them:
    the entries a live worker holds must not be taken over (computed twice) then. A lapse
    that lasts is a dead host, taken over; a consumer its supervisor retired, at once."""
    monkeypatch.setattr(redis_transport, "LAPSE_CONFIRM_S", 0.5)
    keys = ModelKeys("m", prefix)
    client = redis_server.client()

    def vouch(consumer: str, ttl_ms: int) -> None:  # as a supervisor's renewal, or its lapse
        now_ms = liveness.server_time_ms(client, keys.consumers)
        client.zadd(keys.consumers, {consumer: now_ms + ttl_ms})
        if ttl_ms > 0:
            client.set(keys.heartbeat(consumer), "{}", px=ttl_ms)
        else:
            client.delete(keys.heartbeat(consumer))

    async def main() -> tuple[int, int, int, int]:
        transport = RedisTransport(redis_server.url)
        try:
            await transport.ensure_group(keys)
            calls = [CallRequests(keys.inbox("c"), 60_000, [f"r{i}"], [b"\x01"]) for i in (1, 2)]
            await transport.enqueue(keys, calls, UNBOUNDED)
            assert len(await transport.read_batch(keys, "live", 1, 100)) == 1
            assert len(await transport.read_batch(keys, "gone", 1, 100)) == 1
            vouch("live", -1000)  # Redis answers again: its heartbeat lapsed meanwhile
            await asyncio.sleep(0.3)  # past the takeover's minimum idle time
            stalled = len(await transport.reclaim(keys, "taker", 200, 10))  # "gone": retired
            vouch("live", 5000)  # its supervisor renews it
            await asyncio.sleep(0.6)
            renewed = len(await transport.reclaim(keys, "taker", 200, 10))
            vouch("live", -1000)  # now its host is dead
            first_sight = len(await transport.reclaim(keys, "taker", 200, 10))
            await asyncio.sleep(0.6)
            dead = len(await transport.reclaim(keys, "taker", 200, 10))
            return stalled, renewed, first_sight, dead
        finally:
            await transport.close()

    try:
        assert run(main()) == (1, 0, 0, 1)
    finally:
        client.close()


def test_a_password_set_on_a_running_redis_is_an_outage_for_a_worker_not_a_crash() -> None:
    """An operator sets a password on a running Redis and drops its clients: a worker
    without it gets NOAUTH, or the protocol error Redis answers a long unauthenticated
    command (its XREADGROUP), when its lanes reconnect. That is the broker unavailable (the
    worker's loop waits and retries), not an error reply that ends the worker; it reads
    again once the password is taken back."""
    keys = ModelKeys("m", f"auth{uuid.uuid4().hex[:8]}")
    with RedisServer() as server:
        admin = server.client()

        async def main() -> None:
            transport = RedisTransport(server.url)
            try:
                await transport.ensure_group(keys)
                assert await transport.read_batch(keys, "w", 1, 10) == []
                await asyncio.to_thread(admin.config_set, "requirepass", "rotated")
                await asyncio.to_thread(admin.client_kill_filter, _type="normal", skipme=True)
                for _ in range(2):  # the connections killed: reconnected
                    with pytest.raises(BrokerUnavailable):
                        await transport.read_batch(keys, "w", 1, 10)
                    with pytest.raises(BrokerUnavailable):
                        await transport.partition_count(keys)
                for _ in range(2):
                    with pytest.raises(BrokerUnavailable, match=r"NOAUTH|unauthenticated"):
                        await transport.read_batch(keys, "w", 1, 10)
                    with pytest.raises(BrokerUnavailable, match="NOAUTH"):
                        await transport.partition_count(keys)
                await asyncio.to_thread(admin.config_set, "requirepass", "")
                assert await transport.read_batch(keys, "w", 1, 10) == []
            finally:
                await transport.close()

        try:
            run(main())
        finally:
            admin.close()


def test_the_start_up_warning_of_credentials_redis_refuses_says_so(
    redis_server: RedisServer,
) -> None:
    """A gateway given a wrong password logged that Redis "does not answer", which sends an
    operator looking for a network fault."""
    from broker.connections import async_client

    url = f"redis://nobody:s3cret@127.0.0.1:{redis_server.port}/0"

    async def warnings() -> list[str]:
        client = async_client(url)
        try:
            return await redis_transport.startup_warnings(client, url)
        finally:
            await client.aclose()

    assert run(warnings()) == [
        f"Redis at 127.0.0.1:{redis_server.port} (db 0) refused the credentials (invalid "
        "username-password pair or user is disabled.): requests get 503 BrokerUnavailable "
        "until the URL's user and password are ones it accepts"
    ]


def test_a_caller_s_refused_credentials_are_not_called_unreachable(
    redis_server: RedisServer, prefix: str
) -> None:
    """A call given a password Redis refuses failed with 'cannot reach Redis: WRONGPASS ...',
    which sends a user looking for a network fault: it says Redis refused the credentials."""
    url = f"redis://nobody:s3cret@127.0.0.1:{redis_server.port}/0"
    refused = pytest.raises(BrokerUnavailable, match="Redis refused the credentials: WRONGPASS")
    with Streamer("m", redis_url=url, prefix=prefix) as streamer, refused:
        streamer.predict([1], timeout=5)


def test_a_consumer_whose_name_is_not_utf8_is_taken_over_and_counted_not_a_crash(
    redis_server: RedisServer, prefix: str
) -> None:
    """A worker in another language names its consumer as it likes: bytes that are not UTF-8
    (random bytes, say) reached every Python worker of the model through XINFO CONSUMERS, and
    the takeover's decode killed them, again after each restart; the readiness count failed on
    such a member of the consumers set. Its entries are taken over, it is retired, it counts."""
    keys = ModelKeys("m", prefix)
    name = b"\xff\xfe-ruby"
    client = redis_server.client()

    async def main() -> tuple[int, list[bytes], list[str]]:
        transport = RedisTransport(redis_server.url)
        try:
            await transport.ensure_group(keys)
            calls = [CallRequests(keys.inbox("c"), 60_000, ["r1"], [b"\x01"])]
            await transport.enqueue(keys, calls, UNBOUNDED)
            read = client.xreadgroup(keys.group, name, {keys.stream: ">"}, count=1)
            assert len(read[0][1]) == 1  # held by the foreign consumer, which then died
            await asyncio.sleep(0.3)  # past the takeover's minimum idle time
            taken = len(await transport.reclaim(keys, "taker", 200, 10))
            left = [info["name"] for info in client.xinfo_consumers(keys.stream, keys.group)]
            now_ms = liveness.server_time_ms(client, keys.consumers)
            client.zadd(keys.consumers, {name: now_ms + 60_000})  # alive after all
            return taken, left, liveness.live_consumers(client, keys)
        finally:
            await transport.close()

    try:
        taken, left, live = run(main())
        assert taken == 1
        assert left == [b"taker"]
        assert live == ["\\xff\\xfe-ruby"]
    finally:
        client.close()


def test_a_consumer_with_an_empty_name_is_taken_over_without_killing_the_taker(
    redis_server: RedisServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis takes an empty consumer name (a worker in another language whose name setting was
    left empty): the library's mb_retire refuses its heartbeat key, which has nothing after
    `heartbeat:`, and that refusal killed every Python worker of the model right after it
    took the entries over, again after each restart. The entries are taken over; the consumer,
    which the library cannot retire, is left in the group with one warning."""
    keys = ModelKeys("m", prefix)
    client = redis_server.client()

    async def main() -> tuple[int, int, list[bytes]]:
        transport = RedisTransport(redis_server.url)
        try:
            await transport.ensure_group(keys)
            calls = [CallRequests(keys.inbox("c"), 60_000, ["r1"], [b"\x01"])]
            await transport.enqueue(keys, calls, UNBOUNDED)
            read = client.xreadgroup(keys.group, "", {keys.stream: ">"}, count=1)
            assert len(read[0][1]) == 1  # held by the nameless consumer, which then died
            await asyncio.sleep(0.3)  # past the takeover's minimum idle time
            taken = len(await transport.reclaim(keys, "taker", 200, 10))
            again = len(await transport.reclaim(keys, "taker", 200, 10))
            left = [info["name"] for info in client.xinfo_consumers(keys.stream, keys.group)]
            return taken, again, sorted(left)
        finally:
            await transport.close()

    try:
        with caplog.at_level(logging.WARNING, logger="microbatch.redis"):
            assert run(main()) == (1, 0, [b"", b"taker"])
        said = [r.getMessage() for r in caplog.records if "cannot retire" in r.getMessage()]
        assert len(said) == 1
    finally:
        client.close()


def test_an_entry_another_consumer_claimed_first_under_a_name_not_utf8_is_left_to_it(
    redis_server: RedisServer, prefix: str
) -> None:
    """Between the takeover's XPENDING and its XCLAIM, a worker in another language, whose
    consumer name is not UTF-8, claimed the dead consumer's entry first: the check of whose
    the entry is now decoded that name and killed the worker."""
    keys = ModelKeys("m", prefix)
    client = redis_server.client()

    async def main() -> tuple[int, list[bytes]]:
        transport = RedisTransport(redis_server.url)
        xclaim = transport.redis.xclaim

        async def claimed_first(*args: Any, **kwargs: Any) -> Any:
            ids = args[4]
            client.xclaim(keys.stream, keys.group, b"\xfe-ruby", 0, ids)  # the foreign worker
            return await xclaim(*args, **kwargs)

        try:
            await transport.ensure_group(keys)
            calls = [CallRequests(keys.inbox("c"), 60_000, ["r1"], [b"\x01"])]
            await transport.enqueue(keys, calls, UNBOUNDED)
            client.xreadgroup(keys.group, "gone", {keys.stream: ">"}, count=1)
            await asyncio.sleep(0.3)  # past the takeover's minimum idle time
            transport.redis.xclaim = claimed_first  # type: ignore[method-assign]
            taken = len(await transport.reclaim(keys, "taker", 200, 10))
            owners = client.xpending_range(keys.stream, keys.group, "-", "+", 10)
            return taken, [row["consumer"] for row in owners]
        finally:
            await transport.close()

    try:
        assert run(main()) == (0, [b"\xfe-ruby"])  # left pending for the one that claimed it
    finally:
        client.close()
