"""Heartbeats: the supervisor vouches for each live worker consumer in Redis (and keeps the
model's queue bound and partition count there).

A partitioned queue's functions read the bound, the consumers and the heartbeats in each
partition's own hash slot, so every partition gets its own copy of them; the bound of each is
its share of the model's.

Each consumer has a key ``heartbeat`` with a short TTL and a member in the model's ``consumers``
sorted set, scored by when its heartbeat expires. Readers (gateway readiness, `broker status`,
takeover of a dead worker's entries) count a consumer as live while its score is in the future.
The supervisor renews them from its own process, so a model that holds the GIL in a child cannot
starve them.

The supervisor also prunes, at most once a minute, the expired members of the model's sorted
sets that are scored by expiry: each lane's cancelled and answered sets, and the withdrawn set.
Callers prune the cancelled and withdrawn sets only when they withdraw something, and nothing
else pruned the answered set, so after the last withdrawal their members stayed for good (a
burst of cancelled calls held its 10 minutes' worth of marks in Redis until the next one); an
emptied set is then removed by Redis itself.

A partitioned queue on a Redis Cluster: a partition whose primary does not answer (stopped,
its host frozen or cut off) is renewed apart from the others, after them, and for
``ASIDE_S`` not at all, so that the heartbeats of the partitions on the other primaries do not
lapse with it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
from redis.exceptions import NoPermissionError

from broker.connections import REDIS_ERRORS, sync_client
from broker.keys import ModelKeys, parse_partitions
from broker.liveness import server_times_ms
from broker.logs import Every
from broker.partitions import split_bound

log = logging.getLogger("microbatch.heartbeat")

DEFAULT_TTL_S = 5.0
FORGET_AFTER_MS = 3_600_000
PRUNE_EVERY_S = 60.0  # the expired marks of the model's sets: pruned at most this often
ASIDE_S = 5.0  # a partition whose renewal failed (others' did not) is tried alone after this


class Heartbeats:
    """Renew and retire the heartbeats of a set of consumers of one model."""

    def __init__(
        self,
        redis_url: str,
        keys: ModelKeys,
        ttl_s: float = DEFAULT_TTL_S,
        queue_bound: tuple[int, int] | None = None,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.client = sync_client(redis_url, socket_timeout=2, socket_connect_timeout=2)
        # called before each partition's renewal tried alone: a renewal of many partitions
        # whose primaries are all silent takes seconds a partition, and the supervisor's loop
        # (whose `/live` says whether it goes round) is making progress meanwhile
        self._progress = progress or (lambda: None)
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)
        # (items per live worker, bytes): written with every renewal, so that the bound is back
        # within a second of a Redis that restarted without its data
        self.queue_bound = queue_bound
        self._warn = Every(10.0)  # during an outage: one line every 10 s, not one per renewal
        self._failing = False
        self._prune = Every(PRUNE_EVERY_S)
        # partitions set aside (their renewal failed where others' did not): when to try again
        self._aside: dict[int, float] = {}

    def renew(self, states: Mapping[str, Mapping[str, Any]]) -> bool:
        """Vouch for consumers for another TTL; False (logged) if Redis is unreachable.

        ``states`` maps each consumer to what `broker status` shows of it (its current batch);
        the heartbeat key holds it as JSON, with the expiry.
        """
        if not states:
            return True
        parts = [part for part in self.keys.each() if part.partition not in self._aside]
        try:
            try:
                self._renew(parts, states)
            except REDIS_ERRORS:
                if not self._may_set_aside(parts):
                    raise
                self._renew_each(parts, states)
            self._renew_aside(states)
        except REDIS_ERRORS as exc:
            self._failing = True
            if self._warn.due():
                refused = isinstance(exc, NoPermissionError)
                why = "Redis refused them to this user" if refused else "Redis unreachable?"
                log.warning("cannot renew heartbeats (%s): %s", why, exc)
            return False
        if self._failing:
            self._failing = False
            self._warn.reset()
            log.info("heartbeats renewed again")
        return True

    def _renew(self, parts: list[ModelKeys], states: Mapping[str, Mapping[str, Any]]) -> None:
        """Renew the heartbeats of these partitions (and with partition 0's the model's
        partition count and its pruning) in one pipeline."""
        if not parts:
            return
        consumers = list(states)
        # each partition's expiry by the clock of its node (that of its functions)
        clocks = server_times_ms(self.client, [part.consumers for part in parts])
        pipe = self.client.pipeline(transaction=False)
        count = self.keys.partitions
        for part, now_ms in zip(parts, clocks, strict=True):
            expires_ms = now_ms + self.ttl_ms
            pipe.zadd(part.consumers, dict.fromkeys(consumers, expires_ms))
            # forget consumers whose heartbeat lapsed long ago (their supervisor died)
            pipe.zremrangebyscore(part.consumers, "-inf", expires_ms - FORGET_AFTER_MS)
            for consumer, state in states.items():
                value = json.dumps({"expires_ms": expires_ms, **state})
                pipe.set(part.heartbeat(consumer), value, px=self.ttl_ms)
            if self.queue_bound is not None:
                items, size = (split_bound(n, count) for n in self.queue_bound)
                pipe.hset(part.queue_bound, mapping={"items": items, "bytes": size})
        # the supervisor's (a child's first one has no bound), with partition 0's
        if self.queue_bound is not None and parts[0].partition == 0:
            pipe.set(self.keys.partitions_key, count)
            if len(parts) == count and self._prune.due():
                self._prune_expired(pipe, clocks)
        pipe.execute()

    def _may_set_aside(self, parts: list[ModelKeys]) -> bool:
        """Whether a failed renewal of ``parts`` is worth trying partition by partition: a
        partitioned queue on a cluster, whose primaries may fail one at a time."""
        return len(parts) > 1 and isinstance(self.client, redis.cluster.RedisCluster)

    def _renew_each(self, parts: list[ModelKeys], states: Mapping[str, Mapping[str, Any]]) -> None:
        """Renew each partition alone, setting aside those whose renewal fails (tried alone
        again ASIDE_S later); raise the last failure if every one fails (an outage of all,
        which renew says at most every 10 s: nothing is set aside, nor said of each)."""
        failed: list[tuple[int, BaseException]] = []
        for part in parts:
            self._progress()
            try:
                self._renew([part], states)
            except REDIS_ERRORS as exc:
                if len(failed) + 1 == len(parts):
                    raise
                failed.append((part.partition, exc))
        again = time.monotonic() + ASIDE_S
        for partition, why in failed:
            self._aside[partition] = again
            log.warning(
                "cannot renew the heartbeats of partition %d of %s (%s): renewing the "
                "others, and it again every %g s", partition, self.keys.stream, why, ASIDE_S,
            )  # fmt: skip

    def _renew_aside(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Try each partition set aside whose time has come, alone: back with the others if
        renewed, else aside for ASIDE_S more."""
        now = time.monotonic()
        for partition in [k for k, again in self._aside.items() if again <= now]:
            self._progress()
            try:
                self._renew([self.keys.of(partition)], states)
            except REDIS_ERRORS:
                self._aside[partition] = time.monotonic() + ASIDE_S
                continue
            del self._aside[partition]
            log.info("heartbeats of partition %d of %s renewed again", partition, self.keys.stream)

    def _prune_expired(self, pipe: Any, clocks: list[int]) -> None:
        """Remove the members whose expiry (their score, ms) has passed from the sorted sets
        scored so: each lane's cancelled and answered sets (by its partition's clock) and
        the withdrawn set of the model (or pipeline). A score is when its member may go:
        callers already prune the cancelled and withdrawn sets so whenever they withdraw
        something. An answered mark goes 10 minutes after its item was answered, as its
        score says; a worker that takes over an entry open for longer than that computes
        such an item again, and its caller drops the duplicate reply."""
        for lane in self.keys.lanes():
            now_ms = clocks[lane.partition]
            pipe.zremrangebyscore(lane.cancelled, "-inf", now_ms)
            pipe.zremrangebyscore(lane.answered, "-inf", now_ms)
        pipe.zremrangebyscore(self.keys.withdrawn, "-inf", clocks[0])

    def retire(self, consumer: str) -> None:
        """Stop vouching for ``consumer`` (it exited)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for part in self.keys.each():
                pipe.zrem(part.consumers, consumer)
                pipe.delete(part.heartbeat(consumer))
            pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("cannot retire consumer %s: %s", consumer, exc)

    def warn_if_partitions_lowered(self) -> None:
        """Warn (once, at start) where this worker reads fewer partitions than the model's
        stored count while a live worker still reads the others or they hold entries: calls
        queued there meanwhile are answered only while a worker with the higher count lives."""
        try:
            stored = parse_partitions(self.client.get(self.keys.partitions_key))
            count = self.keys.partitions
            if stored <= count:
                return
            dropped = [
                ModelKeys(self.keys.model, self.keys.prefix, k, stored)
                for k in range(count, stored)
            ]
            streams = [lane.stream for part in dropped for lane in part.lanes()]
            queued = sum(int(self.client.xlen(stream)) for stream in streams)
            (now_ms,) = server_times_ms(self.client, [dropped[0].consumers])
            live = len(self.client.zrangebyscore(dropped[0].consumers, f"({now_ms}", "+inf"))
        except REDIS_ERRORS as exc:
            log.debug("cannot compare the partition counts: %s", exc)
            return
        if not live and not queued:
            return
        why = "a live worker reads them" if live else f"they hold {queued} entries"
        log.warning(
            "this worker serves %s with --partitions %d, but the model has %d partitions and "
            "%s: calls queued to partition(s) %s are answered only while a worker started with "
            "--partitions %d lives. Start every worker of a model with the same count; to lower "
            "it, drain the queue first (stop the callers, wait for `broker status` to show those "
            "partitions empty): docs/deployment.md, Partitioned queues",
            self.keys.model, count, stored, why, _span(count, stored - 1), stored,
        )  # fmt: skip

    def close(self) -> None:
        self.client.close()


def _span(first: int, last: int) -> str:
    """Partition numbers ``first`` to ``last`` as a log line says them."""
    return str(first) if first == last else f"{first}-{last}"
