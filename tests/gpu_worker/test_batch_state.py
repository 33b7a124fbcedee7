"""gpu_worker.batch_state: the supervisor never reads a half-written batch."""

from __future__ import annotations

import multiprocessing
import time

from gpu_worker.batch_state import _SEQUENCE, _VALUES, BatchState


def _flip(path: str, seconds: float) -> None:
    state = BatchState(path)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        state.busy(64)
        state.idle()


def test_busy_and_idle_read_back() -> None:
    state = BatchState.create()
    try:
        assert state.read() == (0, None)
        before = time.monotonic()
        state.busy(7)
        items, started = state.read()
        assert items == 7 and started is not None and before <= started <= time.monotonic()
        state.idle()
        assert state.read() == (0, None)
    finally:
        state.close(unlink=True)


def test_a_state_caught_mid_write_reads_as_idle() -> None:
    state = BatchState.create()
    try:
        # what a reader sees between the stores of busy(): a count, the idle start, odd sequence
        _SEQUENCE.pack_into(state._map, 0, 3)
        _VALUES.pack_into(state._map, _SEQUENCE.size, 64, 0.0)
        assert state.read() == (0, None)
        state.busy(5)  # a writer that died mid-write does not wedge the next one
        assert state.read()[0] == 5
    finally:
        state.close(unlink=True)


def test_a_reader_racing_a_busy_writer_never_sees_a_torn_batch() -> None:
    state = BatchState.create()
    writer = multiprocessing.get_context("spawn").Process(target=_flip, args=(state.path, 1.5))
    try:
        writer.start()
        reads = busy = 0
        started_at = time.monotonic()
        while writer.is_alive() or reads == 0:
            items, started = state.read()
            reads += 1
            if items:
                busy += 1
                assert items == 64
                assert started is not None and started_at - 5 < started <= time.monotonic()
            if time.monotonic() - started_at > 20:
                break
        writer.join(10)
        assert reads > 1000
    finally:
        state.close(unlink=True)
