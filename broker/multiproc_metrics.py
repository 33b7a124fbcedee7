"""prometheus-client's multiprocess mode, as `worker start` and gunicorn's gateway use it.

Every process writes its samples to files in one directory (``PROMETHEUS_MULTIPROC_DIR``) and
one exporter serves them all, summed. prometheus-client picks its mode when it is first
imported, so the directory is set before that, in the parent, before any child starts: this
module imports it only inside its functions.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

ENV = "PROMETHEUS_MULTIPROC_DIR"


def fresh_directory(prefix: str) -> str:
    """Make an empty directory and point ``PROMETHEUS_MULTIPROC_DIR`` at it (for this process
    and the children it starts from now on)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    os.environ[ENV] = directory
    return directory


def registry() -> Any:
    """A registry that reads the samples of every process writing to the directory."""
    from prometheus_client import CollectorRegistry, multiprocess

    collected = CollectorRegistry()
    multiprocess.MultiProcessCollector(collected)  # type: ignore[no-untyped-call]
    return collected


def process_gone(pid: int) -> None:
    """Forget an exited process's live gauges (its counters keep counting in the sum)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
