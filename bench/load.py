"""Closed-loop load generators, run in a process of their own (and in the alternatives' venvs).

Only the standard library, numpy and bench.cpu (itself standard library only) at module level,
so any of the benchmark's virtualenvs can run it with this repository on PYTHONPATH. Every
generator does a warm-up, then ``repeats`` windows of ``duration`` seconds each, and prints one
JSON line: a list of windows, each
``{"items_per_s", "p50_ms", "p90_ms", "p99_ms", "requests", "errors", "mean_batch",
"load_cpu_us_per_item"}`` (the last: CPU time of this whole process, client and load loop, per
item answered), and with ``"cpu_roots": {name: pid}`` in the spec ``"cpu_us_per_item"``: the
CPU time per item of each of those process trees (the servers), read from /proc.

The mean batch size of a window comes from a *batch probe*: ``metrics:URL`` (a worker's
Prometheus endpoint: microbatch_worker_batch_size_sum / _count), ``file:PATH`` (the batch-size log
the alternatives' servers append to, one line per model call) or ``none``.

    python -m bench.load asyncio|threads|local|ss-redis  ARGS-AS-JSON
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.cpu import CpuMeter, per_item


def sample_input() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(256).astype(np.float32)


def percentiles(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    ordered = np.sort(np.asarray(latencies)) * 1000
    n = len(ordered)
    return {f"p{q}_ms": float(ordered[min(n - 1, int(q / 100 * n))]) for q in (50, 90, 99)}


class BatchProbe:
    """Totals (items, batches) the model has run so far, from wherever the server keeps them."""

    def __init__(self, spec: str) -> None:
        self.kind, _, self.where = spec.partition(":")

    def totals(self) -> tuple[float, float]:
        if self.kind == "metrics":
            text = urllib.request.urlopen(self.where, timeout=5).read().decode()
            items = sum(
                float(v)
                for v in re.findall(r"^microbatch_worker_batch_size_sum\{.*\} (\S+)$", text, re.M)
            )
            batches = sum(
                float(v)
                for v in re.findall(r"^microbatch_worker_batch_size_count\{.*\} (\S+)$", text, re.M)
            )
            return items, batches
        if self.kind == "file":
            try:
                with open(self.where, "rb") as f:
                    sizes = [int(line) for line in f.read().split() if line.isdigit()]
            except FileNotFoundError:
                return 0.0, 0.0
            return float(sum(sizes)), float(len(sizes))
        return 0.0, 0.0

    def mean(
        self, before: tuple[float, float], after: tuple[float, float], done: int
    ) -> float | None:
        batches = after[1] - before[1]
        items = after[0] - before[0]
        if items != items:  # NaN: the probe counts batches only; every item was one request
            items = done
        return items / batches if batches > 0 else None


def windows(
    run_window: Callable[[float], tuple[int, list[float], int]],
    probe: BatchProbe,
    warmup: float,
    duration: float,
    repeats: int,
    meter: CpuMeter | None = None,
) -> list[dict[str, Any]]:
    """Warm up, then REPEATS measured windows; run_window(seconds) -> (done, latencies, errors).

    With a ``meter``, each window also has ``cpu_us_per_item``: the CPU time of each of the
    meter's process trees (the servers) per item, and their total."""
    run_window(warmup)
    # Every arm's load process alike: what exists now lives until the end, so a full collection
    # need not walk it (its pauses would show up as the served arms' tail latency).
    gc.collect()
    gc.freeze()
    out = []
    for _ in range(repeats):
        before = probe.totals()
        servers = meter.sample() if meter is not None else {}
        start, cpu = time.perf_counter(), sum(os.times()[:2])
        done, latencies, errors = run_window(duration)
        elapsed, cpu = time.perf_counter() - start, sum(os.times()[:2]) - cpu
        window: dict[str, Any] = {
            "items_per_s": done / elapsed,
            **percentiles(latencies),
            "requests": done,
            "errors": errors,
            "mean_batch": probe.mean(before, probe.totals(), done),
            # this process: the client and the load loop around it, every thread
            "load_cpu_us_per_item": cpu / done * 1e6 if done else None,
        }
        if meter is not None:  # the servers' processes, each tree apart
            window["cpu_us_per_item"] = per_item(servers, meter.sample(), done)
        out.append(window)
    return out


