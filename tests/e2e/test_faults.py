"""Fault injection: real redis-server, real `worker start` processes, real signals.

Each test breaks one thing (a worker, the model, Redis, a caller, the load) and checks the
promise of docs/reliability.md: every request ends in exactly one result or typed error,
nothing is silently dropped. Each prints one ``FIGURES`` line (sent,
answered, errors by type, lost, duplicates, recovery time, ...); docs/reliability.md carries them
in its table. Run with ``-s`` to see them::

    .venv/bin/python -m pytest -q -s tests/e2e/test_faults.py

Definitions used in the figures:

- *answered*: the caller got a result, and it is the result of its own input;
- *errors*: typed errors the callers got, by type;
- *lost*: calls that ended with neither (a hang past the deadline, or an untyped failure);
- *wrong*: results that belong to another input;
- *duplicates*: replies that reached a caller's inbox for a request already answered (the
  client drops them, so no caller ever sees two answers; a caller that reads its own reply key
  would see them, so they must be 0 wherever no data was lost);
- *computed twice*: items the model computed more than once (allowed: at-least-once).

Timing bounds are generous (the suite runs on 2 shared cores); the measured figure is printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import nan
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from broker import Streamer, codec
from broker.client import ClientCore
from broker.devserver import RedisServer
from broker.errors import MicrobatchError
from broker.keys import ModelKeys
from broker.liveness import alive_consumers, live_consumers
from broker.protocol import Reply, decode_reply, request_fields
from gpu_worker.config import AUTO_QUEUE_BATCHES
from gpu_worker.oom import oom_kills, sigkill_cause
from tests.conftest import ROOT, stop_process, wait_for_consumers, wait_until
from tests.e2e.fault_models import BATCH_SLEEP_ENV, FIXED_ENV, GIL_SECONDS_ENV, RECORD_ENV
from tests.e2e.test_gateway import check_error, gateway_process

pytestmark = pytest.mark.slow  # real processes killed and restarted: minutes in all

FAULTY = "tests.e2e.fault_models:Faulty"
PENDING_FAULTY = "tests.e2e.fault_models:PendingFaulty"  # predict returns a Future
GILHOG = "tests.e2e.fault_models:GilHog"
SLEEPER = "tests.e2e.fault_models:Sleeper"


def model_name(model: str) -> str:
    """The name a fault model serves under (its class name, lower-cased)."""
    return model.rsplit(":", 1)[1].lower()


# -- processes ------------------------------------------------------------------------------------
@contextmanager
def worker(
    redis_url: str,
    model: str,
    prefix: str,
    log: Path,
    *args: str,
    env: dict[str, str] | None = None,
    consumers: int = 1,
) -> Iterator[subprocess.Popen[bytes]]:
    """`worker start` as a real process, its output in ``log``; waits until ``consumers`` live
    consumers of the model exist (counting those of other workers), SIGTERM afterwards."""
    command = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", model]
    command += ["--redis", redis_url, "--prefix", prefix, *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        keys = ModelKeys(model_name(model), prefix)
        try:
            wait_for_consumers(redis_url, keys, consumers, timeout=60)
            # a worker is vouched for a moment before it creates the consumer group
            wait_until(lambda: group_exists(redis_url, keys), 30, "the consumer group")
        except (TimeoutError, AssertionError):
            sys.stderr.write(log.read_text(errors="replace")[-4000:])
            raise
        yield process
    finally:
        stop_process(process)


def group_exists(redis_url: str, keys: ModelKeys) -> bool:
    """Whether the model's consumer group exists (a worker has started its batch loop)."""
    client = redis.Redis.from_url(redis_url)
    try:
        return any(
            group["name"].decode() == keys.group for group in client.xinfo_groups(keys.stream)
        )
    except redis.ResponseError:  # no stream yet
        return False
    finally:
        client.close()


def child_pids(pid: int) -> list[int]:
    """The direct children of a process (what `pgrep -P` prints), from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry))
    return sorted(children)


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of some processes together."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def read_records(directory: Path, kind: str) -> dict[int, list[Any]]:
    """Records of the fault models, per worker pid."""
    out: dict[int, list[Any]] = {}
    for path in directory.glob(f"{kind}-*.jsonl"):
        pid = int(path.stem.rsplit("-", 1)[1])
        out[pid] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def computed(directory: Path) -> Counter[Any]:
    """How many times each item was computed, over all worker processes."""
    counts: Counter[Any] = Counter()
    for items in read_records(directory, "items").values():
        counts.update(json.dumps(item) if not isinstance(item, str) else item for item in items)
    return counts


def batches_with(directory: Path, item: str) -> list[list[Any]]:
    """Every batch predict was given that contained ``item``."""
    return [
        batch
        for batches in read_records(directory, "batches").values()
        for batch in batches
        if item in batch
    ]


def queue_state(client: redis.Redis, keys: ModelKeys) -> tuple[int, int, int]:
    """(stream length, pending entries, dead letters) of a model."""
    pending = (
        client.xpending(keys.stream, keys.group)["pending"] if client.exists(keys.stream) else 0
    )
    return int(client.xlen(keys.stream)), int(pending), int(client.xlen(keys.dead_letters))


def queued_items(client: redis.Redis, keys: ModelKeys) -> int:
    """Items in a model's stream: its entries, and what multi-item entries hold beyond their
    first (docs/protocol.md, section 5.1)."""
    return int(client.xlen(keys.stream)) + int(client.get(keys.packed_items) or 0)


def pending_items(client: redis.Redis, keys: ModelKeys) -> int:
    """Items of the entries delivered to a worker and not acknowledged."""
    rows: Any = client.xpending_range(keys.stream, keys.group, "-", "+", 10_000)
    total = 0
    for row in rows:
        entry_id = row["message_id"]
        found: Any = client.xrange(keys.stream, entry_id, entry_id)
        total += int(found[0][1].get(b"n", 1)) if found else 1
    return total


# -- callers -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one call got."""

    item: Any
    sent: float  # time.monotonic()
    done: float = float("inf")
    result: Any = None
    error: str | None = None  # the typed error's class name
    message: str = ""

    @property
    def latency(self) -> float:
        return self.done - self.sent


@dataclass
class ReplyCounter:
    """Counts every reply that reaches a client's inbox, by request id (duplicates included)."""

    seen: Counter[str] = field(default_factory=Counter)

    @property
    def duplicates(self) -> int:
        return sum(count - 1 for count in self.seen.values() if count > 1)


@pytest.fixture
def replies(monkeypatch: pytest.MonkeyPatch) -> ReplyCounter:
    counter = ReplyCounter()
    resolve = ClientCore._resolve

    def counting(self: ClientCore, reply: Reply) -> None:
        counter.seen[reply.request_id] += 1
        resolve(self, reply)

    monkeypatch.setattr(ClientCore, "_resolve", counting)
    return counter


async def call(streamer: Streamer, item: Any, timeout: float) -> Outcome:
    outcome = Outcome(item, time.monotonic())
    try:
        outcome.result = (await streamer.apredict([item], timeout=timeout))[0]
    except MicrobatchError as exc:
        outcome.error, outcome.message = type(exc).__name__, str(exc)
    except Exception as exc:  # anything untyped counts as lost
        outcome.error, outcome.message = f"untyped:{type(exc).__name__}", str(exc)
    outcome.done = time.monotonic()
    return outcome


