"""Property-based: whatever bytes an entry or a reply holds, the real decode paths fail that
item alone, with a typed error (or a dead letter), and never raise anything else.

Through codec.decode/encode, protocol.parse_request and decode_reply, the worker's input check,
the batch loop's prepare/process over the in-memory transport, and the client's reply reader.
Derandomized (the same examples every run) and sized to run in seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from broker import codec, protocol, reply_elements
from broker.client import ClientCore
from broker.errors import (
    WIRE_ERRORS,
    CodecError,
    DeadlineExceeded,
    InvalidInput,
    MicrobatchError,
    ProtocolError,
)
from broker.keys import ModelKeys
from broker.memory_transport import InMemoryTransport
from broker.protocol import (
    VERSION,
    MalformedEntry,
    Reply,
    decode_reply,
    encode_error,
    encode_result,
    parse_request,
    request_fields,
)
from broker.reply_elements import array_header, decode_any, decode_element
from gpu_worker.batching import BatchLoop, BatchSettings
from gpu_worker.model import TensorSpec, input_check

QUICK = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SLOWER = settings(QUICK, max_examples=60)

# -- adversarial array headers ---------------------------------------------------------------------
EDGE_DIMS = [0, 1, 2, 3, 255, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**61, 2**62, 2**63 - 1, 2**63,
             2**63 + 1, 2**64 - 1]  # fmt: skip
dims = st.one_of(st.sampled_from(EDGE_DIMS), st.integers(0, 2**64 - 1), st.integers(0, 6))
dtype_strings = st.one_of(
    st.sampled_from(sorted(codec.ALLOWED_DTYPES)),
    st.sampled_from([">f4", ">i8", "|O", "<U4", "<M8", "<f16", "f4", "", "<V8", "|S3"]),
    st.binary(max_size=12).map(lambda raw: raw.decode("latin-1")),
)


def nominal_bytes(dtype_str: str, shape: list[int]) -> int | None:
    """What a valid header's data must hold; None if no valid array has this header."""
    if dtype_str not in codec.ALLOWED_DTYPES or len(shape) > codec.MAX_NDIM:
        return None
    size = np.dtype(dtype_str).itemsize
    for dim in shape:
        size *= dim or 1
    if size >= 2**63:
        return None
    return 0 if 0 in shape else size


@st.composite
def array_bodies(draw: st.DrawFn) -> tuple[bytes, tuple[str, tuple[int, ...]] | None]:
    """An ext-1 body, and the (dtype, shape) it must decode to, or None if it is invalid."""
    dtype_str = draw(dtype_strings)
    dtype_raw = dtype_str.encode("latin-1")
    shape = draw(st.one_of(st.lists(dims, max_size=4), st.lists(dims, max_size=36)))
    ndim = draw(st.one_of(st.just(len(shape)), st.integers(0, 255)))
    expected = nominal_bytes(dtype_str, shape)
    choices = [st.just(0), st.integers(0, 64)]
    if expected is not None and expected <= 4096:
        choices.append(st.sampled_from([expected, expected, expected + 1, max(expected - 1, 0)]))
    length = draw(st.one_of(*choices))
    header = bytes([len(dtype_raw) % 256]) + dtype_raw + bytes([ndim])
    body = header + b"".join(struct.pack("<Q", dim) for dim in shape) + bytes(length)
    cut = draw(st.one_of(st.none(), st.integers(0, len(body))))
    if cut is not None and cut < len(body):
        return body[:cut], None
    valid = ndim == len(shape) and len(dtype_raw) < 256 and length == expected
    return body, (dtype_str, tuple(shape)) if valid else None


