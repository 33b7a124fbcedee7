"""prometheus-client's multiprocess mode, as `worker start` and gunicorn's gateway use it.

Every process writes its samples to files in one directory (``PROMETHEUS_MULTIPROC_DIR``) and
one exporter serves them all, summed. prometheus-client picks its mode when it is first
imported, so the directory is set before that, in the parent, before any child starts: this
module imports it only inside its functions.
"""

from __future__ import annotations

import bisect
import os
import tempfile
from collections.abc import Sequence
from typing import Any

ENV = "PROMETHEUS_MULTIPROC_DIR"


def fresh_directory(prefix: str) -> str:
    """Make an empty directory and point ``PROMETHEUS_MULTIPROC_DIR`` at it (for this process
    and the children it starts from now on)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    os.environ[ENV] = directory
    return directory


def registry() -> Any:
    """A registry that reads the samples of every process writing to the directory."""
    from prometheus_client import CollectorRegistry, multiprocess

    collected = CollectorRegistry()
    multiprocess.MultiProcessCollector(collected)  # type: ignore[no-untyped-call]
    return collected


def process_gone(pid: int) -> None:
    """Forget an exited process's live gauges (its counters keep counting in the sum)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


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
