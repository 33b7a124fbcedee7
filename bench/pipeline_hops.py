"""What a pipeline's extra stage costs at concurrency 1: a chain of two small models against the
first of them served alone.

    python -m bench.pipeline_hops [--requests 500]

Starts a private redis-server and real `worker start` processes (tests/pipeline_models.py: the
``Embed`` model alone, and the ``Chain`` pipeline, embed -> polarity, one worker per stage), then
sends one-item requests one after another through a Streamer and prints p50/p90/p99 latency of
each. The difference is the forwarding hop (a stream entry written by the first stage's worker,
read by the second's) plus the second model's time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def _latencies(url: str, name: str, requests: int) -> list[float]:
    from broker import Streamer

    item = np.arange(8, dtype=np.float32)
    with Streamer(name, redis_url=url, prefix="bench") as streamer:
        for _ in range(50):  # warm up
            streamer.predict([item], timeout=10)
        took = []
        for _ in range(requests):
            started = time.perf_counter()
            streamer.predict([item], timeout=10)
            took.append(time.perf_counter() - started)
    return took


def _start(url: str, model: str, *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", model]
    command += ["--redis", url, "--prefix", "bench", "--log-level", "warning", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, cwd=ROOT, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    options = parser.parse_args()
    from broker.connections import sync_client
    from broker.devserver import RedisServer
    from broker.keys import ModelKeys
    from broker.liveness import wait_for_consumers

    with RedisServer() as server:
        url = server.url
        module = "tests.pipeline_models"
        processes = [
            _start(url, f"{module}:Embed"),
            _start(url, f"{module}:Chain", "--stage", "embed"),
            _start(url, f"{module}:Chain", "--stage", "polarity"),
        ]
        try:
            client = sync_client(url)
            for name in ("embed", "chain", "chain.polarity"):
                wait_for_consumers(client, ModelKeys(name, "bench"), 1, 120)
            for name, label in (("embed", "one model (embed)"), ("chain", "chain embed->polarity")):
                took = sorted(_latencies(url, name, options.requests))
                q = statistics.quantiles(took, n=100)
                print(
                    f"{label:24s} p50 {q[49] * 1e3:6.2f} ms  p90 {q[89] * 1e3:6.2f} ms  "
                    f"p99 {q[98] * 1e3:6.2f} ms  ({len(took)} requests)"
                )
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(30)


if __name__ == "__main__":
    main()
