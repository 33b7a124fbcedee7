"""When nothing consumes a model: what a client knows of its model's live workers.

A call waits for its workers only so long: once its model has had no live worker (see
:mod:`broker.liveness`) for ``grace_s`` seconds, the call fails with ``NoWorkers`` instead of
waiting in silence for its timeout. The client asks Redis at most once per ``CHECK_EVERY_S``,
and only while it has calls in flight of which one has waited that long (or while it already
knows of no live worker), so a served model costs nothing.

How long "no live worker" has lasted is counted from the latest of: when the last worker's
heartbeat lapsed (Redis knows), when this client began watching (the oldest call then in
flight was accepted), and when Redis last failed to answer the check, or answered it over
``CHECK_EVERY_S`` late (an outage or a stall says nothing about workers: their heartbeats lapse
while Redis cannot take the renewals). So a call made while a worker is starting gets the whole
grace period, and calls made once the model is known to have had none for that long fail at
once.
"""

from __future__ import annotations

import math

DEFAULT_GRACE_S = 10.0
"""Twice the workers' default heartbeat TTL (``worker start --heartbeat-ttl``, 5 s)."""
CHECK_EVERY_S = 1.0


class WorkerWatch:
    """What one client knows of its model's workers; times are its event loop's clock."""

    def __init__(self, grace_s: float = DEFAULT_GRACE_S) -> None:
        if not grace_s > 0:
            raise ValueError(f"the workers' grace period must be positive, not {grace_s!r}")
        self.grace_s = float(grace_s)
        self.dead_since: float | None = None  # no live worker since then, as far as known
        self.checked_at = -math.inf
        self.unknown_at = -math.inf  # when Redis last failed to answer a check

    def observe(self, now: float, lapsed_s: float | None, oldest_call_at: float) -> None:
        """Record a check: the model has had no live worker for ``lapsed_s`` seconds (0: one
        is live; None: none known); ``oldest_call_at`` is when the oldest call in flight was
        accepted."""
        if lapsed_s is not None and lapsed_s <= 0:
            self.dead_since = None
        elif self.dead_since is None or now - self.checked_at > self.grace_s:
            # A new watch: a worker may have come and gone unseen since an older one.
            start = max(oldest_call_at, self.unknown_at)
            self.dead_since = start if lapsed_s is None else max(start, now - lapsed_s)
        elif lapsed_s is not None:
            self.dead_since = max(self.dead_since, now - lapsed_s)
        self.checked_at = now

    def unreachable(self, now: float) -> None:
        """Record a check that Redis did not answer: nothing is known of the workers."""
        self.dead_since = None
        self.unknown_at = now

    def expired(self, now: float) -> bool:
        """Whether the model has had no live worker for longer than the grace period."""
        return self.dead_since is not None and now - self.dead_since > self.grace_s

    def known_dead(self, now: float) -> bool:
        """:meth:`expired`, as of a check recent enough to fail a new call at once."""
        return self.expired(now) and now - self.checked_at <= CHECK_EVERY_S

    def due(self, now: float, oldest_call_at: float) -> float:
        """Seconds until the next check is worth making (0: now)."""
        if self.dead_since is not None:  # known to be without workers: see if one came
            return max(0.0, self.checked_at + CHECK_EVERY_S - now)
        # While calls are young, a served model answers them: no check needed yet.
        return max(0.0, oldest_call_at + CHECK_EVERY_S - now, self.checked_at + CHECK_EVERY_S - now)
