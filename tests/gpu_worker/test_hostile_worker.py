"""A real `worker start` fed hostile stream entries (raw XADDs, as anyone allowed to XADD could
write them) under innocent load from a Streamer: no process dies or restarts, every innocent
call gets its right answer, every hostile entry gets one typed answer or a dead letter, and
nothing is left pending. Also: entries with timeout 0 are never computed.

docs/reliability.md ("Hostile input") quotes the counts these tests use.
"""

from __future__ import annotations

import json
import os
import random
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import redis

from broker import Streamer, codec
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from broker.liveness import live_consumers
from broker.protocol import decode_reply, request_fields
from tests.conftest import worker_process


def array_ext(shape: tuple[int, ...], dtype: bytes = b"<f4", data: bytes = b"") -> Any:
    """An array (msgpack ext type 1) with any header at all."""
    body = bytes([len(dtype)]) + dtype + bytes([len(shape)])
    body += b"".join(struct.pack("<Q", dim) for dim in shape) + data
    return msgpack.ExtType(1, body)


def bare_array(shape: tuple[int, ...], dtype: bytes = b"<f4", data: bytes = b"") -> bytes:
    """A payload that is one such array (the codec's fast path)."""
    return msgpack.packb(array_ext(shape, dtype, data))


KILLER_SHAPES = [
    (0, 2**64 - 1),
    (2**32, 2**32, 0),
    (0, 2**63),
    (2**63, 0),
    (0, 2**62, 4),
    (2**64 - 1, 2**64 - 1, 0, 2**64 - 1),
    (1, 0, 2**61),
    (0,) * 31 + (2**64 - 1,),
    (2**40, 0, 2**40),
    (0, 2**63 - 1),
]  # every one of these killed a worker child before the decode boundary


Case = tuple[str, bytes, dict[bytes, bytes | None], str]


def hostile_cases() -> list[Case]:
    """(category, data, fields changed from a valid entry (None: removed), expected outcome):
    the outcome is an error type, "ok" or "dead" (dead-lettered)."""
    rng = random.Random(7)
    cases: list[Case] = []
    for shape in KILLER_SHAPES:
        category = "array header: a zero dim beside huge dims, bare (24 bytes and up)"
        cases.append((category, bare_array(shape), {}, "CodecError"))
        category = "array header: the same, inside a map"
        cases.append((category, msgpack.packb({"x": array_ext(shape)}), {}, "CodecError"))
    for shape, dtype, data in [
        ((2**63 + 5,), b"<f4", b""),  # a dim of 2**63 and more
        ((2**33, 2**33), b"|u1", b""),  # a product that overflows 64 bits
        ((4,), b"<f4", bytes(15)),  # byte count one short
        ((4,), b"<f4", bytes(17)),  # one long
        ((4,), b"|O", bytes(32)),  # object dtype
        ((4,), b">f4", bytes(16)),  # big-endian
        ((4,), b"<U4", bytes(64)),  # strings
        ((4,), b"\xff\xfe", bytes(16)),  # not ASCII
        ((1,) * 33, b"<f4", bytes(4)),  # more than 32 dims
    ]:
        category = "array header: a dim of 2**63+, overflowing product, bad byte count/dtype/ndim"
        cases.append((category, bare_array(shape, dtype, data), {}, "CodecError"))
    for _ in range(20):
        data = b"\xc1" + bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        cases.append(("data: random bytes (never msgpack)", data, {}, "CodecError"))
    for item in (
        np.zeros((2, 4), np.float32),
        np.zeros(3, np.float32),
        [1.0] * 5,
        "text",
        {"a": 1},
        None,
        [True] * 4,
        np.zeros(4, np.complex64),
    ):
        category = "data: valid msgpack, not the model's FP32 [4]"
        cases.append((category, codec.encode(item), {}, "InvalidInput"))
    fine = msgpack.packb([1.0, 2.0, 3.0, 4.0])
    garbage = {b"v": b"\x91", b"id": b"\xc3\x28", b"reply": b"\xa0", b"timeout": b"\xff"}
    cases += [
        ("v: missing", fine, {b"v": None}, "ProtocolError"),
        ("v: 2", fine, {b"v": b"2"}, "ProtocolError"),
        ("v: 1 MB, not UTF-8", fine, {b"v": b"\xff" * 1_000_000}, "ProtocolError"),
        ("timeout: negative", fine, {b"timeout": b"-5"}, "ProtocolError"),
        ("timeout: not digits", fine, {b"timeout": b"\xb2\x00"}, "ProtocolError"),
        ("timeout: missing", fine, {b"timeout": None}, "ProtocolError"),
        ("timeout: 10**30", fine, {b"timeout": b"1" + b"0" * 30}, "ok"),
        ("timeout: 5,000 digits", fine, {b"timeout": b"9" * 5000}, "ok"),
        ("data: missing", fine, {b"data": None}, "ProtocolError"),
        ("traceparent: garbage", fine, {b"traceparent": b"\xff\n\x1b[31m"}, "ok"),
        ("extra fields: garbage", fine, {b"\xff": b"\x00" * 100, b"junk": b"\xc1"}, "ok"),
        ("id: not UTF-8", fine, {b"id": b"\xff\xfe"}, "dead"),
        ("id: empty", fine, {b"id": b""}, "dead"),
        ("id: missing", fine, {b"id": None}, "dead"),
        ("reply: not UTF-8", fine, {b"reply": b"\xffinbox"}, "dead"),
        ("reply: missing", fine, {b"reply": None}, "dead"),
        ("every field garbage", b"\x00", garbage, "dead"),
        ("a 24-byte killer and no reply key", bare_array((0, 2**64 - 1)), {b"reply": None}, "dead"),
    ]
    return cases


