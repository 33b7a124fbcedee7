"""Redis-only behaviour: sharing, isolation, malformed entries, coalescing, fork safety."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import redis

from broker import CodecError, ProtocolError, Streamer
from broker.client import REPLY_WAIT_S
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from broker.protocol import decode_reply, request_fields
from tests.conftest import worker_process
from tests.models import DELAY_ENV, RECORD_ENV, TAG_ENV


def read_records(directory: Path, kind: str) -> list[object]:
    records = []
    for path in directory.glob(f"{kind}-*.jsonl"):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return records


def test_two_workers_and_two_clients_share_a_stream_with_nothing_lost_or_duplicated(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    env = {RECORD_ENV: str(tmp_path), DELAY_ENV: "0.01"}  # a batch takes a while: both work
    # 1000 items are submitted at once: more than the default bound (8 batches per worker)
    args = ("--workers", "2", "--batch-size", "16", "--max-queue-items", "0")
    with worker_process(
        redis_server.url, "tests.models:Toy", prefix, *args, env=env, expect_consumers=2
    ):
        clients = [Streamer("toy", redis_url=redis_server.url, prefix=prefix) for _ in range(2)]
        results: dict[int, list[list[dict[str, object]]]] = {0: [], 1: []}

        def run(client_index: int) -> None:
            client = clients[client_index]
            futures = [
                client.submit([f"c{client_index}-{call}-{i}" for i in range(5)])
                for call in range(100)
            ]
            results[client_index] = [future.result(timeout=60) for future in futures]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for client in clients:
            client.close()

    sent = {f"c{c}-{call}-{i}" for c in range(2) for call in range(100) for i in range(5)}
    answered = [out["item"] for c in range(2) for result in results[c] for out in result]
    assert Counter(answered) == Counter(sent)  # every item answered once, with its own result
    computed = Counter(read_records(tmp_path, "items"))
    assert set(computed) == sent and max(computed.values()) == 1  # none computed twice
    pids = {out["pid"] for c in range(2) for result in results[c] for out in result}
    assert len(pids) == 2  # both workers took part
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    assert client.xlen(keys.stream) == 0  # answered entries are deleted
    assert client.xpending(keys.stream, keys.group)["pending"] == 0


def test_prefixes_and_models_never_see_each_others_requests(
    redis_server: RedisServer, prefix: str
) -> None:
    url = redis_server.url
    other = prefix + "-b"
    with (
        worker_process(url, "tests.models:Toy", prefix, env={TAG_ENV: "A"}),
        worker_process(url, "tests.models:Toy", other, env={TAG_ENV: "B"}),
        worker_process(
            url, "tests.models:Toy", prefix, "--name", "toy2", env={TAG_ENV: "C"}, name="toy2"
        ),
    ):
        streamers = {
            "A": Streamer("toy", redis_url=url, prefix=prefix),
            "B": Streamer("toy", redis_url=url, prefix=other),
            "C": Streamer("toy2", redis_url=url, prefix=prefix),
        }
        futures = {tag: s.submit([f"{tag}{i}" for i in range(60)]) for tag, s in streamers.items()}
        for tag, future in futures.items():
            outputs = future.result(timeout=30)
            assert {out["tag"] for out in outputs} == {tag}
            assert [out["item"] for out in outputs] == [f"{tag}{i}" for i in range(60)]
        for streamer in streamers.values():
            streamer.close()


class _Exploit:
    """Unpickling this would create a file: proof that a pickle was executed."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_malformed_entries_are_answered_or_dead_lettered_and_never_executed(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    marker = tmp_path / "pwned"
    reply = keys.inbox("raw")

    def add(**fields: object) -> None:
        client.xadd(keys.stream, fields)  # type: ignore[arg-type]

    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        good = request_fields("ok-before", reply, 10_000, msgpack.packb("fine"))
        add(**good)
        add(**request_fields("bad-msgpack", reply, 10_000, b"\xc1\xff\x00"))
        add(**request_fields("pickle", reply, 10_000, pickle.dumps(_Exploit(marker))))
        add(**{**request_fields("future", reply, 10_000, msgpack.packb("x")), "v": "99"})
        add(**{"id": "no-reply-key", "data": b"x"})  # nowhere to answer: dead-lettered
        add(junk=b"\x80\x04")  # not even an id: dead-lettered
        add(**request_fields("ok-after", reply, 10_000, msgpack.packb("still fine")))

        replies = {}
        while len(replies) < 5:
            popped = client.blpop([reply], timeout=20)
            assert popped is not None, f"only got {sorted(replies)}"
            decoded = decode_reply(popped[1])
            replies[decoded.request_id] = decoded

    assert replies["ok-before"].ok and replies["ok-before"].result["item"] == "fine"
    assert replies["ok-after"].ok and replies["ok-after"].result["item"] == "still fine"
    assert replies["bad-msgpack"].error_type == CodecError.__name__
    assert replies["pickle"].error_type == CodecError.__name__
    assert replies["future"].error_type == ProtocolError.__name__
    assert "version" in replies["future"].error_message
    assert not marker.exists()
    dead = client.xrange(keys.dead_letters)
    assert len(dead) == 2
    assert all(b"dead_reason" in fields for _, fields in dead)
    assert client.xlen(keys.stream) == 0


