"""broker.multiproc_metrics: the samples of exited processes are folded into one file a kind,
keeping every sum the exporter serves, and scrapes never see a fold half done."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from broker import multiproc_metrics

# A process that writes samples in multiprocess mode, as a worker process does, then exits.
WRITER = """
import sys
from prometheus_client import Counter, Gauge, Histogram
value = float(sys.argv[1])
Counter("mb_test_batches", "batches", ["model"]).labels("toy").inc(value)
Histogram("mb_test_seconds", "seconds", buckets=(1.0, 10.0)).observe(value)
Gauge("mb_test_peak", "peak", multiprocess_mode="max").set(value)
Gauge("mb_test_last", "last", multiprocess_mode="mostrecent").set(value)
Gauge("mb_test_live", "live", multiprocess_mode="livesum").set(value)
print(__import__("os").getpid())
"""


def write_samples(directory: Path, value: float) -> int:
    """Run a writer process to its end; its pid."""
    env = {**os.environ, multiproc_metrics.ENV: str(directory)}
    done = subprocess.run(
        [sys.executable, "-c", WRITER, str(value)], env=env, capture_output=True, check=True
    )
    return int(done.stdout)


def scrape(directory: Path) -> dict[str, float]:
    """What the exporter serves, by sample name and labels."""
    os.environ[multiproc_metrics.ENV] = str(directory)
    try:
        collected = multiproc_metrics.registry().collect()
        return {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for metric in collected
            for s in metric.samples
            if s.name.startswith("mb_test")
        }
    finally:
        del os.environ[multiproc_metrics.ENV]


def test_an_exited_process_s_samples_are_folded_and_every_sum_kept(tmp_path: Path) -> None:
    pids = [write_samples(tmp_path, value) for value in (3.0, 20.0, 5.0)]
    before = scrape(tmp_path)
    for pid in pids:
        multiproc_metrics.fold(str(tmp_path), pid)
    after = scrape(tmp_path)
    # the live gauge is removed by mark_process_dead, not by a fold: it stays as it was
    assert after == before
    assert after["mb_test_batches_total[('model', 'toy')]"] == 28.0
    assert after["mb_test_seconds_count[]"] == 3.0
    assert after["mb_test_seconds_bucket[('le', '10.0')]"] == 2.0
    assert after["mb_test_peak[]"] == 20.0
    assert after["mb_test_last[]"] == 5.0  # the value written last
    names = sorted(p.name for p in tmp_path.glob("*.db"))
    assert names == sorted(
        ["counter_retired.db", "histogram_retired.db", "gauge_max_retired.db",
         "gauge_mostrecent_retired.db"] + [f"gauge_livesum_{pid}.db" for pid in pids]
    )  # fmt: skip


def test_a_process_gone_leaves_no_file_of_its_own(tmp_path: Path) -> None:
    """Every exited process left four files, read at every scrape: a worker replaced every
    few minutes made its scrapes slower day by day."""
    pids = [write_samples(tmp_path, 1.0) for _ in range(4)]
    os.environ[multiproc_metrics.ENV] = str(tmp_path)
    try:
        for pid in pids:
            multiproc_metrics.process_gone(pid)
    finally:
        del os.environ[multiproc_metrics.ENV]
    assert not [p.name for p in tmp_path.glob("*.db") if any(str(pid) in p.name for pid in pids)]
    assert scrape(tmp_path)["mb_test_batches_total[('model', 'toy')]"] == 4.0


def test_a_scrape_waits_for_a_fold_in_progress(tmp_path: Path) -> None:
    """Between a fold's write of the retired file and its removal of the process's own, a
    scrape would count that process twice (a counter that then goes down: a reset to
    Prometheus); before the write, not at all."""
    write_samples(tmp_path, 1.0)
    seen: list[float] = []

    def scrape_once() -> None:
        for metric in multiproc_metrics._FoldAwareCollector(str(tmp_path)).collect():
            seen.extend(s.value for s in metric.samples if s.name == "mb_test_batches_total")

    with multiproc_metrics._locked(str(tmp_path), exclusive=True):  # what a fold holds
        scraper = threading.Thread(target=scrape_once)
        scraper.start()
        scraper.join(0.5)
        assert scraper.is_alive() and not seen  # waiting for the fold
    scraper.join(10)
    assert seen == [1.0]


def test_a_process_that_is_creating_its_file_fails_no_scrape_nor_fold(tmp_path: Path) -> None:
    """A process creates its file empty, then sizes it: a scrape at that moment (a worker
    replaced by --max-batches under load, every few seconds) answered 500, and a fold of a
    process killed at that moment raised in the supervisor."""
    write_samples(tmp_path, 2.0)
    (tmp_path / "counter_999999.db").touch()  # a process just starting, or killed as it did
    assert scrape(tmp_path)["mb_test_batches_total[('model', 'toy')]"] == 2.0
    multiproc_metrics.fold(str(tmp_path), 999999)
    assert not (tmp_path / "counter_999999.db").exists()
    assert scrape(tmp_path)["mb_test_batches_total[('model', 'toy')]"] == 2.0
