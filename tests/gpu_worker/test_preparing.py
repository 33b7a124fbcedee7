"""gpu_worker.preparing: decoding entries into items; cutting a prepared batch into
model-sized batches."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from broker import codec
from broker.keys import ModelKeys
from broker.protocol import Request, decode_reply
from gpu_worker.model import TensorSpec, input_check
from gpu_worker.observer import BatchObserver
from gpu_worker.preparing import PreparedBatch, Preparer, in_chunks

KEYS = ModelKeys("m", "p")


def preparer(datatype: str = "FP32", shape: tuple[int, ...] = (2, 3)) -> Preparer:
    check = input_check([TensorSpec("input", datatype, list(shape))])
    return Preparer(KEYS, BatchObserver(), lambda: 0.0, check)


def entry(seq: int, data: bytes, reply: str = KEYS.inbox("c")) -> tuple[str, dict[bytes, bytes]]:
    fields = {b"v": b"1", b"id": b"r%d" % seq, b"reply": reply.encode()}
    return f"1000-{seq}", fields | {b"timeout": b"60000", b"data": data}


@pytest.mark.parametrize(
    "value",
    [
        np.arange(6, dtype=np.float32).reshape(2, 3),  # the input's dtype and shape exactly
        np.arange(6, dtype=np.int32).reshape(2, 3),  # as many bytes, another dtype: converted
        np.arange(6, dtype=np.float32).reshape(3, 2),  # another shape: refused
        np.arange(6, dtype=np.float64).reshape(2, 3),  # converted
        [[1, 2, 3], [4, 5, 6]],  # a list: converted
    ],
)
def test_an_item_decodes_as_codec_decode_and_the_input_check_say(value: object) -> None:
    data = codec.encode(value)
    batch = preparer().prepare([entry(0, data)])
    try:
        expected = input_check([TensorSpec("input", "FP32", [2, 3])])(codec.decode(data))  # type: ignore[union-attr]
    except Exception:
        assert not batch.items and len(batch.replies) == 1
        return
    [item] = batch.items
    assert type(item) is np.ndarray and item.dtype == np.float32 and item.shape == (2, 3)
    assert np.array_equal(item, expected)
    assert item.flags.writeable == expected.flags.writeable


def test_a_payload_cut_short_or_padded_is_refused_alone() -> None:
    good = codec.encode(np.ones((2, 3), np.float32))
    batch = preparer().prepare([entry(0, good[:-1]), entry(1, good), entry(2, good + b"\0")])
    assert [request.request_id for request in batch.live] == ["r1"]
    assert len(batch.replies) == 2


def test_items_of_one_reply_key_are_checked_once_alike_and_others_on_their_own() -> None:
    data = codec.encode(np.ones((2, 3), np.float32))
    entries = [entry(0, data), entry(1, data, "elsewhere"), entry(2, data), entry(3, data)]
    batch = preparer().prepare(entries)
    assert [request.request_id for request in batch.live] == ["r0", "r2", "r3"]
    assert [dead[0][0] for dead in batch.dead] == ["1000-1"]


def test_malformed_and_misdirected_entries_are_summed_up_in_the_log_not_a_line_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One line per malformed or misdirected entry: a caller writing them (a v2 entry of 512
    items without their fields is 512 of them, in one XADD) flooded the worker's log. The
    first of each kind is logged at once, then at most one line every 10 s saying how many."""
    data = codec.encode(np.ones((2, 3), np.float32))
    no_id = [(f"1000-{i}", {b"v": b"1", b"reply": KEYS.inbox("c").encode()}) for i in range(100)]
    elsewhere = [entry(100 + i, data, "mb:{p:other}:inbox:c") for i in range(100)]
    bad_version = [(i, f | {b"v": b"9"}) for i, f in (entry(200 + i, data) for i in range(100))]
    prepare = preparer()
    with caplog.at_level(logging.WARNING, logger="microbatch.worker"):
        for _ in range(2):
            batch = prepare.prepare(no_id + elsewhere + bad_version)
            assert len(batch.dead) == 200 and len(batch.replies) == 100
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("1 malformed entry(ies) of mb:{p:m}:requests since the last")
    assert "the latest: 1000-0: entry has no readable 'id' or 'reply' field" in lines[0]
    assert lines[1].startswith("1 entry(ies) of mb:{p:m}:requests dead-lettered since the last")
    assert "reply key 'mb:{p:other}:inbox:c' is none of this model's inboxes" in lines[1]