@st.composite
def zero_size_bodies(draw: st.DrawFn) -> tuple[bytes, tuple[str, tuple[int, ...]] | None]:
    """The kind of header that once killed workers: no data, a zero dim, huge dims beside it."""
    dtype_str = draw(st.sampled_from(sorted(codec.ALLOWED_DTYPES)))
    big = st.one_of(st.sampled_from(EDGE_DIMS[5:]), st.integers(2**31, 2**64 - 1))
    shape = draw(st.lists(st.one_of(st.just(0), big, st.integers(0, 4)), min_size=1, max_size=6))
    shape.insert(draw(st.integers(0, len(shape))), 0)
    header = bytes([len(dtype_str)]) + dtype_str.encode() + bytes([len(shape)])
    body = header + b"".join(struct.pack("<Q", dim) for dim in shape)
    valid = nominal_bytes(dtype_str, shape) == 0
    return body, (dtype_str, tuple(shape)) if valid else None


all_array_bodies = st.one_of(array_bodies(), zero_size_bodies())


def check_array(value: Any, expected: tuple[str, tuple[int, ...]]) -> None:
    dtype_str, shape = expected
    assert isinstance(value, np.ndarray)
    assert value.dtype.str == np.dtype(dtype_str).str and value.shape == shape


@QUICK
@given(all_array_bodies, st.sampled_from(["bare", "map", "list"]))
def test_array_headers_decode_exactly_when_valid_else_codec_error(
    case: tuple[bytes, Any], wrapping: str
) -> None:
    body, expected = case
    ext = msgpack.ExtType(1, body)
    message = {"bare": ext, "map": {"x": ext}, "list": [1, ext]}[wrapping]
    data = msgpack.packb(message)
    if expected is None:
        with pytest.raises(CodecError):
            codec.decode(data)
        return
    decoded = codec.decode(data)
    if wrapping != "bare":
        decoded = decoded["x"] if wrapping == "map" else decoded[-1]
    check_array(decoded, expected)


def test_the_24_byte_killers_are_codec_errors() -> None:
    for shape in [(0, 2**64 - 1), (2**32, 2**32, 0), (0, 2**63), (0, 2**62, 4)]:
        body = b"\x03<f4" + bytes([len(shape)]) + b"".join(struct.pack("<Q", d) for d in shape)
        data = msgpack.packb(msgpack.ExtType(1, body))
        with pytest.raises(CodecError, match="too large"):
            codec.decode(data)
    zero = b"\x03<f4\x02" + struct.pack("<QQ", 0, 2**40)  # valid, if odd: no data at all
    assert codec.decode(msgpack.packb(msgpack.ExtType(1, zero))).shape == (0, 2**40)


# -- arbitrary bytes and arbitrary msgpack ---------------------------------------------------------
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
ext_types = st.one_of(
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=40)),
    all_array_bodies.map(lambda case: msgpack.ExtType(1, case[0])),
)
msgpack_values = st.recursive(
    st.one_of(scalars, ext_types),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner, max_size=5),
    ),
    max_leaves=20,
)
# any type byte, negative ones (-1: msgpack's timestamp) included, in an ext 8 or a fixext 4
raw_exts = st.tuples(st.integers(0, 255), st.binary(max_size=40), st.booleans()).map(
    lambda t: (
        (b"\xc7" + bytes([len(t[1]), t[0]]) + t[1])
        if t[2]
        else b"\xd6" + bytes([t[0]]) + (t[1] + bytes(4))[:4]
    )
)
payloads = st.one_of(
    st.binary(max_size=200),
    all_array_bodies.map(lambda case: msgpack.packb(msgpack.ExtType(1, case[0]))),
    raw_exts,
    raw_exts.map(lambda ext: b"\x81\xa1x" + ext),  # {"x": ext}
    msgpack_values.map(lambda value: msgpack.packb(value, use_bin_type=True)),
    # valid msgpack with garbage after it, or cut short
    st.tuples(msgpack_values, st.binary(max_size=8)).map(
        lambda pair: msgpack.packb(pair[0], use_bin_type=True) + pair[1]
    ),
    st.tuples(msgpack_values, st.integers(0, 50)).map(
        lambda pair: msgpack.packb(pair[0], use_bin_type=True)[: pair[1]]
    ),
)


