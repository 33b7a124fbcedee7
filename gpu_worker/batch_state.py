"""The batch a worker child is computing, shared with its supervisor through a tiny mmap.

A memory write per batch, not a message: the supervisor reads it when it looks (its
watchdog, its heartbeats), so reporting a batch costs the child no system call and wakes no
process on the request's critical path.

The two values are written as a sequence lock: the child makes the sequence number odd, writes,
then makes it even; the supervisor accepts a read only if the number was even and unchanged
around it. Without it, a read between the two stores of a busy() saw the new item count with
the idle start time (0.0): a batch "running since boot", which the watchdog killed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
import time

STATE_FILE_ENV = "MICROBATCH_CHILD_STATE_FILE"
_SEQUENCE = struct.Struct("<Q")  # even: the values below are whole; odd: being written
_VALUES = struct.Struct("<qd")  # items in the batch (0: idle), its start (time.monotonic())
_SIZE = _SEQUENCE.size + _VALUES.size
_READ_TRIES = 100


def _directory() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class BatchState:
    """One worker child's current batch: written by the child, read by its supervisor."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)

    @classmethod
    def create(cls) -> BatchState:
        """A new, idle state file (the supervisor makes one per worker slot)."""
        fd, path = tempfile.mkstemp(prefix="microbatch-batch-", dir=_directory())
        try:
            os.write(fd, bytes(_SIZE))
        finally:
            os.close(fd)
        return cls(path)

    def _write(self, items: int, started: float) -> None:
        # One writer at a time (the supervisor before it spawns a child, then that child).
        writing = _SEQUENCE.unpack_from(self._map, 0)[0] | 1
        _SEQUENCE.pack_into(self._map, 0, writing)  # odd: being written
        _VALUES.pack_into(self._map, _SEQUENCE.size, items, started)
        _SEQUENCE.pack_into(self._map, 0, writing + 1)  # even: whole again

    def busy(self, items: int) -> None:
        """The child started computing a batch of ``items``."""
        self._write(items, time.monotonic())

    def idle(self) -> None:
        """The child finished its batch."""
        self._write(0, 0.0)

    def read(self) -> tuple[int, float | None]:
        """(items, start on time.monotonic()) of the batch in hand, or (0, None) when idle.

        A state caught mid-write (again and again) reads as idle: the watchdog looks again soon.
        """
        for _ in range(_READ_TRIES):
            before = _SEQUENCE.unpack_from(self._map, 0)[0]
            items, started = _VALUES.unpack_from(self._map, _SEQUENCE.size)
            if before % 2 == 0 and _SEQUENCE.unpack_from(self._map, 0)[0] == before:
                return (items, started) if items > 0 and started > 0 else (0, None)
        return 0, None

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
