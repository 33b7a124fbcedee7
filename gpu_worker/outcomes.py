"""What a model call gives each item: its output or a typed error, and the reply that says so."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any, Protocol, TypeGuard

import numpy as np

from broker import codec
from broker.errors import CodecError, InvalidOutput, MicrobatchError, ModelError
from broker.logs import ThrottledWarning
from broker.protocol import RESULT_ID_HEADS, RESULT_OK, Request, encode_error, encode_result

log = logging.getLogger("microbatch.worker")


class PendingOutputs(Protocol):
    """A batch's outputs still being computed: what ``predict`` may return instead of them.

    A ``concurrent.futures.Future`` of the outputs is one;
    :meth:`gpu_worker.staging.HostStaging.to_host_later` gives one for a CUDA tensor. The
    worker answers the batch before and reads the next while the outputs are pending.
    """

    def done(self) -> bool:
        """True once :meth:`result` would not wait."""

    def result(self) -> Sequence[Any]:
        """The outputs, one per item, in order: waits for them (raises what computing raised)."""


PredictFn = Callable[[list[Any]], Sequence[Any] | PendingOutputs]


def describe(exc: BaseException) -> str:
    """A one-line description of a model exception (no traceback, no payload)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_out_of_memory(exc: BaseException) -> bool:
    """True for CUDA (or other accelerator) out-of-memory errors, without importing torch, and
    for the host's MemoryError."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return "out of memory" in str(exc).lower()


def is_pending(outputs: object) -> TypeGuard[PendingOutputs]:
    """Whether what ``predict`` returned is :class:`PendingOutputs` (has ``done`` and
    ``result``) rather than the outputs themselves."""
    return callable(getattr(outputs, "result", None)) and callable(getattr(outputs, "done", None))


def outputs_now(outputs: Sequence[Any] | PendingOutputs) -> Sequence[Any]:
    """What ``predict`` returned, as outputs: pending ones waited for."""
    if is_pending(outputs):
        return outputs.result()
    return outputs  # type: ignore[return-value]  # TypeGuard narrows only the true branch


def predict_robust(predict: PredictFn, items: list[Any]) -> list[Any]:
    """Run the model (waiting for pending outputs); on an exception, bisect so only the
    failing items get ModelError."""
    started = start_predict(predict, items)
    return started if isinstance(started, list) else finish_predict(predict, items, started)


def start_predict(predict: PredictFn, items: list[Any]) -> list[Any] | PendingOutputs:
    """Call the model: pending outputs as they are (:func:`finish_predict` takes them),
    anything else as :func:`predict_robust` would give it."""
    try:
        outputs = predict(items)
    except Exception as exc:
        failure = exc
    else:
        if isinstance(outputs, list) or not is_pending(outputs):
            return _checked(outputs, items)
        return outputs
    return _split(predict, items, failure)


def finish_predict(predict: PredictFn, items: list[Any], pending: PendingOutputs) -> list[Any]:
    """The outcomes of a batch whose outputs were pending; if computing it raised, the batch
    is computed again in halves, so only the failing items get ModelError."""
    try:
        outputs = pending.result()
    except Exception as exc:
        failure = exc
    else:
        return _checked(outputs, items)
    return _split(predict, items, failure)


# A model failing on every item fails each batch once per item and once per split: one line
# each flooded the log. The traceback (where the model raised: the one thing the callers'
# ModelError does not tell) is logged with the first failure and then with one every 10 s.
failed_items = ThrottledWarning(
    log,
    "the model raised on %d item(s) since the last such line; the latest: %s",
    every_s=10.0,
)
split_batches = ThrottledWarning(
    log,
    "%d batch(es) split since the last such line to find the failing items; the latest: %s",
    every_s=10.0,
)


# Outputs a model cannot use are the model author's mistake, not the caller's: the callers get
# InvalidOutput, and the worker's log says so too (throttled, as a broken model repeats it).
unusable_outputs = ThrottledWarning(
    log,
    "the model's outputs were unusable %d time(s) since the last such line; the latest: %s",
    every_s=10.0,
)

# What len() takes but is not one output per item: a str or bytes (its characters), a
# mapping (its keys), a set (no order).
_NOT_OUTPUTS = (str, bytes, bytearray, memoryview, Mapping, Set)


def _split(predict: PredictFn, items: list[Any], exc: Exception) -> list[Any]:
    """Outcomes for ``items`` after ``exc``: ModelError for one item, else each half's.

    Called outside the ``except`` block, so that an exception in a half is not chained to
    this one (a failing item's logged traceback showed every split above it)."""
    described = describe(exc)
    if len(items) == 1:
        failed_items.note(described, traceback_of=exc)
        return [ModelError(described)]
    out_of_memory = is_out_of_memory(exc)
    kind = "out of memory" if out_of_memory else "failed"
    split_batches.note(f"a batch of {len(items)} {kind} ({described})")
    if out_of_memory:
        # The traceback holds the model's frames, and they the failed attempt's tensors: kept
        # while the halves run, they made every half run out of memory too (PyTorch's FAQ).
        traceback.clear_frames(exc.__traceback__)
    middle = len(items) // 2
    return predict_robust(predict, items[:middle]) + predict_robust(predict, items[middle:])


def _checked(outputs: Any, items: list[Any]) -> list[Any]:
    """One output per item as a list, or InvalidOutput for each item if ``outputs`` is not a
    sequence of as many (a list, tuple, array, tensor...)."""
    if type(outputs) is list and len(outputs) == len(items):
        return list(outputs)  # the common case
    try:
        count = -1 if isinstance(outputs, _NOT_OUTPUTS) else len(outputs)
    except TypeError:
        count = -1
    if count == len(items):
        return list(outputs)
    if count >= 0:
        text = f"model returned {count} outputs for a batch of {len(items)}"
    else:
        text = (
            f"model returned {type(outputs).__name__}, not a list of one output per item, "
            f"for a batch of {len(items)}"
        )
    unusable_outputs.note(text)
    return [InvalidOutput(text)] * len(items)


def encode_outcome(request: Request, outcome: Any) -> tuple[bytes, str]:
    """The reply to one computed item, and the name of its outcome."""
    if isinstance(outcome, MicrobatchError):
        kind = "model_error" if isinstance(outcome, ModelError) else "invalid_output"
        return encode_error(request.request_id, outcome), kind
    try:
        return encode_result(request.request_id, outcome), "ok"
    except Exception as exc:  # CodecError; anything else must not take the worker down
        text = str(exc) if isinstance(exc, CodecError) else describe(exc)
        error = InvalidOutput(f"cannot send output: {text}")
        unusable_outputs.note(error.message)
        return encode_error(request.request_id, error), "invalid_output"


class OutcomeEncoder:
    """:func:`encode_outcome` for the items of a batch, with the same bytes: an array output
    of the dtype and shape of the one before is packed behind the bytes its reply shares with
    that one's (a model's outputs usually share both), without going through the codec."""

    def __init__(self) -> None:
        self._dtype: np.dtype[Any] | None = None
        self._shape: tuple[int, ...] = ()
        self._prefix = b""  # RESULT_OK, then the array's extension and array headers

    def encode(
        self, requests: Sequence[Request], outcomes: Sequence[Any], counts: dict[str, int]
    ) -> list[tuple[str, bytes]]:
        """(reply key, reply) for each request, its outcome counted in ``counts``."""
        replies: list[tuple[str, bytes]] = []
        append, heads, ndarray = replies.append, RESULT_ID_HEADS, np.ndarray
        ok = 0
        for request, outcome in zip(requests, outcomes, strict=True):
            if type(outcome) is ndarray:
                if outcome.dtype is not self._dtype or outcome.shape != self._shape:
                    self._learn(outcome)
                rid = request.request_id.encode()
                if self._prefix and len(rid) < len(heads):
                    try:
                        data = outcome.tobytes()
                    except Exception:  # MemoryError: encode_outcome says so
                        pass
                    else:
                        append((request.reply_key, heads[len(rid)] + rid + self._prefix + data))
                        ok += 1
                        continue
            reply, kind = encode_outcome(request, outcome)
            append((request.reply_key, reply))
            counts[kind] = counts.get(kind, 0) + 1
        if ok:
            counts["ok"] = counts.get("ok", 0) + ok
        return replies

    def _learn(self, array: np.ndarray) -> None:
        """Take the headers of arrays of this one's dtype and shape (none where the codec
        packs them otherwise: big-endian, fixext, too large, or not sendable)."""
        self._dtype, self._shape = array.dtype, array.shape
        found = codec.array_prefix(array.dtype, array.shape)
        self._prefix = b"" if found is None else RESULT_OK + found[0]
