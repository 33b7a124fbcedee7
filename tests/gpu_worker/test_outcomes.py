"""gpu_worker.outcomes: a batch's replies encoded by OutcomeEncoder, byte for byte as
encode_outcome encodes each, with the same outcome counts; model calls whose outputs come
pending."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from broker.errors import InvalidOutput, ModelError
from broker.protocol import Request
from gpu_worker import outcomes
from gpu_worker.outcomes import (
    OutcomeEncoder,
    encode_outcome,
    finish_predict,
    is_pending,
    predict_robust,
    start_predict,
)


def request(index: int, id_length: int = 8) -> Request:
    request_id = (f"r{index}-" + "x" * id_length)[:id_length]
    return Request(f"1000-{index}", request_id, "p:m:inbox:c", 1000, 61000, b"", None)


def expected(requests: list[Request], outcomes: list[Any]) -> tuple[list[Any], dict[str, int]]:
    replies, counts = [], {}
    for req, outcome in zip(requests, outcomes, strict=True):
        reply, kind = encode_outcome(req, outcome)
        replies.append((req.reply_key, reply))
        counts[kind] = counts.get(kind, 0) + 1
    return replies, counts


def test_a_batch_encodes_as_each_item_would() -> None:
    outcomes: list[Any] = [
        np.zeros(3, np.float32),
        np.arange(3, dtype=np.float32),  # the same dtype and shape: the headers reused
        np.ones((2, 2), ">f4"),  # big-endian: swapped by the codec
        np.array(1.0),  # a 0-d array
        np.ones(4, np.int64),
        np.ones(3, object),  # cannot be sent: invalid_output
        ModelError("boom"),
        InvalidOutput("wrong count"),
        {"a": 1},
        np.ones(8, np.float16),
        np.ones(8, np.float16)[::2],  # not contiguous
        np.zeros((0, 3), np.float32),
        np.ones(2, np.uint8),  # a body msgpack packs as fixext
        np.float32(3),
        np.ones(3, np.float32).astype(np.dtype("float32")),  # an equal dtype, another object
    ]
    lengths = [1, 31, 32, 100, 255, 256, 300, 5, 5, 5, 5, 5, 5, 5, 40]
    requests = [request(i, n) for i, n in enumerate(lengths)]
    counts: dict[str, int] = {}
    replies = OutcomeEncoder().encode(requests, outcomes, counts)
    want_replies, want_counts = expected(requests, outcomes)
    assert replies == want_replies
    assert counts == want_counts


def test_an_encoder_keeps_up_with_outputs_that_change_shape() -> None:
    encoder = OutcomeEncoder()
    for shape in [(4,), (4,), (2, 2), (4,), (3,)]:
        requests = [request(i) for i in range(3)]
        outcomes = [np.full(shape, i, np.float32) for i in range(3)]
        counts: dict[str, int] = {}
        assert encoder.encode(requests, outcomes, counts) == expected(requests, outcomes)[0]
        assert counts == {"ok": 3}


# -- outputs that come pending ---------------------------------------------------------------------
def later(predict: Any) -> Any:
    """``predict`` returning a future of its outputs (computed at once, raising on result())."""

    def launch(items: list[Any]) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(predict(items))
        except Exception as exc:
            future.set_exception(exc)
        return future

    return launch


def doubles_but_not_minus_one(items: list[Any]) -> list[Any]:
    if -1 in items:
        raise RuntimeError("device-side assert")
    return [item * 2 for item in items]


def test_pending_outputs_are_handed_back_and_taken_later() -> None:
    predict = later(doubles_but_not_minus_one)
    pending = start_predict(predict, [1, 2, 3])
    assert is_pending(pending)
    assert finish_predict(predict, [1, 2, 3], pending) == [2, 4, 6]
    assert predict_robust(predict, [1, 2, 3]) == [2, 4, 6]
    assert start_predict(doubles_but_not_minus_one, [1]) == [2]  # plain outputs stay lists


def test_a_pending_batch_that_fails_is_computed_again_in_halves() -> None:
    predict = later(doubles_but_not_minus_one)
    items = [1, 2, -1, 4]
    outcomes = finish_predict(predict, items, start_predict(predict, items))
    assert outcomes[:2] == [2, 4] and outcomes[3] == 8
    assert isinstance(outcomes[2], ModelError)
    assert "device-side assert" in outcomes[2].message
    assert predict_robust(predict, items)[:2] == [2, 4]


def test_pending_outputs_of_the_wrong_count_fail_each_item() -> None:
    predict = later(lambda items: [0])
    outcomes = finish_predict(predict, [1, 2], start_predict(predict, [1, 2]))
    assert all(isinstance(o, InvalidOutput) for o in outcomes) and len(outcomes) == 2


def test_a_model_failing_on_every_item_logs_a_traceback_every_few_seconds(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callers' ModelError says what was raised, not where: the worker's log has the
    traceback, and not a line per item and per split for a model that always fails."""
    now = [0.0]
    for throttled in (outcomes.failed_items, outcomes.split_batches):
        monkeypatch.setattr(throttled, "clock", lambda: now[0])
        monkeypatch.setattr(throttled, "count", 0)
        monkeypatch.setattr(throttled, "_next", float("-inf"))

    def broken_model(batch: list[Any]) -> list[Any]:
        raise RuntimeError("boom")

    with caplog.at_level(logging.WARNING, logger="microbatch.worker"):
        for _ in range(5):
            got = predict_robust(broken_model, list(range(64)))
            assert [str(error) for error in got] == ["RuntimeError: boom"] * 64
            now[0] += 1
        now[0] += 10
        predict_robust(broken_model, [1])
    items = [r for r in caplog.records if "raised on" in r.getMessage()]
    splits = [r for r in caplog.records if "split since" in r.getMessage()]
    assert len(caplog.records) == len(items) + len(splits) == 3
    assert [r.getMessage().split(";")[0] for r in items] == [
        "the model raised on 1 item(s) since the last such line",
        "the model raised on 320 item(s) since the last such line",
    ]
    assert all(r.exc_info and "broken_model" in caplog.text for r in items)
    assert "a batch of 64 failed (RuntimeError: boom)" in splits[0].getMessage()


