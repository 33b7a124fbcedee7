"""Packed reply elements (docs/protocol.md, section 7.1): the replies of one batch to one reply
key, for items of multi-item entries, in one list element; every other reply alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest

from broker import Streamer, codec
from broker.devserver import RedisServer
from broker.errors import CodecError, DeadlineExceeded, ModelError, ProtocolError
from broker.functions import ENQUEUE
from broker.keys import ModelKeys
from broker.protocol import CallRequests, Reply, decode_reply, encode_error, encode_result
from broker.redis_transport import RedisTransport, _packable, _reply_calls
from broker.reply_elements import (
    MAX_ELEMENT_BYTES,
    MAX_ELEMENT_REPLIES,
    _decode_array_results,
    decode_any,
    decode_element,
    is_packed,
    pack,
    reply_id,
)
from broker.transport import UNBOUNDED
from tests.conftest import wait_until, worker_process


def arrays(count: int, size: int = 3) -> list[np.ndarray]:
    return [np.arange(size, dtype=np.float32) + i for i in range(count)]


def routed(element: bytes) -> list[Reply]:
    replies = decode_element(element)
    assert all(isinstance(reply, Reply) for reply in replies)
    return replies  # type: ignore[return-value]


# -- the element's form --------------------------------------------------------------------------
def test_a_packed_element_is_an_array_of_the_reply_maps_as_they_were() -> None:
    maps = [encode_result(f"c.{i}", {"n": i}) for i in range(3)]
    (element,) = pack(maps)
    assert is_packed(element) and not any(is_packed(m) for m in maps)
    assert msgpack.unpackb(element) == [msgpack.unpackb(m) for m in maps]
    assert element == b"\x93" + b"".join(maps)


def test_a_lone_reply_goes_as_its_map() -> None:
    reply = encode_result("c.0", 1)
    assert pack([reply]) == [reply]
    assert pack([]) == []


def test_sixteen_replies_and_more_take_the_array16_header() -> None:
    maps = [encode_result(f"c.{i}", i) for i in range(40)]
    (element,) = pack(maps)
    assert element[:3] == b"\xdc\x00\x28"
    assert [r.result for r in routed(element)] == list(range(40))


def test_elements_are_capped_in_replies_and_bytes() -> None:
    maps = [encode_result(f"c.{i}", i) for i in range(MAX_ELEMENT_REPLIES + 3)]
    first, second = pack(maps)
    assert len(routed(first)) == MAX_ELEMENT_REPLIES and len(routed(second)) == 3
    big = encode_result("c.big", b"x" * MAX_ELEMENT_BYTES)
    small = [encode_result("c.a", 1), encode_result("c.b", 2)]
    elements = pack([small[0], big, small[1]])
    # the big one ends the group before it, and goes alone (as its map); the last, alone too
    assert elements == [small[0], big, small[1]]
    assert [is_packed(e) for e in elements] == [False, False, False]


def test_reply_id_reads_the_id_of_every_reply_this_package_encodes() -> None:
    long_id = "host-" + "x" * 60 + ".7"
    for rid in ("c.1", long_id):
        assert reply_id(encode_result(rid, arrays(1)[0])) == rid.encode()
        assert reply_id(encode_result(rid, {"a": 1})) == rid.encode()
        assert reply_id(encode_error(rid, ModelError("boom"))) == rid.encode()
    assert reply_id(msgpack.packb({"ok": True, "id": "c.1"})) is None  # id not first
    assert reply_id(b"") is None and reply_id(b"\x83\xa2id") is None


# -- reading elements -----------------------------------------------------------------------------
def test_array_results_are_read_each_with_its_own_bytes() -> None:
    results = arrays(20, size=256)
    element = pack([encode_result(f"c.{i}", r) for i, r in enumerate(results)])[0]
    replies = routed(element)
    assert _decode_array_results(element) is not None  # read without msgpack
    assert [r.request_id for r in replies] == [f"c.{i}" for i in range(20)]
    for reply, expected in zip(replies, results, strict=True):
        assert reply.ok and reply.result.dtype == np.float32
        np.testing.assert_array_equal(reply.result, expected)
        # its own bytes: one result kept does not keep the whole element alive
        assert len(reply.result.base) < len(element) // 10


def test_mixed_replies_are_read_through_msgpack_each_as_its_map_says() -> None:
    maps = [
        encode_result("c.0", arrays(1)[0]),
        encode_error("c.1", DeadlineExceeded("late")),
        encode_result("c.2", {"label": "pos"}),
        msgpack.packb({"id": "c.3", "ok": "yes"}),  # malformed: fails its item alone
        msgpack.packb([1, 2]),  # not a map: nothing routes it
    ]
    replies = decode_element(pack(maps)[0])
    assert [type(r) for r in replies] == [Reply] * 4 + [ProtocolError]
    first, late, label, odd = replies[:4]
    np.testing.assert_array_equal(first.result, arrays(1)[0])  # type: ignore[union-attr]
    assert (late.ok, late.error_type) == (False, "DeadlineExceeded")  # type: ignore[union-attr]
    assert label.result == {"label": "pos"}  # type: ignore[union-attr]
    assert odd.error_type == "ProtocolError" and "malformed reply" in odd.error_message  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "element",
    [b"\x92\xc1", b"\x93" + encode_result("c.0", 1), b"\x91\x83", b"\xdc\x00"],
)
def test_an_unreadable_element_raises_codec_error(element: bytes) -> None:
    with pytest.raises(CodecError):
        decode_element(element)


def test_a_truncated_array_result_falls_back_and_fails_the_element() -> None:
    element = pack([encode_result(f"c.{i}", r) for i, r in enumerate(arrays(3))])[0]
    with pytest.raises(CodecError):
        decode_element(element[:-1])
    with pytest.raises(CodecError):  # a trailing byte: not an array of exactly its replies
        decode_element(element + b"\x00")


def test_decode_any_reads_both_forms() -> None:
    single = encode_result("c.0", 5)
    assert [r.result for r in decode_any(single)] == [5]  # type: ignore[union-attr]
    assert [r.result for r in decode_any(pack([single, single])[0])] == [5, 5]  # type: ignore[union-attr]
    with pytest.raises(ProtocolError):
        decode_any(msgpack.packb({"no": "id"}))


# -- which replies the worker packs --------------------------------------------------------------
def test_only_replies_to_items_of_v2_entries_share_an_element() -> None:
    inbox, other = "mb:{p:m}:inbox:c", "mb:{p:m}:inbox:f"
    entries = [
        ("1-0#0", {b"id": b"c.0", b"reply": inbox.encode()}),
        ("1-0#1@1", {b"id": b"c.1", b"reply": inbox.encode()}),  # tagged with its partition
        ("2-0", {b"id": b"c.2", b"reply": inbox.encode()}),  # a v1 entry to the same inbox
        ("3-0", {b"id": b"f.0", b"reply": other.encode()}),
    ]
    replies = [
        (inbox, encode_result("c.0", 0)),
        (other, encode_result("f.0", 3)),
        (inbox, encode_result("c.2", 2)),
        (inbox, encode_error("c.1", ModelError("boom"))),
    ]
    assert _packable(entries) == {inbox: {b"c.0", b"c.1"}}  # by id: a v1 entry names it too
    assert _packable(entries[:2]) == {inbox: None}  # only items of v2 entries name it
    (call,) = _reply_calls(replies, 60, _packable(entries))
    assert call.keys == [inbox, other] and call.args[:3] == [60, 2, 1]
    single, packed, alone = call.args[3:]
    assert decode_reply(single).request_id == "c.2" and decode_reply(alone).result == 3
    assert [(r.request_id, r.ok) for r in routed(packed)] == [("c.0", True), ("c.1", False)]
    # without entries (a poison reply, a test's own), every reply goes alone
    assert len(_reply_calls(replies, 60)[0].args) == 2 + len(replies) + 1


# -- on a real Redis, with a real worker ---------------------------------------------------------
def enqueue_v1_by_hand(client, keys: ModelKeys, inbox: str, rid: str, data: bytes) -> None:  # type: ignore[no-untyped-def]
    """A foreign caller's FCALL mb_enqueue of library version 1: a v1 entry."""
    keys_of_call = (keys.stream, keys.queued_bytes, keys.queue_bound, keys.consumers)
    result = client.execute_command(
        "FCALL", ENQUEUE, 4, *keys_of_call, 1, 0, 0, 1, inbox, 30000, "", rid, data
    )
    assert result[0][0] == 0