def hostile_entries(keys: ModelKeys) -> list[tuple[str, dict[bytes, bytes], str]]:
    """The cases as stream entries (ids ``hostile-<n>``, replies to one inbox)."""
    entries = []
    for n, (category, data, changes, expected) in enumerate(hostile_cases()):
        fields = request_fields(f"hostile-{n}", keys.inbox("hostile"), 30_000, data)
        entry = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
        for name, value in changes.items():
            if value is None:
                entry.pop(name, None)
            else:
                entry[name] = value
        entries.append((category, entry, expected))
    return entries


def child_pids(client: redis.Redis, keys: ModelKeys) -> set[str]:
    """Every consumer the worker's supervisor ever vouched for (`<host>-<child pid>`): a child
    restarted would add one."""
    return {member.decode() for member in client.zrange(keys.consumers, 0, -1)}


def test_a_worker_fed_hostile_entries_under_load_keeps_its_processes_and_its_answers(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    client = redis_server.client()
    keys = ModelKeys("doubler", prefix)
    hostile = hostile_entries(keys)
    log_path = tmp_path / "worker.log"
    with worker_process(
        redis_server.url, "tests.gateway_models:Doubler", prefix, "--max-deliveries", "1",
        # raw XADDs skip the bound but count against it: room for them and the innocent calls
        "--max-queue-items", "1000", log_path=log_path,
    ) as worker:  # fmt: skip
        children = child_pids(client, keys)
        assert len(children) == 1
        child_pid = int(next(iter(children)).rsplit("-", 1)[1])
        streamer = Streamer("doubler", redis_url=redis_server.url, prefix=prefix, timeout=60)
        innocent: list[Any] = []
        errors: list[BaseException] = []

        def load() -> None:  # innocent calls of 1 to 4 items, 4 at a time in flight
            try:
                for n in range(60):
                    batch = [np.full(4, n * 10 + i, np.float32) for i in range(n % 4 + 1)]
                    innocent.append((batch, streamer.submit(batch)))
                    if len(innocent) >= 4:
                        innocent[-4][1].result(timeout=60)
            except BaseException as exc:
                errors.append(exc)

        loader = threading.Thread(target=load)
        loader.start()
        for _, fields, _ in hostile:
            client.xadd(keys.stream, fields)  # type: ignore[arg-type]
            time.sleep(0.002)  # interleaved with the innocent load
        loader.join(120)
        assert not errors and not loader.is_alive()
        for batch, future in innocent:
            for item, out in zip(batch, future.result(timeout=60), strict=True):
                np.testing.assert_array_equal(out, item * 2)
        streamer.close()

        expected_replies = sum(1 for _, _, outcome in hostile if outcome != "dead")
        answers = {}
        while len(answers) < expected_replies:
            popped = client.blpop([keys.inbox("hostile")], timeout=20)
            assert popped is not None, f"{len(answers)} of {expected_replies} hostile replies"
            reply = decode_reply(popped[1])
            assert reply.request_id not in answers  # one answer each
            answers[reply.request_id] = reply
        deadline = time.monotonic() + 20
        while client.xlen(keys.dead_letters) < len(hostile) - expected_replies:
            assert time.monotonic() < deadline, "dead letters missing"
            time.sleep(0.05)

        # nothing pending, nothing queued, nobody restarted
        assert client.xlen(keys.stream) == 0
        assert client.xpending(keys.stream, keys.group)["pending"] == 0
        assert worker.poll() is None
        os.kill(child_pid, 0)  # the same child process is alive
        assert child_pids(client, keys) == children
        assert live_consumers(client, keys) == list(children)

    dead = client.xrange(keys.dead_letters)
    assert len(dead) == len(hostile) - expected_replies
    assert {fields[b"dead_reason"] for _, fields in dead} == {
        b"malformed entry: no readable request id or reply key"
    }
    table: Counter[tuple[str, str]] = Counter()
    for n, (category, _, expected) in enumerate(hostile):
        if expected == "dead":
            table[(category, "dead-lettered")] += 1
            continue
        reply = answers[f"hostile-{n}"]
        got = "ok" if reply.ok else reply.error_type
        assert got == expected, (category, reply)
        table[(category, got)] += 1
    outcomes: Counter[str] = Counter()
    for (_, outcome), count in table.items():
        outcomes[outcome] += count
    # the figures of docs/reliability.md, "Hostile input"
    assert outcomes == {
        "CodecError": 49, "InvalidInput": 8, "ProtocolError": 7, "ok": 4, "dead-lettered": 7
    }  # fmt: skip
    assert sum(len(batch) for batch, _ in innocent) == 150
    log = log_path.read_text()
    assert "Traceback" not in log and "restart" not in log.lower()
    assert max(map(len, log.splitlines())) < 500  # a field is quoted short (the 1 MB 'v')
    print(json.dumps({f"{c} -> {o}": n for (c, o), n in table.items()}, indent=1))


def test_entries_with_timeout_0_are_never_computed(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    record = tmp_path / "record"
    record.mkdir()
    reply = keys.inbox("zero")
    env = {"MICROBATCH_TEST_RECORD_DIR": str(record)}
    with worker_process(redis_server.url, "tests.models:Toy", prefix, env=env):
        replies = []
        for n in range(30):  # one at a time, so each wakes a worker blocked in its read
            client.xadd(keys.stream, request_fields(f"zero-{n}", reply, 0, msgpack.packb(n)))
            popped = client.blpop([reply], timeout=20)
            assert popped is not None
            replies.append(decode_reply(popped[1]))
        client.xadd(keys.stream, request_fields("control", reply, 10_000, msgpack.packb("c")))
        popped = client.blpop([reply], timeout=20)
        assert popped is not None and decode_reply(popped[1]).ok  # the worker does compute
    assert [(r.request_id, r.error_type) for r in replies] == [
        (f"zero-{n}", "DeadlineExceeded") for n in range(30)
    ]
    lines = [
        line for path in record.glob("items-*.jsonl") for line in path.read_text().splitlines()
    ]
    computed = [json.loads(line) for line in lines]
    assert computed == ["c"]


def test_an_entry_id_from_the_future_does_not_hold_the_batches_behind_it(
    redis_server: RedisServer, prefix: str
) -> None:
    """A caller may XADD with an id of its choosing: one an hour ahead made a worker with a
    max latency wait until that hour had passed before answering anything (and every later
    entry, given a later id still by Redis, did the same)."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    reply = keys.inbox("future")
    now_ms = int(client.time()[0]) * 1000
    future = f"{now_ms + 3_600_000}-0"
    client.xadd(keys.stream, request_fields("ahead", reply, 30_000, msgpack.packb(1)), id=future)
    with (
        worker_process(redis_server.url, "tests.models:Toy", prefix, "--max-latency", "0.05"),
        Streamer("toy", redis_url=redis_server.url, prefix=prefix, timeout=10) as streamer,
    ):
        popped = client.blpop([reply], timeout=10)
        assert popped is not None and decode_reply(popped[1]).request_id == "ahead"
        assert [out["item"] for out in streamer.predict(["a", "b"])] == ["a", "b"]


def test_a_payload_of_empty_arrays_is_refused_as_it_decodes(
    redis_server: RedisServer, prefix: str
) -> None:
    """Each empty msgpack array or map is one byte of a payload and a Python list or dict of
    64 bytes or more: a 16 MiB payload of them, XADDed straight into a stream, grew a worker
    by 1.7 GB (and one of 64 MiB, the message limit, would have taken about 7 GB). The decode
    now stops one past codec.DEFAULT_MAX_CONTAINERS: CodecError, and the worker grows by
    little more than the entry it read."""
    client = redis_server.client()
    keys = ModelKeys("doubler", prefix)
    reply = keys.inbox("flood")
    count = 16 * 2**20
    with worker_process(redis_server.url, "tests.gateway_models:Doubler", prefix):
        (member,) = child_pids(client, keys)
        child_pid = int(member.rsplit("-", 1)[1])
        Path(f"/proc/{child_pid}/clear_refs").write_text("5")  # reset the peak
        idle = _status_bytes(child_pid, "VmRSS")
        for n, unit in enumerate((b"\x90", b"\x80")):  # arrays, then maps
            data = b"\xdd" + count.to_bytes(4, "big") + unit * count
            client.xadd(keys.stream, request_fields(f"flood-{n}", reply, 60_000, data))
            popped = client.blpop([reply], timeout=60)
            assert popped is not None
            answer = decode_reply(popped[1])
            assert (answer.request_id, answer.error_type) == (f"flood-{n}", "CodecError")
            assert "arrays and maps" in str(answer.error_message)
        grown = _status_bytes(child_pid, "VmHWM") - idle
        assert grown < 250 * 2**20, f"the worker grew {grown / 2**20:.0f} MB"
        # and it still computes
        client.xadd(keys.stream, request_fields("fine", reply, 60_000, codec.encode([1, 2, 3, 4])))
        popped = client.blpop([reply], timeout=20)
        assert popped is not None and decode_reply(popped[1]).ok


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for {pid}")
