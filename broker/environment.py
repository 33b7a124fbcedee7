"""Variables of a settings prefix that name no setting: a misspelt setting is ignored, and
should not be so in silence. The commands print them; the client warns of them."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping, MutableMapping

# Variables of the compose files (docker-compose*.yml, .env.example) that share a command's
# prefix: compose reads them, never a command, so they are not typos of its settings.
COMPOSE_VARIABLES = frozenset(
    {
        "MICROBATCH_GATEWAY_EXTRAS",
        "MICROBATCH_GATEWAY_IMAGE",
        "MICROBATCH_WORKER_CPU_IMAGE",
        "MICROBATCH_WORKER_CPU_WORKERS",
        "MICROBATCH_WORKER_EXTRAS",
        "MICROBATCH_WORKER_IMAGE",
    }
)

# What Kubernetes puts in the environment of every pod for each Service of its namespace: a
# Service named microbatch-gateway gives MICROBATCH_GATEWAY_SERVICE_HOST and the like.
SERVICE_LINK = re.compile(
    r".*_SERVICE_HOST|.*_SERVICE_PORT(_[A-Z0-9_]+)?|.*_PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?"
)
SERVICE_LINK_URL = re.compile(r"(tcp|udp|sctp)://")


def is_service_link(value: str) -> bool:
    """Whether a variable's value is a Kubernetes service link's address (``tcp://ip:port``):
    a Service named after a command (``microbatch-gateway``) gives ``MICROBATCH_GATEWAY_PORT``
    such a value, which names no setting's value however its name reads."""
    return bool(SERVICE_LINK_URL.match(value))


def drop_service_links(prefix: str, environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Remove from the environment (this process's by default) the variables of ``prefix``
    whose values are service links' addresses, which a command (click) would take as its
    options' values and refuse; return their names, in order."""
    target = os.environ if environ is None else environ
    dropped = sorted(
        name for name, value in target.items() if name.startswith(prefix) and is_service_link(value)
    )
    for name in dropped:
        del target[name]
    return dropped


def unknown_variables(
    prefix: str,
    known: Iterable[str],
    environ: Mapping[str, str] | None = None,
    case_sensitive: bool = True,
) -> list[tuple[str, str]]:
    """``(variable, hint)`` for each variable of ``prefix`` in ``environ`` (the process's
    environment by default) that is none of ``known``, in name order; the hint names the
    closest setting (or is empty). Kubernetes' service links and compose's own variables
    share the prefix and are left out. Not ``case_sensitive``: names are compared in upper
    case, as a reader that ignores case reads them (``known`` are given in upper case)."""
    environ = os.environ if environ is None else environ
    names = sorted(set(known))
    found = []
    for variable, value in sorted(environ.items()):
        name = variable if case_sensitive else variable.upper()
        if not name.startswith(prefix) or name in names or name in COMPOSE_VARIABLES:
            continue
        if SERVICE_LINK.fullmatch(name) or is_service_link(value):
            continue
        if name.endswith(("_REDIS", "_REDIS_URL")) and f"{prefix}REDIS_URL" not in names:
            hint = " (--redis reads REDIS_URL)"
        else:
            # compared without the prefix, which every name shares
            settings = [known_name[len(prefix) :] for known_name in names]
            close = difflib.get_close_matches(name[len(prefix) :], settings, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        found.append((variable, hint))
    return found
