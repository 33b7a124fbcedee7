"""Automatic busy polling: spin briefly for the next request only when it pays and a core is free.

A worker whose queue has run dry blocks on Redis until the next request comes. If one comes a
fraction of a millisecond later, the worker's core has meanwhile gone idle and comes back slower
(see :func:`broker.busy_poll.busy_poll`). Polling instead of sleeping saves that wake-up, at the
price of a core spinning. :class:`AutoBusyPoll` decides, read by read, how long to poll:

- only while requests arrive closely: the mean gap between arrivals (from the stream entries'
  own times, smoothed) is at most the cap; the poll then lasts twice that gap (a Poisson stream's
  next arrival falls within it 86% of the time), at least 0.25 ms, never more than the cap;
- only with a core to spare: the cores this process may use (its CPU affinity, and a cgroup CPU
  quota when one is set, as in a container) minus the load of everything else on the machine
  (the 1-minute load average less this process's own CPU share, re-read every few seconds)
  leave at least one whole core.

On a busy shared machine it stays off; on a GPU host with cores to spare it polls while traffic
is dense, and never when requests are sparse enough that the wait would be spent spinning.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from broker.protocol import entry_time_ms

DEFAULT_CAP_S = 0.001  # the longest an automatic poll lasts
MIN_POLL_S = 0.00025  # the shortest: entry times have 1 ms resolution, so a mean gap near 0 is
# "several per millisecond", not "none to wait for"
CHECK_EVERY_S = 2.0  # how often the spare-core test is re-read
SMOOTHING = 0.2  # weight of the newest gap in the mean inter-arrival time
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> float:
    """The cores this process may run on: its affinity, bounded by a cgroup v2 CPU quota."""
    cores = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    try:
        return min(cores, int(quota) / int(period))
    except (ValueError, ZeroDivisionError):
        return cores


class SpareCore:
    """Whether a whole core is free for this process to spin on, re-read every ``every_s``."""

    def __init__(
        self,
        cores: Callable[[], float] = usable_cores,
        load: Callable[[], float] = lambda: os.getloadavg()[0],
        cpu_time: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = CHECK_EVERY_S,
    ) -> None:
        self._cores, self._load, self._cpu_time, self._clock = cores, load, cpu_time, clock
        self._every_s = every_s
        self._checked_at = clock()
        self._cpu_at = cpu_time()
        self._free = False

    def __call__(self) -> bool:
        now = self._clock()
        elapsed = now - self._checked_at
        if elapsed >= self._every_s:
            cpu = self._cpu_time()
            own_share = min(1.0, (cpu - self._cpu_at) / elapsed)
            others = max(0.0, self._load() - own_share)
            self._free = self._cores() - others >= 1.0
            self._checked_at, self._cpu_at = now, cpu
        return self._free


class AutoBusyPoll:
    """How long a read with nothing in hand polls: sized from the observed inter-arrival time,
    zero unless arrivals are dense and :class:`SpareCore` says a core is free."""

    def __init__(
        self, cap_s: float = DEFAULT_CAP_S, spare_core: Callable[[], bool] | None = None
    ) -> None:
        self.cap_s = cap_s
        self._spare_core = spare_core if spare_core is not None else SpareCore()
        self._last_ms: int | None = None
        self.mean_gap_s: float | None = None

    def observe(self, entry_id: str, count: int) -> None:
        """Note the arrival of ``count`` entries just read (at least one), ``entry_id`` the
        newest of them: the mean gap is taken from the newest ids of successive reads."""
        newest = entry_time_ms(entry_id)
        if self._last_ms is not None and newest >= self._last_ms:
            gap_s = (newest - self._last_ms) / 1000 / count
            mean = self.mean_gap_s
            self.mean_gap_s = gap_s if mean is None else mean + SMOOTHING * (gap_s - mean)
        self._last_ms = newest

    def seconds(self) -> float:
        """The poll for the next read: 2x the mean gap (0.25 ms at least, the cap at most);
        0 when arrivals are sparse or no core is spare."""
        gap = self.mean_gap_s
        if gap is None or gap > self.cap_s or not self._spare_core():
            return 0.0
        return min(self.cap_s, max(MIN_POLL_S, 2 * gap))
