"""Priorities under overload: per-level latency with 1.5x the measured capacity offered.

    .venv/bin/python -m bench.priorities [--batch-size 8] [--load 1.5] [--high-share 0.5]
        [--duration 15] [--json bench/results/priorities.json]

One `worker start --model examples.mlp:MLP` (one process, torch threads 1) serves a private
redis-server. First its **capacity**: ``--burst`` one-item calls, 6 x batch size of them in
flight at all times (a backlog within the queue bound), items/s from the first call to the
last answer (the best of ``--bursts`` runs, the first one also warming up). Then the **open
loop**: one-item calls ``Streamer.apredict([x], priority=...)`` at ``--load`` times that
capacity, on a fixed schedule (uniform arrivals), each ``high`` with probability
``--high-share`` (seeded), for ``--duration`` seconds after ``--warmup`` seconds; each call's
latency runs from its scheduled time to its answer, so a generator or a queue that falls
behind counts against it. Per level: answered calls, refusals (QueueFull: the level's queue
at its bound), p50/p90/p99; and high p99 / normal p99 (the target: at most 0.3). The worker's
queue bound (``--max-queue-items``, for each level) keeps the overloaded normal level from
growing without end: past it, its calls are refused (QueueFull) at once. The generator runs on
uvloop; batches are small (``--batch-size 4``) so that 1.5x the capacity stays within what one
Python process can send on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis
import uvloop

from broker import Streamer
from broker.devserver import RedisServer
from broker.errors import MicrobatchError
from broker.keys import ModelKeys
from broker.liveness import wait_for_consumers

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "bench-priorities"
MODEL = "examples.mlp:MLP"


def start_worker(
    url: str, batch_size: int, max_queue_items: int, log_path: Path
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", MODEL]
    command += ["--redis", url, "--prefix", PREFIX, "--batch-size", str(batch_size)]
    command += ["--max-queue-items", str(max_queue_items)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=log)
    client = redis.Redis.from_url(url)
    wait_for_consumers(client, ModelKeys("mlp", PREFIX), 1, timeout=120)
    return process


async def burst(streamer: Streamer, item: Any, count: int, concurrency: int) -> float:
    """Items/s of ``count`` one-item calls, ``concurrency`` of them in flight at all times
    (a backlog that stays within the queue bound)."""
    left = [count]

    async def caller() -> None:
        while left[0] > 0:
            left[0] -= 1
            await streamer.apredict([item], timeout=60)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return count / (time.perf_counter() - started)


async def open_loop(
    streamer: Streamer, item: Any, rate: float, seconds: float, high_share: float, seed: int
) -> list[tuple[str, float, str]]:
    """(level, latency s, outcome) of each call of the schedule."""
    total = int(rate * seconds)
    rng = random.Random(seed)
    levels = ["high" if rng.random() < high_share else "normal" for _ in range(total)]
    clock = time.perf_counter
    start = clock() + 0.05
    out: list[tuple[str, float, str]] = []

    async def one(i: int) -> None:
        due = start + i / rate
        try:
            await streamer.apredict([item], timeout=60, priority=levels[i])
            outcome = "ok"
        except MicrobatchError as exc:
            outcome = type(exc).__name__
        out.append((levels[i], clock() - due, outcome))

    tasks = []
    i = 0
    while i < total:
        now = clock()
        while i < total and start + i / rate <= now:
            tasks.append(asyncio.ensure_future(one(i)))
            i += 1
        await asyncio.sleep(max(0.001, start + i / rate - clock()))
    await asyncio.gather(*tasks)
    return out


def level_figures(results: list[tuple[str, float, str]], level: str) -> dict[str, Any]:
    mine = [(latency, outcome) for name, latency, outcome in results if name == level]
    ok = np.array([latency for latency, outcome in mine if outcome == "ok"]) * 1000
    errors: dict[str, int] = {}
    for _, outcome in mine:
        if outcome != "ok":
            errors[outcome] = errors.get(outcome, 0) + 1
    pct = lambda q: round(float(np.percentile(ok, q)), 2) if ok.size else None  # noqa: E731
    return {
        "offered": len(mine),
        "answered": int(ok.size),
        "errors": errors,
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
    }


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    item = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    streamer = Streamer("mlp", redis_url=url, prefix=PREFIX)
    await streamer.aconnect()
    concurrency = min(6 * args.batch_size, args.max_queue_items)  # a backlog within the bound
    capacities = [await burst(streamer, item, args.burst, concurrency) for _ in range(args.bursts)]
    capacity = max(capacities)
    rate = args.load * capacity
    warm = await open_loop(streamer, item, rate, args.warmup, args.high_share, args.seed + 1)
    results = await open_loop(streamer, item, rate, args.duration, args.high_share, args.seed)
    await streamer.aclose()
    high, normal = level_figures(results, "high"), level_figures(results, "normal")
    ratio = None
    if high["p99_ms"] is not None and normal["p99_ms"]:
        ratio = round(high["p99_ms"] / normal["p99_ms"], 3)
    return {
        "capacity_items_s": round(capacity, 1),
        "bursts_items_s": [round(c, 1) for c in capacities],
        "offered_rate": round(rate, 1),
        "warmup_calls": len(warm),
        "high": high,
        "normal": normal,
        "high_p99_over_normal_p99": ratio,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--max-queue-items", type=int, default=256, help="the worker's bound, for each level"
    )
    parser.add_argument("--load", type=float, default=1.5, help="offered / measured capacity")
    parser.add_argument("--high-share", type=float, default=0.5)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    log_path = Path("/tmp") / f"bench-priorities-worker-{os.getpid()}.log"
    load_before = os.getloadavg()
    with RedisServer() as server:
        worker = start_worker(server.url, args.batch_size, args.max_queue_items, log_path)
        try:
            figures = uvloop.run(measure(args, server.url))
        finally:
            worker.terminate()
            worker.wait(30)
    report = {
        "command": "python -m bench.priorities " + " ".join(argv or sys.argv[1:]),
        "model": MODEL,
        "batch_size": args.batch_size,
        "max_queue_items": args.max_queue_items,
        "load": args.load,
        "high_share": args.high_share,
        "duration_s": args.duration,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **figures,
    }
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
