"""prometheus-client's multiprocess mode, as `worker start` and gunicorn's gateway use it.

Every process writes its samples to files in one directory (``PROMETHEUS_MULTIPROC_DIR``) and
one exporter serves them all, summed. prometheus-client picks its mode when it is first
imported, so the directory is set before that, in the parent, before any child starts: this
module imports it only inside its functions.

prometheus-client keeps an exited process's files, so that its counts stay in the sums, and
reads every file at every scrape: a worker replaced every few minutes (``--max-batches``) or
restarted in a loop would slow its scrapes down file by file, day after day. So the files of
an exited process are folded into one file a type (``counter_retired.db``, ...), under a lock
that scrapes share, so that no scrape sees a count twice or not at all.
"""

from __future__ import annotations

import bisect
import fcntl
import glob
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

ENV = "PROMETHEUS_MULTIPROC_DIR"
RETIRED = "retired"  # in the place of the pid in the name of a file of folded samples
_LOCK_FILE = ".fold.lock"

# How an exited process's sample is folded into the retired one, by file kind (the part of the
# file name before the pid): (value, timestamp) of the retired sample and of the process's.
_Fold = Callable[[tuple[float, float], tuple[float, float]], tuple[float, float]]


def _add(kept: tuple[float, float], gone: tuple[float, float]) -> tuple[float, float]:
    return kept[0] + gone[0], max(kept[1], gone[1])


def _latest(kept: tuple[float, float], gone: tuple[float, float]) -> tuple[float, float]:
    return gone if gone[1] > kept[1] else kept


_FOLDS: dict[str, _Fold] = {
    "counter": _add,
    "histogram": _add,
    "summary": _add,
    "gauge_sum": _add,
    "gauge_max": lambda kept, gone: gone if gone[0] > kept[0] else kept,
    "gauge_min": lambda kept, gone: gone if gone[0] < kept[0] else kept,
    "gauge_mostrecent": _latest,
}  # not gauge_all (one sample a process, by design) nor the live modes (removed at exit)


def fresh_directory(prefix: str) -> str:
    """Make an empty directory and point ``PROMETHEUS_MULTIPROC_DIR`` at it (for this process
    and the children it starts from now on)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    os.environ[ENV] = directory
    return directory


@contextmanager
def _locked(directory: str, exclusive: bool) -> Iterator[None]:
    """The directory's fold lock (shared by scrapes, exclusive to a fold), between processes
    and threads alike (each holder opens the lock file anew)."""
    with open(os.path.join(directory, _LOCK_FILE), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield  # closing the file lets go


class _FoldAwareCollector:
    """prometheus-client's multiprocess collector, reading under the fold lock."""

    def __init__(self, directory: str) -> None:
        self._directory = directory

    def collect(self) -> Any:
        from prometheus_client.multiprocess import MultiProcessCollector

        with _locked(self._directory, exclusive=False):
            files = glob.glob(os.path.join(self._directory, "*.db"))
            return list(MultiProcessCollector.merge(_sized(files), accumulate=True))  # type: ignore[no-untyped-call]


def _sized(files: list[str]) -> list[str]:
    """The files that a process has sized: one that a process has just created is empty (it
    holds no sample yet; prometheus-client fails to read it) until the process sizes it."""
    sized = []
    for path in files:
        try:
            if os.path.getsize(path) > 0:
                sized.append(path)
        except FileNotFoundError:  # a live gauge's, removed as its process was marked dead
            continue
    return sized


def registry() -> Any:
    """A registry that reads the samples of every process writing to the directory."""
    from prometheus_client import CollectorRegistry

    collected = CollectorRegistry()
    collected.register(_FoldAwareCollector(os.environ[ENV]))
    return collected


def process_gone(pid: int) -> None:
    """Forget an exited process's live gauges, and fold the rest of its samples into the
    retired files (its counts stay in the sums)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
    fold(os.environ[ENV], pid)


def fold(directory: str, pid: int) -> None:
    """Fold the files of the exited process ``pid`` into the directory's retired files, and
    remove them."""
    from prometheus_client.mmap_dict import MmapedDict

    with _locked(directory, exclusive=True):
        for kind, combine in _FOLDS.items():
            own = os.path.join(directory, f"{kind}_{pid}.db")
            if not _sized([own]):  # none, or one it was killed creating: no sample in it
                with suppress(FileNotFoundError):
                    os.remove(own)
                continue
            samples = MmapedDict.read_all_values_from_file(own)  # type: ignore[no-untyped-call]
            retired: Any = MmapedDict(os.path.join(directory, f"{kind}_{RETIRED}.db"))  # type: ignore[no-untyped-call]
            try:
                kept = {key: (value, stamp) for key, value, stamp in retired.read_all_values()}
                for key, value, stamp, _ in samples:
                    gone = (value, stamp)
                    retired.write_value(key, *(combine(kept[key], gone) if key in kept else gone))
            finally:
                retired.close()
            os.remove(own)


def observe_many(histogram: Any, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for each value, with one update per bucket touched.

    In multi-process mode every update is a locked write to a memory-mapped file; a worker's
    batch of queue waits, or the gateway's requests since its last flush, would otherwise cost
    one per value. prometheus-client has no bulk observe, so
    this uses its histogram child's bucket values, falling back to observe() if they change.
    """
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    added = sum(values)
    if added != added:  # a NaN among them: each goes where bisect puts it (sorting would not)
        counts: dict[int, int] = {}
        for value in values:
            index = bisect.bisect_left(bounds, value)  # the first bucket with value <= bound
            counts[index] = counts.get(index, 0) + 1
        total.inc(added)
        for index, count in counts.items():
            buckets[index].inc(count)
        return
    total.inc(added)
    # Sorted, each bucket's values are a run: found by one bisection per bucket, not per value.
    ordered = sorted(values)
    start, end = 0, len(ordered)
    for index, bound in enumerate(bounds):
        if start == end:
            break
        upto = bisect.bisect_right(ordered, bound, start)  # the values <= bound
        if upto > start:
            buckets[index].inc(upto - start)
            start = upto
