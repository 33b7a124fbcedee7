"""Every Redis key and name microbatch uses, in one place.

All keys of one model under one prefix share the hash tag ``{prefix:model}``, so they live in
one Redis Cluster slot and the functions that take several of them work there. These templates
are copied verbatim into docs/protocol.md; change both together.

A model's queue may be partitioned over N streams (``PARTITIONS_TEMPLATE`` holds N; absent: 1).
Partition 0 is the model's own keys; partition k >= 1 has the same keys under its own hash tag
``{prefix:model:pk}`` (``TAG_TEMPLATE``), so a cluster can place it on another shard: its stream,
dead letters, cancelled set, queued-bytes counter, and the copies of the model's queue bound,
consumers and heartbeats that its functions read in its slot. Model names and prefixes hold no
``:``, so no partition's tag is another model's.

A worker replies only to keys of an inbox namespace of the model whose stream the entry came
from, ``INBOX_TEMPLATE`` with any non-empty ``client``: a reply can then never touch a
request stream, a dead-letter stream, a counter, another model's keys or another prefix's
(tenant's). Partition k >= 1 has an inbox namespace of its own, under its tag (in its slot,
so a worker writes a reply and acknowledges its entry on one node); a worker may reply to an
entry of partition k in that namespace or in the model's own (partition 0's), never in
another partition's. A later pipeline of models gets the same rule under its own name (its
names share the model names' pattern and their namespace).

A pipeline of models (``gpu_worker.pipeline``) is served under its own name: its first stage
consumes the pipeline's own keys (so callers queue to it exactly as to a model), and each later
stage has keys of its own under the name ``<pipeline>.<stage>`` (``STAGE_TEMPLATE``; ``.`` is in
no model name, so no stage's keys are a model's), in a slot of its own. Every stage replies only
to the pipeline's inboxes, ``INBOX_TEMPLATE`` with the pipeline's name.

Each partition has two priority levels (``LEVELS``): ``normal`` (level 0, the keys above) and
``high`` (level 1). The high level of a partition has its own stream, dead letters, cancelled
set and queued-bytes counter: the normal level's keys with ``LEVEL_SUFFIX`` appended, in the
same hash slot (so every function still takes keys of one slot); it shares the partition's
queue bound, consumers and heartbeats. A stream of the queue (one level of one partition) is a
*lane*, numbered ``partition + level * MAX_PARTITIONS``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

DEFAULT_PREFIX = "default"
GROUP = "workers"

MAX_PARTITIONS = 256

STREAM_TEMPLATE = "mb:{{{prefix}:{model}}}:requests"
DEAD_LETTER_TEMPLATE = "mb:{{{prefix}:{model}}}:dead"
INBOX_TEMPLATE = "mb:{{{prefix}:{model}}}:inbox:{client}"
HEARTBEAT_TEMPLATE = "mb:{{{prefix}:{model}}}:heartbeat:{consumer}"
CONSUMERS_TEMPLATE = "mb:{{{prefix}:{model}}}:consumers"
CANCELLED_TEMPLATE = "mb:{{{prefix}:{model}}}:cancelled"
QUEUED_BYTES_TEMPLATE = "mb:{{{prefix}:{model}}}:queued-bytes"
PACKED_ITEMS_TEMPLATE = "mb:{{{prefix}:{model}}}:packed-items"
ANSWERED_TEMPLATE = "mb:{{{prefix}:{model}}}:answered"
QUEUE_BOUND_TEMPLATE = "mb:{{{prefix}:{model}}}:queue-bound"
PARTITIONS_TEMPLATE = "mb:{{{prefix}:{model}}}:partitions"
# Of a pipeline (under its own name): request ids its callers withdrew, and fan-out joins.
WITHDRAWN_TEMPLATE = "mb:{{{prefix}:{model}}}:withdrawn"
JOIN_TEMPLATE = "mb:{{{prefix}:{model}}}:join:{length}:{client}:{request}"

# Partition k >= 1 of a model: every template above but PARTITIONS_TEMPLATE, WITHDRAWN_TEMPLATE
# and JOIN_TEMPLATE, with this in place of "{prefix}:{model}" (partition 0 is the model's own
# keys).
TAG_TEMPLATE = "{prefix}:{model}:p{partition}"

# The name whose keys stage ``stage`` (not the first) of pipeline ``pipeline`` consumes.
STAGE_TEMPLATE = "{pipeline}.{stage}"
# The priority levels, lowest first: a level's number is its index. Every worker reads both.
LEVELS = ("normal", "high")
NORMAL, HIGH = 0, 1
# Appended to a partition's stream, dead-letter, cancelled, answered, queued-bytes and
# packed-items keys for its high level (the normal level's keys have none).
LEVEL_SUFFIX = ":high"

# Matched whole (fullmatch): with re.match, "$" also matches before a trailing newline, and a
# name or prefix read from a file ending in one ("tenant\n") was taken.
NAME_PATTERN = re.compile(r"[a-z0-9_-]+")
PREFIX_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
STAGE_KEYS_PATTERN = re.compile(r"[a-z0-9_-]+\.[a-z0-9_-]+")


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid model name (``[a-z0-9_-]+``), else raise ValueError."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"invalid model name {name!r}: use lower-case letters, digits, '_' or '-'")
    return name


def check_keys_name(name: str) -> str:
    """Return ``name`` if keys may be named so: a model's (or pipeline's) name, or a later
    stage's ``<pipeline>.<stage>`` (``STAGE_TEMPLATE``); else raise ValueError."""
    if not STAGE_KEYS_PATTERN.fullmatch(name):
        check_name(name)
    return name