async def steady_load(
    streamer: Streamer, items: list[Any], rate: float, timeout: float
) -> list[Outcome]:
    """Open-loop load: one single-item call every 1/rate s, whatever the answers do; waits for
    every call (a call still open 5 s past its deadline is reported as hung)."""
    started = time.monotonic()
    tasks = []
    for index, item in enumerate(items):
        delay = started + index / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(call(streamer, item, timeout)))
    done, hung = await asyncio.wait(tasks, timeout=timeout + 5)
    for task in hung:
        task.cancel()
    outcomes = []
    for item, task in zip(items, tasks, strict=True):
        if task in done:
            outcomes.append(task.result())
        else:
            outcomes.append(Outcome(item, started, error="hung"))
    return outcomes


def is_answer(outcome: Outcome) -> bool:
    result = outcome.result
    return outcome.error is None and isinstance(result, dict) and result.get("item") == outcome.item


def figures(name: str, outcomes: list[Outcome], counter: ReplyCounter, **extra: Any) -> dict:
    """Print one FIGURES line and return the numbers."""
    errors = Counter(o.error for o in outcomes if o.error and o.error != "hung")
    untyped = sum(count for error, count in errors.items() if error.startswith("untyped:"))
    numbers = {
        "sent": len(outcomes),
        "answered": sum(1 for o in outcomes if is_answer(o)),
        "errors": dict(sorted(errors.items())),
        "lost": sum(1 for o in outcomes if o.error == "hung") + untyped,
        "wrong": sum(1 for o in outcomes if o.error is None and not is_answer(o)),
        "duplicates": counter.duplicates,
        **extra,
    }
    shown = " ".join(
        f"{key}={value:.2f}s" if key.endswith("_s") and isinstance(value, float) else
        f"{key}={value}"
        for key, value in numbers.items()
    )  # fmt: skip
    print(f"\nFIGURES {name}: {shown}")
    return numbers


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class KeepAliveClient:
    """A minimal HTTP/1.1 keep-alive client, the load generator of the overload test.

    httpx costs the test process about 4 ms of CPU per request; at a few hundred requests per
    second on 2 cores that makes the client, not the gateway, what the latencies measure.
    """

    def __init__(self, base: str) -> None:
        parsed = httpx.URL(base)
        self.host, self.port = parsed.host, int(parsed.port or 80)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open(self, count: int) -> None:
        for _ in range(count):
            self.idle.append(await asyncio.open_connection(self.host, self.port))

    async def post(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        ).encode() + body
        for attempt in range(2):
            if self.idle:
                reader, writer = self.idle.pop()
            else:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(request)
            status_line = await reader.readline()
            if status_line:
                break
            writer.close()  # the server closed this idle connection: use another one
            assert attempt == 0, "the gateway closed two connections in a row"
        got: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            got[name.strip().lower()] = value.strip()
        data = await reader.readexactly(int(got.get("content-length", "0")))
        self.idle.append((reader, writer))
        return int(status_line.split()[1]), got, data

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


# -- 1. kill -9 of a worker mid-batch ------------------------------------------------------------
async def held_items(client: aioredis.Redis, keys: ModelKeys, consumer: str) -> list[Any]:
    """The items a consumer holds: delivered to it, not yet answered."""
    pending = await client.xpending_range(
        keys.stream, keys.group, "-", "+", 10_000, consumername=consumer
    )
    items = []
    for entry in pending:
        entry_id = entry["message_id"]
        for _, fields in await client.xrange(keys.stream, entry_id, entry_id):
            if b"n" in fields:  # a multi-item entry (docs/protocol.md, section 5.1)
                n = int(fields[b"n"])
                items += [codec.decode(fields[b"data.%d" % i]) for i in range(n)]
            else:
                items.append(codec.decode(fields[b"data"]))
    return items


def signal_when_batch_starts(
    child: int, records: Path, target: int | None = None, sig: int = signal.SIGKILL
) -> float:
    """Send ``sig`` to ``target`` (default: ``child``) the moment worker ``child`` records a
    new batch; run it in a thread, so that a busy event loop cannot delay it. Returns when."""
    path = records / f"batches-{child}.jsonl"
    size = path.stat().st_size
    while path.stat().st_size == size:
        time.sleep(0.0005)
    os.kill(child if target is None else target, sig)
    return time.monotonic()


def kill_one_of_two_workers(
    url: str, prefix: str, tmp_path: Path, replies: ReplyCounter, name: str, *,
    batch_size: int, batch_sleep: float, rate: float, seconds: float, bound: int = 0,
    model_thread: str = "auto", model: str = FAULTY,
) -> dict[str, Any]:  # fmt: skip
    """Two `worker start` processes under open-loop load; 2 s in, SIGKILL the child of one of
    them the moment it starts a batch. Prints and returns the figures."""
    name = model_name(model)
    keys = ModelKeys(name, prefix)
    records = tmp_path / "records"
    records.mkdir()
    env = {RECORD_ENV: str(records), BATCH_SLEEP_ENV: str(batch_sleep)}
    args = ("--batch-size", str(batch_size), "--heartbeat-ttl", "2")
    args += ("--model-thread", model_thread)
    # The model's own bound is off: with a bound, the caller's is the one under test; without,
    # none is (on a loaded machine the default one could refuse calls while one worker serves)
    args += ("--max-queue-items", "0")
    total = int(rate * seconds)
    with (
        worker(url, model, prefix, tmp_path / "w1.log", *args, env=env, consumers=1),
        worker(url, model, prefix, tmp_path / "w2.log", *args, env=env, consumers=2) as second,
    ):
        [victim] = child_pids(second.pid)
        streamer = Streamer(name, redis_url=url, prefix=prefix, max_queue_items=bound)
        marks: dict[str, Any] = {}

        async def scenario() -> list[Outcome]:
            load = asyncio.ensure_future(
                steady_load(streamer, [f"r{i}" for i in range(total)], rate, timeout=30)
            )
            await asyncio.sleep(2.0)
            watcher = aioredis.Redis.from_url(url)
            try:
                # kill it the moment it starts a batch: it is then inside predict (sleeping)
                marks["kill"] = await asyncio.to_thread(signal_when_batch_starts, victim, records)
                consumer = f"{socket.gethostname()}-{victim}"
                marks["held"] = await held_items(watcher, keys, consumer)
                # full strength again: two live consumers, neither of them the dead one
                while True:
                    live = await alive_consumers(watcher, keys)
                    if len(live) == 2 and consumer not in live:
                        break
                    await asyncio.sleep(0.05)
                marks["pool"] = time.monotonic()
            finally:
                await watcher.aclose()
            return await load

        outcomes = run(scenario())
        streamer.close()
        marks["replacement"] = child_pids(second.pid)
        marks["state"] = queue_state(redis.Redis.from_url(url), keys)

    kill, held = marks["kill"], marks["held"]
    by_item = {o.item: o for o in outcomes}
    # recovery: from the kill to the answer of the last item the dead worker held
    recovery = max(by_item[item].done for item in held) - kill if held else float("nan")
    in_hand = set(read_records(records, "batches")[victim][-1]) & set(held)
    numbers = figures(
        name, outcomes, replies, held_by_victim=len(held), in_predict=len(in_hand),
        computed_twice=sum(1 for count in computed(records).values() if count > 1),
        recovery_s=recovery, pool_restored_s=marks["pool"] - kill,
        **({"max_queue_items": bound} if bound else {}),
    )  # fmt: skip
    assert held, "the worker was killed holding nothing"
    assert all(is_answer(by_item[item]) for item in held)
    # The batch in predict at the kill was taken over. Other items the dead worker held may
    # have been answered by it already: an entry of many items (submitted together) that spans
    # several batches is acknowledged once all its items are answered, and the worker taking it
    # over skips those marked answered (protocol.md, section 5.1).
    assert in_hand and all(by_item[item].result["pid"] != victim for item in in_hand)
    assert numbers["lost"] == 0 and numbers["duplicates"] == 0
    assert recovery < 5.0, f"recovery took {recovery:.1f} s (target 5 s)"
    assert marks["replacement"] and victim not in marks["replacement"]  # restarted
    assert marks["state"] == (0, 0, 0)  # nothing queued, pending or dead-lettered
    return numbers