def inbox_elements(client, inbox: str, items: int, timeout: float = 30.0) -> list[bytes]:  # type: ignore[no-untyped-def]
    """The elements of an inbox once they hold ``items`` replies."""

    def count() -> int:
        return sum(len(decode_any(e)) for e in client.lrange(inbox, 0, -1))

    wait_until(lambda: count() >= items, timeout, f"{items} replies on {inbox}")
    return list(client.lrange(inbox, 0, -1))


def test_a_packed_burst_is_answered_in_fewer_elements_and_v1_entries_one_map_each(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("hosttagged", prefix)
    client = redis_server.client()
    inbox, foreign = keys.inbox("c"), keys.inbox("f")
    items = [[float(i), float(-i)] for i in range(20)]
    calls = [
        CallRequests(inbox, 30_000, [f"c.{i}"], [codec.encode(np.array(x, dtype=np.float32))])
        for i, x in enumerate(items)
    ]

    async def enqueue() -> None:
        transport = RedisTransport(redis_server.url, entry_items=32)
        try:
            await transport.enqueue(keys, calls, UNBOUNDED)
        finally:
            await transport.close()

    asyncio.run(enqueue())
    for i in range(3):
        enqueue_v1_by_hand(client, keys, foreign, f"f.{i}", codec.encode([float(i), 1.0]))
    enqueue_v1_by_hand(client, keys, inbox, "c.v1", codec.encode([5.0, 5.0]))
    assert [f[b"v"] for _, f in client.xrange(keys.stream)] == [b"2", b"1", b"1", b"1", b"1"]
    with worker_process(redis_server.url, "tests.models:HostTagged", prefix, "--batch-size", "64"):
        elements = inbox_elements(client, inbox, 21)
        foreign_elements = inbox_elements(client, foreign, 3)
        wait_until(lambda: client.xlen(keys.stream) == 0, 10, "the entries' acks")
    # the burst's 20 replies in fewer elements than items; the v1 item's reply alone, a map
    packed = [e for e in elements if is_packed(e)]
    assert packed and len(elements) < 21
    assert sum(len(decode_element(e)) for e in packed) == 20
    (single,) = [e for e in elements if not is_packed(e)]
    assert decode_reply(single).request_id == "c.v1"
    got = {r.request_id: r.result.tolist() for e in packed for r in routed(e)}
    assert got == {f"c.{i}": [2 * x[0], x[1] + 1, 0.0] for i, x in enumerate(items)}
    # a foreign client's v1 entries: one reply map per element, as wire v1 always had
    assert len(foreign_elements) == 3 and not any(is_packed(e) for e in foreign_elements)
    assert sorted(decode_reply(e).request_id for e in foreign_elements) == ["f.0", "f.1", "f.2"]


class _Counting(RedisTransport):
    """A caller's transport that counts the elements it pops."""

    def __init__(self, url: str, popped: list[int]) -> None:
        super().__init__(url, entry_items=32)
        self.popped = popped

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        got = await super().pop_replies(inbox, count, timeout_s)
        self.popped.append(len(got))
        return got


def test_concurrent_callers_each_get_their_own_answer_from_packed_elements(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("hosttagged", prefix)
    client = redis_server.client()
    items = [[float(i), float(2 * i)] for i in range(200)]
    popped: list[int] = []

    class Counted(Streamer):
        def _make_transport(self) -> RedisTransport:
            return _Counting(self.redis_url, popped)

    async def burst(streamer: Streamer) -> list[list[float]]:
        outs = await asyncio.gather(*(streamer.apredict([x]) for x in items))
        return [out[0].tolist() for out in outs]

    worker = worker_process(
        redis_server.url, "tests.models:HostTagged", prefix, "--batch-size", "64"
    )
    with worker, Counted("hosttagged", redis_url=redis_server.url, prefix=prefix) as streamer:
        out = asyncio.run(burst(streamer))
    assert out == [[2 * x[0], x[1] + 1, 0.0] for x in items]
    assert int(client.xinfo_stream(keys.stream)["entries-added"]) < len(items)
    assert sum(popped) < len(items)  # the replies came packed: fewer elements than calls


def test_a_foreign_reply_holding_a_value_the_codec_refuses_fails_its_item_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """A worker in another language sends an array of a dtype off the codec's list (`>f4`):
    its call waited for its deadline, the reply dropped as unreadable although its id was
    plain; the item now fails with ProtocolError at once, and its element-mate is routed."""
    from broker import functions

    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    functions.load(client)
    client.xgroup_create(keys.stream, "workers", id="0", mkstream=True)
    big_endian = msgpack.ExtType(1, b"\x03>f4\x01" + (1).to_bytes(8, "little") + b"?\x80\x00\x00")
    with Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True) as s:
        for packed in (True, False):
            future = s.submit(["a", "b"], timeout=120)
            read = client.xreadgroup("workers", "foreign", {keys.stream: ">"}, block=10_000)
            ((_, ((_, fields),)),) = read
            ids = [fields[f"id.{i}".encode()].decode() for i in (0, 1)]
            bad = msgpack.packb({"id": ids[1], "ok": True, "result": big_endian})
            good = msgpack.packb({"id": ids[0], "ok": True, "result": "fine"})
            elements = [b"\x92" + good + bad] if packed else [good, bad]
            counts = [len(elements)]
            client.fcall("mb_reply", 1, fields[b"reply"], 2, 60, *counts, *elements)  # type: ignore[arg-type]
            with pytest.raises(ProtocolError, match="dtype '>f4'") as failed:
                future.result(timeout=30)
            assert failed.value.index == 1


def _foreign_streamer(redis_server: RedisServer, prefix: str) -> tuple[Any, Streamer]:
    """A Redis client that plays a foreign worker of model ``toy`` (its group made), and a
    Streamer whose calls it answers."""
    from broker import functions

    client = redis_server.client()
    functions.load(client)
    client.xgroup_create(ModelKeys("toy", prefix).stream, "workers", id="0", mkstream=True)
    return client, Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)


