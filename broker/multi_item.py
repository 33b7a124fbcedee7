"""Multi-item stream entries (wire version 2): several items of one caller in one entry.

``mb_enqueue`` packs the items of the calls one round trip carries (same reply key) into
entries of up to ``entry_items`` items each: one XADD, one pending-list entry, one ack for
all of them, instead of one each (docs/protocol.md, section 5.1). A lone item stays a v1
entry. The fields of a v2 entry::

    v 2   reply <key>   n <items>   id.<i> <request id>   timeout.<i> <ms>   data.<i> <bytes>
    [traceparent.<i> <W3C trace context>]   [deadline <ms>]     (i = 0 .. n-1)

A worker reads a v2 entry as ``n`` *item entries*: v1-shaped entries whose id is
``<entry id>#<i>`` (the entry's time stays first, so deadlines read as before). Everything
downstream (batching, deadlines, withdrawal checks, replies, dead letters) works on item
entries; :class:`ItemAcks` acknowledges the stream entry once all its items are answered. A
caller withdraws one item of a v2 entry by its item id (``mb_withdraw`` marks it in the
cancelled set, which workers check by item id).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .functions import MAX_ENTRY_ITEMS as MAX_ENTRY_ITEMS
from .transport import Entry

VERSION = b"2"
ITEM_MARK = "#"
# The most items one v2 entry may hold (functions.MAX_ENTRY_ITEMS: a worker refuses to read
# more from one entry). The Python client's default packs up to DEFAULT_ENTRY_ITEMS.
DEFAULT_ENTRY_ITEMS = 32

_V1 = b"1"
_ITEM_FIELDS = (b"id", b"timeout", b"data", b"traceparent")  # each item's own, numbered


def check_entry_items(count: int) -> int:
    """Return ``count`` if it is a valid number of items per entry (1: v1 entries only)."""
    if not 1 <= count <= MAX_ENTRY_ITEMS:
        raise ValueError(f"items per entry must be 1 to {MAX_ENTRY_ITEMS}, not {count}")
    return count


def item_id(entry_id: str, index: int) -> str:
    """The id of item ``index`` of a v2 entry (``entry_id`` as its stream names it)."""
    return f"{entry_id}{ITEM_MARK}{index}"


def item_count(fields: Any) -> int | None:
    """How many items a v2 entry holds; None for any other entry (v1, or a v2 entry whose
    ``n`` is not 1 to MAX_ENTRY_ITEMS: left to the parser to refuse)."""
    if not isinstance(fields, dict) or fields.get(b"v") != VERSION:
        return None
    n = fields.get(b"n")
    if not isinstance(n, bytes) or not n.isdigit():
        return None
    digits = n.lstrip(b"0")  # any ASCII digits, leading zeros too, as mb_withdraw reads them
    count = int(digits) if 0 < len(digits) <= 4 else 0
    return count if 1 <= count <= MAX_ENTRY_ITEMS else None


# Each item's field names (b"id.<i>", b"timeout.<i>", b"data.<i>", b"traceparent.<i>"), made
# once: splitting is on the worker's hot path, for every item read.
_NAMES = tuple(
    tuple(name + b".%d" % index for name in _ITEM_FIELDS) for index in range(MAX_ENTRY_ITEMS)
)
_INDEXES = tuple(str(index) for index in range(MAX_ENTRY_ITEMS))


def split(entry_id: str, fields: dict[bytes, Any], count: int) -> list[Entry]:
    """The item entries of a v2 entry of ``count`` items: each a v1 entry's fields (a field
    the entry lacks is absent from its item, whose parse then fails alone)."""
    return _split(entry_id, fields, count)[0]


def _split(entry_id: str, fields: dict[bytes, Any], count: int) -> tuple[list[Entry], int]:
    """:func:`split`, and the data bytes of the items (:func:`data_size`), in one pass."""
    reply = fields.get(b"reply")
    if reply is not None and b"deadline" not in fields and len(fields) == 3 + 3 * count:
        # As mb_enqueue writes them (v, reply, n, and each item's id, timeout and data): if
        # every item's three are there, that is all the entry holds.
        try:
            return _split_plain(entry_id, fields, count, reply)
        except KeyError:
            pass  # an item lacks a field: the general way below
    return _split_any(entry_id, fields, count)


def _split_plain(
    entry_id: str, fields: dict[bytes, Any], count: int, reply: Any
) -> tuple[list[Entry], int]:
    """:func:`_split` of an entry whose items have an id, a timeout and data each, and
    nothing else (no trace context, no deadline); KeyError if one lacks one."""
    items: list[Entry] = []
    size = 0
    prefix = entry_id + ITEM_MARK
    for index in range(count):
        id_name, timeout_name, data_name, _ = _NAMES[index]
        data = fields[data_name]
        if type(data) is bytes:
            size += len(data)
        item = {
            b"v": _V1,
            b"reply": reply,
            b"id": fields[id_name],
            b"timeout": fields[timeout_name],
            b"data": data,
        }
        items.append((prefix + _INDEXES[index], item))
    return items, size


def _split_any(entry_id: str, fields: dict[bytes, Any], count: int) -> tuple[list[Entry], int]:
    """:func:`_split` of any entry: a field an item lacks is absent from its item entry."""
    shared: dict[bytes, Any] = {b"v": _V1}
    reply, deadline = fields.get(b"reply"), fields.get(b"deadline")
    if reply is not None:
        shared[b"reply"] = reply
    if deadline is not None:
        shared[b"deadline"] = deadline
    get = fields.get
    items: list[Entry] = []
    size = 0
    prefix = entry_id + ITEM_MARK
    for index in range(count):
        id_name, timeout_name, data_name, trace_name = _NAMES[index]
        item = shared.copy()
        request_id, timeout, data = get(id_name), get(timeout_name), get(data_name)
        if request_id is not None:
            item[b"id"] = request_id
        if timeout is not None:
            item[b"timeout"] = timeout
        if data is not None:
            item[b"data"] = data
            if isinstance(data, bytes):
                size += len(data)
        trace = get(trace_name)
        if trace is not None:
            item[b"traceparent"] = trace
        items.append((prefix + _INDEXES[index], item))
    return items, size


def data_size(fields: dict[bytes, Any], count: int) -> int:
    """The data bytes of a v2 entry's items (what ``mb_enqueue`` counted for the byte bound)."""
    total = 0
    for index in range(count):
        value = fields.get(_NAMES[index][2])
        if isinstance(value, bytes):
            total += len(value)
    return total