def request(entry_id: str) -> Request:
    return Request(entry_id, f"r-{entry_id}", "mb:{p:m}:inbox:c", 1, 10**15, b"")


def test_a_batch_of_at_most_size_items_is_not_cut() -> None:
    batch = PreparedBatch([("1-0#0", {})], 0.0, [], [], [request("1-0#0")], ["a"])
    assert in_chunks(batch, 1) == [batch]


def test_a_bigger_batch_is_cut_in_order_and_every_entry_is_in_exactly_one_part() -> None:
    ids = [f"1-0#{i}" for i in range(5)]
    entries = [(i, {}) for i in [*ids, "2-0"]]  # 2-0: answered already (an error)
    replies = [("mb:{p:m}:inbox:c", b"error")]
    dead = [(("3-0", {}), "why")]
    batch = PreparedBatch(entries, 7.0, replies, dead, [request(i) for i in ids], list("abcde"))
    parts = in_chunks(batch, 2)
    assert [part.items for part in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert [[r.entry_id for r in part.live] for part in parts] == [ids[:2], ids[2:4], ids[4:]]
    assert sorted(e[0] for part in parts for e in part.entries) == sorted(e[0] for e in entries)
    assert parts[0].replies == replies and parts[0].dead == dead
    assert all(not part.replies and not part.dead for part in parts[1:])
    assert all(part.now_ms == 7.0 for part in parts)


@pytest.mark.parametrize(
    ("datatype", "item", "said"),
    [
        ("FP32", ["ab", "cd"], "input 'input' is text, the model takes FP32"),
        ("FP32", [None, {"a": 1}], "input 'input' is not numeric data, the model takes FP32"),
        ("FP32", [True, False], "input 'input' is booleans, the model takes FP32"),
        ("INT32", [1.5, 2.0], "input 'input' is floating-point numbers, the model takes INT32"),
        ("FP32", [1j, 2j], "input 'input' is complex numbers, the model takes FP32"),
        ("BOOL", [1, 0], "input 'input' is integers, the model takes BOOL"),
    ],
)
def test_an_item_of_the_wrong_kind_is_refused_in_a_callers_words(
    datatype: str, item: object, said: str
) -> None:
    """The message named numpy's dtype: `input 'input' is <U2 data`, `is object data`."""
    from broker.errors import InvalidInput

    check = input_check([TensorSpec("input", datatype, [2])])
    assert check is not None
    with pytest.raises(InvalidInput) as refused:
        check(item)
    assert str(refused.value) == said


@pytest.mark.parametrize(("compute_ms", "computed"), [(0.0, True), (50.0, True), (200.0, False)])
def test_an_item_due_before_a_batch_could_be_computed_is_answered_deadline_exceeded(
    compute_ms: float, computed: bool
) -> None:
    """Due 100 ms from now (entry at 1000 ms, timeout 60 s): computed while batches take
    less; else its result would reach nobody, and it gets DeadlineExceeded at once."""
    check = input_check([TensorSpec("input", "FP32", [2, 3])])
    prepare = Preparer(KEYS, BatchObserver(), lambda: 60_900.0, check, lambda items: compute_ms)
    data = codec.encode(np.ones((2, 3), np.float32))
    batch = prepare.prepare([entry(0, data)])
    assert len(batch.items) == int(computed) and len(batch.replies) == int(not computed)
    if not computed:
        reply = decode_reply(batch.replies[0][1])
        assert reply.error_type == "DeadlineExceeded"
        assert reply.error_message == (
            "deadline too near to compute the item in time (batches take 200 ms)"
        )
    # checked again just before computing: by then it is too near
    prepare.compute_ms = lambda items: 150.0
    assert prepare.drop_stale(batch, set()) == computed and not batch.items
