"""Automatic busy polling: when a worker spins for the next request, and for how long."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import gpu_worker.batching
from broker.keys import ModelKeys
from broker.memory_transport import InMemoryTransport
from gpu_worker.batching import BatchLoop
from gpu_worker.config import BatchSettings
from gpu_worker.polling import DEFAULT_CAP_S, MIN_POLL_S, AutoBusyPoll, SpareCore, usable_cores

from .test_batching import Doubler, PollRecordingTransport, serve_items


def ids(ms: int, count: int) -> list[str]:
    return [f"{ms}-{seq}" for seq in range(count)]


def read(ms: int, count: int) -> tuple[str, int]:
    """What a read of ``count`` entries added within millisecond ``ms`` tells the poll: the
    newest id, and how many."""
    entry_ids = ids(ms, count)
    return entry_ids[-1], len(entry_ids)


def test_dense_arrivals_poll_twice_the_mean_gap_within_the_cap() -> None:
    poll = AutoBusyPoll(spare_core=lambda: True)
    assert poll.seconds() == 0.0  # nothing seen yet
    poll.observe(*read(1000, 1))
    poll.observe(*read(1001, 4))  # 4 arrivals in 1 ms: 0.25 ms apart
    assert poll.mean_gap_s == pytest.approx(0.00025)
    assert poll.seconds() == pytest.approx(0.0005)
    poll.observe(*read(1001, 3))  # more within the same millisecond: several per ms
    assert MIN_POLL_S <= poll.seconds() <= DEFAULT_CAP_S


def test_sparse_arrivals_never_poll() -> None:
    poll = AutoBusyPoll(spare_core=lambda: True)
    for ms in range(1000, 1100, 5):  # one every 5 ms: a poll of 1 ms would mostly spin
        poll.observe(*read(ms, 1))
    assert poll.mean_gap_s == pytest.approx(0.005)
    assert poll.seconds() == 0.0


def test_no_spare_core_no_poll() -> None:
    poll = AutoBusyPoll(spare_core=lambda: False)
    poll.observe(*read(1000, 1))
    poll.observe(*read(1001, 8))
    assert poll.seconds() == 0.0


def test_the_mean_gap_follows_the_traffic() -> None:
    poll = AutoBusyPoll(spare_core=lambda: True)
    ms = 1000
    for _ in range(50):  # dense
        ms += 1
        poll.observe(*read(ms, 4))
    assert poll.seconds() > 0
    for _ in range(50):  # then sparse
        ms += 20
        poll.observe(*read(ms, 1))
    assert poll.seconds() == 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def spare_core(cores: float, load: float, cpu: list[float], clock: Clock) -> SpareCore:
    return SpareCore(lambda: cores, lambda: load, lambda: cpu[0], clock, every_s=2.0)


def test_a_core_is_spare_when_the_others_leave_one_whole() -> None:
    clock, cpu = Clock(), [0.0]
    idle = spare_core(2, 0.5, cpu, clock)
    assert not idle()  # not measured yet: off until the first reading
    clock.now = 2.0
    assert idle()
    busy = spare_core(2, 1.5, [0.0], clock)
    clock.now = 4.0
    assert not busy()


def test_the_process_own_cpu_is_not_counted_against_it() -> None:
    clock, cpu = Clock(), [0.0]
    check = spare_core(2, 1.8, cpu, clock)  # the load average counts our own spinning too
    clock.now, cpu[0] = 2.0, 2.0  # we used a whole core over those 2 s
    assert check()  # others: 0.8 of 2 cores
    clock.now, cpu[0] = 4.0, 2.0  # we slept: the load of 1.8 is all others'
    assert not check()


def test_the_spare_core_is_read_again_only_every_few_seconds() -> None:
    clock, load = Clock(), [0.2]
    check = SpareCore(lambda: 2, lambda: load[0], lambda: 0.0, clock, every_s=2.0)
    clock.now = 2.0
    assert check()
    load[0] = 1.9
    clock.now = 3.0
    assert check()  # not re-read yet
    clock.now = 4.0
    assert not check()


@pytest.mark.parametrize(
    "cpu_max, expected", [("150000 100000\n", 1.5), ("max 100000\n", None), ("junk", None)]
)
def test_usable_cores_honour_a_cgroup_quota(
    tmp_path: Path, cpu_max: str, expected: float | None
) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    affinity = usable_cores(tmp_path / "missing")
    assert affinity >= 1
    assert usable_cores(path) == (min(affinity, expected) if expected else affinity)


def test_a_worker_on_auto_polls_from_what_it_reads_only_with_nothing_in_hand() -> None:
    settings = BatchSettings(busy_poll_s=None)
    loop = BatchLoop(Doubler(), InMemoryTransport(), ModelKeys("double", "t"), "c1", settings)
    assert loop.auto_poll is not None
    loop.auto_poll = AutoBusyPoll(spare_core=lambda: True)
    assert loop._busy_poll_s(ahead=False) == 0.0  # nothing seen yet
    loop._observe_arrivals([(entry_id, {}) for entry_id in ids(1000, 2)])
    loop._observe_arrivals([(entry_id, {}) for entry_id in ids(1001, 2)])  # 0.5 ms apart
    assert loop._busy_poll_s(ahead=False) == pytest.approx(0.001)
    assert loop._busy_poll_s(ahead=True) == 0.0  # a read ahead waits while the model computes
    fixed = BatchLoop(Doubler(), InMemoryTransport(), ModelKeys("double", "t"), "c1")
    assert fixed.auto_poll is None and fixed._busy_poll_s(ahead=False) == 0.0


def test_a_worker_on_auto_with_no_spare_core_never_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        gpu_worker.batching, "AutoBusyPoll", lambda: AutoBusyPoll(spare_core=lambda: False)
    )
    predict = Doubler(delay=0.002)
    transport = PollRecordingTransport(predict)
    replies, _ = asyncio.run(
        serve_items(predict, list(range(20)), "off", transport, busy_poll_s=None)
    )
    assert len(replies) == 20
    assert all(poll == 0 for poll, _ in transport.reads)