@pytest.mark.parametrize(
    ("model_thread", "model"), [("off", FAULTY), ("on", FAULTY), ("auto", PENDING_FAULTY)]
)
def test_kill_9_of_one_of_two_workers_mid_batch_loses_nothing(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter,
    model_thread: str, model: str,
) -> None:  # fmt: skip
    # 8 s of steady load at 300 requests/s, about a third of what the two workers can do; the
    # model inline, on its own thread, or returning its outputs pending (killed inside predict,
    # or while the batch is pending with the next one handed over)
    numbers = kill_one_of_two_workers(
        redis_server.url, prefix, tmp_path, replies, f"kill-9-{model_name(model)}-{model_thread}",
        batch_size=16, batch_sleep=0.03, rate=300, seconds=8, model_thread=model_thread,
        model=model,
    )  # fmt: skip
    assert numbers["sent"] >= 2000
    assert numbers["answered"] == numbers["sent"] and numbers["errors"] == {}


@pytest.mark.parametrize("model", [FAULTY, PENDING_FAULTY])
def test_kill_9_of_a_worker_under_a_backlog_is_recovered_without_waiting_for_it_to_drain(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter, model: str
) -> None:
    # offered 500/s against 2 x 160/s: every read is a full batch and the queue sits at its
    # bound; the dead worker's items must still be taken over within seconds (with pending
    # outputs it holds three batches: one pending, one handed over, one read ahead)
    numbers = kill_one_of_two_workers(
        redis_server.url, prefix, tmp_path, replies, f"kill-9-backlog-{model_name(model)}",
        batch_size=8, batch_sleep=0.05, rate=500, seconds=8, bound=150, model=model,
    )  # fmt: skip
    assert set(numbers["errors"]) <= {"QueueFull"} and numbers["errors"]
    assert numbers["answered"] + numbers["errors"]["QueueFull"] == numbers["sent"]


