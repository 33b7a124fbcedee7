"""gpu_worker.recycling: `worker start --max-batches/--max-rss-mib` replace a worker process
that has served long enough or grown too big, without losing or failing a call."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from pathlib import Path

import pytest

from broker import Streamer
from broker.devserver import RedisServer, free_port
from gpu_worker.recycling import RecyclePolicy, call_when_due, resident_bytes
from tests.conftest import wait_until, worker_process
from tests.models import INIT_UNTIL_ENV


def test_a_policy_is_due_after_its_batches_or_over_its_memory() -> None:
    assert not RecyclePolicy().active
    assert RecyclePolicy(max_batches=10).reason(9) is None
    assert RecyclePolicy(max_batches=10).reason(10) == "computed 10 batches (--max-batches 10)"
    over = RecyclePolicy(max_rss_mib=100)
    assert over.reason(5, lambda: 100 * 2**20) is None
    assert over.reason(5, lambda: 150 * 2**20) == (
        "resident memory 150 MiB is over --max-rss-mib 100"
    )


def test_this_process_s_resident_memory_is_read() -> None:
    assert 2**20 < resident_bytes() < 2**40


def test_the_watch_calls_once_due_and_only_then() -> None:
    batches = [0]
    called: list[str] = []

    async def scenario() -> None:
        watch = asyncio.create_task(
            call_when_due(RecyclePolicy(max_batches=3), lambda: batches[0], called.append, 0.01)
        )
        await asyncio.sleep(0.05)
        assert not called and not watch.done()
        batches[0] = 3
        await asyncio.wait_for(watch, 5)

    asyncio.run(scenario())
    assert called == ["computed 3 batches (--max-batches 3)"]


@pytest.mark.slow  # worker processes replaced under load
@pytest.mark.parametrize("option", [["--max-batches", "2"], ["--max-rss-mib", "1"]])
def test_a_worker_process_due_is_replaced_and_no_call_is_lost(
    redis_server: RedisServer, prefix: str, option: list[str], tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    port = free_port()
    with (
        worker_process(
            redis_server.url,
            "tests.models:Toy",
            prefix,
            *option,
            "--metrics-port",
            str(port),
            log_path=log,
        ),  # fmt: skip
        Streamer("toy", redis_url=redis_server.url, prefix=prefix, timeout=60) as streamer,
    ):
        pids: set[int] = set()
        deadline = time.monotonic() + 60
        sent = 0
        while len(pids) < 3 and time.monotonic() < deadline:
            futures = [streamer.submit([{"sleep": 0.05}, sent + i]) for i in range(4)]
            for index, future in enumerate(futures):
                outputs = future.result(timeout=60)  # none fails, none is lost
                assert [out["item"] for out in outputs] == [{"sleep": 0.05}, sent + index]
                pids |= {out["pid"] for out in outputs}
            sent += len(futures)
        assert len(pids) >= 3, "no worker process was replaced twice"
        # the replaced processes' counts stay in the sums (folded, not dropped); a batch's
        # are written once its replies are sent, so the last may lag its results a little
        served = sent * 2
        line = 'microbatch_worker_items_total{model="toy",outcome="ok"} '

        def counted() -> list[float]:
            url = f"http://127.0.0.1:{port}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            return [float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]

        with contextlib.suppress(AssertionError):
            wait_until(lambda: counted() == [served], 10, "every item served counted")
        assert counted() == [served]
    text = log.read_text()
    assert "stopped to be replaced" in text and "restarting" not in text


def test_workers_due_together_are_replaced_one_at_a_time() -> None:
    """Under an even load every worker of a `worker start` comes due at once; stopping them
    all at once left the host serving nothing until a fresh process had loaded the model."""
    import signal

    from gpu_worker import supervisor
    from gpu_worker.config import WorkerConfig

    class Running:
        returncode = 0

        def __init__(self, pid: int) -> None:
            self.pid, self.signals = pid, list[int]()

        def poll(self) -> int | None:
            return 0 if self.signals else None

        def send_signal(self, signum: int) -> None:
            self.signals.append(signum)

    workers = supervisor.Supervisor(
        WorkerConfig(model="tests.models:Toy", workers=2, max_batches=5)
    )
    workers.all_ready_once = True
    first, second = workers.slots
    try:
        first.process, second.process = Running(1), Running(2)  # type: ignore[assignment]
        first.ready = second.ready = True
        first.due = second.due = "computed 5 batches (--max-batches 5)"
        workers._replace_due()
        assert (first.process.signals, second.process.signals) == ([signal.SIGTERM], [])
        workers._reap(first, 1000.0)  # it answered its batches and exited: a fresh one starts
        assert first.refilling and first.restart_at == 1000.0
        workers._replace_due()
        assert second.process.signals == []  # not while the fresh one loads the model
        first.process, first.ready, first.refilling = Running(3), True, False  # type: ignore[assignment]
        workers._replace_due()
        assert second.process.signals == [signal.SIGTERM]
    finally:
        workers.heartbeats.close()


@pytest.mark.slow  # waits out a worker's start timeout
def test_a_fresh_process_stuck_loading_the_model_is_restarted_after_the_start_timeout(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """--start-timeout held only until every worker had first been ready: a replacement (or
    restarted) process stuck loading the model then held its slot for good, serving nothing."""
    log, loadable = tmp_path / "worker.log", tmp_path / "loadable"
    loadable.touch()
    options = ("--max-batches", "1", "--start-timeout", "3")
    with (
        worker_process(
            redis_server.url, "tests.models:Toy", prefix, *options,
            env={INIT_UNTIL_ENV: str(loadable)}, log_path=log,
        ),
        Streamer("toy", redis_url=redis_server.url, prefix=prefix, timeout=60) as streamer,
    ):  # fmt: skip
        loadable.unlink()  # the next process hangs in init_model (60 s)
        first = streamer.predict([1])[0]["pid"]
        deadline = time.monotonic() + 40
        while "not ready within 3 s; restarting" not in log.read_text():
            assert time.monotonic() < deadline, "the stuck process was never stopped"
            time.sleep(0.2)
        loadable.touch()
        assert streamer.predict([2])[0]["pid"] != first