def _second_item_fails_at_once(
    client: Any, streamer: Streamer, result: Callable[[dict[bytes, bytes]], bytes], match: str,
    packed: bool = False,
) -> None:  # fmt: skip
    """Answer a call of two items as a foreign worker would, the first right, the second with
    ``result`` (the msgpack of the reply's `result`, made from the entry's fields): the
    second item must fail with ProtocolError at once, saying ``match``, the call's own timeout
    being 120 s."""
    future = streamer.submit(["a", "b"], timeout=120)
    read = client.xreadgroup("workers", "ruby", {streamer.keys.stream: ">"}, block=10_000)
    ((_, ((_, fields),)),) = read
    ids = [fields[f"id.{i}".encode()].decode() for i in (0, 1)]
    # {"id" => id, "ok" => true, "result" => ...}, as msgpack-ruby packs it
    head = msgpack.packb({"id": ids[1], "ok": True})
    bad = b"\x83" + head[1:] + b"\xa6result" + result(fields)
    good = msgpack.packb({"id": ids[0], "ok": True, "result": "fine"})
    elements = [b"\x92" + good + bad] if packed else [good, bad]
    client.fcall("mb_reply", 1, fields[b"reply"], 2, 60, len(elements), *elements)
    with pytest.raises(ProtocolError, match=match) as failed:
        future.result(timeout=60)
    assert failed.value.index == 1


