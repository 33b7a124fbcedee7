"""Spine benchmark: a model called directly vs served through Redis by the Python client.

Scenarios, each a closed loop for a fixed duration after a warm-up, repeated (medians reported):

* direct, batched: ``model.predict`` on full batches (the ceiling);
* direct, one at a time: ``model.predict([x])`` in a loop (the floor);
* redis: ``Streamer.apredict([x])`` from N concurrent asyncio tasks (uvloop) in one process,
  against one ``worker start`` process and a private redis-server on this machine.

Every arm uses the same torch thread count (``--torch-threads``; the worker gets it through
OMP_NUM_THREADS). Run: ``python -m bench.spine [--quick]``. Writes bench/results/spine.json and
prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.http_bench import wait_workers
from broker import Streamer
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from gpu_worker import load_model_class
from gpu_worker.outcomes import outputs_now

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODELS = {
    "identity": "bench.models:Identity",
    "mlp": "examples.mlp:MLP",
    "heavy": "bench.models:HeavyMLP",
}


@dataclass
class Result:
    model: str
    scenario: str
    concurrency: int
    items_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_batch: float | None = None


def percentiles(latencies: list[float]) -> tuple[float, float, float]:
    ordered = sorted(latencies)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return pick(0.5), pick(0.9), pick(0.99)


def sample_input() -> np.ndarray:
    return np.random.default_rng(0).standard_normal(256).astype(np.float32)


def direct(
    model_path: str, batch_size: int, duration: float, one_at_a_time: bool, device: str = "cpu"
) -> Result:
    model = load_model_class(model_path)(device=device)
    model.init_model()
    x = sample_input()
    batch = [x] if one_at_a_time else [x] * batch_size
    for _ in range(5):
        outputs_now(model.predict(batch))
    latencies: list[float] = []
    items = 0
    start = time.perf_counter()
    while time.perf_counter() - start < duration:
        t0 = time.perf_counter()
        outputs_now(model.predict(batch))  # with a GPU's pending outputs: until they land
        latencies.append(time.perf_counter() - t0)
        items += len(batch)
    elapsed = time.perf_counter() - start
    scenario = "direct, one at a time" if one_at_a_time else f"direct, batches of {batch_size}"
    return Result(model.name, scenario, 1, items / elapsed, *percentiles(latencies))


async def closed_loop(
    streamer: Streamer, concurrency: int, duration: float
) -> tuple[int, list[float]]:
    x = sample_input()
    latencies: list[float] = []
    done = 0
    stop_at = time.perf_counter() + duration

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await streamer.apredict([x], timeout=60)
            latencies.append(time.perf_counter() - t0)
            done += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done, latencies


def run_load(
    url: str, name: str, prefix: str, concurrency: int, duration: float, warmup: float
) -> dict[str, Any]:
    import uvloop

    streamer = Streamer(name, redis_url=url, prefix=prefix)

    async def main() -> dict[str, Any]:
        await closed_loop(streamer, concurrency, warmup)
        start = time.perf_counter()
        done, latencies = await closed_loop(streamer, concurrency, duration)
        elapsed = time.perf_counter() - start
        await streamer.aclose()
        return {"items_per_s": done / elapsed, "latencies": latencies}

    return uvloop.run(main())


class WorkerProcess:
    """One `worker start` process; reports the batches it ran when stopped."""

    def __init__(self, url: str, model_path: str, prefix: str, batch_size: int, threads: int):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
        command = [
            sys.executable,
            "-m",
            "gpu_worker.cli",
            "start",
            "--model",
            model_path,
            "--redis",
            url,
            "--prefix",
            prefix,
            "--batch-size",
            str(batch_size),
            "--log-level",
            "INFO",
        ]
        self.process = subprocess.Popen(
            command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
        )
        self.name = load_model_class(model_path).name
        self.keys = ModelKeys(self.name, prefix)
        self.url = url

    def wait_ready(self, timeout: float = 120) -> None:
        wait_workers(self.url, self.keys, 1, timeout, self.process)

    def stop(self) -> tuple[int, int]:
        """SIGTERM; return (batches, items) the worker ran."""
        self.process.terminate()
        _, stderr = self.process.communicate(timeout=60)
        found = re.findall(r"stopped after (\d+) batches \((\d+) items", stderr)
        return (int(found[-1][0]), int(found[-1][1])) if found else (0, 0)


def served(url: str, model_path: str, concurrency: int, args: argparse.Namespace) -> Result:
    prefix = f"bench{os.getpid()}{concurrency}"
    worker = WorkerProcess(url, model_path, prefix, args.batch_size, args.torch_threads)
    try:
        worker.wait_ready()
        # the load runs in its own process, like a real caller on another machine would
        code = (
            "import json, sys; from bench.spine import run_load; "
            f"r = run_load({url!r}, {worker.name!r}, {prefix!r}, {concurrency}, "
            f"{args.duration}, {args.warmup}); print(json.dumps(r))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        load = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        batches, items = worker.stop()
    return Result(
        worker.name,
        "redis, python client (asyncio)",
        concurrency,
        load["items_per_s"],
        *percentiles(load["latencies"]),
        mean_batch=items / batches if batches else None,
    )


def median_result(results: list[Result]) -> Result:
    first = results[0]
    fields = ("items_per_s", "p50_ms", "p90_ms", "p99_ms")
    values = {f: statistics.median(getattr(r, f) for r in results) for f in fields}
    batches = [r.mean_batch for r in results if r.mean_batch]
    return Result(
        first.model,
        first.scenario,
        first.concurrency,
        **values,
        mean_batch=statistics.median(batches) if batches else None,
    )


def table(results: list[Result]) -> str:
    lines = [
        "| model | scenario | concurrency | items/s | p50 ms | p90 ms | p99 ms | mean batch |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        batch = f"{r.mean_batch:.1f}" if r.mean_batch else "-"
        lines.append(
            f"| {r.model} | {r.scenario} | {r.concurrency} | {r.items_per_s:,.0f} | "
            f"{r.p50_ms:.2f} | {r.p90_ms:.2f} | {r.p99_ms:.2f} | {batch} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp", help="comma-separated: identity,mlp,heavy")
    parser.add_argument("--concurrency", default="1,256")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="one short repeat (proves it runs)")
    parser.add_argument("--output", default=str(RESULTS / "spine.json"))
    args = parser.parse_args()
    if args.quick:
        args.duration, args.warmup, args.repeats = 1.0, 0.3, 1

    import torch

    torch.set_num_threads(args.torch_threads)
    results: list[Result] = []
    with RedisServer() as server:
        for model in args.models.split(","):
            path = MODELS[model]
            arms: list[list[Result]] = [[], []]
            served_arms: dict[int, list[Result]] = {}
            for _ in range(args.repeats):
                arms[0].append(direct(path, args.batch_size, args.duration, one_at_a_time=False))
                arms[1].append(direct(path, args.batch_size, args.duration, one_at_a_time=True))
                for concurrency in map(int, args.concurrency.split(",")):
                    served_arms.setdefault(concurrency, []).append(
                        served(server.url, path, concurrency, args)
                    )
            results += [median_result(arm) for arm in arms]
            results += [median_result(arm) for arm in served_arms.values()]
    report = {
        "command": " ".join(["python -m bench.spine", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": args.torch_threads,
        "repeats": args.repeats,
        "duration_s": args.duration,
        "results": [asdict(r) for r in results],
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
