"""Stop a process once the process that started it is gone.

A worker child whose ``worker start`` died without stopping it (SIGKILL, a signal it does not
handle) would otherwise serve on, unwatched and without heartbeats, holding its device and the
model's old code after a redeploy; a compat supervisor likewise outlives its Python program.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("microbatch.worker")

CHECK_EVERY_S = 1.0


def stop_when_orphaned(parent: int, what: str) -> None:
    """Send this process SIGTERM (its graceful stop) once its parent is no longer ``parent``
    (checked every second, on a daemon thread); ``what`` names the parent in the log line."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(CHECK_EVERY_S)
        log.warning("%s (pid %d) is gone: stopping", what, parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
