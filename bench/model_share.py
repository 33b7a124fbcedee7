"""How much of a worker's time goes into the model, against the model called alone.

    python -m bench.model_share --model heavy --concurrency 256 --duration 10
    python -m bench.model_share --model wide --cuda 0    # on a GPU (docs/gpu.md)

Calls the model directly on full batches (the ceiling), then starts a private redis-server and
one `worker start` process with its metrics port, loads it with N asyncio tasks calling
``Streamer.apredict``, and reads the worker's own ``microbatch_worker_inference_seconds`` before
and after the window. It prints served and direct items/s, the share of the worker's wall time
spent in ``predict``, the time per batch inside and outside the model (what the serving costs,
apart from the model running slower while the client and Redis share the machine), and the CPU
time per item of the worker, the client (this process) and Redis, from /proc: steadier than
throughput on a shared machine, so the measure to compare two versions of the code by.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.request
from contextlib import ExitStack
from typing import Any

from bench.embed_bench import tree_cpu_seconds
from bench.harness import MODELS, ROOT
from bench.http_bench import process, wait_workers
from bench.spine import closed_loop, direct
from broker.devserver import free_port
from gpu_worker.batching import MODEL_THREAD_MODES

METRICS = ("inference_seconds_sum", "inference_seconds_count", "batch_size_sum")


def worker_totals(port: int) -> dict[str, float]:
    """The worker's inference time, batch count and items so far, from its /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    totals = {}
    for name in METRICS:
        found = re.search(rf"^microbatch_worker_{name}\{{[^}}]*\}} (\S+)", text, re.MULTILINE)
        totals[name] = float(found.group(1)) if found else 0.0
    return totals


def served(model: str, args: argparse.Namespace) -> dict[str, Any]:
    import uvloop

    from broker import Streamer
    from broker.devserver import RedisServer
    from broker.keys import ModelKeys
    from gpu_worker import load_model_class

    name = load_model_class(MODELS[model]).name
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.torch_threads)}
    port = free_port()
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        worker = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", MODELS[model]]
        worker += ["--redis", server.url, "--prefix", "share", "--metrics-port", str(port)]
        worker += ["--batch-size", str(args.batch_size), "--log-level", "WARNING"]
        worker += ["--cuda", args.cuda] if args.cuda is not None else []
        worker += ["--model-thread", args.model_thread]
        worker_pid = stack.enter_context(process(worker, env)).pid
        wait_workers(server.url, ModelKeys(name, "share"), 1)
        assert server.process is not None
        redis_pid = server.process.pid

        def cpu_seconds() -> dict[str, float]:
            return {
                "worker": tree_cpu_seconds([worker_pid]),  # the supervisor and its child
                "client": sum(os.times()[:2]),  # this process alone, all its threads
                "redis": tree_cpu_seconds([redis_pid]),
            }

        async def main() -> dict[str, Any]:
            streamer = Streamer(
                name, redis_url=server.url, prefix="share", entry_items=args.entry_items
            )
            await closed_loop(streamer, args.concurrency, args.warmup)
            before, started = worker_totals(port), time.perf_counter()
            cpu_before = cpu_seconds()
            done, _ = await closed_loop(streamer, args.concurrency, args.duration)
            elapsed, after = time.perf_counter() - started, worker_totals(port)
            cpu_after = cpu_seconds()
            await streamer.aclose()
            model_s = after[METRICS[0]] - before[METRICS[0]]
            batches = after[METRICS[1]] - before[METRICS[1]]
            items = after[METRICS[2]] - before[METRICS[2]]
            return {
                "items_per_s": done / elapsed,
                "mean_batch": items / batches,
                "model_share_of_wall": model_s / elapsed,
                "ms_per_batch_in_model": model_s / batches * 1e3,
                "ms_per_batch_outside_model": (elapsed - model_s) / batches * 1e3,
                **{
                    f"cpu_us_per_item_{role}": (cpu_after[role] - cpu_before[role]) / done * 1e6
                    for role in cpu_before
                },
            }

        return uvloop.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.model_share", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="heavy", choices=sorted(MODELS))
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--model-thread", default="auto", choices=MODEL_THREAD_MODES)
    parser.add_argument("--cuda", help="a CUDA device index for the model (default: the CPU)")
    parser.add_argument(
        "--entry-items",
        type=int,
        default=None,
        help="items per stream entry the client packs (default: the client's default, 32; "
        "1: one v1 entry per item)",
    )
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    device = "cpu" if args.cuda is None else f"cuda:{args.cuda}"
    alone = direct(MODELS[args.model], args.batch_size, args.duration, False, device)
    result = {"direct_batched_items_per_s": alone.items_per_s, **served(args.model, args)}
    result["served_over_direct"] = result["items_per_s"] / alone.items_per_s
    print(json.dumps({k: round(v, 3) for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