def test_a_foreign_reply_over_a_packed_elements_size_holding_a_refused_value_fails_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """A Ruby worker packs its float32 output with `pack("g*")`, big-endian, and says so:
    `>f4`. Over 1 MiB, its reply was dropped as unroutable although its id came first and
    plain, and the call waited for its deadline (HTTP 504 at a gateway); it now fails with
    ProtocolError at once, as a smaller one does, in a packed element too."""
    count = 300_000  # 1.2 MB of data
    data = np.arange(count, dtype=">f4").tobytes()
    header = b"\x03>f4\x01" + count.to_bytes(8, "little")
    big_endian = msgpack.packb(msgpack.ExtType(1, header + data))
    assert len(big_endian) > MAX_ELEMENT_BYTES
    client, streamer = _foreign_streamer(redis_server, prefix)
    with streamer:
        for packed in (False, True):
            _second_item_fails_at_once(
                client, streamer, lambda _: big_endian, "dtype '>f4'", packed
            )


def test_a_foreign_reply_whose_result_has_array_or_map_keys_fails_its_item_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """A Ruby model's Hash may have any value as a key (bigram counts: `{["a", "b"] => 2}`),
    which no Python dict can hold: the reply was dropped as unroutable although its id was
    plain, and the call waited for its deadline. It now fails with ProtocolError at once."""
    array_key = b"\x81\x92\xcb" + np.float64(1).tobytes()[::-1] + b"\xcb" + bytes(8) + b"\x01"
    map_key = b"\x81\x81\xa1k\xcb" + np.float64(1).tobytes()[::-1] + b"\x01"
    client, streamer = _foreign_streamer(redis_server, prefix)
    with streamer:
        for result, packed in ((array_key, False), (map_key, False), (array_key, True)):
            _second_item_fails_at_once(
                client, streamer, lambda _, r=result: r, "map key is an array or a map", packed
            )