@QUICK
@given(payloads)
def test_decode_returns_or_raises_codec_error_and_nothing_else(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        codec.decode(data)


class Unsendable:
    pass


sendable_or_not = st.recursive(
    st.one_of(
        scalars,
        st.integers(2**64, 2**70),  # too large for msgpack
        st.builds(Unsendable),
        st.sets(st.integers(0, 9), max_size=3),
        hnp.arrays(
            st.one_of(hnp.scalar_dtypes(), st.just(np.dtype(object)), hnp.byte_string_dtypes()),
            hnp.array_shapes(min_dims=0, max_dims=3, max_side=3),
        ),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner)
    ),
    max_leaves=10,
)


@QUICK
@given(sendable_or_not)
def test_encode_returns_bytes_or_raises_codec_error_and_nothing_else(value: Any) -> None:
    try:
        data = codec.encode(value)
    except CodecError:
        return
    codec.decode(data)  # and what it made decodes


# -- entries: every field -------------------------------------------------------------------------
def field(valid: st.SearchStrategy[bytes], *garbage: st.SearchStrategy[bytes]) -> Any:
    """A field's value: valid, absent (None) or hostile."""
    return st.one_of(valid, st.none(), st.binary(max_size=40), *garbage)


timeouts = field(
    st.just(b"30000"),
    st.sampled_from([b"0", b"-5", b"1e3", b"\xc2\xb2", b" 5", b"10" + b"0" * 30, b"9" * 5000]),
    st.integers(0, 10**40).map(lambda n: str(n).encode()),
)
ids = field(st.text(min_size=1, max_size=12).map(str.encode), st.just(b""), st.just(b"\xff\xfe"))
MODEL = ModelKeys("m", "t")
reply_keys = field(
    st.just(MODEL.inbox("hostile").encode()),
    st.just(b""),
    st.just(b"\xffinbox"),
    st.just(b"mb:{t:other}:inbox:x"),  # another model's inbox: dead-lettered, never written
    st.just(b"mb:{t:m}:requests"),  # the stream itself
)
versions = field(st.just(b"1"), st.sampled_from([b"2", b"1.0", b"", b"\x00", b"1" * 100]))
datas = field(
    st.just(codec.encode([1, 2])),
    payloads,
    all_array_bodies.map(lambda case: msgpack.packb(msgpack.ExtType(1, case[0]))),
)
traces = field(st.just(b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01"))
extras = st.dictionaries(
    st.binary(min_size=1, max_size=10).filter(
        lambda k: k not in (b"v", b"id", b"reply", b"timeout", b"data", b"traceparent")
    ),
    st.binary(max_size=20),
    max_size=3,
)


@st.composite
def hostile_fields(draw: st.DrawFn) -> dict[bytes, bytes]:
    fields = draw(extras)
    for name, strategy in (
        (b"v", versions),
        (b"id", ids),
        (b"reply", reply_keys),
        (b"timeout", timeouts),
        (b"data", datas),
        (b"traceparent", traces),
    ):
        value = draw(strategy)
        if value is not None:
            fields[name] = value
    return fields


def readable(value: bytes | None) -> str | None:
    try:
        return value.decode() or None if value is not None else None
    except UnicodeDecodeError:
        return None


@QUICK
@given(hostile_fields())
def test_parse_request_raises_malformed_entry_and_nothing_else(fields: dict[bytes, bytes]) -> None:
    request_id, reply_key = readable(fields.get(b"id")), readable(fields.get(b"reply"))
    try:
        request = parse_request("1700000000000-0", fields)
    except MalformedEntry as exc:
        message = str(exc)
        assert exc.type == "ProtocolError" and len(message) < 200  # a field is quoted short
        if request_id and reply_key:  # whoever can be told is told
            assert (exc.request_id, exc.reply_key) == (request_id, reply_key)
            if b"v" not in fields:
                assert message == (
                    "entry has no protocol version field 'v' (this worker speaks '1' and '2')"
                )
            elif fields[b"v"] == b"2":  # a multi-item entry that could not be split
                assert message.startswith("multi-item entry (v '2') without a valid 'n'")
            elif fields[b"v"] != b"1":
                assert message.startswith("unsupported protocol version '")
                assert message.endswith("' (this worker speaks '1' and '2')")
        else:
            assert not (exc.reply_key and exc.request_id)  # so it is dead-lettered
        return
    assert (request.request_id, request.reply_key) == (request_id, reply_key)
    assert fields[b"v"] == VERSION.encode() and fields[b"timeout"].isdigit()
    assert request.deadline_ms >= request.arrival_ms == 1700000000000
    assert request.data == fields[b"data"]


# -- the worker's input check ---------------------------------------------------------------------
specs = st.builds(
    TensorSpec,
    st.just("input"),
    st.sampled_from(["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64"]),
    st.lists(st.sampled_from([-1, 0, 1, 2, 3]), max_size=3),
)
items = st.one_of(
    msgpack_values,
    hnp.arrays(hnp.scalar_dtypes(), hnp.array_shapes(min_dims=0, max_dims=4, max_side=3)),
    st.lists(st.lists(st.floats(width=32), max_size=3), max_size=3),
)


@QUICK
@given(specs, items)
def test_the_input_check_returns_a_fitting_array_or_raises_invalid_input(
    spec: TensorSpec, item: Any
) -> None:
    check = input_check([spec])
    assert check is not None
    try:
        out = check(item)
    except InvalidInput:
        return
    assert isinstance(out, np.ndarray) and out.dtype == spec.numpy_dtype
    assert spec.shape_matches(out.shape)


def test_the_input_check_passes_a_fitting_array_as_it_is_and_refuses_the_wrong_shapes() -> None:
    check = input_check([TensorSpec("input", "FP32", [256])])
    assert check is not None
    array = codec.decode(codec.encode(np.zeros(256, dtype=np.float32)))
    assert check(array) is array
    for wrong in (np.zeros((2, 256), np.float32), np.zeros(255, np.float32), [0.0] * 255, "x"):
        with pytest.raises(InvalidInput):
            check(wrong)
    assert check([1] * 256).dtype == np.float32  # lists of numbers are converted
    # finite values past FP32's range are refused, as the gateway and Streamer(model=) refuse
    # them (they became inf); inf and nan given as such pass
    for past in (np.full(256, 1e39), [1e39] + [0.0] * 255, np.full(256, -1e300)):
        with pytest.raises(InvalidInput, match="values out of range for FP32"):
            check(past)
    assert np.isinf(check(np.full(256, np.inf))).all() and np.isnan(check([np.nan] * 256)).all()
    assert input_check([TensorSpec("input", "BYTES", [])]) is None
    assert input_check([TensorSpec("a", "FP32", [1]), TensorSpec("b", "FP32", [1])]) is None


# -- the batch loop over the in-memory transport ---------------------------------------------------
INBOX = MODEL.inbox("innocent")
ODD_INBOX = MODEL.inbox("odd")


class RawTransport(InMemoryTransport):
    """The in-memory transport, plus XADD of raw fields (as anyone with XADD could)."""

    def add_raw(self, keys: ModelKeys, fields: dict[bytes, bytes]) -> str:
        entry_id = self._next_id()
        self._stream(keys.stream).new.append((entry_id, fields))
        return entry_id

    def replies(self, key: str) -> list[bytes]:
        found = self._lists.get(key)
        return list(found.items) if found is not None else []

    def left(self, keys: ModelKeys) -> int:
        return len(self._stream(keys.stream))


def innocent_fields(index: int, item: Any) -> dict[bytes, bytes]:
    fields = request_fields(f"ok-{index}", INBOX, 30_000, codec.encode(item))
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


async def serve_mixed(
    hostile: list[dict[bytes, bytes]], innocent: list[Any], check: TensorSpec | None
) -> tuple[RawTransport, list[str], BatchLoop]:
    """Interleave hostile and innocent entries; a worker answers them in batches of 8."""
    keys, transport = ModelKeys("m", "t"), RawTransport()
    loop = BatchLoop(
        lambda batch: [item * 2 if isinstance(item, np.ndarray) else item for item in batch],
        transport,
        keys,
        "c1",
        BatchSettings(batch_size=8, block_ms=1),
        check_item=input_check([check]) if check else None,
    )
    hostile_ids = []
    for index in range(max(len(hostile), len(innocent))):
        if index < len(innocent):
            transport.add_raw(keys, innocent_fields(index, innocent[index]))
        if index < len(hostile):
            hostile_ids.append(transport.add_raw(keys, hostile[index]))
    while entries := await transport.read_batch(keys, "c1", 8, 1):
        await loop.process(entries)
        await loop._settle_finish()
    return transport, hostile_ids, loop


def check_everyone_answered(
    transport: RawTransport, hostile: list[dict[bytes, bytes]], innocent: list[Any]
) -> dict[str, int]:
    """Innocents got their answers; each hostile entry one typed answer or a dead letter."""
    keys = ModelKeys("m", "t")
    answers = {reply.request_id: reply for reply in map(decode_reply, transport.replies(INBOX))}
    assert len(answers) == len(innocent)
    for index, item in enumerate(innocent):
        reply = answers[f"ok-{index}"]
        assert reply.ok, reply
        np.testing.assert_array_equal(reply.result, np.asarray(item) * 2)
    dead = [entry for entry, _ in transport.dead.get(keys.dead_letters, [])]
    outcomes: dict[str, int] = {"dead": len(dead)}
    expected_replies: dict[str, list[str]] = {}
    for fields in hostile:
        request_id, reply_key = readable(fields.get(b"id")), readable(fields.get(b"reply"))
        if request_id and reply_key and keys.may_reply_to(reply_key):
            expected_replies.setdefault(reply_key, []).append(request_id)
    answered = 0
    for key, request_ids in expected_replies.items():
        replies = [decode_reply(data) for data in transport.replies(key)]
        assert sorted(reply.request_id for reply in replies) == sorted(request_ids)
        for reply in replies:
            name = "ok" if reply.ok else reply.error_type
            assert reply.ok or reply.error_type in WIRE_ERRORS
            outcomes[name] = outcomes.get(name, 0) + 1
        answered += len(replies)
    assert answered + len(dead) == len(hostile)  # exactly one answer or dead letter each
    for key in ("mb:{t:other}:inbox:x", keys.stream):  # never written outside its inboxes
        assert transport.replies(key) == []
    assert transport.left(keys) == 0  # nothing pending, nothing queued
    return outcomes


@SLOWER
@given(st.lists(hostile_fields(), min_size=1, max_size=12))
def test_the_batch_loop_answers_hostile_entries_alone_and_innocent_ones_right(
    hostile: list[dict[bytes, bytes]],
) -> None:
    hostile = [f for f in hostile if readable(f.get(b"reply")) not in (INBOX, ODD_INBOX)]
    innocent = [np.arange(4, dtype=np.float32) + i for i in range(6)]
    transport, _, _ = asyncio.run(serve_mixed(hostile, innocent, None))
    check_everyone_answered(transport, hostile, innocent)


@SLOWER
@given(st.lists(hostile_fields(), min_size=1, max_size=12), items)
def test_the_batch_loop_with_an_input_check_refuses_what_does_not_fit(
    hostile: list[dict[bytes, bytes]], item: Any
) -> None:
    fields = innocent_fields(99, 0)
    fields[b"id"], fields[b"reply"] = b"odd-item", ODD_INBOX.encode()
    try:
        fields[b"data"] = codec.encode(item)
    except CodecError:
        return
    hostile = [f for f in hostile if readable(f.get(b"reply")) not in (INBOX, ODD_INBOX)]
    hostile.append(fields)
    innocent = [np.arange(4, dtype=np.float32) + i for i in range(6)]
    transport, _, _ = asyncio.run(serve_mixed(hostile, innocent, TensorSpec("x", "FP32", [4])))
    outcomes = check_everyone_answered(transport, hostile, innocent)
    (odd,) = [decode_reply(data) for data in transport.replies(ODD_INBOX)]
    try:
        fits = np.asarray(item).shape == (4,)
    except ValueError:  # ragged
        fits = False
    if not odd.ok:
        assert odd.error_type in ("InvalidInput", "CodecError"), odd
    else:
        assert fits and odd.result.dtype == np.float32
    assert sum(outcomes.values()) == len(hostile)


KILLER = b"\xc7\x15\x01\x03<f4\x02" + bytes(8) + b"\xff" * 8  # 24 bytes: shape (0, 2**64-1)


def test_the_documented_cases_get_the_documented_answers() -> None:
    good = innocent_fields(0, 1)
    cases = {
        "no-v": ({k: v for k, v in good.items() if k != b"v"}, "ProtocolError"),
        "v2": ({**good, b"v": b"2"}, "ProtocolError"),
        "v3": ({**good, b"v": b"3"}, "ProtocolError"),
        "bad-utf8-v": ({**good, b"v": b"\xff" * 100}, "ProtocolError"),
        "negative": ({**good, b"timeout": b"-5"}, "ProtocolError"),
        "huge": ({**good, b"timeout": b"1" + b"0" * 30}, "ok"),
        "huger": ({**good, b"timeout": b"9" * 5000}, "ok"),
        "zero": ({**good, b"timeout": b"0"}, "DeadlineExceeded"),
        "killer": ({**good, b"data": KILLER}, "CodecError"),
        "bad-trace": ({**good, b"traceparent": b"\xff\n"}, "ok"),
    }  # fmt: skip
    documented = MODEL.inbox("documented")
    hostile = []
    for name, (fields, _) in cases.items():
        hostile.append({**fields, b"id": name.encode(), b"reply": documented.encode()})
    hostile.append({**good, b"id": b"\xff", b"reply": documented.encode()})  # dead-lettered
    hostile.append({**good, b"id": b"elsewhere", b"reply": b"documented"})  # dead-lettered
    transport, _, _ = asyncio.run(serve_mixed(hostile, [], None))
    replies = {r.request_id: r for r in map(decode_reply, transport.replies(documented))}
    for name, (_, expected) in cases.items():
        reply = replies[name]
        assert (reply.ok and expected == "ok") or reply.error_type == expected, (name, reply)
    assert replies["no-v"].error_message == (
        "entry has no protocol version field 'v' (this worker speaks '1' and '2')"
    )
    assert (
        replies["v2"].error_message
        == "multi-item entry (v '2') without a valid 'n' (1 to 512 items)"
    )
    assert (
        replies["v3"].error_message
        == "unsupported protocol version '3' (this worker speaks '1' and '2')"
    )
    assert replies["bad-utf8-v"].error_message == (
        "unsupported protocol version '" + "\ufffd" * 32 + "...' (this worker speaks '1' and '2')"
    )
    assert len(transport.dead[MODEL.dead_letters]) == 2
    assert transport.replies("documented") == []


# -- the client's reply reader ---------------------------------------------------------------------
reply_maps = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(
            st.just("VICTIM"), st.text(max_size=5), st.binary(max_size=5), st.integers(-5, 5)
        ),
        "ok": st.one_of(st.booleans(), st.none(), st.integers(0, 1), st.text(max_size=3)),
        "result": msgpack_values,
        "error": st.one_of(
            msgpack_values,
            st.fixed_dictionaries(
                {},
                optional={
                    "type": st.one_of(st.sampled_from(sorted(WIRE_ERRORS)), msgpack_values),
                    "message": st.one_of(st.text(max_size=10), msgpack_values),
                },
            ),
        ),
    },
)
replies = st.one_of(payloads, reply_maps.map(lambda m: msgpack.packb(m, use_bin_type=True)))


