"""Memory soak: the whole stack under steady load for a long while, its memory sampled.

    python -m bench.soak                      # 10 minutes (the published run)
    python -m bench.soak --duration 20 --interval 2 --output /tmp/soak.json   # a smoke run

Starts a private redis-server, `worker start --model examples.mlp:MLP` and `gateway start`,
then loads them for --duration seconds: N asyncio tasks calling ``Streamer.apredict`` (the
Python client path) and, when wrk is on PATH, wrk posting JSON to the gateway (the HTTP path).
Every --interval seconds it samples the resident memory of the worker's process tree, the
gateway's process tree, redis-server's ``used_memory``, and the stream's length. It reports
growth between the first sample after the warm-up and the last, and the slope over the second
half (MB per minute), as JSON (--output) and a PNG plot (--plot). A benchmark,
not a test: it asserts nothing about memory; the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import tree_rss_mb
from bench.http_bench import post_script, process, wait_http, wait_workers, wrk_counts
from broker.devserver import free_port
from gpu_worker.batching import MODEL_THREAD_MODES

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL, NAME, PREFIX = "examples.mlp:MLP", "mlp", "soak"


def slope_mb_per_min(times: list[float], values: list[float]) -> float:
    """Least-squares slope of values over times (seconds), in MB per minute."""
    if len(times) < 2:
        return 0.0
    slope, _ = np.polyfit(np.asarray(times), np.asarray(values), 1)
    return float(slope) * 60


def client_load(url: str, concurrency: int, stop: threading.Event, counts: list[int]) -> None:
    import uvloop

    from broker import Streamer

    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)

    async def main() -> None:
        streamer = Streamer(NAME, redis_url=url, prefix=PREFIX)

        async def one() -> None:
            while not stop.is_set():
                try:
                    await streamer.apredict([x], timeout=30)
                    counts[0] += 1
                except Exception:
                    counts[1] += 1

        await asyncio.gather(*(one() for _ in range(concurrency)))
        await streamer.aclose()

    uvloop.run(main())


def wrk_load(url: str, concurrency: int, seconds: float, script: Path) -> subprocess.Popen[str]:
    command = ["wrk", "-t1", f"-c{concurrency}", f"-d{int(seconds)}s", "--timeout", "30s"]
    command += ["-s", str(script), url]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import redis

    from broker.devserver import RedisServer
    from broker.keys import ModelKeys

    keys = ModelKeys(NAME, PREFIX)
    begun = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    samples: list[dict[str, float]] = []
    counts = [0, 0]  # python client: answered, failed
    wrk_out = ""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        worker = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", MODEL]
        worker += ["--redis", server.url, "--prefix", PREFIX, "--log-level", "WARNING"]
        worker += ["--model-thread", args.model_thread, "--busy-poll-us", str(args.busy_poll_us)]
        worker_proc = stack.enter_context(process(worker, env))
        port = free_port()
        gateway = [sys.executable, "-m", "web_gateway.cli", "start", "--model", MODEL]
        gateway += ["--redis", server.url, "--prefix", PREFIX, "--port", str(port)]
        gateway += ["--workers", str(args.gateway_workers), "--log-level", "warning"]
        gateway_proc = stack.enter_context(process(gateway, env))
        wait_workers(server.url, keys, 1)
        url = f"http://127.0.0.1:{port}/v1/models/{NAME}/predict"
        wait_http(f"http://127.0.0.1:{port}/healthz")
        admin = redis.Redis.from_url(server.url)
        stack.callback(admin.close)

        stop = threading.Event()
        loader = threading.Thread(
            target=client_load, args=(server.url, args.client_concurrency, stop, counts)
        )
        loader.start()
        stack.callback(loader.join)
        stack.callback(stop.set)
        wrk = None
        if shutil.which("wrk") and args.http_concurrency > 0:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
            script = post_script(folder / "post.lua", json.dumps({"inputs": [[0.25] * 256]}))
            wrk = wrk_load(url, args.http_concurrency, args.duration, script)
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < args.duration:
            samples.append(
                {
                    "t_s": round(elapsed, 1),
                    "worker_mb": round(tree_rss_mb(worker_proc.pid), 1),
                    "gateway_mb": round(tree_rss_mb(gateway_proc.pid), 1),
                    "redis_mb": round(int(admin.info("memory")["used_memory"]) / 2**20, 2),
                    "stream_length": int(admin.xlen(keys.stream)),
                    "client_answered": counts[0],
                }
            )
            time.sleep(args.interval)
        stop.set()
        if wrk is not None:
            wrk_out = wrk.communicate(timeout=60)[0]
    after = [s for s in samples if s["t_s"] >= args.warmup] or samples
    second_half = after[len(after) // 2 :]
    summary = {}
    for key in ("worker_mb", "gateway_mb", "redis_mb"):
        values = [s[key] for s in after]
        summary[key] = {
            "first": values[0],
            "last": values[-1],
            "max": max(values),
            "median": statistics.median(values),
            "growth": round(values[-1] - values[0], 2),
            "slope_second_half_mb_per_min": round(
                slope_mb_per_min([s["t_s"] for s in second_half], [s[key] for s in second_half]),
                3,
            ),
        }
    return {
        "command": " ".join(["python -m bench.soak", *sys.argv[1:]]),
        "started": begun,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "client_concurrency": args.client_concurrency,
        "gateway_workers": args.gateway_workers,
        "model_thread": args.model_thread,
        "busy_poll_us": args.busy_poll_us,
        "http_concurrency": args.http_concurrency if wrk_out else 0,
        "client_answered": counts[0],
        "client_failed": counts[1],
        "wrk": _wrk_summary(wrk_out),
        "summary": summary,
        "samples": samples,
    }


def _wrk_summary(out: str) -> dict[str, Any]:
    if not out:
        return {}
    requests, non_2xx = wrk_counts(out)
    return {"requests": requests, "non_2xx": non_2xx, "socket_errors": "Socket errors" in out}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key, label in (
        ("worker_mb", "worker (supervisor + model process)"),
        ("gateway_mb", "gateway (gunicorn master + workers)"),
        ("redis_mb", "redis used_memory"),
    ):
        ax.plot(minutes, [s[key] for s in samples], label=label)
    ax.set_xlabel("minutes under load")
    ax.set_ylabel("MB")
    ax.set_ylim(bottom=0)
    ax.set_title("Memory under steady load (MLP, Python client + HTTP)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds under load")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before growth counts")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--client-concurrency", type=int, default=64)
    parser.add_argument("--http-concurrency", type=int, default=32, help="0: no HTTP load")
    parser.add_argument("--gateway-workers", type=int, default=1)
    parser.add_argument(
        "--model-thread", choices=MODEL_THREAD_MODES, default="auto", help="the worker's mode"
    )
    parser.add_argument(
        "--busy-poll-us", type=int, default=0, help="the worker's --busy-poll-us (0: none)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "soak.json")
    parser.add_argument("--plot", type=Path, help="a PNG of memory over time")
    args = parser.parse_args()
    args.warmup = min(args.warmup, args.duration / 2)
    report = run(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
