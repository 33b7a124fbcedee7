"""The transport over Redis Streams.

The hot path (enqueue, the reply reader, the worker's reads, replies and acks) runs on lean
connections (:class:`broker.resp_lane.RespLane`; for a Redis Cluster, one per node, routed by
hash slot and following its redirections: :mod:`broker.cluster_lane`); the rest (consumer
groups, taking over a dead worker's entries, dead letters, INFO) on redis-py's asyncio client
(its cluster client for a cluster); both made by
:mod:`broker.connections` from the URL (one Redis, or a Sentinel service's master, followed
across failovers: a failing connection is BrokerUnavailable until it is back). What must be atomic
(the bounded enqueue, withdrawals, retiring a consumer) or checked key by key (replies) runs in
Redis as the functions of :mod:`broker.functions`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.asyncio.cluster as async_cluster
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterError,
    NoPermissionError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import connections, functions, multi_item, partitions
from .cluster_lane import ClusterLanes, ClusterMap, SlotLane, _unwrap, key_slot
from .errors import BrokerUnavailable, InvalidInput, MicrobatchError, QueueFull
from .functions import ENQUEUE, MAX_CALL_BYTES, MAX_CALL_ENTRIES, REPLY, RETIRE, WITHDRAW
from .keys import HIGH, MAX_PARTITIONS, NORMAL, ModelKeys, parse_partitions
from .liveness import lapsed_s, redis_time_ms
from .multi_item import ITEM_MARK, ItemAcks
from .partition_reads import PartitionReads
from .priorities import LevelKeep
from .protocol import CallRequests, MalformedEntry, parse_request
from .redis_url import (
    CLUSTER_NODE_HINT,
    Address,
    ClusterURL,
    RedisURL,
    cluster_node_error,
    credentials_refused,
    describe,
)
from .redis_url import parse as parse_url
from .reply_elements import pack as pack_replies
from .reply_elements import reply_id
from .resp_lane import CONNECT_TIMEOUT_S, RespLane, bulk_strings, is_script_busy
from .transport import (
    Entry,
    PartitionsChanged,
    QueueBound,
    Redelivery,
    RepliesRefused,
    entry_data_size,
    is_data_field,
)

log = logging.getLogger("microbatch.redis")

LAPSE_CONFIRM_S = 2.0
"""Seconds a consumer's heartbeat must stay lapsed before its entries are taken over: more
than a supervisor takes to renew it once a stalled Redis answers again (a renewal every
second at most, each given up after 2 s)."""

# A worker of a partitioned queue on a Redis Cluster sets aside a partition whose primary does
# not answer, and serves the others meanwhile (RedisTransport._set_aside):
NODE_SILENT_S = 2.0
"""Seconds a cluster node may answer none of a worker's commands (they wait on its lane)
before its connection is dropped and the commands fail: its partitions are then set aside."""
ASIDE_BOUND_S = 3.0
"""Seconds a worker's group creation or sweep (takeover) of one partition may take on a
cluster before that partition is set aside (redis-py's client would wait 10 s per command)."""
PROBE_EVERY_S = 0.5  # how often a partition set aside is checked for its node answering again
PROBE_TIMEOUT_S = 1.0  # each check's connect and reply timeout

T = TypeVar("T")

# (and redis-py's cluster client's own: no node of the cluster reachable, a slot not covered,
# a pipeline's command that the nodes kept redirecting)
UNAVAILABLE = (
    RedisConnectionError, RedisTimeoutError, OSError, RedisClusterException, ClusterError,
)  # fmt: skip


connect = connections.async_client  # an asyncio redis-py client of a URL


def _unavailable(exc: BaseException) -> BrokerUnavailable:
    if isinstance(exc, BusyLoadingError):  # Redis answers, but not before its data is loaded
        return BrokerUnavailable("Redis is loading its data (after a restart); try again shortly")
    if is_script_busy(str(exc)):  # it answers nothing else until the script ends or is killed
        return BrokerUnavailable(f"Redis is busy running a script or function: {exc}")
    if isinstance(exc, AuthenticationError):  # (a ConnectionError to redis-py) Redis did answer
        return BrokerUnavailable(f"Redis refused the credentials: {exc}")
    return BrokerUnavailable(f"cannot reach Redis: {exc}")


class RedisTransport:
    """:class:`broker.transport.Transport` over a Redis server (7.0 or later)."""

    def __init__(self, url: str, entry_items: int = 1, **options: Any) -> None:
        """``entry_items``: as a caller, pack up to this many items a round trip carries into
        one stream entry (1: v1 entries only; docs/protocol.md, section 5.1)."""
        self.url = url
        parsed = parse_url(url)
        self.redis = connections.async_client(parsed, **options)
        connect_timeout_s = float(options.get("socket_connect_timeout") or CONNECT_TIMEOUT_S)
        # shared: one sentinel query, or one slot map of a cluster
        target = connections.lane_target(parsed, connect_timeout_s)
        self._target, self._connect_timeout_s = target, connect_timeout_s
        self._cluster = target if isinstance(target, ClusterMap) else None
        # Each is one lane, or a cluster's lane per node: `.at(key)` picks the one for a key.
        self._lane = connections.lanes(target, connect_timeout_s)  # commands that answer at once
        # blocking reads, each bounded by its own timeout instead of the lane's reply timeout
        self._reads = connections.lanes(target, connect_timeout_s, None)  # the worker's XREADGROUP
        self._replies = connections.lanes(target, connect_timeout_s, None)  # the caller's BLMPOP
        # A blocked BLMPOP holds its connection: a caller reading several inboxes (one per
        # partition of a partitioned queue) has blocking lanes per hash tag; the first is
        # self._replies.
        self._reply_lanes: dict[str, RespLane | ClusterLanes] = {}
        # The stream of the model this transport last set up: keyless commands (TIME, the
        # library check) go to its node, so a worker's clock is that of its stream's node.
        self._home = ""
        # a partitioned queue's worker: blocking lanes of its own for each partition beyond
        # the first (on a cluster, to the node serving that partition's slot)
        self._partition_lanes: dict[int, RespLane | ClusterLanes] = {}
        self._partition_reads: dict[tuple[str, str], PartitionReads] = {}
        # per (partition's stream, consumer): what reads of its levels brought, not handed out
        self._kept: dict[tuple[str, str], LevelKeep] = {}
        # per stream: the v2 entries handed out as items, acknowledged with their last item
        self._item_acks: dict[str, ItemAcks] = {}
        self._items_per_entry = 1.0  # of the entries read lately (a moving average)
        self._reclaim_turn = 0  # the partition the last reclaim started from
        # per (stream, consumer): when this worker first saw its heartbeat lapsed (monotonic)
        self._lapsed: dict[tuple[str, str], float] = {}
        # per (stream, consumer): dead consumers the library refused to retire (warned once)
        self._unretired: set[tuple[str, str]] = set()
        self.cancellations_pending = True  # as of the last finish(); True until known
        self._enqueues = EnqueuePacker(multi_item.check_entry_items(entry_items))
        self._may_load: bool | None = None  # whether this user may load the library
        self._library_warned = False  # a warning about the library is standing
        self._loading_warned = False  # a warning about Redis loading its data is standing
        # the lane connections (of a cluster: per node) on which mb_reply has answered
        self._replies_checked: set[Hashable] = set()
        # mb_reply calls that failed after their entries were acknowledged (the library gone
        # or replaced by an older one under a live connection), oldest first: written before
        # anything else once the library answers again, or they would be lost
        self._unwritten: list[ReplyCall] = []
        self._refused = ""  # the last refusal of an enqueue warned of
        # A worker's partitioned queue on a cluster (ensure_group): its keys, the partitions
        # set aside (their primary silent) with the task that waits for it to answer again,
        # and those found answering again, to be taken back.
        self._queue: ModelKeys | None = None
        self._aside: dict[int, asyncio.Task[None]] = {}
        self._back: list[int] = []
        self._asides: dict[int, int] = {}  # how many times each partition was set aside

    # -- the functions library ------------------------------------------------------------
    @property
    def clock_epoch(self) -> int:
        """Changes when the node holding a stream may have changed (a cluster's slot moved):
        a clock estimated from TIME is then to be estimated again."""
        return self._cluster.epoch if self._cluster is not None else 0

    async def _library_failed(
        self, error: ResponseError, lane: RespLane | SlotLane, warn: bool = True
    ) -> None:
        """FCALL found the library missing or old: load it if this Redis user may (once, and
        never again once refused), else raise BrokerUnavailable saying what to do (with
        ``warn``, logged once until the library answers again; a worker's loop logs its own)."""
        if self._may_load is not False:
            try:
                loaded = await _load_library(lane)
            except ResponseError as exc:  # NOPERM: an operator's job (broker functions load)
                self._may_load = False
                log.debug("may not load the microbatch functions: %s", exc)
            else:
                if loaded:  # else another loaded it meanwhile, this release's or a newer one
                    self._may_load = True
                    log.info("loaded the microbatch functions (version %d)", functions.VERSION)
                return
        message = functions.missing_message(error)
        if warn and not self._library_warned:
            self._library_warned = True
            log.warning("%s", message)
        raise BrokerUnavailable(message)

    def _library_answered(self) -> None:
        if self._library_warned:
            self._library_warned = False
            log.info("the microbatch functions answer again")

    async def _fcall(
        self, name: str, keys: Sequence[str | bytes], args: Sequence[Any], warn: bool = True
    ) -> Any:
        """FCALL one of the library's functions on the lane, loading the library first if
        it is missing and this user may."""
        command = ("FCALL", name, len(keys), *keys, functions.VERSION, *args)
        lane = self._lane.at(keys[0] if keys else self._home_key())
        try:
            try:
                reply = await lane.execute(*command)
            except ResponseError as exc:
                if not functions.is_missing(exc):
                    raise
                await self._library_failed(exc, lane, warn)
                reply = await lane.execute(*command)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        self._library_answered()
        return reply

    async def check_functions(self) -> None:
        await self._fcall(REPLY, (), (0,), warn=False)  # no keys: a no-op it must answer
        lane = self._lane.at(self._home_key())
        self._note_replies_checked(lane.generation)
        await self._replace_older_revision(lane)
        await self._write_unwritten()

    async def _replace_older_revision(self, lane: RespLane | SlotLane) -> None:
        """Replace a loaded library of this version but an older revision (a fix of its code
        that kept its interface, which no caller's version argument reveals), if this user
        may; one who may not is told once to run `broker functions load`."""
        if self._may_load is False:
            return
        try:
            try:  # (here, the home node's alone: another's silence must not hold readiness)
                loaded = await _release_of(lane)
            except ResponseError as exc:
                log.debug("the library's release is unknown: %s", exc)
                return
            ours = functions.THIS_RELEASE
            if loaded is None or loaded >= ours:
                return
            try:
                await _load_library(lane)
            except ResponseError as exc:  # NOPERM: an operator's job
                self._may_load = False
                log.warning(
                    "the microbatch library in Redis (%s) is older than this release's (%s): "
                    "%s (%s)", functions.describe_release(loaded),
                    functions.describe_release(ours), functions.HOW_TO_LOAD, exc,
                )  # fmt: skip
            else:
                self._may_load = True
                log.info(
                    "replaced the microbatch library (%s) by %s",
                    functions.describe_release(loaded), functions.describe_release(ours),
                )  # fmt: skip
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc

    # -- caller side ----------------------------------------------------------------------
    async def enqueue(
        self, keys: ModelKeys, calls: Sequence[CallRequests], bound: QueueBound
    ) -> list[list[str] | MicrobatchError]:
        outcomes: list[list[str] | MicrobatchError | None] = [_too_large(call) for call in calls]
        # One mb_enqueue per group of calls within the per-call caps (usually one), all in
        # one round trip; each checks the bound atomically with its XADDs.
        groups = _within_caps([i for i, outcome in enumerate(outcomes) if outcome is None], calls)
        pack = self._enqueues.pack
        commands = [pack(keys, [calls[i] for i in group], bound) for group in groups]
        if not commands:
            return [outcome for outcome in outcomes if outcome is not None]
        lane = self._lane.at(keys.stream)
        try:
            results = await lane.pipeline_packed(b"".join(commands), len(commands))
            missing = [i for i, r in enumerate(results) if _is_missing(r)]
            if missing:  # nothing was queued by these: load the library, then send them again
                await self._library_failed(results[missing[0]], lane)
                again = await lane.pipeline_packed(
                    b"".join(commands[i] for i in missing), len(missing)
                )
                for i, result in zip(missing, again, strict=True):
                    results[i] = result
            _raise_unavailable(results)
        except UNAVAILABLE as exc:
            raise self._caller_unavailable(exc) from exc
        for group, result in zip(groups, results, strict=True):
            if isinstance(result, ResponseError):
                error = self._enqueue_error(result)
                for i in group:
                    outcomes[i] = error
            else:
                for i, outcome in zip(group, result, strict=True):
                    outcomes[i] = _enqueue_outcome(outcome, keys.partitions)
        self._library_answered()
        if self._loading_warned:
            self._loading_warned = False
            log.info("Redis has loaded its data: requests are taken again")
        return [outcome for outcome in outcomes if outcome is not None]

    def _caller_unavailable(self, exc: Exception) -> BrokerUnavailable:
        """BrokerUnavailable for a failed enqueue; Redis loading its data after a restart
        (every call fails until it is done) is logged once, not once per call."""
        if isinstance(exc, BusyLoadingError) and not self._loading_warned:
            self._loading_warned = True
            log.warning("Redis is loading its data: requests fail (BrokerUnavailable) until done")
        return _unavailable(exc)

    def _enqueue_error(self, error: ResponseError) -> MicrobatchError:
        """What the calls of an mb_enqueue that Redis refused get."""
        text = str(error)
        if text.startswith("OOM"):  # maxmemory reached, under noeviction: nothing was queued
            return QueueFull(f"Redis is full (maxmemory): {text}")
        if text.startswith("MBLIMIT"):
            return InvalidInput(text.removeprefix("MBLIMIT ").strip())
        if text.startswith("MOVED"):
            return _cluster_node(text)
        # e.g. an ACL that lacks a command the function runs: a deployment error, said once
        message = f"Redis refused the enqueue: {text}"
        if message != self._refused:
            self._refused = message
            log.warning("%s", message)
        return BrokerUnavailable(message)

    async def cancel(
        self,
        keys: ModelKeys,
        entries: Sequence[tuple[str, int]],
        request_ids: Sequence[str] = (),
    ) -> None:
        if request_ids:
            await self._withdraw_ids(keys, request_ids)
        ids = [entry_id for entry_id, _ in entries]
        for start in range(0, len(ids), MAX_CALL_ENTRIES):
            await self._fcall(
                WITHDRAW,
                (keys.stream, keys.queued_bytes, keys.cancelled, keys.packed_items),
                (keys.group, *ids[start : start + MAX_CALL_ENTRIES]),
            )

    async def _withdraw_ids(self, keys: ModelKeys, request_ids: Sequence[str]) -> None:
        """Mark request ids withdrawn (scored with their expiry, on this host's clock) for a
        pipeline's later stages, and prune the expired ones; best effort (an older ACL may
        not allow it: only pipelines need it)."""
        now_ms = int(time.time() * 1000)
        expiry = now_ms + functions.CANCELLED_TTL_MS
        key = keys.withdrawn
        commands = [
            ("ZADD", key, *chain.from_iterable((expiry, rid) for rid in request_ids)),
            ("ZREMRANGEBYSCORE", key, "-inf", now_ms),
        ]
        try:
            for result in await self.run_in_slot(key, commands, atomic=False):
                if isinstance(result, Exception):
                    log.debug("could not mark requests withdrawn: %s", result)
        except BrokerUnavailable as exc:
            log.debug("could not mark requests withdrawn: %s", exc)

    async def partition_count(self, keys: ModelKeys) -> int:
        try:
            stored = await self._lane.at(keys.partitions_key).execute("GET", keys.partitions_key)
        except UNAVAILABLE as exc:
            raise self._caller_unavailable(exc) from exc
        return parse_partitions(stored)

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        lane = self._replies_lane(inbox)
        if lane.draining:  # replies a worker still pushed to the master this lane left
            drained = await lane.on_left_master("LPOP", inbox, count)
            if drained:
                return list(drained)
        try:
            got: Any = await lane.execute_blocking(
                timeout_s, "BLMPOP", timeout_s, 1, inbox, "LEFT", "COUNT", count
            )
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        except NoPermissionError as exc:
            raise RepliesRefused(
                f"Redis refused this user the read of its replies (BLMPOP {inbox}): {exc}"
            ) from exc
        return list(got[1]) if got else []

    def _replies_lane(self, inbox: str) -> RespLane | SlotLane:
        """The blocking lane to read ``inbox`` on: one per hash tag of the inboxes read."""
        tag = _hash_tag(inbox)
        lanes = self._reply_lanes.get(tag)
        if lanes is None:
            lanes = self._reply_lanes[tag] = (
                connections.lanes(self._target, self._connect_timeout_s, None)
                if self._reply_lanes
                else self._replies
            )
        return lanes.at(inbox)

    # -- worker side ----------------------------------------------------------------------
    async def ensure_group(self, keys: ModelKeys) -> None:
        self._home = keys.stream
        if keys.partitions > 1 and isinstance(self._lane, ClusterLanes):
            self._queue = keys
            self._lane.silent_after_s = NODE_SILENT_S
        for part in keys.lanes():
            if part.partition not in self._aside:
                await self._bounded(part.partition, self._create_group(part))

    # -- partitions set aside ---------------------------------------------------------------
    # A worker of a partitioned queue on a Redis Cluster: a partition whose primary stops
    # answering (stopped, its host frozen or cut off without a reset: its connections stay
    # open) is set aside, rather than the whole worker waiting out its timeouts: nothing is
    # sent to it (reads, replies, acks, sweeps) until it answers again, and the worker goes on
    # with the others. Both changes reach the batch loop as PartitionsChanged, on which it
    # drops what it holds and takes its own pending entries back, as after an outage.

    def _home_key(self) -> str:
        """Where keyless commands go (TIME, the library check): the model's stream, or while
        its partition is set aside the first partition's that is not."""
        queue = self._queue
        if not self._aside or queue is None or 0 not in self._aside:
            return self._home
        return next(part.stream for part in queue.each() if part.partition not in self._aside)

    def _set_aside(self, partition: int, exc: BaseException) -> bool:
        """Set a partition aside after ``exc`` (its node did not answer); False where there is
        nothing to set aside from (not a partitioned queue on a cluster, or every other partition
        is aside already: an outage of the whole worker)."""
        queue = self._queue
        if queue is None:
            return False
        if partition in self._aside:
            return True
        if len(self._aside) + 1 >= queue.partitions:
            return False
        log.warning(
            "partition %d of %s set aside: its primary does not answer (%s); the other "
            "partitions are served meanwhile, and it again once its primary answers",
            partition, queue.stream, exc,
        )  # fmt: skip
        part = queue.of(partition)
        self._aside[partition] = asyncio.get_running_loop().create_task(self._probe(part))
        self._asides[partition] = self._asides.get(partition, 0) + 1
        for reads in self._partition_reads.values():
            reads.forget(partition)
        for level in (HIGH, NORMAL):
            stream = part.at(level).stream
            for kept in [kept for kept in self._kept if kept[0] == stream]:
                del self._kept[kept]  # (pending for this consumer: taken back later)
        return True

    def _failed(self, partition: int, exc: BaseException) -> BrokerUnavailable:
        """What a command to a partition's node that failed raises: PartitionsChanged where
        it sets the partition aside, else BrokerUnavailable."""
        if self._set_aside(partition, exc):
            return PartitionsChanged(f"partition {partition} set aside: {exc}")
        return exc if isinstance(exc, BrokerUnavailable) else _unavailable(exc)

    async def _bounded(self, partition: int, work: Awaitable[T]) -> T:
        """``work`` on a partition's node; while partitions may be set aside, bounded by
        ASIDE_BOUND_S, and if it cannot reach Redis the partition is set aside."""
        if self._queue is None:
            return await work
        try:
            return await asyncio.wait_for(work, ASIDE_BOUND_S)
        except PartitionsChanged:
            raise
        except asyncio.TimeoutError as exc:
            silent = RedisTimeoutError(f"no answer within {ASIDE_BOUND_S:g} s")
            raise self._failed(partition, silent) from exc
        except (BrokerUnavailable, *UNAVAILABLE) as exc:
            cause = exc.__cause__ if isinstance(exc, BrokerUnavailable) else exc
            if not isinstance(cause, UNAVAILABLE):  # e.g. the library missing: not silence
                raise
            raise self._failed(partition, exc) from exc

    async def _probe(self, keys: ModelKeys) -> None:
        """Wait until the primary serving a partition set aside (the one it was, or a replica
        a failover promoted: the slot map is read again each time) answers for its slot,
        asking every PROBE_EVERY_S on a connection of its own, then note it back."""
        assert self._cluster is not None
        cluster, slot = self._cluster, key_slot(keys.stream)
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            try:
                await cluster.refresh()
                address = await cluster.owner(slot)
                lane = RespLane(cluster.target(address), PROBE_TIMEOUT_S, PROBE_TIMEOUT_S)
                try:
                    await lane.execute("EXISTS", keys.stream)
                finally:
                    lane.close()
                await asyncio.wait_for(
                    self._redis_py_follows(keys.stream, address), PROBE_TIMEOUT_S
                )
            except (ResponseError, *UNAVAILABLE):  # silent still, or refusing (CLUSTERDOWN)
                continue
            break
        self._back.append(keys.partition)

    async def _redis_py_follows(self, key: str, address: Address) -> None:
        """Have redis-py's cluster client (group creation, sweeps) send ``key``'s commands to
        ``address`` too: it reads its slot map again itself only after a command has waited out
        its 10 s socket timeout, which the bounded ones here never do (after a failover it
        would go on sending them to the old primary)."""
        client = self.redis
        if not isinstance(client, async_cluster.RedisCluster):
            return
        node = client.get_node_from_key(key)
        if node is not None and node.name == f"{address.host}:{address.port}":
            return
        await client.nodes_manager.initialize(last_failed_node_name=node.name if node else None)

    def _take_back(self) -> PartitionsChanged:
        """The partitions found answering again are served again: what the batch loop is told."""
        back, self._back = self._back, []
        for partition in back:
            self._aside.pop(partition, None)
        stream = self._queue.stream if self._queue is not None else ""
        log.warning(
            "partition(s) %s of %s answer again: served again, this worker's entries there "
            "taken back", ", ".join(map(str, back)), stream,
        )  # fmt: skip
        return PartitionsChanged(f"partition(s) {', '.join(map(str, back))} answer again")

    def _without_aside(
        self,
        keys: ModelKeys,
        replies: Sequence[tuple[str, bytes]],
        entries: Sequence[Entry],
        check: Sequence[str],
    ) -> tuple[list[tuple[str, bytes]], list[Entry], list[str]]:
        """What :meth:`finish` may send while partitions are set aside: nothing to their
        nodes. Their entries, and those whose replies go to their inboxes, are left pending
        for this consumer, taken back once they answer again."""
        aside = self._aside
        tags = {keys.of(partition).tag for partition in aside}

        def leaves(entry: Entry) -> bool:
            if partitions.untag(entry[0])[1] % MAX_PARTITIONS in aside:
                return False
            reply = entry[1].get(b"reply")
            return (
                not isinstance(reply, bytes)
                or _hash_tag(reply.decode("utf-8", "replace")) not in tags
            )

        return (
            [(key, reply) for key, reply in replies if _hash_tag(key) not in tags],
            [entry for entry in entries if leaves(entry)],
            [i for i in check if partitions.untag(i)[1] % MAX_PARTITIONS not in aside],
        )

    async def _create_group(self, keys: ModelKeys) -> None:
        """Create one partition's stream and consumer group if missing."""
        try:
            await self.redis.xgroup_create(keys.stream, keys.group, id="0", mkstream=True)
        except ResponseError as exc:
            if is_script_busy(str(exc)):  # (redis-py's client: BUSY is no connection error)
                raise _unavailable(exc) from exc
            if "BUSYGROUP" not in str(exc):
                raise
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc

    async def read_batch(
        self, keys: ModelKeys, consumer: str, count: int, block_ms: int, busy_poll_s: float = 0.0
    ) -> list[Entry]:
        if keys.partitions == 1:
            return await self._read_partition(keys, consumer, count, block_ms, busy_poll_s)
        if self._back:
            raise self._take_back()
        reads = self._partition_reads.get((keys.stream, consumer))
        if reads is None or reads.partitions != keys.partitions:
            if reads is not None:
                await reads.close()

            def read(partition: int, count: int, block_ms: int, poll_s: float) -> Any:
                if partition in self._aside:  # nothing is read there until it answers again
                    return asyncio.sleep(block_ms / 1000, [])
                return self._read_partition(keys.of(partition), consumer, count, block_ms, poll_s)

            reads = self._partition_reads[keys.stream, consumer] = PartitionReads(
                keys.partitions, read
            )
        return await reads.take(count, max(1, block_ms), busy_poll_s)

    async def read_rest(self, keys: ModelKeys, consumer: str, count: int) -> list[Entry]:
        reads = self._partition_reads.get((keys.stream, consumer))
        rest = [] if reads is None else await reads.rest(count)
        for part in keys.each():
            keep = self._kept.get((part.stream, consumer))
            if keep is not None and len(rest) < count:
                rest += _tagged(part, keep.take(count - len(rest)))
        return rest

    def _reads_lane(self, partition: int) -> RespLane | ClusterLanes:
        """The blocking lane(s) of a partition's reads: one blocked XREADGROUP holds its
        connection, so each partition has its own (a cluster's: its own to each node)."""
        if partition == 0:
            return self._reads
        lane = self._partition_lanes.get(partition)
        if lane is None:
            lane = self._partition_lanes[partition] = connections.lanes(
                self._target, self._connect_timeout_s, None
            )
        return lane

    async def _read_partition(
        self, keys: ModelKeys, consumer: str, count: int, block_ms: int, busy_poll_s: float
    ) -> list[Entry]:
        """Up to ``count`` entries of one partition's levels, ids tagged with their lane,
        in the order its :class:`LevelKeep` gives (high first, but for its starvation turn)."""
        keep = self._kept.get((keys.stream, consumer))
        if keep is None:
            keep = self._kept[keys.stream, consumer] = LevelKeep()
        streams = {level: keys.at(level).stream for level in (HIGH, NORMAL)}
        asides = self._asides.get(keys.partition, 0)
        try:
            replies = await self._read_levels(keys, consumer, keep, count, block_ms, busy_poll_s)
        except ResponseError as exc:
            if str(exc).startswith("MOVED"):
                raise _cluster_node(str(exc)) from exc
            if "NOGROUP" not in str(exc):
                raise
            # The stream was deleted (FLUSHALL, a purge): recreate it and read again next time.
            log.warning(
                "consumer group %s vanished from %s; recreating it", keys.group, keys.stream
            )
            for level in (HIGH, NORMAL):
                await self._create_group(keys.at(level))
            return []
        except UNAVAILABLE as exc:
            keep.clear()  # pending for this consumer: taken back as its own
            return self._read_failed(keys.partition, asides, exc)
        levels = {name.encode(): level for level, name in streams.items()}
        for reply in replies:
            for stream, entries in reply or ():
                read = [(i.decode(), _pairs(f)) for i, f in entries]
                items = multi_item.expand(read, self._acks(streams[levels[stream]]))
                if read:
                    self._items_per_entry = 0.8 * self._items_per_entry + 0.2 * (
                        len(items) / len(read)
                    )
                keep.add(levels[stream], items)
        return _tagged(keys, keep.take(count))

    def _read_failed(self, partition: int, asides: int, exc: BaseException) -> list[Entry]:
        """Nothing, for a read of a partition set aside since it was sent (``asides``: how
        many times it had been then; it may be back already, on another node); else raise
        what a read that could not reach Redis raises."""
        if partition in self._aside or self._asides.get(partition, 0) != asides:
            return []
        raise self._failed(partition, exc) from exc

    def _acks(self, stream: str) -> ItemAcks:
        acks = self._item_acks.get(stream)
        if acks is None:
            acks = self._item_acks[stream] = ItemAcks()
        return acks

    def _entries_for(self, items: int) -> int:
        """How many entries to read for about ``items`` items, as entries held lately
        (multi-item entries hold several), so a worker does not take far more than a
        batch from its peers."""
        return max(1, math.ceil(items / max(1.0, self._items_per_entry)))

    async def _read_levels(
        self,
        keys: ModelKeys,
        consumer: str,
        keep: LevelKeep,
        count: int,
        block_ms: int,
        busy_poll_s: float,
    ) -> list[Any]:
        """XREADGROUP replies of one partition's levels: with nothing kept, one XREADGROUP of
        both streams (blocking while both are empty; it may bring ``count`` of each); else a
        pipeline of non-blocking XREADGROUPs of the levels that keep less than ``count``, so
        that high entries never wait behind kept normal ones."""
        lane = self._reads_lane(keys.partition).at(keys.stream)
        high, normal = keys.at(HIGH).stream, keys.at(NORMAL).stream
        group = ("XREADGROUP", "GROUP", keys.group, consumer)
        if keep.empty():
            if lane.draining:  # requests callers still put on the master this lane left
                drained = await lane.on_left_master(
                    *group, "COUNT", self._entries_for(count), "STREAMS", high, normal, ">", ">"
                )
                if drained:
                    return [drained]
            block_ms = max(1, block_ms)
            got: Any = await lane.execute_blocking(
                block_ms / 1000, *group, "COUNT", self._entries_for(count), "BLOCK", block_ms,
                "STREAMS", high, normal, ">", ">", busy_poll_s=busy_poll_s,
            )  # fmt: skip
            return [got]
        streams = {HIGH: high, NORMAL: normal}
        commands = [
            (*group, "COUNT", self._entries_for(n), "STREAMS", streams[level], ">")
            for level, n in keep.wanted(count)
        ]
        replies: list[Any] = await lane.pipeline(commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def finish(
        self,
        keys: ModelKeys,
        replies: Sequence[tuple[str, bytes]],
        entries: Sequence[Entry],
        reply_ttl_s: int,
        check: Sequence[str] = (),
    ) -> set[str]:
        if self._aside:
            replies, entries, check = self._without_aside(keys, replies, entries, check)
        calls = _reply_calls(replies, reply_ttl_s, _packable(entries)) if replies else []
        # Per lane (each level of each partition), all of its slot: its acks,
        # deletes and byte release, its withdrawal checks, the count of its withdrawals standing.
        held = partitions.group(entries)
        checks = partitions.group_ids(check)
        batches: list[tuple[ModelKeys, list[tuple[Any, ...]]]] = []
        for part in keys.lanes():
            if part.partition in self._aside:
                continue
            commands = self._removal(part, held.get(part.lane, []))
            if part.lane in checks:
                commands.append(("ZMSCORE", part.cancelled, *checks[part.lane]))
            commands.append(("ZCARD", part.cancelled))
            batches.append((part, commands))
        # On a cluster, replies to a slot other than their entry's (a caller that gave an
        # entry of partition k an inbox of the model's namespace) must be written before that
        # entry is acknowledged on its own node.
        spread = calls and keys.partitions > 1 and self._cluster is not None
        elsewhere = _replies_elsewhere(keys, held) if spread else set()
        results = await self._reply_and_run(
            calls, [(part.stream, commands) for part, commands in batches], elsewhere
        )
        withdrawn: set[str] = set()
        standing: list[Any] = []
        for (part, commands), got in zip(batches, results, strict=True):
            standing.append(got.pop())
            if part.lane in checks:
                withdrawn |= _withdrawn(part.lane, checks[part.lane], got.pop())
            await self._acknowledged(part, commands[: len(got)], got)
        self.cancellations_pending = any(not isinstance(n, int) or n > 0 for n in standing)
        return withdrawn

    async def _acknowledged(
        self, keys: ModelKeys, commands: Sequence[tuple[Any, ...]], results: Sequence[Any]
    ) -> None:
        """Check the results of one partition's :func:`_removal` commands."""
        for result in results:
            if isinstance(result, Exception):
                log.warning("an acknowledgement could not be completed: %s", result)
        await self._floor_counters(keys, commands, results)

    async def _reply_and_run(
        self,
        calls: Sequence[ReplyCall],
        batches: Sequence[tuple[str, Sequence[tuple[Any, ...]]]],
        elsewhere: Collection[str] = (),
    ) -> list[list[Any]]:
        """Write the replies, then run each batch of commands (of the slot of its key; they
        acknowledge its entries); each batch's results.

        Each mb_reply goes in the same round trip as the batches, ahead of the
        acknowledgements it must precede: on one Redis, all in one pipeline; on a cluster, at
        the head of the transaction of its own slot's batches (so a partition's replies and
        acks are one transaction on its node). One goes alone first, and the batches only
        once it is written, where its connection has not answered an mb_reply yet (a fresh
        one may reach a Redis restarted without its functions, or a cluster node that a
        slot just moved to), and on a cluster where no batch is in its slot (a pipeline's
        inboxes) or its tag is in ``elsewhere`` (replies of entries acknowledged on
        another node)."""
        alone, riding = self._route_replies(calls, [key for key, _ in batches], elsewhere)
        try:
            if alone:
                sent = await asyncio.gather(
                    *(self._send_replies(call) for call in alone), return_exceptions=True
                )
                for outcome in sent:
                    if isinstance(outcome, BaseException):
                        raise outcome
            results = await self._run_per_slot(
                [
                    (key, [*(_reply_command(call) for call in riding.get(index, ())), *commands])
                    for index, (key, commands) in enumerate(batches)
                ]
            )
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        out: list[list[Any]] = []
        for index, got in enumerate(results):
            ridden = riding.get(index, [])
            for call, written in zip(ridden, got, strict=False):
                self._replies_written(call, written)
            out.append(got[len(ridden) :])
        if self._unwritten:  # (a worker's hot path: no coroutine unless there are some)
            await self._write_unwritten()
        return out

    def _route_replies(
        self, calls: Sequence[ReplyCall], batch_keys: Sequence[str], elsewhere: Collection[str]
    ) -> tuple[list[ReplyCall], dict[int, list[ReplyCall]]]:
        """(the mb_reply calls to send alone first, {batch index: the calls at its head}):
        see :meth:`_reply_and_run`."""
        clustered = self._cluster is not None
        first: dict[str, int] = {}  # the first batch of each hash tag
        if clustered:
            for at, key in enumerate(batch_keys):
                first.setdefault(_hash_tag(key), at)
        alone: list[ReplyCall] = []
        riding: dict[int, list[ReplyCall]] = {}
        for call in calls:
            index = first.get(call.tag) if clustered else 0 if batch_keys else None
            generation = self._lane.at(call.keys[0]).generation
            if index is None or call.tag in elsewhere or generation not in self._replies_checked:
                alone.append(call)
            else:
                riding.setdefault(index, []).append(call)
        return alone, riding

    def _replies_written(self, call: ReplyCall, written: Any) -> None:
        """Check what an mb_reply sent with acknowledgements answered."""
        if _is_missing(written):
            # The library went away under a live connection (FUNCTION FLUSH), was replaced by
            # an older one (`broker functions load` of an older release), or a slot moved
            # during the round trip to a node without it: the entries are acknowledged
            # already, so their replies are kept until they are written (_write_unwritten).
            self._replies_checked.clear()
            log.error("replies failed (%s); the entries were acknowledged already", written)
            self._keep_unwritten(call)
        elif isinstance(written, ResponseError):
            log.warning("replies could not be written: %s", written)
        else:
            _log_refused(written)

    async def _run_per_slot(
        self, batches: Sequence[tuple[str, Sequence[tuple[Any, ...]]]]
    ) -> list[list[Any]]:
        """Run each (key, commands) batch; each batch's results, error replies in place.

        One Redis: all in one pipeline, in order. A cluster: the batches of one hash tag in
        one pipeline, in order (a transaction on the node of its slot), the tags' pipelines
        sent at once."""
        if self._cluster is None:
            flat = list(chain.from_iterable(commands for _, commands in batches))
            results: list[Any] = await self._lane.at("").pipeline(flat)
            _raise_unavailable(results)
            out, at = [], 0
            for _, commands in batches:
                out.append(results[at : at + len(commands)])
                at += len(commands)
            return out
        tags: dict[str, list[int]] = {}
        for index, (key, _) in enumerate(batches):
            tags.setdefault(_hash_tag(key), []).append(index)
        got = await asyncio.gather(
            *(
                self._lane.at(batches[indexes[0]][0]).pipeline(
                    list(chain.from_iterable(batches[i][1] for i in indexes))
                )
                for indexes in tags.values()
            ),
            return_exceptions=True,
        )
        failed = [
            batches[indexes[0]][0]
            for indexes, result in zip(tags.values(), got, strict=True)
            if isinstance(result, UNAVAILABLE)
        ]
        if failed:
            self._slots_failed(failed, next(r for r in got if isinstance(r, UNAVAILABLE)))
        for result in got:
            if isinstance(result, BaseException):
                raise result
            _raise_unavailable(result)
        per_batch: list[list[Any]] = [[] for _ in batches]
        for indexes, result in zip(tags.values(), got, strict=True):
            assert not isinstance(result, BaseException)
            at = 0
            for i in indexes:
                count = len(batches[i][1])
                per_batch[i] = list(result[at : at + count])
                at += count
        return per_batch

    def _slots_failed(self, keys: Sequence[str], exc: BaseException) -> None:
        """The nodes of these keys' slots did not answer: raise PartitionsChanged where each
        is a partition's that could be set aside (then all are), else return."""
        queue = self._queue
        if queue is None:
            return
        tags = {part.tag: part.partition for part in queue.each()}
        failed = {tags.get(_hash_tag(key)) for key in keys}
        if None in failed or len(failed.union(self._aside)) >= queue.partitions:
            return
        for partition in failed:
            assert partition is not None
            self._set_aside(partition, exc)
        raise PartitionsChanged(f"partition(s) set aside: {exc}") from exc

    def _keep_unwritten(self, call: ReplyCall) -> None:
        if len(self._unwritten) >= MAX_UNWRITTEN_CALLS:  # an outage without end: the oldest go
            lost = self._unwritten.pop(0)
            log.error("replies to %s dropped unwritten: %d more are waiting for the library",
                      ", ".join(lost.keys), len(self._unwritten))  # fmt: skip
        self._unwritten.append(call)

    async def _write_unwritten(self) -> None:
        """Write the replies of acknowledged entries that an mb_reply failed to write, oldest
        first, each alone (loading the library first if this user may). Each is forgotten only
        once written: BrokerUnavailable (the library still missing or old, Redis away) or a
        cancellation leaves it and the later ones for the next try, which a worker makes when
        the library answers again (check_functions, before it reads) or with its next replies."""
        if not self._unwritten:
            return
        written = 0
        try:
            while self._unwritten:
                call = self._unwritten[0]
                await self._send_replies(call)
                # (by identity: another task may have written it meanwhile, and written it
                # twice, which its caller ignores, rather than skipped one)
                for at, kept in enumerate(self._unwritten):
                    if kept is call:
                        del self._unwritten[at]
                        break
                written += 1
        finally:
            if written:
                log.warning(
                    "wrote the replies of %d acknowledged reply call(s) late%s",
                    written,
                    f"; {len(self._unwritten)} still waiting" if self._unwritten else "",
                )

    async def _send_replies(self, call: ReplyCall) -> None:
        """Run one mb_reply alone and wait for it (loading the library if it must and may)."""
        lane = self._lane.at(call.keys[0])
        generation = lane.generation
        refused = await self._fcall(REPLY, call.keys, call.args, warn=False)
        if generation == lane.generation:
            self._note_replies_checked(generation)
        _log_refused(refused)

    def _note_replies_checked(self, generation: Hashable) -> None:
        """mb_reply answered on this lane connection: replies may go with acks on it."""
        if len(self._replies_checked) >= 4096:  # reconnections by the thousand: start over
            self._replies_checked.clear()
        self._replies_checked.add(generation)

    async def withdrawn(self, keys: ModelKeys, entry_ids: Sequence[str]) -> set[str]:
        if not entry_ids:
            return set()
        checks = partitions.group_ids(entry_ids)
        batches = [
            (keys.of(k).cancelled, [("ZMSCORE", keys.of(k).cancelled, *ids)])
            for k, ids in checks.items()
        ]
        try:
            results = await self._run_per_slot(batches)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        withdrawn: set[str] = set()
        for (partition, ids), (scores,) in zip(checks.items(), results, strict=True):
            if isinstance(scores, Exception):
                raise scores
            withdrawn |= _withdrawn(partition, ids, scores)
        return withdrawn

    async def _floor_counters(
        self, keys: ModelKeys, commands: Sequence[tuple[Any, ...]], results: Sequence[Any]
    ) -> None:
        """Bring the queued-bytes and packed-items counters back to zero where these
        commands' DECRBYs took them below it: a caller that XADDed without counting its
        bytes or items (see docs/protocol.md) must never loosen the queue bound."""
        counters = (keys.queued_bytes, keys.packed_items)
        for command, result in zip(commands, results, strict=False):
            counted = command[0] == "DECRBY" and command[1] in counters
            if counted and isinstance(result, int) and result < 0:
                with contextlib.suppress(*UNAVAILABLE, ResponseError):
                    await self.redis.incrby(command[1], -result)

    async def reclaim(
        self, keys: ModelKeys, consumer: str, min_idle_ms: int, count: int, own: bool = False
    ) -> list[Redelivery]:
        taken: list[Redelivery] = []
        if own:  # what reads delivered and this consumer kept is among what it takes back
            for part in keys.each():
                self._kept.pop((part.stream, consumer), None)
        # Every lane (each level of each partition), each holding its own pending entries;
        # each call starts from the next one, so that one with many to take over does not
        # starve the others.
        parts = [part for part in keys.lanes() if part.partition not in self._aside]
        self._reclaim_turn = turn = (self._reclaim_turn + 1) % len(parts)
        for part in parts[turn:] + parts[:turn]:
            found = await self._bounded(
                part.partition,
                self._reclaim_partition(part, consumer, min_idle_ms, count - len(taken), own),
            )
            taken += [((partitions.tag(i, part.lane), f), n) for (i, f), n in found]
        return taken

    async def _reclaim_partition(
        self, keys: ModelKeys, consumer: str, min_idle_ms: int, count: int, own: bool
    ) -> list[Redelivery]:
        try:
            if own:
                holders = [consumer]
            else:
                holders = await self._dead_consumers(keys, consumer)
            taken: list[Redelivery] = []
            for holder in holders:
                if len(taken) < count:
                    taken += await self._claim(
                        keys, consumer, holder, min_idle_ms, count - len(taken), own
                    )
                if holder != consumer:
                    await self._retire(keys, holder)
            return taken
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc

    async def _retire(self, keys: ModelKeys, holder: str) -> None:
        """Remove the dead consumer ``holder`` from the group once it holds nothing
        (mb_retire). This is housekeeping: a refusal (the empty name, which Redis takes but
        whose heartbeat key the library refuses) is logged once and never stops the
        takeover of what the consumer held."""
        heartbeat = _wire(keys.heartbeat(holder))
        try:
            await self._fcall(RETIRE, (keys.stream, heartbeat), (keys.group, _wire(holder)), False)
        except ResponseError as exc:
            if (keys.stream, holder) not in self._unretired:
                self._unretired.add((keys.stream, holder))
                log.warning(
                    "cannot retire dead consumer %r of %s (its entries are taken over; "
                    "XGROUP DELCONSUMER removes it): %s", holder, keys.stream, exc,
                )  # fmt: skip

    async def _dead_consumers(self, keys: ModelKeys, consumer: str) -> list[str]:
        """The other consumers of ``keys``' group that are dead: retired by their supervisor
        (no heartbeat, no longer in the consumers set), or whose heartbeat lapsed and is
        still lapsed at least ``LAPSE_CONFIRM_S`` after this worker first saw it so.

        A heartbeat can lapse with its worker alive: a Redis that stalls for longer than the
        TTL (stopped, swapping, forking, running a long script) expires every heartbeat at
        once, and its supervisor renews it only once Redis answers again. Taking over at the
        first sight would compute that worker's entries a second time."""
        try:
            consumers: Any = await self.redis.xinfo_consumers(keys.stream, keys.group)
        except ResponseError:  # no stream or group yet
            return []
        others = [_consumer_name(info["name"]) for info in consumers]
        others = [name for name in others if name != consumer]
        if not others:
            return []
        members: list[Any] = [_wire(name) for name in others]  # redis-py takes bytes too
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in others:
                pipe.exists(_wire(keys.heartbeat(name)))
            pipe.zmscore(keys.consumers, members)
            *alive, scores = await pipe.execute()
        now = time.monotonic()
        for seen in [s for s in self._lapsed if s[0] == keys.stream and s[1] not in others]:
            del self._lapsed[seen]  # it left the group
        dead = []
        for name, exists, vouched in zip(others, alive, scores, strict=True):
            seen = (keys.stream, name)
            if exists:
                self._lapsed.pop(seen, None)
            elif vouched is None:  # retired: its supervisor saw it exit
                self._lapsed.pop(seen, None)
                dead.append(name)
            elif now - self._lapsed.setdefault(seen, now) >= LAPSE_CONFIRM_S:
                dead.append(name)
        return dead

    async def _claim(
        self, keys: ModelKeys, consumer: str, holder: str, min_idle_ms: int, count: int, own: bool
    ) -> list[Redelivery]:
        pending: Any = await self.redis.xpending_range(
            keys.stream, keys.group, "-", "+", count, consumername=_wire(holder)
        )
        if not pending:
            return []
        deliveries = {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        claimed: Any = await self.redis.xclaim(
            keys.stream, keys.group, consumer, 0 if own else min_idle_ms, list(deliveries)
        )
        found = [(_text(entry_id), fields) for entry_id, fields in claimed if entry_id is not None]
        # Not claimed: deleted while pending (answered, then the ack was lost), or not idle for
        # min_idle_ms (read just before its worker died, or just claimed by another worker).
        # Only the deleted ones may be acknowledged: acking the others would lose them. Redis 7
        # drops deleted entries from the group itself; Redis 6.2 hands them to the claimer.
        missed = sorted(set(deliveries) - {entry_id for entry_id, _ in found})
        if missed:
            async with self.redis.pipeline(transaction=False) as pipe:
                for entry_id in missed:
                    pipe.xpending_range(keys.stream, keys.group, entry_id, entry_id, 1)
                owners: Any = await pipe.execute()
            gone = [
                entry_id
                for entry_id, rows in zip(missed, owners, strict=True)
                if rows and _consumer_name(rows[0]["consumer"]) == consumer
            ]
            if gone:
                await self.redis.xack(keys.stream, keys.group, *gone)
        if found:
            log.warning(
                "took over %d entr%s from %s consumer %s",
                len(found), "y" if len(found) == 1 else "ies", "own" if own else "dead",
                _wire(holder).decode(errors="backslashreplace"),
            )  # fmt: skip
        taken: list[Redelivery] = []
        acks = self._acks(keys.stream)
        for entry_id, fields in found:
            items = multi_item.item_count(fields)
            if items is None:
                taken.append(((entry_id, fields), deliveries[entry_id]))
            elif items > 1 and not own:
                # One of its items may be what killed its worker: each goes back to the
                # stream alone, to be delivered (and, if it kills again, dead-lettered) alone.
                await self._split(keys, entry_id, fields, items)
            else:
                acks.hand_out(entry_id, fields, items, again=True)
                parts = multi_item.split(entry_id, fields, items)
                taken += [(part, deliveries[entry_id]) for part in parts]
        return taken

    async def _split(
        self, keys: ModelKeys, entry_id: str, fields: dict[bytes, Any], count: int
    ) -> None:
        """Replace a v2 entry taken over by one v1 entry per item (keeping each item's
        deadline), in one transaction in its slot: the items withdrawn by their callers, or
        answered by the worker that held the entry, left out."""
        items = multi_item.split(entry_id, fields, count)
        ids = [item_id for item_id, _ in items]
        scores = await self.run_in_slot(
            keys.cancelled,
            [("ZMSCORE", keys.cancelled, *ids), ("ZMSCORE", keys.answered, *ids)],
            atomic=False,
        )
        # withdrawn by their callers, or answered by the worker that held the entry
        done = [
            any(isinstance(got, list) and got[i] is not None for got in scores)
            for i in range(count)
        ]
        commands: list[tuple[Any, ...]] = []
        kept_bytes = 0
        for item, skip in zip(items, done, strict=True):
            if not skip:
                fields_of_item = item[1]
                # the deadline the item has now, whatever its new entry's time (a malformed
                # item fails its parse wherever it goes, and is answered from there)
                with contextlib.suppress(MalformedEntry):
                    fields_of_item[b"deadline"] = b"%d" % parse_request(*item).deadline_ms
                commands.append(("XADD", keys.stream, "*", *_flatten(fields_of_item)))
                kept_bytes += len(fields_of_item.get(b"data", b""))
        released = multi_item.data_size(fields, count) - kept_bytes
        commands += [
            ("XACK", keys.stream, keys.group, entry_id),
            ("XDEL", keys.stream, entry_id),
            ("DECRBY", keys.packed_items, count - 1),
            ("ZREM", keys.answered, *ids),
        ]
        if released:
            commands.append(("DECRBY", keys.queued_bytes, released))
        await self.run_in_slot(keys.stream, commands)
        self._acks(keys.stream).forget([entry_id])
        log.warning(
            "split multi-item entry %s of %s, taken over, into %d entries",
            entry_id, keys.stream, len(commands) - 4 - bool(released),
        )  # fmt: skip

    async def dead_letter(self, keys: ModelKeys, entries: Sequence[Entry], reason: str) -> None:
        # Each partition's entries go to its own dead-letter stream, in its slot.
        for partition, part in partitions.group(entries).items():
            await self._dead_letter_partition(keys.of(partition), part, reason)

    async def _dead_letter_partition(
        self, keys: ModelKeys, entries: Sequence[Entry], reason: str
    ) -> None:
        commands: list[tuple[Any, ...]] = []
        for entry_id, fields in entries:
            record = dead_record(fields)
            record[b"dead_reason"] = reason
            record[b"dead_entry"] = entry_id
            commands.append(("XADD", keys.dead_letters, "*", *_flatten(record)))
        commands += self._removal(keys, entries)
        try:
            results = await self._lane.at(keys.stream).pipeline(commands)
            _raise_unavailable(results)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        for result in results:
            if isinstance(result, ResponseError):
                raise result
        await self._floor_counters(keys, commands, results)

    def _removal(self, keys: ModelKeys, entries: Sequence[Entry]) -> list[tuple[Any, ...]]:
        """The ack, delete and byte release of entries this worker holds: an item of a v2
        entry only with the entry's last (multi_item.ItemAcks)."""
        if not entries:
            return []
        settled = self._acks(keys.stream).settle(entry_id for entry_id, _ in entries)
        ids, size = settled.plain, settled.released
        if len(ids) == len(entries):  # no items of v2 entries (the usual case)
            size += sum(entry_data_size(fields) for _, fields in entries)
        else:
            plain = set(ids)
            size += sum(entry_data_size(f) for entry_id, f in entries if entry_id in plain)
        ids += settled.done
        commands: list[tuple[Any, ...]] = []
        if settled.answered:
            # answered items of entries still open: whoever takes such an entry over (this
            # worker after an outage, or another after its death) skips them
            expiry = int(time.time() * 1000) + functions.CANCELLED_TTL_MS
            members = chain.from_iterable((expiry, item) for item in settled.answered)
            commands.append(("ZADD", keys.answered, *members))
        if settled.unmarked:
            commands.append(("ZREM", keys.answered, *settled.unmarked))
        if not ids:
            return commands
        commands += [("XACK", keys.stream, keys.group, *ids), ("XDEL", keys.stream, *ids)]
        if settled.packed:
            commands.append(("DECRBY", keys.packed_items, settled.packed))
        if size:  # last: finish reads the counter's new value from its reply
            commands.append(("DECRBY", keys.queued_bytes, size))
        return commands

    async def eviction_warning(self) -> str | None:
        """A warning if Redis may evict keys (streams would lose requests), else None."""
        return await eviction_warning(self.redis)

    async def workers_lapsed_s(self, keys: ModelKeys) -> float | None:
        commands = [("TIME",), ("ZRANGEBYSCORE", keys.consumers, "-inf", "+inf", "WITHSCORES")]
        try:
            time, flat = await self._lane.at(keys.consumers).pipeline(commands)
            _raise_unavailable((time, flat))
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        for result in (time, flat):
            if isinstance(result, Exception):  # e.g. an ACL user without ZRANGEBYSCORE
                raise result
        return lapsed_s(redis_time_ms(time), [float(score) for score in flat[1::2]])

    async def time_ms(self) -> int:
        try:
            reply = await self._lane.at(self._home_key()).execute("TIME")
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        return redis_time_ms(reply)

    async def run_in_slot(
        self, key: str, commands: Sequence[tuple[Any, ...]], atomic: bool = True
    ) -> list[Any]:
        """Run commands whose keys all lie in ``key``'s slot in one round trip (``atomic``: as
        one transaction, as a cluster's always are); their replies in order, error replies in
        place. What a pipeline's stages send: each touches one slot, never a cross-slot script."""
        if not commands:
            return []
        try:
            if self._cluster is not None or len(commands) == 1 or not atomic:
                results: list[Any] = await self._lane.at(key).pipeline(commands)
            else:
                results = _unwrap(
                    await self._lane.at(key).pipeline([("MULTI",), *commands, ("EXEC",)])
                )
            _raise_unavailable(results)
        except UNAVAILABLE as exc:
            raise _unavailable(exc) from exc
        return results

    async def ping(self) -> bool:
        # on the lane calls are sent on, which it connects: a caller's first call then
        # need not, and no connection is opened that calls never use
        try:
            return bool(await self._lane.at(self._home).execute("PING"))
        except (*UNAVAILABLE, ResponseError):
            return False

    async def close(self) -> None:
        for probe in self._aside.values():
            probe.cancel()
        for reads in self._partition_reads.values():
            await reads.close()
        lanes = (self._lane, self._reads, self._replies, *self._partition_lanes.values())
        for lane in (*lanes, *self._reply_lanes.values()):
            lane.close()
        await self.redis.aclose()


async def eviction_warning(client: aioredis.Redis) -> str | None:
    """A warning if this Redis may evict keys (request streams would be lost), else None.

    Reads INFO (not CONFIG GET, which ACLs and managed services often refuse).
    """
    try:
        info = await client.info("memory")
    except (ResponseError, *UNAVAILABLE):
        return None  # nothing to check with
    policy = _text(info.get("maxmemory_policy", "noeviction"))
    if policy == "noeviction":
        return None
    return (
        f"Redis runs with maxmemory-policy {policy}: under memory pressure it may evict "
        "request streams and lose requests; set maxmemory-policy noeviction"
    )


async def cluster_node_misuse(client: aioredis.Redis, url: str | RedisURL) -> str | None:
    """:func:`broker.redis_url.cluster_node_error` of ``client``'s server (None where INFO is
    refused or the URL is a redis+cluster:// one); raises what an unreachable Redis raises."""
    if isinstance(parse_url(url), ClusterURL):
        return None
    try:
        cluster_info = await client.info("cluster")
    except ResponseError:
        return None  # INFO refused (an ACL): nothing to check with
    return cluster_node_error(url, cluster_info)


async def startup_warnings(client: aioredis.Redis, url: str | RedisURL) -> list[str]:
    """What a process starting to use ``url`` should log: Redis unreachable (for now) or
    refusing the credentials, a Cluster node given as a plain node, or keys that may be
    evicted."""
    try:
        warnings = [await cluster_node_misuse(client, url)]
    except AuthenticationError as exc:  # a ConnectionError to redis-py, yet Redis did answer
        reason = f"refused the credentials ({exc})"
        if parse_url(url).password is None:
            reason = credentials_refused(url, exc)  # one it needs, not redis-py's HELLO
        return [
            f"Redis at {describe(url)} {reason}: requests get 503 "
            "BrokerUnavailable until the URL's user and password are ones it accepts"
        ]
    except UNAVAILABLE as exc:
        return [
            f"Redis at {describe(url)} does not answer ({exc}): requests get 503 "
            "BrokerUnavailable until it does"
        ]
    warnings.append(await eviction_warning(client))
    return [warning for warning in warnings if warning]


def _cluster_node(moved: str) -> BrokerUnavailable:
    """What a redis:// URL of a Redis Cluster node gets for a slot the node does not serve."""
    return BrokerUnavailable(f"Redis answered {moved!r}: {CLUSTER_NODE_HINT}")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _consumer_name(value: Any) -> str:
    """A consumer's name as XINFO CONSUMERS gives it. A worker in another language may name
    its consumer with bytes that are not UTF-8: they are kept (as surrogates) so that
    ``_wire`` gives Redis back the very name."""
    return value.decode(errors="surrogateescape") if isinstance(value, bytes) else str(value)


def _wire(text: str) -> bytes:
    """``text`` as Redis holds it: UTF-8, with a ``_consumer_name``'s surrogates as its bytes."""
    return text.encode(errors="surrogateescape")


def _enqueue_outcome(result: Any, partitions: int = 1) -> list[str] | MicrobatchError:
    code = int(result[0])
    if code == 0:
        return [entry_id.decode() for entry_id in result[1:]]
    bound = int(result[1])
    if code == 3:
        return _never_fits(bound, partitions)
    unit = "items" if code == 1 else "bytes"
    return QueueFull(f"queue is at its bound of {bound} {unit}")


def _never_fits(bound: int, partitions: int) -> QueueFull:
    """QueueFull for a call with more items than its partition's item bound: a call is queued
    whole on one partition, whose bound is the model's divided by the partition count."""
    if partitions == 1:
        return QueueFull(
            f"the call has more items than the queue bound of {bound} items and can never be "
            "queued whole: split it, or raise the bound (the model's: worker start "
            "--max-queue-items, times its live workers; or the caller's own max_queue_items, "
            "whichever is tighter)"
        )
    return QueueFull(
        f"the call has more items than the queue bound of {bound} items of the partition it "
        f"went to (a call is queued whole on one of the model's {partitions} partitions, each "
        "bounded by its share of the model's bound) and can never be queued whole: split it, "
        "or raise the bound (the model's: worker start --max-queue-items, times its live "
        f"workers, divided by its {partitions} partitions; or the caller's own "
        "max_queue_items, likewise divided, whichever is tighter)"
    )


def _too_large(call: CallRequests) -> MicrobatchError | None:
    """InvalidInput for a call more than one mb_enqueue may carry, else None."""
    count, size = len(call.request_ids), call.data_size
    if count <= MAX_CALL_ENTRIES and size <= MAX_CALL_BYTES:
        return None
    return InvalidInput(
        f"a call may carry at most {MAX_CALL_ENTRIES} items and {MAX_CALL_BYTES} bytes of "
        f"encoded data (this one: {count} items, {size} bytes): split it"
    )


def _within_caps(indexes: Sequence[int], calls: Sequence[CallRequests]) -> list[list[int]]:
    """The calls at ``indexes`` grouped, in order, so that no group exceeds what one
    mb_enqueue may carry."""
    groups: list[list[int]] = []
    entries = size = 0
    for i in indexes:
        count, data = len(calls[i].request_ids), calls[i].data_size
        if not groups or entries + count > MAX_CALL_ENTRIES or size + data > MAX_CALL_BYTES:
            groups.append([])
            entries = size = 0
        groups[-1].append(i)
        entries, size = entries + count, size + data
    return groups


class EnqueuePacker:
    """FCALL mb_enqueue commands, RESP-encoded by hand around each item's id and data.

    The part of a call shared by its items (reply key, timeout, trace) is packed once into a
    template, kept for the next call with the same ones. (Building one argument tuple of every
    item for hiredis cost the caller ~6 us per call, more than Redis spends queueing it.)
    """

    MAX_TEMPLATES = 64

    def __init__(self, entry_items: int = 1) -> None:
        self._templates: dict[tuple[str, int, str], bytes] = {}
        self.entry_items = entry_items

    def pack(self, keys: ModelKeys, calls: Sequence[CallRequests], bound: QueueBound) -> bytes:
        """One FCALL mb_enqueue of ``calls`` (section 6 of docs/protocol.md)."""
        head = [
            "FCALL", ENQUEUE, 5, keys.stream, keys.queued_bytes, keys.queue_bound,
            keys.consumers, keys.packed_items, functions.VERSION, bound.max_items,
            bound.max_bytes,
            self.entry_items,
        ]  # fmt: skip
        count = len(head) + sum(4 + 2 * len(call.request_ids) for call in calls)
        parts = [b"*%d\r\n" % count, bulk_strings(head)]
        templates = self._templates
        for call in calls:
            key = (call.reply_key, call.timeout_ms, call.traceparent or "")
            template = templates.get(key)
            if template is None:
                if len(templates) >= self.MAX_TEMPLATES:
                    templates.clear()
                template = templates[key] = bulk_strings(key)
            n = b"%d" % len(call.request_ids)
            parts.append(b"$%d\r\n%s\r\n%s" % (len(n), n, template))
            parts += [
                b"$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(rid), rid, len(data), data)
                for rid, data in zip(
                    [rid.encode() for rid in call.request_ids], call.payloads, strict=True
                )
            ]
        return b"".join(parts)


def _tagged(keys: ModelKeys, taken: Sequence[tuple[int, Entry]]) -> list[Entry]:
    """(level, entry) pairs of one partition's levels as the batch loop knows them: ids
    tagged with their lane."""
    lanes = {level: keys.at(level).lane for level in (NORMAL, HIGH)}
    tag = partitions.tag
    # lane 0 (partition 0's normal level) keeps its ids as they are: the entries themselves
    return [entry if not lanes[level] else (tag(entry[0], lanes[level]), entry[1])
            for level, entry in taken]  # fmt: skip


@dataclass(frozen=True)
class ReplyCall:
    """One mb_reply: its keys (all with one hash tag, ``tag``) and its arguments after the
    version."""

    tag: str
    keys: list[str]
    args: list[Any]


MAX_UNWRITTEN_CALLS = 4096  # mb_reply calls kept for a library that does not come back


def _hash_tag(key: str) -> str:
    """What Redis Cluster hashes of ``key``: its hash tag (the text between the first ``{``
    and the next ``}``, if not empty), else the whole key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


def _packable(entries: Sequence[Entry]) -> dict[str, set[bytes] | None]:
    """Which replies to these entries (the entries answered) may share packed elements: those
    to items of multi-item (v2) entries, whose writers read them (docs/protocol.md, section
    7.1). By reply key: None where every entry naming it is such an item (all its replies
    may), else the request ids of its items of v2 entries."""
    if all(ITEM_MARK in entry_id for entry_id, _ in entries):  # (under load)
        named = {fields.get(b"reply") for _, fields in entries}
        return {key.decode(errors="replace"): None for key in named if isinstance(key, bytes)}
    found: dict[bytes, set[bytes]] = {}
    mixed: set[bytes] = set()  # reply keys also named by v1 entries
    for entry_id, fields in entries:
        reply = fields.get(b"reply")
        if not isinstance(reply, bytes):
            continue
        if ITEM_MARK not in entry_id:
            mixed.add(reply)
            continue
        request_id = fields.get(b"id")
        if isinstance(request_id, bytes):
            found.setdefault(reply, set()).add(request_id)
    return {
        key.decode(errors="replace"): ids if key in mixed else None for key, ids in found.items()
    }


def _reply_calls(
    replies: Sequence[tuple[str, bytes]],
    ttl_s: int,
    packable: Mapping[str, set[bytes] | None] | None = None,
) -> list[ReplyCall]:
    """The mb_reply calls of (reply key, reply) pairs: one per hash tag of the keys (a
    function call touches one slot), each with its list elements grouped by key, in order:
    each reply alone, but those :func:`_packable` names (``packable``, of the entries these
    replies answer), which share packed elements (within reply_elements' caps)."""
    by_key: dict[str, list[bytes]] = {}
    for key, payload in replies:
        by_key.setdefault(key, []).append(payload)
    for key, ids in (packable or {}).items():
        payloads = by_key.get(key)
        if not payloads:
            continue
        if ids is None:
            by_key[key] = pack_replies(payloads)
            continue
        alone: list[bytes] = []
        shared: list[bytes] = []
        for payload in payloads:
            (shared if reply_id(payload) in ids else alone).append(payload)
        if shared:
            by_key[key] = alone + pack_replies(shared)
    by_tag: dict[str, list[str]] = {}
    for key in by_key:
        by_tag.setdefault(_hash_tag(key), []).append(key)
    calls = []
    for tag, keys in by_tag.items():
        counts = [len(by_key[key]) for key in keys]
        pushed = chain.from_iterable(by_key[key] for key in keys)
        calls.append(ReplyCall(tag, keys, [ttl_s, *counts, *pushed]))
    return calls


def _reply_command(call: ReplyCall) -> tuple[Any, ...]:
    return ("FCALL", REPLY, len(call.keys), *call.keys, functions.VERSION, *call.args)


def _replies_elsewhere(keys: ModelKeys, held: Mapping[int, Sequence[Entry]]) -> set[str]:
    """The hash tags of the reply keys of these entries (by lane) that are not their own
    partition's."""
    out: set[str] = set()
    for lane, entries in held.items():
        own = keys.of(lane).tag
        for _, fields in entries:
            reply = fields.get(b"reply")
            if reply is None:
                continue
            tag = _hash_tag(reply.decode(errors="replace"))
            if tag != own:
                out.add(tag)
    return out


def _withdrawn(lane: int, ids: Sequence[str], scores: Any) -> set[str]:
    """The ids (tagged with their lane) that ZMSCORE found withdrawn."""
    if isinstance(scores, Exception):
        log.warning("could not check for withdrawn requests: %s", scores)
        return set()
    return {
        partitions.tag(entry_id, lane) for entry_id, score in zip(ids, scores, strict=True) if score
    }


def _log_refused(refused: Any) -> None:
    """Warn of the reply keys mb_reply refused (they hold something other than a list)."""
    for key, kind in zip(refused[::2], refused[1::2], strict=False):
        log.warning(
            "replies to %s were not delivered: it holds a %s, not a list", _text(key), _text(kind)
        )


async def _load_library(lane: RespLane | SlotLane) -> list[tuple[int, int]]:
    """FUNCTION LOAD REPLACE the library through a lane where it is missing or older than this
    code's, never over a newer one (of a cluster, on every primary: each node has its own
    functions, and a later release's workers may have loaded theirs on some). The releases
    replaced, one per node loaded (raises ResponseError if this user may not load)."""
    if isinstance(lane, SlotLane):
        replaced = await lane.each_node(_load_if_older)
    else:
        replaced = [await _load_if_older(lane)]
    return [release for release in replaced if release is not None]


async def _load_if_older(node: RespLane) -> tuple[int, int] | None:
    """Load the library on one node unless it holds this release or a newer one (or one that
    answers no release: left alone); the release replaced, or None."""
    loaded = await _release_of(node)
    if loaded is None or loaded >= functions.THIS_RELEASE:
        return None
    await node.execute(*functions.LOAD_COMMAND)
    return loaded


async def _release_of(lane: RespLane | SlotLane) -> tuple[int, int] | None:
    """The library release a node holds (through a lane): revision 0 of this version where it
    has no library or one from before revisions (no mb_release); None where mb_release
    answers no release. Raises ResponseError for any other refusal."""
    try:
        return functions.answered_release(await lane.execute("FCALL", functions.RELEASE, 0))
    except ResponseError as exc:
        if not functions.is_missing(exc):
            raise
        return (functions.VERSION, 0)


def _is_missing(result: Any) -> bool:
    return isinstance(result, ResponseError) and functions.is_missing(result)


def _raise_unavailable(results: Sequence[Any]) -> None:
    """Raise the first connection error among a pipeline's replies (LOADING, say)."""
    for result in results:
        if isinstance(result, RedisConnectionError):
            raise result


def _pairs(flat: list[bytes] | None) -> dict[bytes, bytes]:
    """A stream entry's fields from RESP's flat [field, value, ...] list."""
    if not flat:
        return {}
    it = iter(flat)
    return dict(zip(it, it, strict=False))


# The most bytes of a field other than an item's data that a dead letter keeps: an item of a
# multi-item entry is dead-lettered with the entry's shared fields, so one field of a
# megabyte in an entry of 512 items would otherwise be written 512 times.
DEAD_FIELD_BYTES = 1024


def dead_record(fields: Mapping[bytes, Any]) -> dict[Any, Any]:
    """A dead letter's copy of an entry's (or item's) fields: any but the data cut to
    ``DEAD_FIELD_BYTES``, with ``dead_cut`` naming the fields cut."""
    record: dict[Any, Any] = dict(fields)
    cut = [
        name
        for name, value in record.items()
        if isinstance(value, bytes) and len(value) > DEAD_FIELD_BYTES and not is_data_field(name)
    ]
    for name in cut:
        record[name] = record[name][:DEAD_FIELD_BYTES]
    if cut:
        record[b"dead_cut"] = b",".join(cut)
    return record


def _flatten(fields: Mapping[Any, Any]) -> list[Any]:
    """A stream entry's fields as RESP's flat [field, value, ...] list."""
    return list(chain.from_iterable(fields.items()))