def test_a_foreign_reply_holding_a_str_that_is_not_utf8_fails_its_item_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """Ruby's redis client reads every value as a String tagged UTF-8, bytes or not, and its
    msgpack packs such a String as a str: a Ruby worker that echoes what it read (the item's
    data) sends a str that is not UTF-8. The reply was dropped as unroutable although its id
    was plain, and the call waited for its deadline; it now fails with ProtocolError at once,
    saying what is wrong."""

    def echo(fields: dict[bytes, bytes]) -> bytes:  # {"echo" => data}, data packed as a str
        echoed = fields[b"data.1"] + b"\xc7\x15"
        return b"\x81\xa4echo" + bytes([0xA0 | len(echoed)]) + echoed

    client, streamer = _foreign_streamer(redis_server, prefix)
    with streamer:
        for packed in (False, True):
            _second_item_fails_at_once(
                client, streamer, echo, "str holds bytes that are not UTF-8", packed
            )


def test_a_reply_with_more_containers_than_the_codec_reads_fails_its_item_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """A result of over 2**20 arrays and maps (a Ruby model's Array.new(2**20 + 1) { [] }, or a
    Python model's list of as many dicts: the worker sends it, the caller's codec refuses it)
    was dropped as unroutable although its id came first, and the call waited for its
    deadline. It now fails with ProtocolError at once, saying why."""
    many = codec.DEFAULT_MAX_CONTAINERS + 1
    arrays = b"\xdd" + many.to_bytes(4, "big") + b"\x90" * many
    client, streamer = _foreign_streamer(redis_server, prefix)
    with streamer:
        _second_item_fails_at_once(
            client, streamer, lambda _: arrays, "more than 1048576 arrays and maps"
        )
