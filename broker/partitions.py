"""A model's queue spread over partitions: naming a worker's entries by partition, and
splitting a bound over them.

A worker reads every partition of its model, and entry ids of different streams may be equal,
so the entries a transport hands to the batch loop carry their partition in their id:
``<ms>-<seq>`` for partition 0 (as Redis names it), ``<ms>-<seq>@<k>`` for partition k. The
time part stays first, so :func:`broker.protocol.entry_time_ms` reads it as before; the
transport takes the mark off again before any command names the entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

MARK = "@"

T = TypeVar("T")


def tag(entry_id: str, partition: int) -> str:
    """The id of a partition's entry as the batch loop knows it."""
    return entry_id if partition == 0 else f"{entry_id}{MARK}{partition}"


def untag(entry_id: str) -> tuple[str, int]:
    """(the entry's id in its stream, its partition) of an id made by :func:`tag`."""
    stream_id, mark, partition = entry_id.partition(MARK)
    return (stream_id, int(partition)) if mark else (entry_id, 0)


def group(items: Iterable[tuple[str, T]]) -> dict[int, list[tuple[str, T]]]:
    """(tagged id, value) pairs grouped by partition, ids untagged, order kept."""
    out: dict[int, list[tuple[str, T]]] = {}
    for entry_id, value in items:
        stream_id, partition = untag(entry_id)
        out.setdefault(partition, []).append((stream_id, value))
    return out


def group_ids(ids: Iterable[str]) -> dict[int, list[str]]:
    """Tagged ids grouped by partition, untagged, order kept."""
    return {k: [i for i, _ in pairs] for k, pairs in group((i, None) for i in ids).items()}


def split_bound(value: int, partitions: int) -> int:
    """One partition's share of a bound over the whole queue (0 stays 0: no bound); rounded
    up, so that no partition is bounded at 0 items."""
    return -(-value // partitions) if value > 0 else 0
