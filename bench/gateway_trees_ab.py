"""CPU per request of the real HTTP stack, two code trees A/B (e.g. main against a branch).

Starts, for each tree, a private redis-server, one ``worker start --model examples.mlp:MLP``
and one ``gateway start`` (one process), all run from that tree's code; then loads the two
stacks in turn with ``wrk`` (closed loop, the harness' body: one item of 256 numbers), arms
alternating run by run, and reads each process tree's CPU time from /proc around every run.
Prints each arm's median (over the runs) of requests/s and CPU microseconds per request of the
gateway, the worker and Redis, and the median of the back-to-back pairs' gateway ratios.

    flock /work/notes/bench.lock .venv/bin/python -m bench.gateway_trees_ab \\
        --base /tmp/base-tree [--new .] [--runs 5] [--duration 8] [--connections 64]

``--base`` is a checkout of the other code (``git worktree add /tmp/base-tree main``) with
the same virtual environment (a ``.venv`` link, or this one's Python is used).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bench.cpu import CpuMeter, per_item
from bench.http_bench import ENV, post_script, process, wait_http, wait_workers, wrk_counts
from broker.devserver import RedisServer, free_port
from broker.keys import ModelKeys

PREFIX = "ab"


def start_stack(stack: ExitStack, tree: Path) -> tuple[str, CpuMeter]:
    """Redis, a worker and a gateway run from ``tree``; (the predict URL, their meter)."""
    server = stack.enter_context(RedisServer())
    env = {**ENV, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    python = sys.executable
    common = ["--redis", server.url, "--prefix", PREFIX, "--model", "examples.mlp:MLP"]
    worker = [python, "-m", "gpu_worker.cli", "start", *common, "--log-level", "WARNING"]
    worker_proc = stack.enter_context(process(worker, env=env, cwd=tree))
    port = free_port()
    gateway = [python, "-m", "web_gateway.cli", "start", *common, "--port", str(port)]
    gateway += ["--workers", "1", "--log-level", "warning"]
    gateway_proc = stack.enter_context(process(gateway, env=env, cwd=tree))
    wait_workers(server.url, ModelKeys("mlp", PREFIX), 1, proc=worker_proc)
    wait_http(f"http://127.0.0.1:{port}/healthz")
    roots = {"gateway": gateway_proc.pid, "worker": worker_proc.pid, "redis": server.process.pid}
    return f"http://127.0.0.1:{port}/v1/models/mlp/predict", CpuMeter(roots)


def load(url: str, script: Path, meter: CpuMeter, connections: int, seconds: int) -> dict[str, Any]:
    """One wrk run: requests/s and CPU us per request of each process tree."""
    command = ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "-s", str(script), url]
    before = meter.sample()
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    after = meter.sample()
    total, errors = wrk_counts(out)
    if errors:
        raise RuntimeError(f"{errors} non-2xx answers from {url}")
    cpu = per_item(before, after, total)
    assert cpu is not None
    return {"rps": total / seconds, **cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other code tree")
    parser.add_argument("--new", type=Path, default=Path("."), help="this code tree")
    parser.add_argument("--runs", type=int, default=5, help="wrk runs per arm")
    parser.add_argument("--duration", type=int, default=8, help="seconds per wrk run")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the runs here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    item = [round(float(v), 4) for v in rng.standard_normal(256)]
    script = post_script(Path(tempfile.mkdtemp()) / "post.lua", json.dumps({"inputs": [item]}))
    arms = {"base": args.base.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    with ExitStack() as stack:
        stacks = {name: start_stack(stack, tree) for name, tree in arms.items()}
        for url, meter in stacks.values():  # warm up
            load(url, script, meter, args.connections, 2)
        for index in range(args.runs):
            order = list(stacks) if index % 2 == 0 else list(reversed(stacks))
            for name in order:
                url, meter = stacks[name]
                runs[name].append(load(url, script, meter, args.connections, args.duration))
    print(f"wrk -c{args.connections}, {args.runs} runs of {args.duration} s per arm, alternating")
    print(f"{'arm':6s} {'req/s':>8s} {'gateway':>8s} {'worker':>8s} {'redis':>8s}  us CPU/request")
    for name, results in runs.items():
        med = {key: statistics.median(run[key] for run in results) for key in results[0]}
        print(
            f"{name:6s} {med['rps']:8.0f} {med['gateway']:8.1f} {med['worker']:8.1f} "
            f"{med['redis']:8.1f}"
        )
    ratios = [n["gateway"] / b["gateway"] for n, b in zip(runs["new"], runs["base"], strict=True)]
    print(f"gateway new/base, median of pairs: {statistics.median(ratios):.3f}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