def thread_window(
    call: Callable[[Any], Any], concurrency: int
) -> Callable[[float], tuple[int, list[float], int]]:
    """N threads, each calling call(x) in a closed loop."""
    x = sample_input()

    def run(duration: float) -> tuple[int, list[float], int]:
        stop_at = time.perf_counter() + duration
        per_thread: list[list[float]] = [[] for _ in range(concurrency)]
        errors = [0]

        def client(latencies: list[float]) -> None:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    call(x)
                except Exception:
                    errors[0] += 1
                    continue
                latencies.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=client, args=(lat,)) for lat in per_thread]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        latencies = [v for lat in per_thread for v in lat]
        return len(latencies), latencies, errors[0]

    return run


def asyncio_window(
    acall: Callable[[Any], Any], concurrency: int
) -> Callable[[float], tuple[int, list[float], int]]:
    """N asyncio tasks on one (uvloop) loop, each awaiting acall(x) in a closed loop."""
    import asyncio

    x = sample_input()
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()

    def run(duration: float) -> tuple[int, list[float], int]:
        latencies: list[float] = []
        errors = 0
        stop_at = time.perf_counter() + duration

        async def client() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    await acall(x)
                except Exception:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - t0)

        async def main() -> None:
            await asyncio.gather(*(client() for _ in range(concurrency)))

        loop.run_until_complete(main())
        return len(latencies), latencies, errors

    run.loop = loop  # type: ignore[attr-defined]
    return run


def main() -> None:
    kind, spec = sys.argv[1], json.loads(sys.argv[2])
    concurrency, probe = spec["concurrency"], BatchProbe(spec.get("probe", "none"))
    roots = spec.get("cpu_roots")  # {name: pid}: the servers' process trees to meter
    timing = (spec["warmup"], spec["duration"], spec["repeats"], CpuMeter(roots) if roots else None)
    if kind in ("asyncio", "local"):
        if kind == "asyncio":
            from broker import Streamer

            streamer = Streamer(spec["name"], redis_url=spec["redis_url"], prefix=spec["prefix"])
        else:
            import torch

            from gpu_worker import LocalStreamer, load_model_class

            torch.set_num_threads(spec["torch_threads"])
            streamer = LocalStreamer(
                load_model_class(spec["model"]),
                batch_size=spec["batch_size"],
                device=spec.get("device", "cpu"),
            )
            probe = LocalProbe(streamer)

        async def acall(x: Any) -> Any:
            return await streamer.apredict([x], timeout=60)

        result = windows(asyncio_window(acall, concurrency), probe, *timing)
    elif kind == "threads":
        from broker import Streamer

        streamer = Streamer(spec["name"], redis_url=spec["redis_url"], prefix=spec["prefix"])
        result = windows(
            thread_window(lambda x: streamer.predict([x], timeout=60), concurrency),
            probe,
            *timing,
        )
    elif kind == "ss-redis":
        # service_streamer 0.1.2's RedisStreamer, one shared instance, N threads (its own usage)
        from service_streamer import RedisStreamer

        streamer = RedisStreamer(redis_broker=spec["broker"], prefix=spec["prefix"])
        result = windows(
            thread_window(lambda x: streamer.predict([x]), concurrency), probe, *timing
        )
    else:
        raise SystemExit(f"unknown load kind {kind}")
    print(json.dumps(result), flush=True)
    os._exit(0)  # background threads of some clients never end by themselves


class LocalProbe(BatchProbe):
    """LocalStreamer counts its batches; items are counted by the windows themselves."""

    def __init__(self, streamer: Any) -> None:
        self.streamer = streamer
        self.kind = "local"

    def totals(self) -> tuple[float, float]:
        return float("nan"), float(self.streamer.batches_run)


if __name__ == "__main__":
    main()
