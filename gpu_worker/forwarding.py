"""A pipeline stage's worker: where each answered item goes next.

:class:`StageTransport` wraps the worker's transport and sees every answer of the stage on its
way out (``finish``), before its entries are acknowledged:

- an output of a stage that others follow is added to each next stage's stream (``XADD`` with
  the item's request id, reply key, trace context and absolute deadline, and ``INCRBY`` of that
  stream's queued bytes, as one transaction in that stage's slot), and not replied;
- an output of a leaf is the answer: replied as it is, or, when the pipeline has several
  leaves, left in the request's join hash (in the pipeline's slot), the last of them to arrive
  replying with them all (``{leaf: output}``);
- an error is replied at once, naming this stage.

Only then are the stage's entries acknowledged (forward, then ack): a worker that dies in between
has its entries taken over and forwarded again, and the duplicate answers that can follow are
dropped by the caller, which takes one answer per request id.

A stage that forwards also reads no new batch while a next stage holds its queue bound (that
stage's ``queue-bound`` hash, as ``mb_enqueue`` applies it): its own stream then fills, up to the
first stage, whose bound refuses new calls with ``QueueFull``. Without this, a slow later stage
behind a fast first one grew its stream without bound (callers saw only ``DeadlineExceeded``).

A later stage also drops, unanswered, the items whose callers withdrew them (by request id, in the
pipeline's ``withdrawn`` set) as it reads them, so that an item withdrawn after it moved on is
not computed there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

import msgpack

from broker import codec
from broker.errors import BrokerUnavailable, DeadlineExceeded, InvalidOutput
from broker.keys import HIGH, ModelKeys
from broker.logs import ThrottledWarning
from broker.partitions import is_high
from broker.protocol import (
    F_DATA,
    F_DEADLINE,
    F_ID,
    F_REPLY,
    F_TIMEOUT,
    F_VERSION,
    VERSION,
    Fields,
    Reply,
    Request,
    RequestReader,
    decode_reply,
    encode_error,
)
from broker.redis_transport import RedisTransport
from broker.transport import Entry, Redelivery, counter_value

from .config import WorkerConfig
from .model import ItemCheck
from .outcomes import PendingOutputs, PredictFn
from .pipeline import Pipeline, Transform, load_pipeline

log = logging.getLogger("microbatch.worker")

JOIN_GRACE_MS = 60_000  # a join hash outlives its request's deadline by this much
# The latest PEXPIREAT Redis takes: a deadline past it (a caller's timeout of 19 digits or
# more) must still give a join hash a TTL, not an error that leaves it without one.
MAX_EXPIRE_AT_MS = 2**63 - 1
# Backpressure: how long a next stage found under its bound is trusted before it is checked again,
# and how long a worker waits before it looks again at one found at its bound.
BACKPRESSURE_CHECK_S = 0.01
BACKPRESSURE_WAIT_S = 0.05


class StageRoute:
    """Where the outputs of one stage of a pipeline go (from the declaration, never from what an
    entry says)."""

    def __init__(self, pipeline: type[Pipeline], stage: str, prefix: str) -> None:
        pipeline.stage(stage)
        self.stage = stage
        self.keys = pipeline.keys(stage, prefix)
        self.next = [pipeline.keys(name, prefix) for name in pipeline.next_stages(stage)]
        leaves = pipeline.leaves()
        self.leaves = leaves if len(leaves) > 1 and stage in leaves else []
        self.later = stage != pipeline.first()  # reads items forwarded to it


def stage_error(stage: str, reply: Reply) -> bytes:
    """An error reply of this stage: its message prefixed with the stage, and the stage in the
    error map (readers that do not know the field ignore it)."""
    error = {
        "type": reply.error_type,
        "message": f"stage {stage!r}: {reply.error_message}",
        "stage": stage,
    }
    packed: bytes = msgpack.packb(
        {"id": reply.request_id, "ok": False, "error": error}, use_bin_type=True
    )
    return packed


def _joined(request_id: str, parts: dict[str, bytes], leaves: Sequence[str]) -> bytes:
    """The answer to a fan-out request, ``{leaf: output}``, built around the parts as stored
    (each already encoded)."""

    def pack(value: Any) -> bytes:
        packed: bytes = msgpack.packb(value, use_bin_type=True)
        return packed

    head = b"\x83" + pack("id") + pack(request_id) + pack("ok") + b"\xc3" + pack("result")
    return head + _map_header(len(leaves)) + b"".join(pack(leaf) + parts[leaf] for leaf in leaves)


def _map_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x80 | count,))
    return b"\xde" + count.to_bytes(2, "big")


class StageTransport:
    """The worker's transport, with the stage's outputs routed on (see the module's doc).

    Everything not named here is the wrapped transport's.
    """

    def __init__(self, inner: RedisTransport, route: StageRoute) -> None:
        self.inner = inner
        self.route = route
        # The broker's clock as the batch loop estimates it (set once the loop exists).
        self.now_ms: Callable[[], float] = lambda: time.time() * 1000
        self._room_checked = float("-inf")  # monotonic time of the last check that found room
        self._held_back = ThrottledWarning(
            log,
            "not reading new items: a next stage is at its queue bound (%d time(s) since the "
            "last such line; latest: %s); its backlog holds this stage's stream back",
            every_s=10.0,
        )
        self._check_failed = ThrottledWarning(
            log,
            "cannot check the next stage's queue bound, so no backpressure (%d time(s); "
            "latest: %s); with ACL users, print them again (broker acl) and apply them",
            every_s=60.0,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    # -- reading: withdrawn items are not computed --------------------------------------------
    async def read_batch(
        self, keys: ModelKeys, consumer: str, count: int, block_ms: int, busy_poll_s: float = 0.0
    ) -> list[Entry]:
        full = await self.next_stage_full()
        if full is not None:  # backpressure: leave the items in this stage's stream
            self._held_back.note(full)
            await asyncio.sleep(min(max(block_ms, 1) / 1000, BACKPRESSURE_WAIT_S))
            return []
        entries = await self.inner.read_batch(keys, consumer, count, block_ms, busy_poll_s)
        return await self._drop_withdrawn(keys, entries)

    async def next_stage_full(self) -> str | None:
        """What holds a next stage at its queue bound (items per live worker, or bytes, at
        either level, counted as ``mb_enqueue`` counts them), or None while every next stage
        has room (or no bound). Checked at most every BACKPRESSURE_CHECK_S while there is
        room; a failed check counts as room (reading goes on; forwarding then says what is
        wrong)."""
        if not self.route.next or time.monotonic() - self._room_checked < BACKPRESSURE_CHECK_S:
            return None
        now_ms = int(self.now_ms())
        for keys in self.route.next:
            high = keys.at(HIGH)
            commands: list[tuple[Any, ...]] = [
                ("HMGET", keys.queue_bound, "items", "bytes"),
                ("ZRANGEBYSCORE", keys.consumers, now_ms, "+inf"),
                ("XLEN", keys.stream),
                ("XLEN", high.stream),
                ("GET", keys.queued_bytes),
                ("GET", high.queued_bytes),
                ("GET", keys.packed_items),
                ("GET", high.packed_items),
            ]
            try:
                got = await self.inner.run_in_slot(keys.stream, commands, atomic=False)
            except BrokerUnavailable:
                return None
            failed = [result for result in got if isinstance(result, Exception)]
            if failed:  # e.g. NOPERM under an ACL user from before this check: say so
                self._check_failed.note(f"{keys.model}: {failed[0]}")
                return None
            bound, live, length, high_length, size, high_size, packed, high_packed = got
            per_worker, max_bytes = counter_value(bound[0]), counter_value(bound[1])
            items = per_worker * max(len(live), 1)
            for level, count, queued in (
                ("", int(length) + counter_value(packed), counter_value(size)),
                (
                    " (high level)",
                    int(high_length) + counter_value(high_packed),
                    counter_value(high_size),
                ),
            ):
                if per_worker > 0 and count >= items:
                    return f"{keys.model}{level} holds {count} items, its bound {items}"
                if max_bytes > 0 and queued >= max_bytes:
                    return f"{keys.model}{level} holds {queued} bytes, its bound {max_bytes}"
        self._room_checked = time.monotonic()
        return None

    async def read_rest(self, keys: ModelKeys, consumer: str, count: int) -> list[Entry]:
        return await self._drop_withdrawn(keys, await self.inner.read_rest(keys, consumer, count))

    async def reclaim(
        self, keys: ModelKeys, consumer: str, min_idle_ms: int, count: int, own: bool = False
    ) -> list[Redelivery]:
        taken = await self.inner.reclaim(keys, consumer, min_idle_ms, count, own)
        kept = {entry[0] for entry in await self._drop_withdrawn(keys, [e for e, _ in taken])}
        return [(entry, n) for entry, n in taken if entry[0] in kept]

    async def _drop_withdrawn(self, keys: ModelKeys, entries: list[Entry]) -> list[Entry]:
        """The entries whose callers have not withdrawn them; the others are acknowledged and
        deleted unanswered (only on a later stage: the first has withdrawal by entry id)."""
        if not entries or not self.route.later:
            return entries
        ids = [fields.get(F_ID) or b"" for _, fields in entries]
        withdrawn = keys.withdrawn
        (scores,) = await self.inner.run_in_slot(withdrawn, [("ZMSCORE", withdrawn, *ids)])
        if isinstance(scores, Exception):
            log.warning("could not check for withdrawn requests: %s", scores)
            return entries
        gone = [entry for entry, score in zip(entries, scores, strict=True) if score is not None]
        if not gone:
            return entries
        log.debug("dropping %d withdrawn item(s) of %s", len(gone), keys.stream)
        await self.inner.finish(keys, [], gone, JOIN_GRACE_MS // 1000)
        dropped = {entry[0] for entry in gone}
        return [entry for entry in entries if entry[0] not in dropped]

    # -- answering: forward, join or reply; then acknowledge -----------------------------------
    async def finish(
        self,
        keys: ModelKeys,
        replies: Sequence[tuple[str, bytes]],
        entries: Sequence[Entry],
        reply_ttl_s: int,
        check: Sequence[str] = (),
    ) -> set[str]:
        out, joins = await self._route(replies, entries)
        withdrawn = await self.inner.finish(keys, out, entries, reply_ttl_s, check)
        if joins:  # answered: a join hash is not needed any more
            await self.inner.run_in_slot(joins[0], [("DEL", *joins)])
        return withdrawn

    async def _route(
        self, replies: Sequence[tuple[str, bytes]], entries: Sequence[Entry]
    ) -> tuple[list[tuple[str, bytes]], list[str]]:
        """The replies to send now (errors, leaves' answers, joins completed), after forwarding
        the outputs that go on and storing the parts of joins; and the join hashes answered."""
        route = self.route
        requests = _requests(entries)
        out: list[tuple[str, bytes]] = []
        onward: list[tuple[Request, bytes]] = []  # with the output, encoded
        for key, payload in replies:
            try:
                reply = decode_reply(payload)
            except Exception:  # not a reply this worker could have made: send it as it is
                out.append((key, payload))
                continue
            request, _ = requests.get((key, reply.request_id), (None, None))
            if not reply.ok:
                out.append((key, stage_error(route.stage, reply)))
            elif not (route.next or route.leaves):
                out.append((key, payload))  # a chain's last stage: the answer
            elif request is None:  # never expected: an output is always of an entry answered
                log.error("an output of stage %r has no entry to go on with", route.stage)
                error = InvalidOutput(f"stage {route.stage!r}: output without its entry")
                out.append((key, encode_error(reply.request_id, error)))
            else:
                onward.append((request, codec.encode(reply.result)))

        if not onward:
            return out, []
        if route.next:
            fields = {request.entry_id: entry for request, entry in requests.values()}
            out += await self._forward(onward, fields)
            return out, []
        return await self._join(onward, out)

    async def _forward(
        self, items: list[tuple[Request, bytes]], fields: dict[str, Fields]
    ) -> list[tuple[str, bytes]]:
        """Add the outputs to each next stage's stream (``fields``: of their entries, by entry
        id); the replies of items already late."""
        now_ms = self.now_ms()
        late: list[tuple[str, bytes]] = []
        live: list[tuple[Request, bytes]] = []
        for request, data in items:
            if request.deadline_ms <= now_ms:
                error = Reply(
                    request.request_id,
                    ok=False,
                    error_type=DeadlineExceeded.__name__,
                    error_message="deadline passed before the item was forwarded",
                )  # with the stage in its map, as every error a stage answers
                late.append((request.reply_key, stage_error(self.route.stage, error)))
            else:
                live.append((request, data))
        if live:
            await asyncio.gather(
                *(self._add(keys, live, fields, now_ms) for keys in self.route.next)
            )
        return late

    async def _add(
        self,
        keys: ModelKeys,
        items: list[tuple[Request, bytes]],
        entries: dict[str, Fields],
        now_ms: float,
    ) -> None:
        """XADD the items to one next stage's stream, with INCRBY of its queued bytes. Each
        entry keeps the fields of the one it came from (request id, reply key, trace context,
        fields this worker does not know), with its output as ``data``, the deadline it carries
        and the time left until then as ``timeout``."""
        commands: list[tuple[Any, ...]] = []
        queued: dict[str, int] = {}  # data bytes added, by queued-bytes key (one per level)
        for request, data in items:
            # An item keeps its priority level from stage to stage (same slot, either level).
            target = keys.at(HIGH) if is_high(request.entry_id) else keys
            fields = dict(entries.get(request.entry_id) or {})
            for name in (F_DATA, F_TIMEOUT, F_DEADLINE):
                fields.pop(name, None)
            fields[F_VERSION], fields[F_ID] = VERSION.encode(), request.request_id.encode()
            fields[F_REPLY] = request.reply_key.encode()
            fields[F_TIMEOUT] = b"%d" % max(1, int(request.deadline_ms - now_ms))
            fields[F_DEADLINE] = b"%d" % request.deadline_ms
            fields[F_DATA] = data
            commands.append(("XADD", target.stream, "*", *chain.from_iterable(fields.items())))
            queued[target.queued_bytes] = queued.get(target.queued_bytes, 0) + len(data)
        commands += [("INCRBY", key, size) for key, size in queued.items()]
        results = await self.inner.run_in_slot(keys.stream, commands)
        for result in results:
            if isinstance(result, Exception):
                # Not acknowledged, so taken back and forwarded again once this is fixed.
                raise BrokerUnavailable(f"cannot forward to {keys.stream}: {result}")

    async def _join(
        self, items: list[tuple[Request, bytes]], out: list[tuple[str, bytes]]
    ) -> tuple[list[tuple[str, bytes]], list[str]]:
        """Leave each output in its request's join hash; reply for those now complete."""
        route = self.route
        namespace = len(route.keys.reply_namespace)
        commands: list[tuple[Any, ...]] = []
        hashes = []
        for request, data in items:
            join = route.keys.join(request.reply_key[namespace:], request.request_id)
            hashes.append(join)
            commands += [
                ("HSET", join, route.stage, data),
                ("PEXPIREAT", join, min(request.deadline_ms + JOIN_GRACE_MS, MAX_EXPIRE_AT_MS)),
                ("HGETALL", join),
            ]
        results = await self.inner.run_in_slot(hashes[0], commands)
        answered = []
        for (request, _), join, got in zip(items, hashes, results[2::3], strict=True):
            if isinstance(got, Exception):
                raise BrokerUnavailable(f"cannot join the branches' outputs: {got}")
            parts = _parts(got)
            if all(leaf in parts for leaf in route.leaves):
                out.append((request.reply_key, _joined(request.request_id, parts, route.leaves)))
                answered.append(join)
        return out, answered


def _parts(flat: Any) -> dict[str, bytes]:
    """HGETALL's flat [field, value, ...] reply as {stage: output bytes}."""
    it = iter(flat)
    return {
        field.decode("utf-8", "replace"): value
        for field, value in zip(it, it, strict=False)
        if isinstance(field, bytes) and isinstance(value, bytes)
    }


def _requests(entries: Sequence[Entry]) -> dict[tuple[str, str], tuple[Request, Fields]]:
    """The parsed requests of the entries answered, with their fields, by (reply key, request
    id)."""
    found: dict[tuple[str, str], tuple[Request, Fields]] = {}
    parse = RequestReader().parse
    for entry in entries:
        try:
            request = parse(*entry)
        except Exception:  # MalformedEntry: answered (or dead-lettered) as such already
            continue
        found.setdefault((request.reply_key, request.request_id), (request, entry[1]))
    return found


def stage_predict(
    predict: PredictFn, transform: Transform | None, check: ItemCheck | None
) -> PredictFn:
    """The stage's ``predict``, with its transform (and then the model's input check) run on
    each item first, in the worker."""
    if transform is None:
        return predict

    def run(items: list[Any]) -> Sequence[Any] | PendingOutputs:
        ready = [transform(item) for item in items]
        if check is not None:
            ready = [check(item) for item in ready]
        return predict(ready)

    return run


def stage_worker(
    config: WorkerConfig, transport: RedisTransport, predict: PredictFn, check: ItemCheck | None
) -> tuple[StageTransport, PredictFn, ItemCheck | None]:
    """What a worker of ``config.stage`` runs with: the transport that routes its outputs on,
    its predict (with the stage's transform), and the input check the batch loop applies (none
    with a transform: the transform's output is checked instead)."""
    assert config.stage is not None
    pipeline = load_pipeline(config.model)
    route = StageRoute(pipeline, config.stage, config.prefix)
    transform = pipeline.stage(config.stage).transform_fn()
    stage = StageTransport(transport, route)
    if transform is None:
        return stage, predict, check
    return stage, stage_predict(predict, transform, check), None
