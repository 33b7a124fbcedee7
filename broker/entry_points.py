"""The console scripts (pyproject.toml's ``[project.scripts]``): ``broker``, ``worker`` and
``gateway``.

Each command takes a few tenths of a second to import (typer, rich, redis-py, numpy; the
gateway's web framework): a Ctrl-C then printed the traceback of whatever import it stopped.
These functions import the command inside a handler, so that a Ctrl-C at any moment ends it
with exit status 130 and an empty line (the shell's prompt on a line of its own after ``^C``).
This module, and the packages it is in, import nothing else.
"""

from __future__ import annotations

import importlib
import sys

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command a Ctrl-C ended


def broker() -> None:
    """``broker``: look at queues and workers, manage dead letters."""
    _run("broker.cli")


def worker() -> None:
    """``worker``: serve a model."""
    _run("gpu_worker.cli")


def gateway() -> None:
    """``gateway``: serve models over HTTP."""
    _run("web_gateway.cli")


def _run(module: str) -> None:
    try:
        importlib.import_module(module).main()
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        sys.exit(INTERRUPTED)
