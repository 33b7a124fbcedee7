"""What operators ask of a deployment: queue status and dead letters (synchronous, for the CLI)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import redis

from . import functions, liveness, multi_item
from .keys import (
    HIGH,
    LEVEL_SUFFIX,
    MAX_PARTITIONS,
    NAME_PATTERN,
    NORMAL,
    PREFIX_PATTERN,
    ModelKeys,
    parse_partitions,
)
from .liveness import server_time_ms
from .partitions import tag
from .protocol import F_DEADLINE, F_ID
from .transport import counter_value, entry_data_size

# A request stream of either level (a model whose callers queued only at high priority, before
# any worker made its normal stream, has only the high one), of a valid prefix and model (or
# pipeline stage) name: any other key that looks like one (written by hand) is not microbatch's.
_NAME = NAME_PATTERN.pattern
STREAM_KEY = re.compile(
    rf"mb:\{{(?P<prefix>{PREFIX_PATTERN.pattern}):(?P<model>{_NAME}(?:\.{_NAME})?)"
    rf"(?::p(?P<partition>[1-9][0-9]*))?\}}:requests(?:{re.escape(LEVEL_SUFFIX)})?"
)
DEAD_FIELDS = (b"dead_reason", b"dead_entry", b"dead_cut")
# A dead id as dead_letters shows it (broker.partitions.tag): a stream id, then the lane's mark.
DEAD_ID = re.compile(
    r"(?P<stream>[0-9]{1,20}-[0-9]{1,20})(?:@(?P<partition>[0-9]{1,3})(?P<high>h?))?"
)
DEAD_PAGE = 1000  # dead letters read per XRANGE when replaying them all
REPLAY_DROPS = (*DEAD_FIELDS, F_DEADLINE)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _now_ms(client: redis.Redis, keys: ModelKeys) -> int:
    return server_time_ms(client, keys.stream)  # the clock of the node holding the model


def find_models(client: redis.Redis, prefix: str | None = None) -> list[ModelKeys]:
    """Every (prefix, model) with a request stream, optionally under one prefix (SCAN of
    every primary of a Redis Cluster), each with its partitions: as many as stored with the
    model, or as its streams show if more."""
    pattern = f"mb:{{{prefix}:*}}:requests*" if prefix else "mb:{*}:requests*"
    found: dict[tuple[str, str], int] = {}
    for key in client.scan_iter(match=pattern, count=1000, _type="stream"):
        match = STREAM_KEY.fullmatch(_text(key))
        if match:
            partition = int(match["partition"] or 0)
            if partition < MAX_PARTITIONS:
                model = (match["prefix"], match["model"])
                found[model] = max(found.get(model, 1), partition + 1)
    return [
        model_keys(client, model, prefix, streams)
        for (prefix, model), streams in sorted(found.items())
    ]


def prefixes(client: redis.Redis) -> list[str]:
    """The prefixes with a model's request stream (their key names only: a SCAN)."""
    found = set()
    for key in client.scan_iter(match="mb:{*}:requests*", count=1000, _type="stream"):
        match = STREAM_KEY.fullmatch(_text(key))
        if match:
            found.add(match["prefix"])
    return sorted(found)


def served_keys(client: redis.Redis, model: str, prefix: str) -> ModelKeys:
    """A model's keys with as many partitions as stored with it, or as its streams (requests
    or dead letters) show if more: after ``--partitions`` was lowered, the partitions dropped
    keep what they held (a SCAN of every primary of a Redis Cluster)."""
    pattern = f"mb:{{{prefix}:{model}:p*}}:*"
    found = re.compile(
        rf"mb:\{{{re.escape(prefix)}:{re.escape(model)}:p(?P<partition>[1-9][0-9]*)\}}"
        rf":(?:requests|dead)(?:{re.escape(LEVEL_SUFFIX)})?"
    )
    seen = 1
    for key in client.scan_iter(match=pattern, count=1000, _type="stream"):
        match = found.fullmatch(_text(key))
        if match and int(match["partition"]) < MAX_PARTITIONS:
            seen = max(seen, int(match["partition"]) + 1)
    return model_keys(client, model, prefix, seen)