# -- 2. a request that kills its worker ----------------------------------------------------------
def test_a_request_that_kills_its_worker_is_dead_lettered_and_replayed_after_a_fix(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter
) -> None:
    url, keys = redis_server.url, ModelKeys("faulty", prefix)
    records = tmp_path / "records"
    records.mkdir()
    fixed = tmp_path / "model-fixed"
    env = {RECORD_ENV: str(records), BATCH_SLEEP_ENV: "0.05", FIXED_ENV: str(fixed)}
    args = ("--workers", "2", "--batch-size", "8", "--max-deliveries", "3", "--heartbeat-ttl", "2")
    admin = redis_server.client()
    poison_id, reply_key = "poison-1", keys.inbox("poison-test")
    poison = f"poison:{prefix}"
    with worker(url, FAULTY, prefix, tmp_path / "w.log", *args, env=env, consumers=2) as process:
        streamer = Streamer("faulty", redis_url=url, prefix=prefix)
        # keep both workers busy for a second, so that what follows queues up behind them
        busy = []
        for i in (1, 2):
            busy.append(streamer.submit([f"sleep:1:busy{i}"], timeout=60))
            wait_until(lambda i=i: len(read_records(records, "batches")) == i, 10, "a busy worker")
        started = time.monotonic()
        innocents = [f"i{i}" for i in range(80)]
        futures = [streamer.submit([item], timeout=60) for item in innocents[:40]]
        wait_until(lambda: queued_items(admin, keys) >= 42, 10, "innocents queued")
        fields = request_fields(poison_id, reply_key, 60_000, codec.encode(poison))
        admin.xadd(keys.stream, fields)  # type: ignore[arg-type]
        futures += [streamer.submit([item], timeout=60) for item in innocents[40:]]

        popped = admin.blpop([reply_key], timeout=60)
        assert popped is not None, "the poison request got no answer"
        reply = decode_reply(popped[1])
        poisoned_after = time.monotonic() - started
        outcomes = []
        for item, future in zip(innocents, futures, strict=True):
            outcome = Outcome(item, started)
            try:
                outcome.result = future.result(timeout=60)[0]
            except MicrobatchError as exc:
                outcome.error, outcome.message = type(exc).__name__, str(exc)
            outcomes.append(outcome)
        assert all(len(future.result(timeout=60)) == 1 for future in busy)
        # the pool comes back to full strength: two live consumers, two children
        restored = wait_until(
            lambda: len(live_consumers(admin, keys)) == 2 and len(child_pids(process.pid)) == 2,
            30, "two live workers again",
        )  # fmt: skip
        dead = admin.xrange(keys.dead_letters)
        poison_batches = batches_with(records, poison)
        dead_state = queue_state(admin, keys)
        numbers = figures(
            "poison", [*outcomes, Outcome(poison, started, error=reply.error_type)], replies,
            dead_letters=len(dead), poison_deliveries=len(poison_batches),
            poison_batch_sizes=sorted(map(len, poison_batches), reverse=True),
            poisoned_after_s=poisoned_after,
            pool_restored_s=restored,
        )  # fmt: skip
        assert reply.request_id == poison_id and reply.error_type == "PoisonRequest", reply
        assert "dead-letter" in reply.error_message
        innocent_errors = [(o.item, o.error) for o in outcomes if not is_answer(o)]
        assert not innocent_errors, f"innocent requests failed: {innocent_errors}"
        assert numbers["answered"] == len(innocents) and numbers["errors"] == {"PoisonRequest": 1}
        assert numbers["duplicates"] == 0
        assert max(map(len, poison_batches)) > 1, "the poison never shared a batch"
        assert len(poison_batches) == 3  # delivered max-deliveries times, each time fatal
        dead_ids = [fields[b"id"].decode() for _, fields in dead]
        assert dead_ids == [poison_id], f"dead-lettered: {dead_ids}"
        assert dead_state == (0, 0, 1)
        [(_, dead_fields)] = dead
        assert b"3 times" in dead_fields[b"dead_reason"]

        # "fix" the model, then replay the dead letter with the CLI
        fixed.touch()
        replay = subprocess.run(
            [sys.executable, "-m", "broker.cli", "dead-letters", "replay", "--name", "faulty",
             "--prefix", prefix, "--redis", url],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert replay.returncode == 0, replay.stderr
        assert "replayed 1 dead letter" in replay.stdout
        popped = admin.blpop([reply_key], timeout=30)
        assert popped is not None, "the replayed request got no answer"
        replayed = decode_reply(popped[1])
        streamer.close()
        final_state = queue_state(admin, keys)
        queued_bytes = int(admin.get(keys.queued_bytes) or 0)

    print(f"FIGURES poison-replay: ok={replayed.ok} result={replayed.result}")
    assert replayed.ok and replayed.request_id == poison_id
    assert replayed.result["item"] == poison
    assert final_state == (0, 0, 0) and queued_bytes == 0


# -- 3. a model that holds the GIL, a model that hangs ----------------------------------------
class HeartbeatWatch(threading.Thread):
    """Polls the heartbeat keys of some consumers every 2 ms; records each lapse (ms)."""

    def __init__(self, client: redis.Redis, keys: ModelKeys, consumers: list[str]) -> None:
        super().__init__(daemon=True)
        self.client, self.keys, self.consumers = client, keys, consumers
        self.stopping = threading.Event()
        self.checks = 0
        self.gaps: list[float] = []

    def run(self) -> None:
        missing_since: dict[str, float] = {}
        while not self.stopping.is_set():
            pipe = self.client.pipeline(transaction=False)
            for consumer in self.consumers:
                pipe.exists(self.keys.heartbeat(consumer))
            found = pipe.execute()
            now = time.monotonic()
            self.checks += 1
            for consumer, exists in zip(self.consumers, found, strict=True):
                if not exists:
                    missing_since.setdefault(consumer, now)
                elif consumer in missing_since:
                    self.gaps.append(round((now - missing_since.pop(consumer)) * 1000, 1))
            time.sleep(0.002)
        self.gaps += [round((time.monotonic() - t) * 1000, 1) for t in missing_since.values()]

    def finish(self) -> None:
        self.stopping.set()
        self.join()


def test_a_model_holding_the_gil_for_several_heartbeat_ttls_is_not_taken_over(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter
) -> None:
    url, keys = redis_server.url, ModelKeys("gilhog", prefix)
    records = tmp_path / "records"
    records.mkdir()
    env = {RECORD_ENV: str(records), GIL_SECONDS_ENV: "3"}
    args = ("--workers", "2", "--batch-size", "4", "--heartbeat-ttl", "1", "--batch-timeout", "30")
    log = tmp_path / "w.log"
    admin = redis_server.client()
    with worker(url, GILHOG, prefix, log, *args, env=env, consumers=2) as process:
        children = child_pids(process.pid)
        # A takeover happens when a heartbeat key is missing, so watch them directly: any
        # moment without one (the worker being alive throughout) is a false takeover waiting
        # to happen, whether or not another worker looked at that moment.
        watch = HeartbeatWatch(redis_server.client(), keys, live_consumers(admin, keys))
        watch.start()
        streamer = Streamer("gilhog", redis_url=url, prefix=prefix)
        started = time.monotonic()
        outcomes = []
        # one busy worker while the other is idle and looking for dead consumers; both busy;
        # one busy again: 3 s batches against a 1 s heartbeat TTL
        for round_, calls in enumerate((1, 2, 1)):
            sent = time.monotonic()
            batches = [[f"g{round_}.{c}.{i}" for i in range(4)] for c in range(calls)]
            futures = [streamer.submit(batch, timeout=60) for batch in batches]
            for batch, future in zip(batches, futures, strict=True):
                results = future.result(timeout=60)
                for item, result in zip(batch, results, strict=True):
                    outcomes.append(Outcome(item, sent, time.monotonic(), result))
        elapsed = time.monotonic() - started
        watch.finish()
        streamer.close()
        state = queue_state(admin, keys)
        same_children = child_pids(process.pid) == children

    counts = computed(records)
    batch_count = sum(len(b) for b in read_records(records, "batches").values())
    takeovers = log.read_text(errors="replace").count("took over")
    numbers = figures(
        "gil-hog", outcomes, replies, batches=batch_count, computed_twice=sum(
            1 for count in counts.values() if count > 1
        ), takeovers=takeovers, heartbeat_checks=watch.checks, heartbeat_gaps=watch.gaps,
        elapsed_s=elapsed,
    )  # fmt: skip
    assert same_children
    assert watch.gaps == [], "a live worker's heartbeat lapsed"
    assert numbers["answered"] == 16 and numbers["errors"] == {} and numbers["duplicates"] == 0
    assert set(counts) == {o.item for o in outcomes}
    assert max(counts.values()) == 1, "an item was computed twice: a false takeover"
    assert batch_count == 4 and takeovers == 0
    assert state == (0, 0, 0)


@pytest.mark.parametrize("model", [FAULTY, PENDING_FAULTY])
def test_a_hanging_model_is_killed_by_the_watchdog_and_its_items_recomputed_or_dead_lettered(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter, model: str
) -> None:
    # PENDING_FAULTY hangs in the Future predict returned: the batch is pending, not in predict
    url, keys = redis_server.url, ModelKeys(model_name(model), prefix)
    records = tmp_path / "records"
    records.mkdir()
    env = {RECORD_ENV: str(records)}
    args = ("--workers", "2", "--batch-size", "8", "--batch-timeout", "2")
    args += ("--heartbeat-ttl", "2", "--max-deliveries", "2")
    log = tmp_path / "w.log"
    admin = redis_server.client()
    hang = f"hang:{prefix}"
    items = [f"h{i}" for i in range(4)] + [hang] + [f"h{i}" for i in range(4, 11)]
    with worker(url, model, prefix, log, *args, env=env, consumers=2) as process:
        streamer = Streamer(model_name(model), redis_url=url, prefix=prefix)

        async def burst() -> list[Outcome]:
            # created in one go: they reach Redis in one enqueue, so one worker reads the hang
            # item in a batch with 7 others
            return list(await asyncio.gather(*(call(streamer, item, 60) for item in items)))

        started = time.monotonic()
        outcomes = run(burst())
        restored = wait_until(
            lambda: len(live_consumers(admin, keys)) == 2 and len(child_pids(process.pid)) == 2,
            30, "two live workers again",
        )  # fmt: skip
        streamer.close()
        state = queue_state(admin, keys)

    hang_batches = batches_with(records, hang)
    watchdog_kills = log.read_text(errors="replace").count("--batch-timeout); killing it")
    hang_outcome = next(o for o in outcomes if o.item == hang)
    numbers = figures(
        "hang", outcomes, replies, hang_deliveries=len(hang_batches),
        batch_sizes=[len(b) for b in hang_batches], watchdog_kills=watchdog_kills,
        hang_answered_after_s=hang_outcome.latency,
        slowest_innocent_s=max(o.latency for o in outcomes if o.item != hang),
        pool_restored_s=restored, total_s=time.monotonic() - started,
    )  # fmt: skip
    assert hang_outcome.error == "PoisonRequest", hang_outcome
    assert numbers["answered"] == len(items) - 1, [o for o in outcomes if not is_answer(o)]
    assert numbers["errors"] == {"PoisonRequest": 1} and numbers["lost"] == 0
    assert numbers["duplicates"] == 0
    assert max(map(len, hang_batches)) > 1, "the hanging item never shared a batch"
    # max-deliveries (2) as an entry of its own, after one delivery inside the multi-item
    # entry its calls were sent in, which the worker taking it over split (protocol.md 5.1)
    assert len(hang_batches) <= 3 and watchdog_kills == len(hang_batches)
    assert max(computed(records).values()) == 1
    assert state == (0, 0, 1)


# -- 4. predict raises for one input -------------------------------------------------------------
def test_one_failing_input_among_many_callers_fails_only_its_caller(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter
) -> None:
    url, keys = redis_server.url, ModelKeys("faulty", prefix)
    records = tmp_path / "records"
    records.mkdir()
    failing = "fail:refusing input 7 of many"
    items = [f"m{i}" for i in range(30)] + [failing] + [f"m{i}" for i in range(30, 60)]
    admin = redis_server.client()
    with worker(
        url, FAULTY, prefix, tmp_path / "w.log", "--batch-size", "16",
        env={RECORD_ENV: str(records)},
    ):  # fmt: skip
        streamers = [Streamer("faulty", redis_url=url, prefix=prefix) for _ in range(2)]

        async def scenario() -> list[Outcome]:
            busy = asyncio.ensure_future(call(streamers[0], "sleep:0.5:busy", 30))
            await asyncio.sleep(0.2)  # the worker is busy: everything below queues up
            callers = [call(streamers[i % 2], item, 30) for i, item in enumerate(items)]
            outcomes = list(await asyncio.gather(*callers))
            await busy
            return outcomes

        outcomes = run(scenario())
        for streamer in streamers:
            streamer.close()
        state = queue_state(admin, keys)

    failed = [o for o in outcomes if o.error]
    fail_batches = batches_with(records, failing)
    numbers = figures(
        "model-error", outcomes, replies, first_batch=len(fail_batches[0]) if fail_batches else 0,
        predict_calls_with_it=len(fail_batches),
    )  # fmt: skip
    assert [o.item for o in failed] == [failing]
    assert failed[0].error == "ModelError"
    assert "refusing input 7 of many" in failed[0].message and "item 0" in failed[0].message
    assert numbers["answered"] == len(items) - 1 and numbers["errors"] == {"ModelError": 1}
    assert numbers["duplicates"] == 0
    assert len(fail_batches[0]) > 1, "the failing input did not share a batch"
    assert max(computed(records).values()) == 1
    assert state == (0, 0, 0)


# -- 5. expired and withdrawn items are never computed -------------------------------------------
@pytest.mark.parametrize("model_thread", ["auto", "on"])
def test_expired_and_cancelled_items_never_reach_predict(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter,
    model_thread: str,
) -> None:  # fmt: skip
    url, keys = redis_server.url, ModelKeys("faulty", prefix)
    records = tmp_path / "records"
    records.mkdir()
    admin = redis_server.client()
    with worker(
        url, FAULTY, prefix, tmp_path / "w.log", "--batch-size", "8",
        "--model-thread", model_thread, env={RECORD_ENV: str(records)},
    ):  # fmt: skip
        streamer = Streamer("faulty", redis_url=url, prefix=prefix)
        seen: dict[str, int] = {}
        slow_items = ["sleep:2:slow"] + [f"fill{i}" for i in range(7)]

        async def scenario() -> tuple[list[Outcome], list[asyncio.Task[Outcome]]]:
            # a full batch (so the worker reads the next one ahead while it computes) of 2 s
            slow = asyncio.ensure_future(streamer.apredict(slow_items, timeout=30))
            wait_until_batch = time.monotonic() + 10
            while not batches_with(records, "sleep:2:slow"):
                assert time.monotonic() < wait_until_batch
                await asyncio.sleep(0.01)
            # Behind it: calls with a 0.5 s deadline, interleaved with calls that are cancelled
            # after 0.3 s. Created together, they reach Redis in one enqueue and wait in the
            # stream (or in the worker's read-ahead, if its read reached Redis before the model
            # started).
            late, cancelled = [], []
            for i in range(12):
                late.append(asyncio.ensure_future(call(streamer, f"late{i}", 0.5)))
                cancelled.append(asyncio.ensure_future(call(streamer, f"cancel{i}", 30)))
            await asyncio.sleep(0.3)
            seen["queued"] = int(await asyncio.to_thread(admin.xlen, keys.stream))
            for task in cancelled:
                task.cancel()
            await asyncio.sleep(0.1)
            seen["after_cancel"] = int(await asyncio.to_thread(admin.xlen, keys.stream))
            seen["marked"] = int(await asyncio.to_thread(admin.zcard, keys.cancelled))
            outcomes = list(await asyncio.gather(*late))
            now = time.monotonic()
            for item, result in zip(slow_items, await slow, strict=True):
                outcomes.append(Outcome(item, now, now, result))
            outcomes.append(await call(streamer, "after", 30))  # the worker has moved on
            return outcomes, cancelled

        outcomes, cancelled = run(scenario())
        streamer.close()
        state = queue_state(admin, keys)
        queued_bytes = int(admin.get(keys.queued_bytes) or 0)

    given: set[str] = set()
    for batches in read_records(records, "batches").values():
        for batch in batches:
            given.update(batch)
    never = {f"late{i}" for i in range(12)} | {f"cancel{i}" for i in range(12)}
    numbers = figures(
        f"deadline-cancel-thread-{model_thread}", outcomes, replies,
        cancelled=sum(t.cancelled() for t in cancelled),
        queued_behind=seen["queued"], withdrawn_from_stream=seen["queued"] - seen["after_cancel"],
        withdrawn_read_ahead=seen["marked"], passed_to_predict=len(given & never),
    )  # fmt: skip
    assert numbers["errors"] == {"DeadlineExceeded": 12} and numbers["answered"] == 9
    assert numbers["duplicates"] == 0
    assert all(task.cancelled() for task in cancelled)
    assert not given & never, f"computed anyway: {sorted(given & never)}"
    assert given == {*slow_items, "after"}
    # withdrawn while queued: deleted from the stream, or marked (entries a worker already
    # holds, and items that share a multi-item entry with calls not withdrawn: see
    # test_items_withdrawn_while_their_batch_forms_never_reach_predict)
    assert numbers["withdrawn_from_stream"] > 0 or numbers["withdrawn_read_ahead"] > 0
    assert state == (0, 0, 0) and queued_bytes == 0


def test_items_withdrawn_while_their_batch_forms_never_reach_predict(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter
) -> None:
    """With --max-latency a worker holds items it has read while it waits for batch-mates;
    callers that give up meanwhile must not have them computed either."""
    url, keys = redis_server.url, ModelKeys("faulty", prefix)
    records = tmp_path / "records"
    records.mkdir()
    admin = redis_server.client()
    with worker(
        url, FAULTY, prefix, tmp_path / "w.log", "--batch-size", "16", "--max-latency", "1.0",
        env={RECORD_ENV: str(records)},
    ):  # fmt: skip
        streamer = Streamer("faulty", redis_url=url, prefix=prefix)
        seen: dict[str, int] = {}

        async def scenario() -> tuple[list[Outcome], list[asyncio.Task[Outcome]]]:
            # created together: one enqueue, read at once by the worker, which then waits up
            # to 1 s for more; meanwhile 3 callers cancel and 2 deadlines pass
            kept = [asyncio.ensure_future(call(streamer, f"kept{i}", 30)) for i in range(3)]
            gone = [asyncio.ensure_future(call(streamer, f"gone{i}", 30)) for i in range(3)]
            late = [asyncio.ensure_future(call(streamer, f"late{i}", 0.3)) for i in range(2)]
            await asyncio.sleep(0.3)
            seen["pending"] = await asyncio.to_thread(pending_items, admin, keys)
            for task in gone:
                task.cancel()
            outcomes = list(await asyncio.gather(*kept, *late))
            return outcomes, gone

        outcomes, gone = run(scenario())
        streamer.close()
        state = queue_state(admin, keys)

    given: set[str] = set()
    for batches in read_records(records, "batches").values():
        for batch in batches:
            given.update(batch)
    numbers = figures(
        "batch-window-cancel", outcomes, replies, cancelled=sum(t.cancelled() for t in gone),
        held_by_worker_at_cancel=seen["pending"], passed_to_predict=sorted(given),
    )  # fmt: skip
    assert seen["pending"] == 8, "the worker did not hold the items while the batch formed"
    assert numbers["answered"] == 3 and numbers["errors"] == {"DeadlineExceeded": 2}
    assert numbers["duplicates"] == 0
    assert all(task.cancelled() for task in gone)
    assert given == {"kept0", "kept1", "kept2"}, f"computed: {sorted(given)}"
    assert state == (0, 0, 0)


# -- 6. SIGTERM drains ---------------------------------------------------------------------------
def test_sigterm_to_a_worker_under_load_answers_its_batch_and_exits_zero(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter
) -> None:
    url, keys = redis_server.url, ModelKeys("faulty", prefix)
    records = tmp_path / "records"
    records.mkdir()
    env = {RECORD_ENV: str(records), BATCH_SLEEP_ENV: "0.05"}
    # once one worker has gone, 200/s is more than the other can take: a backlog builds, which
    # must not be refused here (what is tested is the drain, not the bound)
    args = ("--batch-size", "8", "--max-queue-items", "0")
    admin = redis_server.client()
    total, rate = 1000, 200.0
    with (
        worker(url, FAULTY, prefix, tmp_path / "w1.log", *args, env=env, consumers=1),
        worker(url, FAULTY, prefix, tmp_path / "w2.log", *args, env=env, consumers=2) as second,
    ):
        [child] = child_pids(second.pid)
        streamer = Streamer("faulty", redis_url=url, prefix=prefix)
        marks: dict[str, float] = {}

        async def scenario() -> list[Outcome]:
            load = asyncio.ensure_future(
                steady_load(streamer, [f"s{i}" for i in range(total)], rate, timeout=30)
            )
            await asyncio.sleep(1.5)
            # to `worker start` (which tells its child) while the child is inside predict
            marks["term"] = await asyncio.to_thread(
                signal_when_batch_starts, child, records, second.pid, signal.SIGTERM
            )
            code = await asyncio.to_thread(second.wait, 30)
            marks["exit"] = time.monotonic()
            marks["code"] = code
            return await load

        outcomes = run(scenario())
        streamer.close()
        state = queue_state(admin, keys)

    last_batch = read_records(records, "batches")[child][-1]
    by_pid = {o.item: o.result["pid"] for o in outcomes if is_answer(o)}
    twice = sum(1 for count in computed(records).values() if count > 1)
    numbers = figures(
        "sigterm", outcomes, replies, last_batch=len(last_batch),
        last_batch_answered_by_it=sum(by_pid.get(item) == child for item in last_batch),
        computed_twice=twice, exit_code=marks["code"], exit_after_s=marks["exit"] - marks["term"],
    )  # fmt: skip
    assert marks["code"] == 0
    assert numbers["answered"] == total and numbers["errors"] == {}
    assert numbers["lost"] == 0 and numbers["duplicates"] == 0
    assert all(by_pid[item] == child for item in last_batch), "it did not answer its batch"
    every = [item for batch in read_records(records, "batches")[child] for item in batch]
    assert all(by_pid[item] == child for item in every), "a batch it started was taken over"
    assert twice == 0  # drained, not taken over
    assert marks["exit"] - marks["term"] < 10
    assert state == (0, 0, 0)


# -- 7. Redis killed and restarted ---------------------------------------------------------------
PERSISTENCE = {
    # the recommended setting: a SIGKILLed Redis loses nothing it acknowledged (the AOF write
    # reached the kernel); a crash of the machine may lose about the last second
    "aof-everysec": {"appendonly": "yes", "appendfsync": "everysec"},
    # no persistence: everything in Redis is lost, as when a replica that missed the latest
    # writes is promoted; in-flight calls must end in DeadlineExceeded, never hang
    "no-persistence": {"appendonly": "no"},
}


@pytest.mark.parametrize("persistence", list(PERSISTENCE))
def test_redis_killed_and_restarted_under_load(
    prefix: str, tmp_path: Path, replies: ReplyCounter, persistence: str
) -> None:
    server = RedisServer(PERSISTENCE[persistence]).start()
    url, keys = server.url, ModelKeys("faulty", prefix)
    env = {BATCH_SLEEP_ENV: "0.2"}  # 2 x 80 items/s: ~20 calls are in flight at any time
    args = ("--workers", "2", "--batch-size", "16", "--heartbeat-ttl", "5")
    timeout, total, rate = 3.0, 900, 100.0  # 9 s of load; Redis is away from 2.5 s to 4 s
    try:
        with worker(url, FAULTY, prefix, tmp_path / "w.log", *args, env=env, consumers=2) as sup:
            children = child_pids(sup.pid)
            streamer = Streamer("faulty", redis_url=url, prefix=prefix)
            marks: dict[str, float] = {}

            async def scenario() -> list[Outcome]:
                load = asyncio.ensure_future(
                    steady_load(streamer, [f"x{i}" for i in range(total)], rate, timeout)
                )
                await asyncio.sleep(2.5)
                server.kill()
                marks["down"] = time.monotonic()
                await asyncio.sleep(1.5)
                await asyncio.to_thread(server.start)
                marks["up"] = time.monotonic()
                return await load

            outcomes = run(scenario())
            alive = sup.poll() is None
            same_children = child_pids(sup.pid) == children
            streamer.close()
            admin = server.client()
            state = queue_state(admin, keys)
    finally:
        server.stop()

    down, up = marks["down"], marks["up"]
    after = sorted((o for o in outcomes if o.sent >= up and is_answer(o)), key=lambda o: o.done)
    resumed = after[0].done - up if after else float("inf")
    late = [o for o in outcomes if o.latency > timeout + 1.0]
    failed_fast = [o for o in outcomes if o.error == "BrokerUnavailable"]
    numbers = figures(
        f"redis-restart-{persistence}", outcomes, replies,
        waited_across_outage=sum(1 for o in outcomes if o.sent < down and up < o.done),
        outage_s=up - down, resumed_s=resumed,
        slowest_error_s=max((o.latency for o in outcomes if o.error), default=0.0),
        slowest_unavailable_s=max((o.latency for o in failed_fast), default=0.0),
        worker_alive=alive, children_unchanged=same_children,
    )  # fmt: skip
    assert alive and same_children, "a worker process crashed or was restarted"
    assert set(numbers["errors"]) <= {"DeadlineExceeded", "BrokerUnavailable"}
    # work acknowledged in the second before the crash may be redone (at-least-once): a
    # duplicate reply may then reach an inbox, where the client drops it; nobody gets two
    assert numbers["lost"] == 0 and numbers["wrong"] == 0
    assert numbers["answered"] + sum(numbers["errors"].values()) == total
    assert not late, f"{len(late)} calls ran past their deadline, e.g. {late[0]}"
    assert resumed < 2.0, f"service resumed {resumed:.2f} s after Redis came back"
    assert numbers["answered"] > total * 0.6
    assert state[0] == 0 and state[1] == 0


# -- 8. overload through the gateway -------------------------------------------------------------
def test_overload_through_the_gateway_is_refused_fast_and_bounded(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """The queue bound by default: the one the worker stores with the model (8 batches per
    live worker), with no option anywhere. A burst of 4 batches per worker at an idle queue is
    taken whole; 10x overload is refused fast, and the stream never exceeds the bound."""
    url, keys = redis_server.url, ModelKeys("sleeper", prefix)
    batch, sleep, live = 4, 0.2, 1
    bound = AUTO_QUEUE_BATCHES * batch * live  # 32 items
    capacity = batch / sleep  # 20 items/s with one worker
    rate, seconds, deadline = 10 * capacity, 5.0, 5.0
    admin = redis_server.client()
    with (
        worker(
            url, SLEEPER, prefix, tmp_path / "w.log", "--batch-size", str(batch),
            env={BATCH_SLEEP_ENV: str(sleep)},
        ) as work,
        gateway_process(url, [SLEEPER], prefix) as (base, gate),
    ):  # fmt: skip
        assert admin.hget(keys.queue_bound, "items") == str(bound // live).encode()
        endpoint = f"{base}/v1/models/sleeper/predict"
        headers = {"X-Request-Timeout": str(deadline)}
        for i in range(20):  # warm both up before measuring memory
            response = httpx.post(endpoint, json={"inputs": [[i, 0, 0, 0]]}, timeout=10)
            assert response.status_code == 200, response.text
        # a burst at the idle queue: 4 batches per live worker, all at once, none refused
        burst = 4 * batch * live

        async def burst_at_idle() -> list[int]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                responses = await asyncio.gather(
                    *(
                        client.post("/v1/models/sleeper/predict", json={"inputs": [[i, 0, 0, 0]]})
                        for i in range(burst)
                    )
                )
            return [response.status_code for response in responses]

        burst_codes = Counter(run(burst_at_idle()))
        gateway_pids = [gate.pid, *child_pids(gate.pid)]
        worker_pids = [work.pid, *child_pids(work.pid)]
        rss_before = rss_bytes(gateway_pids), rss_bytes(worker_pids)
        lengths: list[int] = []

        async def scenario() -> list[tuple[int, float, float, httpx.Response]]:
            sampler_client = aioredis.Redis.from_url(url)
            stop = asyncio.Event()

            async def sample() -> None:
                while not stop.is_set():
                    lengths.append(int(await sampler_client.xlen(keys.stream)))
                    await asyncio.sleep(0.01)

            sampler = asyncio.ensure_future(sample())
            http = KeepAliveClient(base)
            await http.open(50)

            async def one(i: int) -> tuple[int, float, float, tuple[int, dict[str, str], bytes]]:
                sent = time.monotonic()
                body = json.dumps({"inputs": [[float(i), 1.0, 2.0, 3.0]]}).encode()
                response = await http.post("/v1/models/sleeper/predict", body, headers)
                return i, sent, time.monotonic() - sent, response

            started = time.monotonic()
            tasks = []
            for i in range(int(rate * seconds)):
                delay = started + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(one(i)))
            raw = list(await asyncio.gather(*tasks))
            http.close()
            stop.set()
            await sampler
            await sampler_client.aclose()
            return [
                (i, sent, latency, httpx.Response(status, headers=got, content=data))
                for i, sent, latency, (status, got, data) in raw
            ]

        results = run(scenario())
        rss_after = rss_bytes(gateway_pids), rss_bytes(worker_pids)
        state = queue_state(admin, keys)

    codes = Counter(response.status_code for _, _, _, response in results)
    refused = sorted(latency for _, _, latency, r in results if r.status_code == 503) or [nan]
    fast = sum(1 for latency in refused if latency <= 0.050) / len(refused)
    accepted = sorted(latency for _, _, latency, r in results if r.status_code == 200) or [nan]
    growth = [(after - before) / 2**20 for before, after in zip(rss_before, rss_after, strict=True)]
    print(
        f"\nFIGURES overload: burst_at_idle={burst} status={dict(sorted(burst_codes.items()))} "
        f"offered={len(results)} ({rate:g}/s for {seconds:g} s, capacity "
        f"{capacity:g}/s) status={dict(sorted(codes.items()))} "
        f"refused_within_50ms={fast * 100:.1f}% "
        f"refused_p50={refused[len(refused) // 2] * 1000:.1f}ms "
        f"refused_p99={refused[int(len(refused) * 0.99)] * 1000:.1f}ms "
        f"refused_max={refused[-1] * 1000:.1f}ms accepted_p50={accepted[len(accepted) // 2]:.2f}s "
        f"accepted_max={accepted[-1]:.2f}s max_xlen={max(lengths)} (default bound {bound}, "
        f"{len(lengths)} samples) gateway_rss_growth={growth[0]:.1f}MB "
        f"worker_rss_growth={growth[1]:.1f}MB"
    )
    assert burst_codes == {200: burst}, burst_codes  # 0 refusals for the burst
    assert set(codes) == {200, 503}, codes
    for i, _, _, response in results:
        if response.status_code == 200:
            assert response.json() == {"outputs": [[2.0 * i, 2.0, 4.0, 6.0]]}
        else:
            assert check_error(response, 503, "QueueFull")
            assert response.headers["retry-after"] == "1"
    assert codes[503] > len(results) * 0.7  # ~90 % is excess
    assert codes[200] >= capacity * seconds * 0.5
    assert fast >= 0.95, f"only {fast:.1%} of the 503s came within 50 ms"
    assert refused[-1] < 2.0, "503s were not fast"
    assert accepted[-1] < deadline  # every accepted request met its deadline
    assert max(lengths) <= bound
    assert growth[0] < 50 and growth[1] < 50
    assert state == (0, 0, 0)


def test_overload_with_deadlines_shorter_than_the_queue_computes_what_can_be_answered(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter
) -> None:
    """5x overload from callers whose deadline (0.6 s) is shorter than the full queue takes
    (the default bound, 32 items: 1.6 s of work). The items that reach the front of the queue
    are those just short of their deadline: computing them answers nobody. Before, 95 % of
    the items computed were answered after their caller had got DeadlineExceeded, and almost
    no call got its result; now an item that cannot be computed within its deadline, at the
    time recent batches took, is answered DeadlineExceeded instead."""
    url = redis_server.url
    records = tmp_path / "records"
    records.mkdir()
    batch, sleep, timeout = 4, 0.2, 0.6
    capacity = batch / sleep  # 20 items/s
    rate, seconds = 5 * capacity, 4.0
    with worker(
        url, SLEEPER, prefix, tmp_path / "w.log", "--batch-size", str(batch),
        env={BATCH_SLEEP_ENV: str(sleep), RECORD_ENV: str(records)},
    ):  # fmt: skip
        items = [[float(i), 0.0, 0.0, 0.0] for i in range(int(rate * seconds))]

        async def scenario() -> list[Outcome]:
            async with Streamer("sleeper", redis_url=url, prefix=prefix) as streamer:
                return await steady_load(streamer, items, rate, timeout)

        outcomes = run(scenario())
        time.sleep(2 * sleep)  # the batch computing when the load ended is recorded
    answered = {
        json.dumps(o.item) for o in outcomes if o.error is None and o.result.tolist() == [
            2 * value for value in o.item
        ]
    }  # fmt: skip
    results = sum(1 for o in outcomes if o.error is None)
    done = computed(records)
    wasted = sum(count for item, count in done.items() if item not in answered)
    numbers = figures(
        "overload-deadlines", outcomes, replies, answered=len(answered),
        wrong=results - len(answered), capacity=capacity, offered_rate=rate,
        computed=sum(done.values()), computed_unanswered=wasted,
    )  # fmt: skip
    assert set(numbers["errors"]) <= {"QueueFull", "DeadlineExceeded"}, numbers["errors"]
    assert numbers["lost"] == 0 and numbers["duplicates"] == 0 and numbers["wrong"] == 0
    assert wasted <= max(2 * batch, sum(done.values()) // 5), numbers
    assert len(answered) >= capacity * seconds * 0.3, numbers


# -- 9. pickles are never executed ---------------------------------------------------------------
class _Exploit:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_pickles_written_into_the_stream_under_load_are_never_executed(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter
) -> None:
    """A variant under load of test_redis_integration's malformed-entry test: pickles as the
    payload, and a pickle inside an array extension that claims an object dtype."""
    url, keys = redis_server.url, ModelKeys("faulty", prefix)
    marker = tmp_path / "pwned"
    reply_key = keys.inbox("pickles")
    exploit = pickle.dumps(_Exploit(marker))
    dtype = b"|O"
    header = bytes([len(dtype)]) + dtype + bytes([1]) + (1).to_bytes(8, "little")
    in_array = msgpack.packb(msgpack.ExtType(codec.ARRAY_EXT_TYPE, header + exploit))
    payloads = {f"p{i}": exploit for i in range(10)}
    payloads |= {f"a{i}": in_array for i in range(10)}
    payloads |= {f"p0-{i}": pickle.dumps(_Exploit(marker), protocol=0) for i in range(5)}
    admin = redis_server.client()
    with worker(url, FAULTY, prefix, tmp_path / "w.log", "--batch-size", "16"):
        streamer = Streamer("faulty", redis_url=url, prefix=prefix)

        async def scenario() -> list[Outcome]:
            load = asyncio.ensure_future(
                steady_load(streamer, [f"n{i}" for i in range(400)], 200.0, 20)
            )
            for request_id, payload in payloads.items():
                fields = request_fields(request_id, reply_key, 20_000, payload)
                await asyncio.to_thread(admin.xadd, keys.stream, fields)  # type: ignore[arg-type]
                await asyncio.sleep(0.05)
            return await load

        outcomes = run(scenario())
        got = {}
        while len(got) < len(payloads):
            popped = admin.blpop([reply_key], timeout=20)
            assert popped is not None, f"only {sorted(got)} answered"
            reply = decode_reply(popped[1])
            got[reply.request_id] = reply
        streamer.close()
        state = queue_state(admin, keys)

    numbers = figures(
        "pickle", outcomes, replies, pickles=len(payloads),
        pickle_replies=dict(Counter(r.error_type for r in got.values())), executed=marker.exists(),
    )  # fmt: skip
    assert not marker.exists(), "a pickle was executed"
    assert {r.error_type for r in got.values()} == {"CodecError"}
    assert numbers["answered"] == 400 and numbers["errors"] == {}
    assert numbers["duplicates"] == 0
    assert state == (0, 0, 0)


# -- 10. out of memory ---------------------------------------------------------------------------
HUNGRY = "tests.e2e.fault_models:Hungry"


@pytest.mark.parametrize("model_thread", ["off", "on"])
def test_a_batch_too_big_for_the_device_is_computed_in_smaller_pieces(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter,
    model_thread: str,
) -> None:  # fmt: skip
    """A batch of 16 on a device that holds 4 items: torch.cuda.OutOfMemoryError, and the
    halves are computed once the failed attempt's memory is free (an exception's traceback
    holds the frames that hold it: retried inside the handler, every piece ran out too). An
    item that never fits gets ModelError naming the OOM; its batch-mates their results."""
    url, keys = redis_server.url, ModelKeys("hungry", prefix)
    records = tmp_path / "records"
    records.mkdir()
    huge = f"huge:{prefix}"
    items = [f"h{i}" for i in range(10)] + [huge] + [f"h{i}" for i in range(10, 15)]
    admin = redis_server.client()
    log = tmp_path / "w.log"
    with worker(
        url, HUNGRY, prefix, log, "--batch-size", "16", "--max-deliveries", "1",
        "--model-thread", model_thread, env={RECORD_ENV: str(records)},
    ) as process:  # fmt: skip
        [child] = child_pids(process.pid)
        streamer = Streamer("hungry", redis_url=url, prefix=prefix)

        async def scenario() -> list[Outcome]:
            busy = asyncio.ensure_future(call(streamer, "sleep:0.5:busy", 30))
            await asyncio.sleep(0.2)  # the worker is busy: everything below queues up
            outcomes = list(await asyncio.gather(*(call(streamer, i, 30) for i in items)))
            await busy
            return outcomes

        outcomes = run(scenario())
        streamer.close()
        state = queue_state(admin, keys)
        same_child = child_pids(process.pid) == [child]

    sizes = [len(batch) for batch in batches_with(records, "h0")]
    numbers = figures("out-of-memory", outcomes, replies, batches_with_h0=sizes)
    logged = log.read_text()
    failed = [(o.item, o.error, o.message) for o in outcomes if o.error]
    assert [(item, error) for item, error, _ in failed] == [(huge, "ModelError")], failed
    assert "OutOfMemoryError" in failed[0][2]
    assert numbers["answered"] == len(items) - 1 and numbers["duplicates"] == 0
    assert max(sizes) == 16, "the batch never reached the device whole"
    assert max(computed(records).values()) == 1
    assert state == (0, 0, 0) and same_child
    assert "a batch of 16 out of memory (OutOfMemoryError: CUDA out of memory." in logged
    assert "During handling of the above exception" not in logged  # one traceback, unchained


def test_a_worker_killed_as_by_the_oom_killer_is_named_so_and_restarted_with_backoff(
    redis_server: RedisServer, prefix: str, tmp_path: Path, replies: ReplyCounter
) -> None:
    """SIGKILL (what the kernel's OOM killer sends) to the child mid-batch, then twice more:
    its batch is answered once, each restart waits longer, and the log names the signal."""
    url, keys = redis_server.url, ModelKeys("faulty", prefix)
    records = tmp_path / "records"
    records.mkdir()
    log = tmp_path / "w.log"
    admin = redis_server.client()
    with worker(url, FAULTY, prefix, log, env={RECORD_ENV: str(records)}) as process:
        streamer = Streamer("faulty", redis_url=url, prefix=prefix)
        future = streamer.submit(["sleep:3:held"], timeout=60)
        wait_until(lambda: batches_with(records, "sleep:3:held"), 10, "the batch to start")
        for _ in range(3):
            [child] = child_pids(process.pid)
            os.kill(child, signal.SIGKILL)
            wait_until(
                lambda child=child: child_pids(process.pid) not in ([], [child])
                and len(live_consumers(admin, keys)) == 1,
                60, "a restarted worker",
            )  # fmt: skip
        [result] = future.result(timeout=60)
        streamer.close()
        state = queue_state(admin, keys)
    logged = log.read_text()
    delays = [line.rsplit("restarting in ", 1)[1] for line in logged.splitlines() if
              "restarting in" in line]  # fmt: skip
    print(f"\nFIGURES oom-kill: restarts={delays} duplicates={replies.duplicates}")
    assert result["item"] == "sleep:3:held" and replies.duplicates == 0
    assert state == (0, 0, 0)
    assert delays == ["0.5 s", "1.0 s", "2.0 s"], delays
    # a kill -9 from outside (this test's): the cgroup counted no OOM kill, where it can be read
    kills = oom_kills()
    cause = sigkill_cause(kills, kills)
    assert logged.count(f"worker 0 killed by SIGKILL ({cause})") == 3
    assert "exited with code -9" not in logged