@QUICK
@given(replies)
def test_decode_reply_returns_a_reply_or_raises_codec_or_protocol_error(data: bytes) -> None:
    try:
        reply = decode_reply(data)
    except (CodecError, ProtocolError):
        return
    assert isinstance(reply, Reply) and isinstance(reply.request_id, str)
    assert reply.ok or (isinstance(reply.error_type, str) and isinstance(reply.error_message, str))


def reply_outcome(decode: Any, data: bytes) -> Any:
    """What a decoder makes of ``data``, comparable with ==."""
    try:
        reply = decode(data)
    except Exception as exc:
        return type(exc)
    result = reply.result
    if isinstance(result, np.ndarray):
        result = (result.dtype.str, result.shape, result.tobytes(), result.flags.writeable)
    return (reply.request_id, reply.ok, result, reply.error_type, reply.error_message)


@QUICK
@given(all_array_bodies, st.text(max_size=100), st.integers(-3, 3))
def test_array_results_read_without_msgpack_decode_as_msgpack_reads_them(
    case: tuple[bytes, Any], request_id: str, change: int
) -> None:
    body, expected = case
    result = msgpack.ExtType(codec.ARRAY_EXT_TYPE, body)
    data = msgpack.packb({"id": request_id, "ok": True, "result": result}, use_bin_type=True)
    if expected is not None and len(request_id.encode()) < 256:
        assert data == encode_result(request_id, codec.decode(codec.encode(result)))
    if change < 0:  # cut short
        data = data[:change]
    elif change > 0:  # trailing bytes
        data += bytes(change)
    assert reply_outcome(decode_reply, data) == reply_outcome(protocol._decode_reply_map, data)


