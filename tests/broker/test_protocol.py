"""Keys and wire v1."""

from __future__ import annotations

import numpy as np
import pytest

from broker import codec
from broker.errors import DeadlineExceeded, ModelError, ProtocolError, error_from_wire
from broker.keys import ModelKeys
from broker.protocol import (
    MalformedEntry,
    RequestReader,
    decode_reply,
    encode_error,
    encode_result,
    parse_request,
    request_fields,
)


def as_stream_fields(fields: dict[str, str | bytes]) -> dict[bytes, bytes]:
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


def test_keys_share_one_hash_slot_per_model_and_prefix() -> None:
    keys = ModelKeys("mlp", "channel_1")
    assert keys.stream == "mb:{channel_1:mlp}:requests"
    assert keys.dead_letters == "mb:{channel_1:mlp}:dead"
    assert keys.inbox("c1") == "mb:{channel_1:mlp}:inbox:c1"
    assert keys.heartbeat("w1") == "mb:{channel_1:mlp}:heartbeat:w1"
    tagged = [keys.stream, keys.dead_letters, keys.inbox("x"), keys.heartbeat("y"), keys.consumers]
    assert {key.split("{")[1].split("}")[0] for key in tagged} == {"channel_1:mlp"}
    for bad in ("MLP", "a b", "", "x{y}"):
        with pytest.raises(ValueError):
            ModelKeys(bad)
    with pytest.raises(ValueError):
        ModelKeys("mlp", "a{b}")


def test_a_trailing_newline_makes_no_name_or_prefix() -> None:
    """A prefix read from a file ending in a newline would split `broker acl`'s user lines
    and name keys no tenant's ACL pattern covers: refused, as any other character."""
    from broker import acl

    for bad in ("mlp\n", "pipe.stage\n"):
        with pytest.raises(ValueError, match="invalid model name"):
            ModelKeys(bad)
    with pytest.raises(ValueError, match="invalid prefix"):
        ModelKeys("mlp", "tenant\n")
    with pytest.raises(ValueError, match="invalid prefix"):
        acl.render(["tenant\n"], environ={})


def test_request_round_trip_and_deadline_from_entry_time() -> None:
    fields = as_stream_fields(request_fields("r1", "inbox", 250, codec.encode([1, 2])))
    request = parse_request("1700000000000-3", fields)
    assert request.request_id == "r1" and request.reply_key == "inbox"
    assert request.deadline_ms == 1700000000250
    assert codec.decode(request.data) == [1, 2]


def test_a_reader_parses_a_run_of_entries_as_parse_request_parses_each() -> None:
    good = as_stream_fields(request_fields("r1", "inbox", 250, b"\x90"))
    shared = good[b"reply"]  # the items of a multi-item entry share their reply field
    runs: list[tuple[str | bytes, dict[bytes, bytes]]] = [
        ("1700000000000-3#0", good),
        ("1700000000000-3#1", {**good, b"reply": shared, b"id": b"r2"}),
        ("17000000000001-0", good),  # the time before, and more digits: not the same time
        ("1700000000000-4", {**good, b"reply": b"other"}),
        ("1700000000000-5", {**good, b"reply": b""}),  # malformed: no reply key
        ("1700000000000-6", good),
        ("-7", good),  # malformed: no time
        ("1700000000000-7", {**good, b"reply": b"\xff"}),  # not UTF-8
        ("1700000000000-8", good),
        (b"1700000000001-0", {**good, b"deadline": b"1700000000100"}),
        ("x-1", good),
        ("1700000000001-1", {**good, b"traceparent": b"not one"}),
        ("1700000000001-2", {b"data": b"x"}),
    ]
    reader = RequestReader()
    for entry_id, fields in runs:
        try:
            want: object = parse_request(entry_id, fields)
        except MalformedEntry as exc:
            want = (str(exc), exc.request_id, exc.reply_key)
        try:
            got: object = reader.parse(entry_id, fields)
        except MalformedEntry as exc:
            got = (str(exc), exc.request_id, exc.reply_key)
        assert got == want, entry_id


def test_malformed_entries_say_where_to_answer_when_they_can() -> None:
    good = as_stream_fields(request_fields("r1", "inbox", 250, b"\x90"))
    with pytest.raises(MalformedEntry) as caught:
        parse_request("1-0", {**good, b"v": b"3"})
    assert caught.value.reply_key == "inbox" and "version" in str(caught.value)
    assert caught.value.type == "ProtocolError"
    with pytest.raises(MalformedEntry) as caught:
        parse_request("1-0", {b"data": b"x"})
    assert caught.value.reply_key is None
    with pytest.raises(MalformedEntry):
        parse_request("1-0", {**good, b"timeout": b"soon"})


def test_replies() -> None:
    ok = decode_reply(encode_result("r1", {"a": 1}))
    assert ok.ok and ok.request_id == "r1" and ok.result == {"a": 1}
    err = decode_reply(encode_error("r2", ModelError("ValueError: bad")))
    assert not err.ok and err.error_type == "ModelError"
    rebuilt = error_from_wire(err.error_type, err.error_message, index=3)
    assert isinstance(rebuilt, ModelError) and rebuilt.index == 3
    assert "item 3" in str(rebuilt)
    assert isinstance(error_from_wire("DeadlineExceeded", "late"), DeadlineExceeded)
    assert "Weird" in str(error_from_wire("Weird", "x"))


def test_a_reply_whose_strings_are_msgpack_bins_of_utf8_is_read() -> None:
    """A worker in another language echoing the request id as the bytes its Redis client read
    (a msgpack bin, not a str) had its replies dropped: each call waited for its deadline."""
    import msgpack

    ok = decode_reply(msgpack.packb({b"id": b"r1", "ok": True, "result": 2}, use_bin_type=True))
    assert ok.ok and ok.request_id == "r1" and ok.result == 2
    error = {"type": b"ModelError", "message": "bad \u00e9".encode()}
    failed = decode_reply(msgpack.packb({"id": b"r2", "ok": False, "error": error}))
    assert (failed.request_id, failed.error_type, failed.error_message) == (
        "r2",
        "ModelError",
        "bad \u00e9",
    )
    with pytest.raises(ProtocolError, match="string 'id'"):
        decode_reply(msgpack.packb({"id": b"\xff\xfe", "ok": True, "result": 1}))


def test_a_non_ascii_digit_timeout_is_malformed_not_a_crash() -> None:
    fields = as_stream_fields(request_fields("r1", "inbox", 250, b"\x90"))
    with pytest.raises(MalformedEntry):
        parse_request("1-0", {**fields, b"timeout": "²".encode()})


@pytest.mark.parametrize("id_length", [1, 31, 32, 255, 256])
@pytest.mark.parametrize("result", [np.arange(16, dtype=np.float32), np.arange(3, dtype=np.uint8)])
def test_result_replies_of_arrays_are_packed_as_the_generic_encoder_packs_them(
    id_length: int, result: np.ndarray
) -> None:
    request_id = "r" * id_length
    fast = encode_result(request_id, result)
    assert fast == codec.encode({"id": request_id, "ok": True, "result": result})
    reply = decode_reply(fast)
    assert reply.ok and reply.request_id == request_id
    np.testing.assert_array_equal(reply.result, result)
