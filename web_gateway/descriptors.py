"""The file descriptors a gateway process may open: enough for its connection cap."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("microbatch.gateway")

# Descriptors besides its clients' connections: listening sockets, logs, the metrics files,
# and its Redis connections (one per model, and one per partition whose replies it reads).
RESERVE = 256
PER_MODEL = 4


def raise_descriptor_limit(max_connections: int, models: int) -> None:
    """Raise this process's soft limit of open files (``ulimit -n``) to its hard limit where
    it is below what ``max_connections`` clients and ``models`` need; say so where the hard
    limit is below that too. (Past its descriptors a process cannot answer 503: libuv accepts
    each new connection and closes it at once, and no Redis connection can be opened.)"""
    needed = max_connections + RESERVE + PER_MODEL * models
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    raised = needed if hard == resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    except (OSError, ValueError):
        raised = soft
    if raised < needed:
        log.warning(
            "this gateway process may open only %d files (ulimit -n) where --max-connections %d "
            "needs about %d: past them new connections are reset unanswered and Redis "
            "connections fail; raise the limit (ulimit -n, systemd's LimitNOFILE, docker's "
            "--ulimit nofile) or lower --max-connections",
            raised,
            max_connections,
            needed,
        )