@QUICK
@given(st.lists(replies, max_size=20), st.integers(-2, 2))
def test_a_packed_element_of_anything_gives_replies_or_codec_error(
    maps: list[bytes], change: int
) -> None:
    element = array_header(len(maps)) + b"".join(maps)
    if change < 0:
        element = element[:change]
    elif change > 0:
        element += bytes(change)
    try:
        got = decode_any(element)
    except (CodecError, ProtocolError):
        return
    for reply in got:
        assert isinstance(reply, (Reply, ProtocolError))


def element_outcome(decode: Any, data: bytes) -> Any:
    """What a decoder of packed elements makes of ``data``, comparable with ==."""
    try:
        replies = decode(data)
    except Exception as exc:
        return type(exc)
    out = []
    for reply in replies:
        if isinstance(reply, Exception):
            out.append(type(reply))
            continue
        result = reply.result
        if isinstance(result, np.ndarray):
            result = (result.dtype.str, result.shape, result.tobytes(), result.flags.writeable)
        out.append((reply.request_id, reply.ok, result, reply.error_type, reply.error_message))
    return out


@QUICK
@given(
    st.lists(st.tuples(all_array_bodies, st.text(max_size=40)), min_size=1, max_size=20),
    st.integers(-3, 3),
)
def test_packed_array_results_read_without_msgpack_decode_as_msgpack_reads_them(
    cases: list[tuple[tuple[bytes, Any], str]], change: int
) -> None:
    maps = [
        msgpack.packb(
            {"id": rid, "ok": True, "result": msgpack.ExtType(codec.ARRAY_EXT_TYPE, body)},
            use_bin_type=True,
        )
        for (body, _), rid in cases
    ]
    element = array_header(len(maps)) + b"".join(maps)
    if change < 0:  # cut short
        element = element[:change]
    elif change > 0:  # trailing bytes
        element += bytes(change)
    fast, slow = decode_element, reply_elements._decode_through_msgpack
    assert element_outcome(fast, element) == element_outcome(slow, element)


