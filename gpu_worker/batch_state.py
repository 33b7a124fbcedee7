"""The batch a worker child is computing, shared with its supervisor through a tiny mmap.

A memory write per batch, not a message: the supervisor reads it when it looks (its
watchdog, its heartbeats), so reporting a batch costs the child no system call and wakes no
process on the request's critical path.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
import time

STATE_FILE_ENV = "MICROBATCH_CHILD_STATE_FILE"
_LAYOUT = struct.Struct("<qd")  # items in the batch (0: idle), its start (time.monotonic())


def _directory() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class BatchState:
    """One worker child's current batch: written by the child, read by its supervisor."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)

    @classmethod
    def create(cls) -> BatchState:
        """A new, idle state file (the supervisor makes one per worker slot)."""
        fd, path = tempfile.mkstemp(prefix="microbatch-batch-", dir=_directory())
        try:
            os.write(fd, bytes(_LAYOUT.size))
        finally:
            os.close(fd)
        return cls(path)

    def busy(self, items: int) -> None:
        """The child started computing a batch of ``items``."""
        _LAYOUT.pack_into(self._map, 0, items, time.monotonic())

    def idle(self) -> None:
        """The child finished its batch."""
        _LAYOUT.pack_into(self._map, 0, 0, 0.0)

    def read(self) -> tuple[int, float | None]:
        """(items, start on time.monotonic()) of the batch in hand, or (0, None) when idle."""
        items, started = _LAYOUT.unpack_from(self._map, 0)
        return (items, started) if items > 0 else (0, None)

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