class Settled(NamedTuple):
    """What answering some entries of one stream completes: the plain entries and the v2
    entries whose last item was answered (to acknowledge now), with the data bytes and the
    packed items (beyond one per entry) of those v2 entries, to release from the counters;
    the items answered whose entry stays open (to mark answered, so that whoever takes the
    entry over does not compute them again), and the marks of entries now done (to remove)."""

    plain: list[str]
    done: list[str]
    released: int
    packed: int
    answered: list[str]
    unmarked: list[str]


@dataclass(slots=True)
class _OpenEntry:
    """A v2 entry handed out: its items not answered yet, its data bytes, its item count,
    and whether some of its items may be marked answered (in the answered set)."""

    left: set[int]
    size: int
    count: int
    marked: bool


class ItemAcks:
    """Which items of the v2 entries a worker holds (of one stream) are still unanswered.

    Item entries are acknowledged one by one as their batches finish; the stream entry is
    acknowledged (with its bytes released) only with its last item. Ids here are as the
    stream names them (untagged).
    """

    def __init__(self) -> None:
        self._open: dict[str, _OpenEntry] = {}  # by entry id

    def hand_out(
        self, entry_id: str, fields: dict[bytes, Any], count: int, again: bool = False
    ) -> None:
        """Note that all items of the v2 entry ``entry_id`` (a stream id) are handed out;
        ``again``: taken back or over, so its items may have been marked answered before."""
        self.note(entry_id, data_size(fields, count), count, again)

    def note(self, entry_id: str, size: int, count: int, again: bool = False) -> None:
        """:meth:`hand_out` with the entry's data bytes counted already."""
        self._open[entry_id] = _OpenEntry(set(range(count)), size, count, again)

    def settle(self, ids: Iterable[str]) -> Settled:
        """Of stream ids (untagged), some of them item ids, just answered: what that
        completes."""
        plain: list[str] = []
        answered: dict[str, list[str]] = {}
        # The items of one entry come one after another: its state is looked up once.
        last, held, done = "", None, None
        for entry_id in ids:
            stream_id, mark, index = entry_id.partition(ITEM_MARK)
            if not mark:
                plain.append(entry_id)
                continue
            if stream_id != last:
                last, held = stream_id, self._open.get(stream_id)
                done = None if held is None else answered.setdefault(stream_id, [])
            if held is None or done is None or not index.isdigit():
                continue
            number = int(index)
            if number not in held.left:
                continue  # answered already (a duplicate), or handed out before a takeover
            held.left.discard(number)
            done.append(entry_id)
        settled = Settled(plain, [], 0, 0, [], [])
        released = packed = 0
        for stream_id, items in answered.items():
            if not items:
                continue
            held = self._open[stream_id]
            if held.left:
                settled.answered.extend(items)
                held.marked = True
                continue
            del self._open[stream_id]
            settled.done.append(stream_id)
            released += held.size
            packed += held.count - 1
            if held.marked:
                settled.unmarked.extend(item_id(stream_id, i) for i in range(held.count))
        return settled._replace(released=released, packed=packed)

    def forget(self, entry_ids: Iterable[str]) -> None:
        """Forget v2 entries (stream ids) no longer held (acknowledged, or split)."""
        for entry_id in entry_ids:
            self._open.pop(entry_id, None)

    def __len__(self) -> int:
        return len(self._open)


def expand(entries: Sequence[Entry], acks: ItemAcks) -> list[Entry]:
    """Entries as read from a stream, each v2 entry replaced by its item entries (noted in
    ``acks``); ids as the stream names them."""
    out: list[Entry] = []
    for entry_id, fields in entries:
        count = item_count(fields)
        if count is None:
            out.append((entry_id, fields))
            continue
        items, size = _split(entry_id, fields, count)
        acks.note(entry_id, size, count)
        out += items
    return out
