"""Request priorities: the levels' names, and the order in which a worker takes them.

A request is ``normal`` (the default) or ``high`` (:data:`broker.keys.LEVELS`); each level of a
partition is a stream of its own (:mod:`broker.keys`). A worker hands out high entries first,
but not forever: after ``STARVE_AFTER`` batches in a row that held only high entries while
normal ones were waiting, its next batch takes the normal level first (:class:`LevelTurns`).
So a normal entry at the head of its level waits at most ``STARVE_AFTER`` batches of a worker.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any

from .keys import HIGH, LEVELS, NORMAL

STARVE_AFTER = 4
"""K: batches in a row a worker may take from the high level while normal entries wait."""

HEADER = "X-Priority"
"""The HTTP header (v1 and v2 routes) that names a request's priority."""

# How a refused value is shown in the error: shortened, so that a huge header or v2 parameter
# is not echoed whole (nor its repr built whole).
_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = _shown.maxlong = 40
_shown.maxlist = _shown.maxtuple = _shown.maxdict = _shown.maxset = 4
_shown.maxlevel = 2


def _show(value: Any) -> str:
    try:
        return _shown.repr(value)
    except ValueError:  # an int too long for Python to print
        return "(a value too long to show)"


def parse_priority(value: Any, show: Callable[[Any], str] = _show) -> int:
    """The level of a priority as callers name it: ``"high"`` or ``"normal"`` (any case,
    surrounding whitespace ignored), the level's number (1 or 0, an int or that one digit), or
    None (normal). Raises ValueError naming what is accepted and the value, as ``show`` writes
    it (by default its Python repr, shortened)."""
    if value is None:
        return NORMAL
    if isinstance(value, str):
        name = value.strip().lower()
        if name in LEVELS:
            return LEVELS.index(name)
        if name in ("0", "1"):
            return int(name)
    elif isinstance(value, int) and not isinstance(value, bool) and value in (NORMAL, HIGH):
        return value
    raise ValueError(
        f"invalid priority {show(value)}: use 'high' or 'normal' (the default), or 1 or 0"
    )


class LevelTurns:
    """Which level a worker's next batch takes first: high, unless ``starve_after`` batches
    in a row took only high entries while normal ones waited."""

    def __init__(self, starve_after: int = STARVE_AFTER) -> None:
        if starve_after < 1:
            raise ValueError("starve_after must be at least 1")
        self.starve_after = starve_after
        self.streak = 0  # batches in a row of high entries only, while normal ones waited

    def order(self) -> tuple[int, int]:
        """The levels in the order the next batch takes them."""
        return (NORMAL, HIGH) if self.streak >= self.starve_after else (HIGH, NORMAL)

    def took(self, normal_taken: int, normal_waiting: bool) -> None:
        """Count a batch: how many normal entries it took, and whether any are still waiting."""
        if normal_taken == 0 and normal_waiting:
            self.streak += 1
        else:
            self.streak = 0


class LevelKeep:
    """What one consumer's reads of one partition delivered and did not hand out yet, per
    level (a read of both levels may bring more than a batch), and the turns of the levels.

    Entries are ``(id, fields)`` as in their stream; each level's are kept in stream order.
    """

    def __init__(self, starve_after: int = STARVE_AFTER) -> None:
        self.kept: tuple[list[Any], list[Any]] = ([], [])
        self.turns = LevelTurns(starve_after)

    def empty(self) -> bool:
        return not (self.kept[NORMAL] or self.kept[HIGH])

    def wanted(self, count: int) -> list[tuple[int, int]]:
        """(level, how many to read) for each level that keeps less than ``count``."""
        return [(level, count - len(self.kept[level])) for level in (HIGH, NORMAL)
                if len(self.kept[level]) < count]  # fmt: skip

    def add(self, level: int, entries: list[Any]) -> None:
        self.kept[level].extend(entries)

    def take(self, count: int) -> list[tuple[int, Any]]:
        """Up to ``count`` kept entries as (level, entry), the levels in their turn's order."""
        out: list[tuple[int, Any]] = []
        for level in self.turns.order():
            kept = self.kept[level]
            n = min(count - len(out), len(kept))
            if n > 0:
                out += [(level, entry) for entry in kept[:n]]
                del kept[:n]
        if out:
            normal = sum(1 for level, _ in out if level == NORMAL)
            self.turns.took(normal, bool(self.kept[NORMAL]))
        return out

    def clear(self) -> list[tuple[int, Any]]:
        """Everything kept (high first), forgotten here."""
        out = [(level, entry) for level in (HIGH, NORMAL) for entry in self.kept[level]]
        self.kept[NORMAL].clear()
        self.kept[HIGH].clear()
        return out
