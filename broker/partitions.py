"""A model's queue spread over partitions: naming a worker's entries by partition, and
splitting a bound over them.

A worker reads every partition of its model, and entry ids of different streams may be equal,
so the entries a transport hands to the batch loop carry their partition in their id:
``<ms>-<seq>`` for partition 0 (as Redis names it), ``<ms>-<seq>@<k>`` for partition k. The
time part stays first, so :func:`broker.protocol.entry_time_ms` reads it as before; the
transport takes the mark off again before any command names the entry. An entry of a
partition's high priority level (its lane ``k + MAX_PARTITIONS``, :mod:`broker.keys`) is
``<ms>-<seq>@<k>h`` (``@0h`` for partition 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from .keys import MAX_PARTITIONS

MARK = "@"
HIGH_MARK = "h"

T = TypeVar("T")


def tag(entry_id: str, lane: int) -> str:
    """The id of a lane's entry (a partition's, at a priority level) as the batch loop knows
    it."""
    if lane == 0:
        return entry_id
    if lane < MAX_PARTITIONS:
        return f"{entry_id}{MARK}{lane}"
    return f"{entry_id}{MARK}{lane - MAX_PARTITIONS}{HIGH_MARK}"


def untag(entry_id: str) -> tuple[str, int]:
    """(the entry's id in its stream, its lane) of an id made by :func:`tag`."""
    stream_id, mark, lane = entry_id.partition(MARK)
    if not mark:
        return entry_id, 0
    if lane.endswith(HIGH_MARK):
        return stream_id, int(lane[:-1]) + MAX_PARTITIONS
    return stream_id, int(lane)


def is_high(entry_id: str) -> bool:
    """Whether an id made by :func:`tag` is of a high-priority lane."""
    return entry_id.endswith(HIGH_MARK)


def group(items: Iterable[tuple[str, T]]) -> dict[int, list[tuple[str, T]]]:
    """(tagged id, value) pairs grouped by lane, ids untagged, order kept."""
    out: dict[int, list[tuple[str, T]]] = {}
    for item in items:
        entry_id = item[0]
        if MARK not in entry_id:  # lane 0: the pair as it is
            out.setdefault(0, []).append(item)
            continue
        stream_id, partition = untag(entry_id)
        out.setdefault(partition, []).append((stream_id, item[1]))
    return out


def group_ids(ids: Iterable[str]) -> dict[int, list[str]]:
    """Tagged ids grouped by lane, untagged, order kept."""
    return {k: [i for i, _ in pairs] for k, pairs in group((i, None) for i in ids).items()}


def split_bound(value: int, partitions: int) -> int:
    """One partition's share of a bound over the whole queue (0 stays 0: no bound); rounded
    up, so that no partition is bounded at 0 items."""
    return -(-value // partitions) if value > 0 else 0
