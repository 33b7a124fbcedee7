"""CPU time of process trees over a measured window, read from /proc (Linux).

A :class:`CpuMeter` names groups of processes (our worker, our gateway, Redis; an alternative's
server), each by the pid at the root of its tree. :meth:`CpuMeter.sample` reads the user +
system time of every process of every tree, found afresh each time (so gunicorn's or mosec's
workers are counted whatever their pids); :func:`per_item` turns two samples into microseconds
per request. A process that ends within the window takes its time with it, so the figures are
for servers whose processes live for the whole run, as the benchmark's do.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def tree(root: int) -> list[int]:
    """``root`` and all its descendants (those alive now)."""
    pids, frontier = [root], [root]
    while frontier:
        pid = frontier.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(p) for p in f.read().split()]
        except OSError:
            children = []
        pids += children
        frontier += children
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads) so far."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # gone
            continue
        total += int(fields[11]) + int(fields[12])
    return total * TICK_S


def children_cpu_seconds() -> float:
    """CPU seconds of this process's children that have ended and been waited for (a load
    generator run with subprocess.run, say)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """CPU seconds of named process trees: ``CpuMeter({"worker": pid, "redis": pid})``."""

    def __init__(self, roots: Mapping[str, int | None]) -> None:
        self.roots = {name: pid for name, pid in roots.items() if pid is not None}

    def sample(self) -> dict[str, float]:
        return {name: cpu_seconds(tree(pid)) for name, pid in self.roots.items()}


def per_item(
    before: Mapping[str, float], after: Mapping[str, float], items: int
) -> dict[str, float] | None:
    """Microseconds of CPU per item for each group between two samples, and their ``total``."""
    if items <= 0:
        return None
    out = {name: (after[name] - before[name]) / items * 1e6 for name in before}
    out["total"] = sum(out.values())
    return out
