"""The product on namespace hosts: `worker start`, `gateway start`, the load generator, and the
figures the multi-host tests print (sent, answered, wrong, lost, errors by type, recovery)."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

from broker import codec
from broker.keys import ModelKeys
from broker.liveness import live_consumers
from tests.hosts.netns import Host
from tests.hosts.redis_topologies import RedisTopology, wait_for
from tests.models import DELAY_ENV, TAG_ENV, host_tagged_expected

MODEL = "tests.models:HostTagged"
MODEL_NAME = "hosttagged"
GATEWAY_PORT = 8000
CALLER_TAG = 7.0  # the second number of every input: [call index, CALLER_TAG]


def start_worker(
    host: Host, redis_url: str, prefix: str, tag: int, *args: str, batch_delay: float = 0.0
) -> subprocess.Popen[bytes]:
    """`worker start` of :class:`tests.models.HostTagged` on ``host``, its answers tagged."""
    env: dict[str, str | None] = {TAG_ENV: str(tag), DELAY_ENV: str(batch_delay)}
    return host.python(
        "gpu_worker.cli", "start", "--model", MODEL, "--redis", redis_url, "--prefix", prefix,
        *args, env=env, log="worker",
    )  # fmt: skip


def start_gateway(host: Host, redis_url: str, prefix: str, *args: str) -> str:
    """`gateway start` on ``host`` (all addresses, one gunicorn worker); its base URL."""
    env: dict[str, str | None] = {
        k: None for k in os.environ if k.startswith("MICROBATCH_GATEWAY_")
    }
    env["MICROBATCH_GATEWAY_LOG_LEVEL"] = "warning"
    host.python(
        "web_gateway.cli", "start", "--model", MODEL, "--redis", redis_url, "--prefix", prefix,
        "--host", "0.0.0.0", "--port", str(GATEWAY_PORT), "--workers", "1", *args,
        env=env, log="gateway",
    )  # fmt: skip
    return f"http://{host.addr}:{GATEWAY_PORT}"


def wait_for_workers(
    topology: RedisTopology, prefix: str, count: int, timeout: float = 90.0
) -> None:
    """Until ``count`` workers are vouched for and the consumer group exists."""
    keys = ModelKeys(MODEL_NAME, prefix)

    def ready(client: Any) -> bool:
        groups = client.xinfo_groups(keys.stream) if client.exists(keys.stream) else []
        return len(live_consumers(client, keys)) >= count and bool(groups)

    wait_for(lambda: topology.admin(ready), timeout, f"{count} live workers", every=0.2)


def wait_for_gateway(base: str, via: Host, timeout: float = 60.0) -> None:
    """Until the gateway says the model is ready (Redis answers, a live worker consumes it)."""
    url = f"{base}/v2/models/{MODEL_NAME}/ready"

    def ready() -> bool:
        return httpx.get(url, timeout=2).status_code == 200

    wait_for(lambda: via.call(ready), timeout, f"gateway {base} ready", every=0.2)


def worker_consumers(topology: RedisTopology, prefix: str, host: Host) -> list[str]:
    """The consumers (worker processes) of the model that run on ``host``: a consumer's name
    ends with its pid, and ``host`` knows its pids."""
    keys = ModelKeys(MODEL_NAME, prefix)
    pids = {str(pid) for pid in host.pids()}

    def names(client: Any) -> list[str]:
        consumers = client.xinfo_consumers(keys.stream, keys.group)
        return [c["name"].decode() for c in consumers]

    return [name for name in topology.admin(names) if name.rsplit("-", 1)[1] in pids]


def held_entries(topology: RedisTopology, prefix: str, consumers: list[str]) -> dict[str, int]:
    """The entries these consumers hold (delivered, unanswered): entry id -> call index."""
    keys = ModelKeys(MODEL_NAME, prefix)

    def held(client: Any) -> dict[str, int]:
        out = {}
        for consumer in consumers:
            pending = client.xpending_range(
                keys.stream, keys.group, "-", "+", 10_000, consumername=consumer
            )
            for entry in pending:
                entry_id = entry["message_id"]
                for _, fields in client.xrange(keys.stream, entry_id, entry_id):
                    out[entry_id.decode()] = int(codec.decode(fields[b"data"])[0])
        return out

    return topology.admin(held)


def held_inputs(topology: RedisTopology, prefix: str, consumers: list[str]) -> list[int]:
    """The call indices of the entries these consumers hold."""
    return sorted(held_entries(topology, prefix, consumers).values())


def still_pending(topology: RedisTopology, prefix: str, entry_ids: list[str]) -> list[str]:
    """Those of ``entry_ids`` that some consumer still holds (not yet answered and acked)."""
    keys = ModelKeys(MODEL_NAME, prefix)

    def pending(client: Any) -> list[str]:
        if not client.exists(keys.stream):
            return []
        held = client.xpending_range(keys.stream, keys.group, "-", "+", 100_000)
        ids = {entry["message_id"].decode() for entry in held}
        return [entry_id for entry_id in entry_ids if entry_id in ids]

    return topology.admin(pending)


def queue_state(topology: RedisTopology, prefix: str) -> tuple[int, int, int]:
    """(stream length, pending entries, dead letters) of the model."""
    keys = ModelKeys(MODEL_NAME, prefix)

    def state(client: Any) -> tuple[int, int, int]:
        if not client.exists(keys.stream):
            return 0, 0, int(client.xlen(keys.dead_letters))
        pending = client.xpending(keys.stream, keys.group)["pending"]
        return int(client.xlen(keys.stream)), int(pending), int(client.xlen(keys.dead_letters))

    return topology.admin(state)


class Load:
    """The load generator (:mod:`tests.hosts.load`) running on a client host."""

    def __init__(
        self, host: Host, redis_url: str, prefix: str, targets: list[str], *, rate: float,
        seconds: float, timeout: float, name: str = "load",
    ) -> None:  # fmt: skip
        workdir = host.network.workdir
        self.out = workdir / f"{name}.json"
        self.started_path = workdir / f"{name}.started"
        self.bound = seconds + timeout + 30  # the run's own bound, and then some
        config = {
            "redis_url": redis_url, "prefix": prefix, "model": MODEL_NAME, "targets": targets,
            "rate": rate, "seconds": seconds, "timeout": timeout, "tag": CALLER_TAG,
            "started_path": str(self.started_path), "out": str(self.out),
        }  # fmt: skip
        config_path = workdir / f"{name}-config.json"
        config_path.write_text(json.dumps(config))
        self.process = host.python("tests.hosts.load", str(config_path), log=name)

    def wait_started(self, timeout: float = 60.0) -> float:
        """The monotonic time of its first call."""
        wait_for(self.started_path.exists, timeout, "the load to start", every=0.05)
        return float(json.loads(self.started_path.read_text()))

    def result(self) -> dict[str, Any]:
        """Wait for it to finish (bounded); its results."""
        code = self.process.wait(self.bound)
        if code != 0 or not self.out.exists():
            raise RuntimeError(f"the load generator failed (exit code {code})")
        results: dict[str, Any] = json.loads(self.out.read_text())
        return results


def is_right(call: dict[str, Any], tags: set[float]) -> bool:
    """The call got the answer of its own input, computed by one of ``tags``' hosts."""
    output = call["output"]
    return (
        call["error"] is None
        and isinstance(output, list)
        and len(output) == 3
        and output[:2] == host_tagged_expected([call["i"], CALLER_TAG])
        and output[2] in tags
    )