def test_replies_go_only_to_the_models_inboxes_and_never_give_a_key_a_ttl(
    redis_server: RedisServer, prefix: str
) -> None:
    """An entry whose reply key is anything but an inbox of its own model is dead-lettered,
    not answered, and that key is left exactly as it was; an inbox-shaped key that is not a
    list gets no reply and no TTL."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    other_prefix, other_model = ModelKeys("toy", f"{prefix}x"), ModelKeys("other", prefix)
    client.xgroup_create(other_prefix.stream, "workers", id="0", mkstream=True)
    client.xadd(other_prefix.stream, {"queued": "by another tenant"})
    client.rpush(other_model.inbox("c"), b"theirs")
    client.set(keys.queued_bytes, 0)
    client.hset(keys.inbox("a-hash"), "f", "v")
    client.set("elsewhere", "v")
    targets = {  # reply key -> its type, which must not change
        other_prefix.stream: b"stream",  # another prefix's request stream
        other_prefix.dead_letters: b"none",  # another prefix's dead letters
        keys.dead_letters: b"stream",  # its own dead-letter stream (stream once it has one)
        keys.queued_bytes: b"string",  # its own counter
        other_model.inbox("c"): b"list",  # another model's inbox
        "elsewhere": b"string",  # not microbatch's at all
        keys.reply_namespace: b"none",  # the namespace itself, with no client part
    }
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        for i, target in enumerate(targets):
            client.xadd(keys.stream, request_fields(f"bad-{i}", target, 10_000, b"\xa1x"))
        client.xadd(keys.stream, request_fields("hash", keys.inbox("a-hash"), 10_000, b"\xa1x"))
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        assert streamer.predict(["innocent"])[0]["item"] == "innocent"
        streamer.close()
        deadline = time.monotonic() + 10
        while client.xlen(keys.stream) and time.monotonic() < deadline:
            time.sleep(0.05)
    dead = client.xrange(keys.dead_letters)
    assert sorted(fields[b"id"].decode() for _, fields in dead) == [
        f"bad-{i}" for i in range(len(targets))
    ]
    reason = f"reply key outside this model's inboxes ({keys.reply_namespace}*)"
    assert {fields[b"dead_reason"].decode() for _, fields in dead} == {reason}
    for target, kind in targets.items():
        assert client.type(target) == kind, target
        assert client.ttl(target) in (-1, -2), target  # no TTL, or no key at all
    assert client.xlen(other_prefix.stream) == 1  # their queued request, untouched
    assert client.lrange(other_model.inbox("c"), 0, -1) == [b"theirs"]
    assert client.get("elsewhere") == b"v" and client.xlen(keys.stream) == 0
    assert int(client.get(keys.queued_bytes) or 0) == 0  # uncounted bare XADDs: floored at 0
    # inbox-shaped, but not a list: allowed as a reply key, refused by mb_reply
    assert client.type(keys.inbox("a-hash")) == b"hash" and client.ttl(keys.inbox("a-hash")) == -1
    assert client.hgetall(keys.inbox("a-hash")) == {b"f": b"v"}


def _command_calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def test_concurrent_submits_are_coalesced_into_few_round_trips(
    redis_server: RedisServer, prefix: str
) -> None:
    admin = redis_server.client()
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--batch-size", "64"):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        streamer.predict(["warm-up"])  # connections made, inbox reader running
        connections_before = admin.info("stats")["total_connections_received"]
        admin.config_resetstat()
        n = 400
        futures = [streamer.submit([f"item-{i}"]) for i in range(n)]
        assert [f.result(timeout=30)[0]["item"] for f in futures] == [f"item-{i}" for i in range(n)]
        xadds = _command_calls(admin, "xadd")
        reply_reads = _command_calls(admin, "blmpop") + _command_calls(admin, "blpop")
        new_connections = admin.info("stats")["total_connections_received"] - connections_before
        core = streamer._thread_core
        assert core is not None
        # every call settled is forgotten: no request id or deadline left behind
        assert not core._pending and len(core._deadlines) == 0
        streamer.close()
    # the items of each round trip share multi-item entries: far fewer entries than items
    assert xadds <= n // 4
    # one inbox per process: replies are read in bulk, not one blocking call per request
    assert reply_reads <= n // 4
    # n concurrent submits went over a handful of connections: pipelined, not one each
    assert new_connections <= 4


def test_many_threads_calling_in_a_loop_each_get_their_own_results(
    redis_server: RedisServer, prefix: str
) -> None:
    # Batches of replies wake their threads one after another while other batches arrive,
    # predict and submit mixed: each thread gets its own results, and no call is left held.
    threads, calls = 80, 30
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--batch-size", "128"):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        streamer.predict(["warm-up"])
        wrong: list[tuple[str, object]] = []

        def run(index: int) -> None:
            for call in range(calls):
                item = f"t{index}-{call}"
                if call % 3 == 0:
                    got = streamer.submit([item, "x"], timeout=30).result(timeout=30)
                else:
                    got = streamer.predict([item, "x"], timeout=30)
                if [out["item"] for out in got] != [item, "x"]:
                    wrong.append((item, got))

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
        assert not any(worker.is_alive() for worker in workers)
        assert wrong == []
        core = streamer._thread_core
        assert core is not None
        assert not core._pending and len(core._deadlines) == 0
        assert not core._incoming._held  # every batch's last thread let its calls go
        streamer.close()


def _blocked_reply_reads(admin: redis.Redis) -> int:
    """Connections blocked in Redis on a reply read (BLMPOP, BLPOP) right now."""
    clients = admin.client_list()
    return sum(1 for c in clients if c["cmd"] in ("blmpop", "blpop") and "b" in c["flags"])


def test_the_reply_read_waits_in_redis_between_calls_and_leaves_when_idle(
    redis_server: RedisServer, prefix: str
) -> None:
    admin = redis_server.client()
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        assert streamer.predict(["one"])[0]["item"] == "one"
        time.sleep(0.1)
        # the next call of this caller will find its read already waiting
        assert _blocked_reply_reads(admin) == 1
        deadline = time.monotonic() + REPLY_WAIT_S * 3 + 5
        while _blocked_reply_reads(admin) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _blocked_reply_reads(admin) == 0  # idle: no read left blocking
        assert streamer.predict(["two"])[0]["item"] == "two"  # and a new one starts on demand
        streamer.close()
    admin.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_client_shared_across_a_fork_works_in_the_child(
    redis_server: RedisServer, prefix: str
) -> None:
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        assert streamer.predict(["parent"])[0]["item"] == "parent"
        pid = os.fork()
        if pid == 0:  # the child: same Streamer object, fresh connections and loop
            code = 1
            try:
                outputs = streamer.predict(["child-1", "child-2"], timeout=20)
                code = 0 if [o["item"] for o in outputs] == ["child-1", "child-2"] else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert streamer.predict(["parent-again"])[0]["item"] == "parent-again"
        streamer.close()


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "bounded"])
def test_a_call_reaches_an_idle_worker_whole_in_one_batch(
    redis_server: RedisServer, prefix: str, bounded: bool
) -> None:
    """The enqueue is one atomic step (a transaction, or the bound-checking script): a worker
    blocked on the stream wakes once, to every item of the call."""
    bound = {"max_queue_items": 10_000} if bounded else {}
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--batch-size", "64"):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix, **bound)
        streamer.predict(["warm-up"])
        time.sleep(0.2)  # the worker is blocked on the stream again
        outputs = streamer.predict([f"item-{i}" for i in range(40)])
        streamer.close()
    assert [o["item"] for o in outputs] == [f"item-{i}" for i in range(40)]
    assert {(o["batch_no"], o["batch"]) for o in outputs} == {(outputs[0]["batch_no"], 40)}
