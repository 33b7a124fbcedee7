"""Replacing a worker process that has served long enough or grown too big: a guard against
model code that leaks memory (``worker start --max-batches`` and ``--max-rss-mib``).

The worker process watches itself (once a second: nothing per batch or item) and, once due,
tells its supervisor why. The supervisor stops it with SIGTERM (it stops reading, finishes and
answers the batches in hand, and exits) and starts a fresh process at once; one slot at a
time, so that the others serve meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batching import BatchLoop

CHECK_EVERY_S = 1.0

log = logging.getLogger("microbatch.worker")


def resident_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm), else its peak."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes there, KiB elsewhere


@dataclass(frozen=True)
class RecyclePolicy:
    """When a worker process is replaced: after ``max_batches`` batches, or once its resident
    memory exceeds ``max_rss_mib`` MiB (0: never, for either)."""

    max_batches: int = 0
    max_rss_mib: int = 0

    @property
    def active(self) -> bool:
        return self.max_batches > 0 or self.max_rss_mib > 0

    def reason(self, batches: int, rss_bytes: Callable[[], int] = resident_bytes) -> str | None:
        """Why a process that has computed ``batches`` batches is due for replacement, or
        None while it is not."""
        if self.max_batches and batches >= self.max_batches:
            return f"computed {batches} batches (--max-batches {self.max_batches})"
        if self.max_rss_mib:
            rss = rss_bytes()
            if rss > self.max_rss_mib * 2**20:
                return (
                    f"resident memory {rss / 2**20:.0f} MiB is over --max-rss-mib "
                    f"{self.max_rss_mib}"
                )
        return None


async def call_when_due(
    policy: RecyclePolicy,
    batches: Callable[[], int],
    call: Callable[[str], None],
    every_s: float = CHECK_EVERY_S,
) -> None:
    """Check ``policy`` every ``every_s`` seconds against the ``batches`` computed so far, and
    call ``call`` with the reason once it is due (then return)."""
    while True:
        await asyncio.sleep(every_s)
        reason = policy.reason(batches())
        if reason is not None:
            call(reason)
            return


def replace_when_due(
    policy: RecyclePolicy,
    batch_loop: BatchLoop,
    consumer: str,
    report: Callable[..., None],
) -> asyncio.Task[None] | None:
    """Watch ``batch_loop`` by ``policy`` on the running loop (None where it is never due):
    once due, tell the supervisor (``report("replace", reason=...)``), which stops it."""
    if not policy.active:
        return None

    def replace(reason: str) -> None:
        if batch_loop.batches:
            log.info("worker %s is due to be replaced: %s", consumer, reason)
        else:  # and so will every process after it: each one costs a model load
            log.warning(
                "worker %s is due to be replaced before its first batch: %s; a worker needs "
                "more than that once its model is loaded", consumer, reason,
            )  # fmt: skip
        report("replace", reason=reason)

    watch: Any = call_when_due(policy, lambda: batch_loop.batches, replace)
    return asyncio.get_running_loop().create_task(watch)
