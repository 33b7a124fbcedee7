"""What operators ask of a deployment: queue status and dead letters (synchronous, for the CLI)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from .keys import ModelKeys
from .liveness import server_time_ms
from .protocol import F_DATA, F_ID

STREAM_KEY = re.compile(r"^mb:\{(?P<prefix>[^:}]+):(?P<model>[^}]+)\}:requests$")
DEAD_FIELDS = (b"dead_reason", b"dead_entry")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _now_ms(client: redis.Redis, keys: ModelKeys) -> int:
    return server_time_ms(client, keys.stream)  # the clock of the node holding the model


def find_models(client: redis.Redis, prefix: str | None = None) -> list[ModelKeys]:
    """Every (prefix, model) with a request stream, optionally under one prefix (SCAN of
    every primary of a Redis Cluster)."""
    pattern = f"mb:{{{prefix}:*}}:requests" if prefix else "mb:{*}:requests"
    found = set()
    for key in client.scan_iter(match=pattern, count=1000, _type="stream"):
        match = STREAM_KEY.match(_text(key))
        if match:
            found.add((match["prefix"], match["model"]))
    return [ModelKeys(model, prefix) for prefix, model in sorted(found)]


@dataclass
class ConsumerStatus:
    name: str
    pending: int
    idle_ms: int
    alive: bool
    heartbeat_expires_in_ms: int | None
    current_batch: int = 0  # items in the batch it is computing (0: none)
    current_batch_ms: int = 0  # for how long, as of its last heartbeat


@dataclass
class ModelStatus:
    prefix: str
    model: str
    stream_length: int
    pending: int
    queued_bytes: int
    dead_letters: int
    consumers: list[ConsumerStatus] = field(default_factory=list)
    queue_bound_items: int = 0  # the model's item bound now: per live worker x live (0: none)
    queue_bound_bytes: int = 0  # its byte bound (0: none)

    @property
    def live_consumers(self) -> int:
        return sum(consumer.alive for consumer in self.consumers)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "live_consumers": self.live_consumers}


def model_status(client: redis.Redis, keys: ModelKeys) -> ModelStatus:
    """A snapshot of one model's queue, workers and dead letters."""
    now_ms = _now_ms(client, keys)
    pipe = client.pipeline(transaction=False)
    pipe.xlen(keys.stream)
    pipe.get(keys.queued_bytes)
    pipe.xlen(keys.dead_letters)
    pipe.zrange(keys.consumers, 0, -1, withscores=True)
    pipe.hmget(keys.queue_bound, ["items", "bytes"])
    length, queued, dead, vouched, bound = pipe.execute()
    expiries = {_text(name): int(score) for name, score in vouched}
    try:
        summary: Any = client.xpending(keys.stream, keys.group)
        infos: Any = client.xinfo_consumers(keys.stream, keys.group)
    except redis.ResponseError:  # no consumer group yet
        summary, infos = {"pending": 0}, []
    names = sorted({_text(info["name"]) for info in infos} | set(expiries))
    by_name = {_text(info["name"]): info for info in infos}
    beats: Any = client.mget([keys.heartbeat(name) for name in names]) if names else []
    consumers = []
    for name, beat in zip(names, beats, strict=True):
        info = by_name.get(name, {})
        expiry = expiries.get(name)
        state = _heartbeat_state(beat)
        consumers.append(
            ConsumerStatus(
                name=name,
                pending=int(info.get("pending", 0)),
                idle_ms=int(info.get("idle", 0)),
                alive=expiry is not None and expiry > now_ms,
                heartbeat_expires_in_ms=None if expiry is None else expiry - now_ms,
                current_batch=int(state.get("batch", 0)),
                current_batch_ms=int(state.get("batch_ms", 0)),
            )
        )
    live = sum(consumer.alive for consumer in consumers)
    return ModelStatus(
        queue_bound_items=_count(bound[0]) * max(live, 1),
        queue_bound_bytes=_count(bound[1]),
        prefix=keys.prefix,
        model=keys.model,
        stream_length=int(length),
        pending=int(summary["pending"]),
        queued_bytes=int(queued or 0),
        dead_letters=int(dead),
        consumers=consumers,
    )


def _count(value: Any) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def _heartbeat_state(value: Any) -> dict[str, Any]:
    """The JSON a supervisor keeps in a heartbeat key (empty if absent or unreadable)."""
    if not value:
        return {}
    try:
        state = json.loads(value)
    except ValueError:
        return {}
    return state if isinstance(state, dict) else {}


def status(client: redis.Redis, prefix: str | None = None) -> list[ModelStatus]:
    """Snapshots of every model (under ``prefix`` if given)."""
    return [model_status(client, keys) for keys in find_models(client, prefix)]


@dataclass
class DeadLetter:
    """One dead-lettered request; its payload is not shown, only its size."""

    dead_id: str
    entry_id: str
    request_id: str
    reason: str
    data_bytes: int
    age_s: float


def dead_letters(client: redis.Redis, keys: ModelKeys, count: int = 100) -> list[DeadLetter]:
    """The oldest ``count`` dead letters of a model."""
    now_ms = _now_ms(client, keys)
    out = []
    entries: Any = client.xrange(keys.dead_letters, count=count)
    for dead_id, fields in entries:
        dead = _text(dead_id)
        out.append(
            DeadLetter(
                dead_id=dead,
                entry_id=_text(fields.get(b"dead_entry", b"")),
                request_id=_text(fields.get(F_ID, b"")),
                reason=_text(fields.get(b"dead_reason", b"")),
                data_bytes=len(fields.get(F_DATA, b"")),
                age_s=max(0.0, (now_ms - int(dead.split("-")[0])) / 1000),
            )
        )
    return out


def replay_dead_letters(client: redis.Redis, keys: ModelKeys, ids: list[str] | None = None) -> int:
    """Queue dead letters again as fresh requests (all, or those with ``ids``); return how many.

    A replayed request keeps its request id, reply key and timeout; its deadline starts anew.
    """
    replayed = 0
    entries: Any = client.xrange(keys.dead_letters)
    for dead_id, fields in entries:
        dead = _text(dead_id)
        if ids is not None and dead not in ids:
            continue
        original = {k: v for k, v in fields.items() if k not in DEAD_FIELDS}
        pipe = client.pipeline(transaction=True)
        pipe.xadd(keys.stream, original)
        pipe.incrby(keys.queued_bytes, len(original.get(F_DATA, b"")))
        pipe.xdel(keys.dead_letters, dead)
        pipe.execute()
        replayed += 1
    return replayed


def purge_dead_letters(client: redis.Redis, keys: ModelKeys, ids: list[str] | None = None) -> int:
    """Delete dead letters (all, or those with ``ids``); return how many."""
    if ids is not None:
        return int(client.xdel(keys.dead_letters, *ids)) if ids else 0
    count = int(client.xlen(keys.dead_letters))
    client.delete(keys.dead_letters)
    return count