async def client_reads(hostile: list[bytes]) -> tuple[list[Any], Any, Any]:
    """An innocent call and a victim call; the hostile replies arrive before their answers.
    Returns the innocent call's result, the victim's outcome, and what it should have been."""
    keys = ModelKeys("m", "t")
    transport = InMemoryTransport()
    core = ClientCore(keys, transport, asyncio.get_running_loop())
    innocent = core.start_call([codec.encode(1), codec.encode(2)], 5.0)
    victim = core.start_call([codec.encode(3)], 5.0)
    ids = list(core._pending)
    hostile = [data.replace(b"VICTIM", ids[2].encode()) for data in hostile]
    expected: Any = [6]
    for data in hostile:  # the first reply routed to the victim settles it
        try:
            reply = decode_reply(data)
        except MicrobatchError:
            continue
        if reply.request_id == ids[2]:
            expected = reply
            break
    answers = [encode_result(ids[0], 2), encode_result(ids[1], 4), encode_result(ids[2], 6)]
    pushed = [(core.inbox, data) for data in [*hostile, *answers]]
    await transport.finish(keys, pushed, [], 60)
    outcome: Any
    try:
        outcome = await asyncio.wait_for(victim, 5)
    except MicrobatchError as exc:
        outcome = exc
    result = await asyncio.wait_for(innocent, 5)
    await core.aclose()
    return result, outcome, expected


