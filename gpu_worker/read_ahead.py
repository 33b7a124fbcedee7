"""The entries a worker holds beyond the batch computing: read ahead, or held from a window."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from broker.transport import Entry

from .preparing import PreparedBatch

DropStale = Callable[[PreparedBatch, set[str]], bool]


class ReadAhead:
    """The batch read while the model computes (one read in flight at most), the batches of a
    window held to run next, and which of their items callers withdrew meanwhile (as the last
    replies' round trip said)."""

    def __init__(self) -> None:
        self.task: asyncio.Task[list[Entry]] | None = None
        self.held: list[PreparedBatch] = []  # the window's batches still to run, in order
        self.withdrawn: set[str] = set()  # read ahead, then withdrawn by their callers
        self._checked: set[str] = set()  # ids the last replies' round trip checked

    @property
    def reading(self) -> bool:
        """A batch is being (or has been) read ahead and not taken yet."""
        return self.task is not None

    def start(self, read: Coroutine[Any, Any, list[Entry]]) -> None:
        self.task = asyncio.ensure_future(read)

    def take_read(self) -> asyncio.Task[list[Entry]]:
        """The read ahead, to await; it is no longer in hand here."""
        task, self.task = self.task, None
        assert task is not None
        return task

    def take_withdrawn(self) -> set[str]:
        withdrawn, self.withdrawn = self.withdrawn, set()
        return withdrawn

    def unchecked(self, ids: Iterable[str]) -> list[str]:
        """Those of ``ids`` that the last replies' round trip did not check."""
        checked = self._checked
        return [entry_id for entry_id in ids if entry_id not in checked]

    def held_ids(self) -> list[str]:
        return [request.entry_id for batch in self.held for request in batch.live]

    def note_checked(self) -> list[str]:
        """The ids to check with the replies going out now (and remember as checked)."""
        ids = self.ids()
        self._checked = set(ids)
        return ids

    def forget_checked(self) -> None:
        self._checked = set()

    def ids(self) -> list[str]:
        """Entry ids of the batch read ahead, if it has arrived, and of the held items."""
        held = self.held_ids()
        task = self.task
        if task is None or not task.done() or task.cancelled() or task.exception() is not None:
            return held
        return held + [entry_id for entry_id, _ in task.result()]

    def take_held(self, now_ms: float, withdrawn: set[str], drop_stale: DropStale) -> PreparedBatch:
        """The next held batch of the window. Items of the batches still held that were
        withdrawn or expired meanwhile are answered with it rather than after their wait."""
        batch = self.held.pop(0)
        batch.now_ms = now_ms
        drop_stale(batch, withdrawn)
        for later in self.held:
            if drop_stale(later, withdrawn):
                kept = {request.entry_id for request in later.live}
                batch.entries += [entry for entry in later.entries if entry[0] not in kept]
                later.entries = [entry for entry in later.entries if entry[0] in kept]
                batch.replies += later.replies
                later.replies = []
        self.held = [later for later in self.held if later.entries]
        return batch

    def drop(self) -> None:
        """Cancel the read ahead and forget the held batches (after an outage: their entries
        are pending for this consumer, taken back as its own once Redis answers)."""
        if self.task is not None:
            self.task.cancel()
        self.task = None
        self.held = []