@dataclass
class Figures:
    """What the callers of one run got."""

    sent: int
    answered: int
    wrong: int
    lost: int
    errors: dict[str, int]
    duplicate_replies: int
    recovery_s: float | None
    extra: dict[str, Any]

    def line(self, name: str) -> str:
        shown = {
            "sent": self.sent, "answered": self.answered, "wrong": self.wrong,
            "lost": self.lost, "errors": self.errors, "dup_replies": self.duplicate_replies,
            "recovery_s": self.recovery_s, **self.extra,
        }  # fmt: skip
        parts = [
            f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
            for key, value in shown.items()
        ]
        return f"FIGURES {name}: " + " ".join(parts)


def figures(
    name: str, results: dict[str, Any], tags: set[float], fault_at: float | None = None,
    **extra: Any,
) -> Figures:  # fmt: skip
    """Count a load run's outcomes and print one FIGURES line.

    *lost*: ended with neither an answer nor a typed error (hung, or an untyped failure);
    *wrong*: an answer that is not its input's; *recovery_s*: from the fault to the first right
    answer after it; *dup_replies*: duplicate replies the Streamer's inbox got and dropped.
    """
    calls = results["calls"]
    errors = Counter(c["error"] for c in calls if c["error"] is not None)
    lost = sum(n for error, n in errors.items() if error == "hung" or error.startswith("untyped"))
    typed = {error: n for error, n in sorted(errors.items()) if error != "hung"}
    right = [c for c in calls if is_right(c, tags)]
    recovery = None
    if fault_at is not None:
        after = [c["done"] for c in right if c["done"] > fault_at]
        recovery = min(after) - fault_at if after else float("inf")
    numbers = Figures(
        sent=len(calls), answered=len(right),
        wrong=sum(1 for c in calls if c["error"] is None and not is_right(c, tags)),
        lost=lost, errors=typed, duplicate_replies=int(results.get("duplicate_replies", 0)),
        recovery_s=recovery, extra=extra,
    )  # fmt: skip
    print("\n" + numbers.line(name))
    return numbers


def by_index(results: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {call["i"]: call for call in results["calls"]}