def stage_keys_name(pipeline: str, stage: str, first: bool) -> str:
    """The name whose keys a pipeline's stage consumes: the pipeline's for its first stage."""
    check_name(pipeline)
    check_name(stage)
    return pipeline if first else STAGE_TEMPLATE.format(pipeline=pipeline, stage=stage)


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is valid (letters, digits, '_', '-', '.'), else raise ValueError."""
    if not PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(f"invalid prefix {prefix!r}: use letters, digits, '_', '-' or '.'")
    return prefix


def check_partitions(count: int) -> int:
    """Return ``count`` if it is a valid partition count (1 to MAX_PARTITIONS), else raise."""
    if not 1 <= count <= MAX_PARTITIONS:
        raise ValueError(f"a model's queue has 1 to {MAX_PARTITIONS} partitions, not {count}")
    return count


def parse_partitions(value: bytes | str | None) -> int:
    """The partition count stored with a model (``PARTITIONS_TEMPLATE``): 1 when absent, and
    when unreadable or out of range (partition 0, which every worker reads, is always safe)."""
    try:
        count = int(value or 1)
    except ValueError:
        return 1
    return count if 1 <= count <= MAX_PARTITIONS else 1


@dataclass(frozen=True)
class ModelKeys:
    """The keys of one model under one prefix: of its queue's partition ``partition`` (0: the
    model's own keys) out of ``partitions``."""

    model: str
    prefix: str = DEFAULT_PREFIX
    partition: int = 0
    partitions: int = 1
    level: int = NORMAL

    def __post_init__(self) -> None:
        check_keys_name(self.model)
        check_prefix(self.prefix)
        check_partitions(self.partitions)
        if not 0 <= self.partition < self.partitions:
            raise ValueError(f"partition {self.partition} of {self.partitions} does not exist")
        if not 0 <= self.level < len(LEVELS):
            raise ValueError(f"priority level {self.level} does not exist")

    def _format(self, template: str, **more: str) -> str:
        model = self.model if self.partition == 0 else f"{self.model}:p{self.partition}"
        return template.format(prefix=self.prefix, model=model, **more)

    def _leveled(self, template: str) -> str:
        """A key of this level: the partition's, with the high level's suffix."""
        key = self._format(template)
        return key + LEVEL_SUFFIX if self.level == HIGH else key

    @cached_property
    def lane(self) -> int:
        """The number of this stream of the queue: ``partition + level * MAX_PARTITIONS``."""
        return self.partition + self.level * MAX_PARTITIONS

    @property
    def priority(self) -> str:
        """This level's name (``LEVELS``)."""
        return LEVELS[self.level]

    @cached_property
    def tag(self) -> str:
        """The hash tag of this partition's keys (without braces)."""
        if self.partition == 0:
            return f"{self.prefix}:{self.model}"
        return TAG_TEMPLATE.format(prefix=self.prefix, model=self.model, partition=self.partition)

    def of(self, lane: int) -> ModelKeys:
        """The keys of another lane of the same queue (a partition's number is its normal
        level's lane)."""
        if lane == self.lane:
            return self
        # Remembered: the batch loop asks for the same few lanes' keys for every batch. (A
        # frozen dataclass's __dict__ is written directly, as cached_property does.)
        others: dict[int, ModelKeys] = self.__dict__.setdefault("_others", {})
        keys = others.get(lane)
        if keys is None:
            partition, level = lane % MAX_PARTITIONS, lane // MAX_PARTITIONS
            keys = ModelKeys(self.model, self.prefix, partition, self.partitions, level)
            others[lane] = keys
        return keys

    def at(self, level: int) -> ModelKeys:
        """The keys of this partition at another priority level."""
        return self.of(self.partition + level * MAX_PARTITIONS)

    def spread(self, partitions: int) -> ModelKeys:
        """Partition 0's keys (normal level) of this model's queue spread over ``partitions``."""
        return ModelKeys(self.model, self.prefix, 0, partitions)

    def each(self) -> list[ModelKeys]:
        """The keys of every partition (their normal level), 0 first."""
        return [self.of(k) for k in range(self.partitions)]

    def lanes(self) -> list[ModelKeys]:
        """The keys of every lane (each level of each partition): the normal level's
        partitions first, 0 first, then the high level's."""
        return [
            self.of(k + level * MAX_PARTITIONS)
            for level in range(len(LEVELS))
            for k in range(self.partitions)
        ]

    @cached_property
    def stream(self) -> str:
        """The request stream: one entry per item."""
        return self._leveled(STREAM_TEMPLATE)

    @property
    def group(self) -> str:
        """The consumer group all workers of this model read through."""
        return GROUP

    @cached_property
    def dead_letters(self) -> str:
        """The stream of entries that could not be answered normally."""
        return self._leveled(DEAD_LETTER_TEMPLATE)

    @property
    def consumers(self) -> str:
        """Sorted set of live consumers, scored by heartbeat expiry (ms since epoch)."""
        return self._format(CONSUMERS_TEMPLATE)

    @cached_property
    def cancelled(self) -> str:
        """Sorted set of request ids whose callers gave up, scored by expiry (ms)."""
        return self._leveled(CANCELLED_TEMPLATE)

    @cached_property
    def queued_bytes(self) -> str:
        """Counter of the data bytes queued in the stream (for the byte bound)."""
        return self._leveled(QUEUED_BYTES_TEMPLATE)

    @cached_property
    def packed_items(self) -> str:
        """Counter of the items the stream holds beyond one per entry (the sum of ``n - 1``
        over its multi-item entries), for the item bound: items = XLEN + this."""
        return self._leveled(PACKED_ITEMS_TEMPLATE)

    @cached_property
    def answered(self) -> str:
        """Sorted set of the answered items (``<entry id>#<i>``) of multi-item entries whose
        other items are not answered yet, scored by expiry (ms): what a worker taking such an
        entry over does not compute again."""
        return self._leveled(ANSWERED_TEMPLATE)

    @property
    def queue_bound(self) -> str:
        """Hash of the queue bound (of this partition), written by the model's workers:
        ``items`` per live worker, ``bytes`` in all (0 or absent: no bound)."""
        return self._format(QUEUE_BOUND_TEMPLATE)

    @property
    def partitions_key(self) -> str:
        """The model's partition count (a string; absent: 1), in partition 0's slot."""
        return PARTITIONS_TEMPLATE.format(prefix=self.prefix, model=self.model)

    @property
    def pipeline(self) -> str:
        """The name whose inboxes replies go to: the model's, or for a pipeline's later stage
        (``<pipeline>.<stage>``) the pipeline's."""
        return self.model.partition(".")[0]

    @property
    def withdrawn(self) -> str:
        """Sorted set of the request ids that callers of this pipeline (or model) withdrew,
        scored by expiry (ms): what a pipeline's later stages skip."""
        return WITHDRAWN_TEMPLATE.format(prefix=self.prefix, model=self.pipeline)

    def join(self, client: str, request_id: str) -> str:
        """The hash in which a fan-out pipeline's branches leave their outputs for one request
        (``client``: its reply key's part after the inbox namespace). The client part's length
        comes first, so that no two (client, request id) pairs share a hash, whatever ``:``
        either holds."""
        return JOIN_TEMPLATE.format(
            prefix=self.prefix,
            model=self.pipeline,
            length=len(client),
            client=client,
            request=request_id,
        )

    def inbox(self, client: str) -> str:
        """The reply list of one client process (or one request, for simple callers) in this
        partition's slot: the model's own for partition 0 (a pipeline stage's: the
        pipeline's), under the partition's tag for partition k >= 1."""
        if self.partition == 0:
            return INBOX_TEMPLATE.format(prefix=self.prefix, model=self.pipeline, client=client)
        return self._format(INBOX_TEMPLATE, client=client)

    @property
    def reply_namespace(self) -> str:
        """What every reply key of this partition's inboxes starts with: ``inbox("")``."""
        return self.inbox("")

    @cached_property
    def reply_namespaces(self) -> tuple[str, ...]:
        """The inbox namespaces a worker may reply to for an entry of this partition: its
        own, and for partition k >= 1 the model's (partition 0's) too."""
        if self.partition == 0:
            return (self.reply_namespace,)
        return (self.reply_namespace, self.of(0).reply_namespace)

    def may_reply_to(self, key: str) -> bool:
        """Whether a worker may reply to ``key`` for an entry of this partition: an inbox of
        the partition's namespace or of the model's, nothing else."""
        return any(
            len(key) > len(namespace) and key.startswith(namespace)
            for namespace in self.reply_namespaces
        )

    def heartbeat(self, consumer: str) -> str:
        """The heartbeat key of one worker consumer (exists while the worker is vouched for)."""
        return self._format(HEARTBEAT_TEMPLATE, consumer=consumer)