@pytest.mark.parametrize(
    ("returned", "what"),
    [
        ("abc", "str"),  # len() 3, but characters are no outputs
        (b"abc", "bytes"),
        ({0: "a", 1: "b", 2: "c"}, "dict"),  # its keys
        ({"a", "b", "c"}, "set"),  # no order
        (None, "NoneType"),
        ((x for x in "abc"), "generator"),
    ],
)
def test_outputs_that_are_no_list_fail_each_item_naming_what_came(
    returned: Any, what: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outcomes.unusable_outputs, "_next", float("-inf"))
    with caplog.at_level(logging.WARNING, logger="microbatch.worker"):
        got = predict_robust(lambda batch: returned, [1, 2, 3])
    assert [type(o) for o in got] == [InvalidOutput] * 3
    message = f"model returned {what}, not a list of one output per item, for a batch of 3"
    assert [o.message for o in got] == [message] * 3
    assert message in caplog.text  # the model's author sees it in the worker's log too


def test_sequences_of_one_output_per_item_pass() -> None:
    for returned in ([1, 2], (1, 2), np.array([1, 2]), range(1, 3)):
        assert [int(o) for o in predict_robust(lambda batch, r=returned: r, [0, 0])] == [1, 2]


def test_a_wrong_count_and_an_output_that_cannot_be_sent_are_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with caplog.at_level(logging.WARNING, logger="microbatch.worker"):
        monkeypatch.setattr(outcomes.unusable_outputs, "_next", float("-inf"))
        predict_robust(lambda batch: [1], [1, 2])
        monkeypatch.setattr(outcomes.unusable_outputs, "_next", float("-inf"))
        encode_outcome(request(0), lambda: 1)
    assert "model returned 1 outputs for a batch of 2" in caplog.text
    assert "cannot send output: values of type function cannot be sent" in caplog.text
