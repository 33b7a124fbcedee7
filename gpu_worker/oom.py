"""How many processes the kernel's out-of-memory killer has killed in this process's memory
cgroup (a container's): a worker process's SIGKILL is then told apart as the OOM killer's or
someone's ``kill -9``."""

from __future__ import annotations

from pathlib import Path


def oom_kills(proc: str = "/proc", cgroups: str = "/sys/fs/cgroup") -> int | None:
    """The OOM kill count of this process's memory cgroup (cgroup v2 ``memory.events``, v1
    ``memory.oom_control``), or None where neither can be read."""
    try:
        lines = Path(proc, "self", "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if controllers == "":  # the unified (v2) hierarchy, alone or beside v1 ones
            candidates = [
                Path(cgroups, relative, "memory.events"),
                Path(cgroups, "unified", relative, "memory.events"),
            ]
        elif "memory" in controllers.split(","):
            candidates = [Path(cgroups, "memory", relative, "memory.oom_control")]
        else:
            continue
        for candidate in candidates:
            count = _field(candidate, "oom_kill")
            if count is not None:
                return count
    return None


def _field(path: Path, name: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def sigkill_cause(kills_before: int | None, kills_after: int | None) -> str:
    """Who most likely sent a worker process SIGKILL, from the cgroup's OOM kill counts at its
    start and at its end."""
    if kills_before is None or kills_after is None:
        return "the kernel's out-of-memory killer sends it (see dmesg), or someone's kill -9"
    if kills_after > kills_before:
        return (
            "the out-of-memory killer: this container's memory cgroup counted "
            f"{kills_after - kills_before} OOM kill(s) meanwhile; give it more memory"
        )
    return (
        "not this container's out-of-memory killer (its memory cgroup counted no OOM kill "
        "meanwhile): someone's kill -9, or the host's OOM killer (see dmesg)"
    )