def model_keys(client: redis.Redis, model: str, prefix: str, seen: int = 1) -> ModelKeys:
    """A model's keys with its partition count: the stored one, or ``seen`` if more."""
    keys = ModelKeys(model, prefix)
    stored = parse_partitions(client.get(keys.partitions_key))
    return keys.spread(max(stored, seen))


@dataclass
class ConsumerStatus:
    name: str
    pending: int
    idle_ms: int
    alive: bool
    heartbeat_expires_in_ms: int | None
    current_batch: int = 0  # items in the batch it is computing (0: none)
    current_batch_ms: int = 0  # for how long, as of its last heartbeat
    in_group: bool = True  # a consumer of the group (else only in the consumers set: it left
    # the group, or never read; pending and idle_ms are then 0)


@dataclass
class PartitionStatus:
    """One lane of a model's queue: one priority level of one partition (its own stream; a
    partition's levels share its hash slot)."""

    partition: int
    stream: str
    stream_length: int
    pending: int
    queued_bytes: int
    dead_letters: int
    queue_bound_items: int = 0  # this partition's item bound now (0: none), for each level
    queue_bound_bytes: int = 0
    priority: str = "normal"  # the level (broker.keys.LEVELS)
    queued_items: int = 0  # items in the stream: its entries and their packed items
    node: str = ""  # on a Redis Cluster, the primary serving its slot ("host:port"); else ""


@dataclass
class ModelStatus:
    prefix: str
    model: str
    stream_length: int  # the counts are the model's: summed over its partitions
    pending: int
    queued_bytes: int
    dead_letters: int
    consumers: list[ConsumerStatus] = field(default_factory=list)
    queue_bound_items: int = 0  # the model's item bound now: per live worker x live (0: none)
    queue_bound_bytes: int = 0  # its byte bound (0: none), each level's
    partitions: list[PartitionStatus] = field(default_factory=list)  # the normal level's
    high: list[PartitionStatus] = field(default_factory=list)  # each partition's high level
    high_stream_length: int = 0  # of the counts above, the high level's entries queued
    queued_items: int = 0  # items queued: stream_length plus multi-item entries' extra items

    @property
    def live_consumers(self) -> int:
        return sum(consumer.alive for consumer in self.consumers)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "live_consumers": self.live_consumers}


def _partition_status(client: redis.Redis, keys: ModelKeys) -> tuple[PartitionStatus, Any]:
    """One partition's counts and bound (its item bound per live worker), and its group's
    consumers as XINFO CONSUMERS lists them."""
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.stream)
    pipe.get(keys.queued_bytes)
    pipe.xlen(keys.dead_letters)
    pipe.hmget(keys.queue_bound, ["items", "bytes"])
    pipe.get(keys.packed_items)
    length, queued, dead, bound, packed = pipe.execute()
    try:
        summary: Any = client.xpending(keys.stream, keys.group)
        infos: Any = client.xinfo_consumers(keys.stream, keys.group)
    except redis.ResponseError:  # no consumer group yet
        summary, infos = {"pending": 0}, []
    status = PartitionStatus(
        partition=keys.partition,
        stream=keys.stream,
        stream_length=int(length),
        pending=int(summary["pending"]),
        queued_bytes=int(queued or 0),
        dead_letters=int(dead),
        queue_bound_items=counter_value(bound[0]),
        queue_bound_bytes=counter_value(bound[1]),
        priority=keys.priority,
        queued_items=int(length) + counter_value(packed),
        node=_node_of(client, keys.stream),
    )
    return status, infos