@SLOWER
@given(st.lists(replies, max_size=8))
def test_the_client_routes_what_it_can_and_drops_the_rest_without_dying(
    hostile: list[bytes],
) -> None:
    result, outcome, expected = asyncio.run(client_reads(hostile))
    assert result == [2, 4]
    if not isinstance(expected, Reply):  # no hostile reply named the victim
        assert outcome == expected
    elif expected.ok:
        assert isinstance(outcome, list) and len(outcome) == 1
    else:  # the typed error the reply named (ProtocolError if it was malformed)
        assert isinstance(outcome, WIRE_ERRORS.get(expected.error_type, MicrobatchError))
        assert outcome.index == 0


def test_an_unroutable_reply_leaves_its_call_to_end_at_its_deadline() -> None:
    async def main() -> tuple[Any, float]:
        keys = ModelKeys("m", "t")
        transport = InMemoryTransport()
        core = ClientCore(keys, transport, asyncio.get_running_loop())
        call = core.start_call([codec.encode(1)], 0.3)
        garbage = [b"\xc1", msgpack.packb({"ok": True}), msgpack.packb([1, 2])]
        await transport.finish(keys, [(core.inbox, data) for data in garbage], [], 60)
        started = asyncio.get_running_loop().time()
        try:
            await asyncio.wait_for(call, 5)
        except MicrobatchError as exc:
            error: Any = exc
        waited = asyncio.get_running_loop().time() - started
        await core.aclose()
        return error, waited

    error, waited = asyncio.run(main())
    assert isinstance(error, DeadlineExceeded) and waited < 2


def test_a_malformed_reply_naming_its_call_fails_that_item_with_protocol_error() -> None:
    async def main() -> Any:
        keys = ModelKeys("m", "t")
        transport = InMemoryTransport()
        core = ClientCore(keys, transport, asyncio.get_running_loop())
        call = core.start_call([codec.encode(1), codec.encode(2)], 5.0)
        first, second = list(core._pending)
        bad = msgpack.packb({"id": second, "ok": False, "error": {"type": 7, "message": "x"}})
        pushed = [encode_result(first, 1), bad]
        await transport.finish(keys, [(core.inbox, data) for data in pushed], [], 60)
        try:
            await asyncio.wait_for(call, 5)
        except MicrobatchError as exc:
            return exc
        finally:
            await core.aclose()

    error = asyncio.run(main())
    assert isinstance(error, ProtocolError) and error.index == 1
    assert "malformed reply" in error.message
    assert encode_error("x", error)  # and it could travel on
