"""How much slower a model runs on a batch of one when it was not just running.

    python -m bench.cold_model [--model mlp] [--calls 2000]

A request at concurrency 1 reaches a model that has been waiting (for the request's round trip
through Redis) while other processes ran: its weights and the interpreter's code are no longer
in the CPU's caches, and on a VM the idle vCPU may have been descheduled. ``direct, one at a
time`` in the harness calls the model back to back, which nothing served at concurrency 1 can
match. This measures the same ``predict`` on one item, in this process, after each of:

* ``back to back``: nothing in between (the harness's floor);
* ``after a 0.3 ms sleep`` / ``after a 1 ms sleep``: the core may idle, as a worker's does while
  it waits for the next request;
* ``after 0.3 ms of busy polling``: the core kept busy, as ``worker start --busy-poll-us`` does;
* ``after touching 16 MB``: the caches taken by other work, as Redis and the caller's process
  do on a shared machine.

Prints the median and p90 of each, one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from bench.harness import MODELS
from bench.spine import sample_input
from gpu_worker.model import load_model_class
from gpu_worker.outcomes import outputs_now

THRASH_BYTES = 16 * 1024 * 1024


def _sleep(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)


def _spin(seconds: float) -> Callable[[], None]:
    def spin() -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    return spin


def _thrash() -> Callable[[], None]:
    buffer = np.zeros(THRASH_BYTES // 8)
    return lambda: buffer.__iadd__(1.0)


CONDITIONS: dict[str, Callable[[], Callable[[], None]]] = {
    "back to back": lambda: lambda: None,
    "after a 0.3 ms sleep": lambda: _sleep(0.0003),
    "after a 1 ms sleep": lambda: _sleep(0.001),
    "after 0.3 ms of busy polling": lambda: _spin(0.0003),
    "after touching 16 MB": _thrash,
}


def measure(model_name: str, calls: int) -> list[dict[str, float | str]]:
    import torch

    torch.set_num_threads(1)
    model = load_model_class(MODELS[model_name])()
    model.init_model()
    batch = [sample_input()]
    for _ in range(50):
        outputs_now(model.predict(batch))
    results: list[dict[str, float | str]] = []
    for condition, make in CONDITIONS.items():
        before = make()
        latencies = []
        for _ in range(calls):
            before()
            started = time.perf_counter()
            outputs_now(model.predict(batch))
            latencies.append(time.perf_counter() - started)
        latencies.sort()
        results.append(
            {
                "model": model_name,
                "condition": condition,
                "p50_ms": statistics.median(latencies) * 1000,
                "p90_ms": latencies[int(len(latencies) * 0.9)] * 1000,
            }
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cold_model", description=__doc__)
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS))
    parser.add_argument("--calls", type=int, default=2000, help="calls per condition")
    args = parser.parse_args(argv)
    for result in measure(args.model, args.calls):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