def _node_of(client: redis.Redis, key: str) -> str:
    """The primary serving ``key``'s slot on a Redis Cluster ("host:port"), else ""."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return ""
    node = client.get_node_from_key(key)
    return f"{node.host}:{node.port}" if node is not None else ""


def model_status(client: redis.Redis, keys: ModelKeys) -> ModelStatus:
    """A snapshot of one model's queue (each of its partitions), workers and dead letters.
    ``keys`` carry the partition count (:func:`model_keys`)."""
    now_ms = _now_ms(client, keys)  # the clock that scores the consumers (partition 0's)
    vouched: Any = client.zrange(keys.consumers, 0, -1, withscores=True)
    expiries = {_text(name): int(score) for name, score in vouched}
    parts: list[PartitionStatus] = []
    held: dict[str, dict[str, int]] = {}  # consumer -> pending (summed) and idle (least)
    for part in keys.lanes():
        status, infos = _partition_status(client, part)
        parts.append(status)
        for info in infos:
            name = _text(info["name"])
            seen = held.setdefault(name, {"pending": 0, "idle": int(info.get("idle", 0))})
            seen["pending"] += int(info.get("pending", 0))
            seen["idle"] = min(seen["idle"], int(info.get("idle", 0)))
    names = sorted(set(held) | set(expiries))
    beats: Any = client.mget([keys.heartbeat(name) for name in names]) if names else []
    consumers = []
    for name, beat in zip(names, beats, strict=True):
        info = held.get(name, {})
        expiry = expiries.get(name)
        state = _heartbeat_state(beat)
        consumers.append(
            ConsumerStatus(
                name=name,
                pending=int(info.get("pending", 0)),
                idle_ms=int(info.get("idle", 0)),
                alive=expiry is not None and expiry > now_ms,
                heartbeat_expires_in_ms=None if expiry is None else expiry - now_ms,
                current_batch=_count(state, "batch"),
                current_batch_ms=_count(state, "batch_ms"),
                in_group=name in held,
            )
        )
    live = max(sum(consumer.alive for consumer in consumers), 1)
    for share in parts:
        share.queue_bound_items *= live
    normal = [p for p in parts if p.priority == "normal"]  # each level has the bound
    high = [p for p in parts if p.priority != "normal"]
    return ModelStatus(
        queue_bound_items=sum(p.queue_bound_items for p in normal),
        queue_bound_bytes=sum(p.queue_bound_bytes for p in normal),
        prefix=keys.prefix,
        model=keys.model,
        stream_length=sum(p.stream_length for p in parts),
        pending=sum(p.pending for p in parts),
        queued_bytes=sum(p.queued_bytes for p in parts),
        dead_letters=sum(p.dead_letters for p in parts),
        consumers=consumers,
        partitions=normal,
        high=high,
        high_stream_length=sum(p.stream_length for p in high),
        queued_items=sum(p.queued_items for p in parts),
    )


def _heartbeat_state(value: Any) -> dict[str, Any]:
    """The JSON a supervisor keeps in a heartbeat key (empty if absent or unreadable)."""
    if not value:
        return {}
    try:
        state = json.loads(value)
    except (ValueError, RecursionError):
        return {}
    return state if isinstance(state, dict) else {}


def _count(state: dict[str, Any], field: str) -> int:
    """A whole number of a heartbeat's JSON, 0 where it holds anything else: the key may be
    written by a worker in another language, whose odd value must not stop the command."""
    value = state.get(field, 0)
    if isinstance(value, float) and math.isfinite(value):
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def status(client: redis.Redis, prefix: str | None = None) -> list[ModelStatus]:
    """Snapshots of every model (under ``prefix`` if given)."""
    return [model_status(client, keys) for keys in find_models(client, prefix)]


@dataclass
class DeadLetter:
    """One dead-lettered request; its payload is not shown, only its size.

    Each partition of a model has its own dead-letter stream per priority level: the ids of
    partition k's dead letters (and of their entries) end in ``@k``, those of its high level
    in ``@kh`` (:mod:`broker.partitions`)."""

    dead_id: str
    entry_id: str
    request_id: str
    reason: str
    data_bytes: int
    age_s: float
    partition: int = 0
    priority: str = "normal"


def dead_letters(client: redis.Redis, keys: ModelKeys, count: int = 100) -> list[DeadLetter]:
    """The oldest ``count`` dead letters of a model (of each of its partitions)."""
    out = []
    for part in keys.lanes():
        now_ms = _now_ms(client, part)  # the clock that stamped this partition's ids
        entries: Any = client.xrange(part.dead_letters, count=count)
        for dead_id, fields in entries:
            dead = _text(dead_id)
            out.append(
                DeadLetter(
                    dead_id=tag(dead, part.lane),
                    entry_id=tag(_text(fields.get(b"dead_entry", b"")), part.lane),
                    request_id=_text(fields.get(F_ID, b"")),
                    reason=_text(fields.get(b"dead_reason", b"")),
                    data_bytes=entry_data_size(fields),
                    age_s=max(0.0, (now_ms - int(dead.split("-")[0])) / 1000),
                    partition=part.partition,
                    priority=part.priority,
                )
            )
    out.sort(key=lambda letter: -letter.age_s)
    return out[:count]


def parse_dead_id(text: str) -> tuple[str, int]:
    """(the stream id, the lane) of a dead id as :func:`dead_letters` shows it:
    ``<ms>-<seq>``, with ``@<k>`` for partition k and ``h`` after it for the high level; else
    raise ValueError."""
    match = DEAD_ID.fullmatch(text)
    if match is None or any(int(part) >= 2**64 for part in match["stream"].split("-")):
        raise ValueError(
            f"invalid dead id {text!r}: use one that `broker dead-letters list` shows "
            "(<ms>-<seq>, with @<k> for partition k and h after it for high priority)"
        )
    partition = int(match["partition"] or 0)
    if partition >= MAX_PARTITIONS:
        raise ValueError(f"invalid dead id {text!r}: no queue has partition {partition}")
    return match["stream"], partition + (MAX_PARTITIONS if match["high"] else 0)


def missing_dead_letters(client: redis.Redis, keys: ModelKeys, ids: list[str]) -> list[str]:
    """Those of ``ids`` (valid: :func:`parse_dead_id`) that name no dead letter of the model."""
    lanes = {part.lane: part for part in keys.lanes()}
    pipe = client.pipeline(transaction=False)
    asked = []
    for text in ids:
        stream_id, lane = parse_dead_id(text)
        part = lanes.get(lane)
        if part is not None:
            pipe.xrange(part.dead_letters, stream_id, stream_id, count=1)
            asked.append(text)
    found = [text for text, entries in zip(asked, pipe.execute(), strict=True) if entries]
    return [text for text in ids if text not in found]


def _dead_entries(
    client: redis.Redis, keys: ModelKeys, ids: list[str] | None
) -> Iterator[tuple[ModelKeys, str, dict[Any, Any]]]:
    """(lane keys, stream id, fields) of the dead letters with ``ids`` (all if None); all of
    them read a page at a time, never a whole (uncapped) stream in one reply, and only those
    there at the start (a replayed entry a worker dead-letters again is not replayed again)."""
    lanes = {part.lane: part for part in keys.lanes()}
    if ids is not None:
        for stream_id, lane in dict.fromkeys(map(parse_dead_id, ids)):
            if lane in lanes:  # (no dead letter is of a partition the model lacks)
                entries: Any = client.xrange(lanes[lane].dead_letters, stream_id, stream_id)
                for dead_id, fields in entries:
                    yield lanes[lane], _text(dead_id), fields
        return
    for part in lanes.values():
        last: Any = client.xrevrange(part.dead_letters, "+", "-", count=1)
        start = "-"
        while last and (page := _page(client, part.dead_letters, start, last[0][0])):
            for dead_id, fields in page:
                yield part, _text(dead_id), fields
            start = "(" + _text(page[-1][0])


def _page(client: redis.Redis, stream: str, start: str, end: Any) -> Any:
    return client.xrange(stream, start, end, DEAD_PAGE)


class Replayed(NamedTuple):
    """What a replay did: how many dead letters it queued again, and the dead ids of those it
    left, which hold no request (nothing but the dead letter's own fields)."""

    replayed: int
    empty: list[str]


def replay_dead_letters(
    client: redis.Redis, keys: ModelKeys, ids: list[str] | None = None
) -> Replayed:
    """Queue dead letters again as fresh requests (all, or those with ``ids``), each on its
    own partition's stream, counting their data bytes (and a multi-item entry's packed items)
    as an enqueue does.

    A replayed request keeps its request id, reply key and timeout; its deadline starts anew
    (the deadline a pipeline's stage carried with it, F_DEADLINE, is not replayed).
    """
    replayed, empty = 0, []
    for part, dead, fields in _dead_entries(client, keys, ids):
        original = {k: v for k, v in fields.items() if k not in REPLAY_DROPS}
        if not original:
            empty.append(tag(dead, part.lane))
            continue
        pipe = client.pipeline(transaction=True)
        pipe.xadd(part.stream, original)
        pipe.incrby(part.queued_bytes, entry_data_size(original))
        if (count := multi_item.item_count(original)) is not None and count > 1:
            pipe.incrby(part.packed_items, count - 1)
        pipe.xdel(part.dead_letters, dead)
        pipe.execute()
        replayed += 1
    return Replayed(replayed, empty)


def purge_dead_letters(client: redis.Redis, keys: ModelKeys, ids: list[str] | None = None) -> int:
    """Delete dead letters (all, or those with ``ids``); return how many."""
    purged = 0
    wanted = None if ids is None else [parse_dead_id(i) for i in ids]
    for part in keys.lanes():
        if wanted is not None:
            mine = [i for i, k in wanted if k == part.lane]
            purged += int(client.xdel(part.dead_letters, *mine)) if mine else 0
            continue
        purged += int(client.xlen(part.dead_letters))
        client.delete(part.dead_letters)
    return purged


def _oldest_kept_ms(client: redis.Redis, part: ModelKeys, older_than_ms: int) -> int:
    """The id time (ms) from which a partition's dead letters are newer than ``older_than_ms``,
    by the clock of the node holding them (which stamped their ids): XTRIM MINID's bound."""
    return _now_ms(client, part) - older_than_ms


def has_dead_letters(
    client: redis.Redis, keys: ModelKeys, older_than_ms: int | None = None
) -> bool:
    """Whether the model holds a dead letter (one dead-lettered over ``older_than_ms`` ago, by
    the clock of the node holding it, when given)."""
    for part in keys.lanes():
        if older_than_ms is None:
            if int(client.xlen(part.dead_letters)):
                return True
            continue
        oldest_kept = _oldest_kept_ms(client, part, older_than_ms)
        if oldest_kept > 0 and client.xrange(part.dead_letters, "-", oldest_kept - 1, count=1):
            return True
    return False


def purge_old_dead_letters(client: redis.Redis, keys: ModelKeys, older_than_ms: int) -> int:
    """Delete the dead letters dead-lettered over ``older_than_ms`` ago (by the clock of the
    node holding each, which stamped their ids); return how many."""
    purged = 0
    for part in keys.lanes():
        oldest_kept = _oldest_kept_ms(client, part, older_than_ms)
        if oldest_kept > 0:
            purged += int(client.xtrim(part.dead_letters, minid=oldest_kept, approximate=False))
    return purged


class ForgetRefused(Exception):
    """What ``forget`` would delete is in use, or changed while it deleted."""


def stored_keys(part: ModelKeys) -> list[str]:
    """The keys of one partition of a model (of both levels) that stay until deleted: not its
    heartbeats, inboxes or fan-out joins, which expire by themselves; of partition 0, the
    model's partition count and withdrawn set too."""
    names = [
        key
        for lane in (part.at(NORMAL), part.at(HIGH))
        for key in (
            lane.stream,
            lane.dead_letters,
            lane.cancelled,
            lane.queued_bytes,
            lane.packed_items,
            lane.answered,
        )
    ]
    names += [part.consumers, part.queue_bound]
    if part.partition == 0:
        names.append(part.partitions_key)
        if part.pipeline == part.model:  # (a later stage's withdrawn set is its pipeline's)
            names.append(part.withdrawn)
    return names


def forgettable(client: redis.Redis, keys: ModelKeys) -> tuple[list[ModelKeys], int]:
    """The partitions of a model that no live worker reads (each partition's own consumers
    set: workers vouch for themselves in every partition they read), and the model's live
    workers: every partition when none is live, else those dropped when ``--partitions`` was
    lowered. ``keys`` carry the partition count (:func:`model_keys`)."""
    live = [len(liveness.live_consumers(client, part)) for part in keys.each()]
    return [part for part, count in zip(keys.each(), live, strict=True) if not count], live[0]


def _held(client: redis.Redis, part: ModelKeys) -> str:
    """What one partition still holds (its entries queued or pending, its dead letters), in
    words; empty when nothing."""
    pipe = client.pipeline(transaction=False)
    for level in (NORMAL, HIGH):
        pipe.xlen(part.at(level).stream)
        pipe.xlen(part.at(level).dead_letters)
    queued, dead, high_queued, high_dead = pipe.execute()
    held = []
    if queued + high_queued:
        held.append(f"{queued + high_queued} entry(ies) queued or pending")
    if dead + high_dead:
        held.append(f"{dead + high_dead} dead letter(s)")
    return " and ".join(held)


def check_forgettable(client: redis.Redis, parts: list[ModelKeys]) -> None:
    """Raise ForgetRefused if one of these partitions holds entries or dead letters."""
    refusals = [
        f"partition {part.partition} holds {held}"
        for part in parts
        if (held := _held(client, part))
    ]
    if refusals:
        raise ForgetRefused("; ".join(refusals))


def forget(client: redis.Redis, parts: list[ModelKeys]) -> int:
    """Delete what Redis keeps of these partitions of a model (:func:`stored_keys`); return
    how many keys. Raise ForgetRefused, deleting nothing, if one holds entries or dead letters;
    and if one changes meanwhile (a call queued, a worker started), having deleted only the
    partitions done before it. Partition 0 (the model's count) goes last."""
    check_forgettable(client, parts)
    deleted = 0
    for part in sorted(parts, key=lambda p: -p.partition):
        deleted += _forget_partition(client, part)
    return deleted


def _forget_partition(client: redis.Redis, part: ModelKeys) -> int:
    """Delete one partition's keys unless its streams or consumers change first."""
    watched = [part.at(level).stream for level in (NORMAL, HIGH)]
    watched += [part.at(level).dead_letters for level in (NORMAL, HIGH)]
    watched.append(part.consumers)  # a worker starting to read it writes this first
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(*watched)  # type: ignore[no-untyped-call]
            present = [name for name in stored_keys(part) if pipe.exists(name)]
            if any(pipe.xlen(name) for name in watched[:4]):
                raise redis.WatchError
            # A pipeline's withdrawn set is shared with its later stages, which may still hold
            # withdrawn calls to skip: it is left to expire with its latest withdrawal.
            withdrawn = part.withdrawn if part.withdrawn in present else None
            pipe.multi()
            deleted = [name for name in present if name != withdrawn]
            if deleted:
                pipe.delete(*deleted)
            if withdrawn is not None:
                pipe.pexpire(withdrawn, functions.CANCELLED_TTL_MS)
            pipe.execute()
        except redis.WatchError:
            raise ForgetRefused(
                f"partition {part.partition} changed meanwhile (a call was queued or a worker "
                "started): nothing more was deleted"
            ) from None
    return len(deleted)
