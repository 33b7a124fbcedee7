"""Every Redis key and name microbatch uses, in one place.

All keys of one model under one prefix share the hash tag ``{prefix:model}``, so they live in
one Redis Cluster slot and the functions that take several of them work there. These templates
are copied verbatim into docs/protocol.md; change both together.

A worker replies only to keys of the inbox namespace of the model whose stream the entry came
from, ``INBOX_TEMPLATE`` with any non-empty ``client``: a reply can then never touch a
request stream, a dead-letter stream, a counter, another model's keys or another prefix's
(tenant's). A later pipeline of models gets the same rule under its own name (its names share
the model names' pattern and their namespace); a partition of a model's stream does not get
inboxes of its own, so replies stay in the model's namespace whichever partition the entry
came from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PREFIX = "default"
GROUP = "workers"

STREAM_TEMPLATE = "mb:{{{prefix}:{model}}}:requests"
DEAD_LETTER_TEMPLATE = "mb:{{{prefix}:{model}}}:dead"
INBOX_TEMPLATE = "mb:{{{prefix}:{model}}}:inbox:{client}"
HEARTBEAT_TEMPLATE = "mb:{{{prefix}:{model}}}:heartbeat:{consumer}"
CONSUMERS_TEMPLATE = "mb:{{{prefix}:{model}}}:consumers"
CANCELLED_TEMPLATE = "mb:{{{prefix}:{model}}}:cancelled"
QUEUED_BYTES_TEMPLATE = "mb:{{{prefix}:{model}}}:queued-bytes"
QUEUE_BOUND_TEMPLATE = "mb:{{{prefix}:{model}}}:queue-bound"

NAME_PATTERN = re.compile(r"^[a-z0-9_-]+$")
PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_name(name: str) -> str:
    """Return ``name`` if it is a valid model name (``[a-z0-9_-]+``), else raise ValueError."""
    if not NAME_PATTERN.match(name):
        raise ValueError(f"invalid model name {name!r}: use lower-case letters, digits, '_' or '-'")
    return name


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is valid (letters, digits, '_', '-', '.'), else raise ValueError."""
    if not PREFIX_PATTERN.match(prefix):
        raise ValueError(f"invalid prefix {prefix!r}: use letters, digits, '_', '-' or '.'")
    return prefix


@dataclass(frozen=True)
class ModelKeys:
    """The keys of one model under one prefix."""

    model: str
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_name(self.model)
        check_prefix(self.prefix)

    @property
    def stream(self) -> str:
        """The request stream: one entry per item."""
        return STREAM_TEMPLATE.format(prefix=self.prefix, model=self.model)

    @property
    def group(self) -> str:
        """The consumer group all workers of this model read through."""
        return GROUP

    @property
    def dead_letters(self) -> str:
        """The stream of entries that could not be answered normally."""
        return DEAD_LETTER_TEMPLATE.format(prefix=self.prefix, model=self.model)

    @property
    def consumers(self) -> str:
        """Sorted set of live consumers, scored by heartbeat expiry (ms since epoch)."""
        return CONSUMERS_TEMPLATE.format(prefix=self.prefix, model=self.model)

    @property
    def cancelled(self) -> str:
        """Sorted set of request ids whose callers gave up, scored by expiry (ms)."""
        return CANCELLED_TEMPLATE.format(prefix=self.prefix, model=self.model)

    @property
    def queued_bytes(self) -> str:
        """Counter of the data bytes queued in the stream (for the byte bound)."""
        return QUEUED_BYTES_TEMPLATE.format(prefix=self.prefix, model=self.model)

    @property
    def queue_bound(self) -> str:
        """Hash of the model's queue bound, written by its workers: ``items`` per live
        worker, ``bytes`` in all (0 or absent: no bound)."""
        return QUEUE_BOUND_TEMPLATE.format(prefix=self.prefix, model=self.model)

    def inbox(self, client: str) -> str:
        """The reply list of one client process (or one request, for simple callers)."""
        return INBOX_TEMPLATE.format(prefix=self.prefix, model=self.model, client=client)

    @property
    def reply_namespace(self) -> str:
        """What every reply key of this model starts with: ``inbox("")``."""
        return self.inbox("")

    def may_reply_to(self, key: str) -> bool:
        """Whether a worker of this model may reply to ``key``: an inbox of this model."""
        namespace = self.reply_namespace
        return len(key) > len(namespace) and key.startswith(namespace)

    def heartbeat(self, consumer: str) -> str:
        """The heartbeat key of one worker consumer (exists while the worker is vouched for)."""
        return HEARTBEAT_TEMPLATE.format(prefix=self.prefix, model=self.model, consumer=consumer)
