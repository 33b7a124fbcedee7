"""The Python client's own cost: blocking ``predict`` from threads against ``apredict``.

    python -m bench.client_cost                             # this tree's client, 3 rounds
    python -m bench.client_cost --code /tmp/old --code .    # A/B: old and new code alternate

Starts a private redis-server and one ``worker start --model bench.models:Identity`` process at
its defaults, then, round after round, runs each arm in a fresh load process: N threads calling
``Streamer.predict([x])`` (arm ``threads``) or ``Streamer.submit([x]).result()`` (``submit``),
or N asyncio tasks (uvloop) awaiting ``Streamer.apredict([x])``, the very loops of
bench/load.py. A load process warms up, then measures one window: items/s, p50 /
p99 latency, the CPU time per item of itself (the client, all its threads; its system share
apart) and of the worker processes and Redis (from /proc), and its own context switches per
item. With several ``--code`` trees each load process imports the client from one of them
(PYTHONPATH), in turn, against the same worker and Redis. The machine's speed is taken before
and after (the reference MLP called directly on batches of 64, one torch thread).

Prints a markdown table of the medians over the rounds and the ratios the targets judge
(blocking c=64 against asyncio at c=256 and c=64; c=1 p50 differences: the identity model's
own time is under a microsecond, so its p50 is the serving's added latency); ``--json PATH``
keeps every window.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ARMS = [
    ("threads", 64), ("submit", 64), ("asyncio", 256), ("asyncio", 64), ("threads", 1),
    ("asyncio", 1),
]  # fmt: skip
SHOWN = [
    ("items_per_s", "items/s", 0),
    ("p50_ms", "p50 ms", 3),
    ("p99_ms", "p99 ms", 2),
    ("cpu_us_per_item_client", "client CPU us/item", 1),
    ("cpu_us_per_item_client_system", "(system)", 1),
    ("context_switches_per_item_client", "client switches/item", 2),
    ("cpu_us_per_item_worker", "worker CPU us/item", 1),
    ("cpu_us_per_item_redis", "Redis CPU us/item", 1),
]


def _ticks(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _sample(spec: dict[str, Any]) -> tuple[float, ...]:
    """CPU seconds of this process (all, system), the worker and Redis; context switches."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (
        usage.ru_utime + usage.ru_stime,
        usage.ru_stime,
        _ticks(spec["worker_pids"]),
        _ticks([spec["redis_pid"]]),
        usage.ru_nvcsw + usage.ru_nivcsw,
    )


def child(spec: dict[str, Any]) -> None:
    """One arm in this process: warm up, then one measured window; print its JSON line."""
    from bench.load import asyncio_window, percentiles, thread_window
    from broker import Streamer

    streamer = Streamer("identity", redis_url=spec["redis_url"], prefix=spec["prefix"])
    if spec["kind"] == "threads":
        run = thread_window(lambda x: streamer.predict([x], timeout=60), spec["concurrency"])
    elif spec["kind"] == "submit":
        run = thread_window(
            lambda x: streamer.submit([x], timeout=60).result(), spec["concurrency"]
        )
    else:

        async def acall(x: Any) -> Any:
            return await streamer.apredict([x], timeout=60)

        run = asyncio_window(acall, spec["concurrency"])
    run(spec["warmup"])
    gc.collect()
    gc.freeze()
    load = os.getloadavg()[0]
    before, start = _sample(spec), time.perf_counter()
    done, latencies, errors = run(spec["duration"])
    elapsed, after = time.perf_counter() - start, _sample(spec)
    per_item = [(b - a) / max(done, 1) for a, b in zip(before, after, strict=True)]
    client, system, worker, redis, switches = per_item
    result = {"items_per_s": done / elapsed, **percentiles(latencies), "errors": errors}
    result |= {"cpu_us_per_item_client": client * 1e6}
    result |= {"cpu_us_per_item_client_system": system * 1e6}
    result |= {"cpu_us_per_item_worker": worker * 1e6, "cpu_us_per_item_redis": redis * 1e6}
    result |= {"context_switches_per_item_client": switches, "load_1min": load}
    print(json.dumps(result), flush=True)
    os._exit(0)


def worker_pids(root: int) -> list[int]:
    """The worker's supervisor and its children (they stay the same for the whole run)."""
    pids, frontier = [root], [root]
    while frontier:
        pid = frontier.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(p) for p in f.read().split()]
        except OSError:
            kids = []
        pids += kids
        frontier += kids
    return pids


def machine_speed() -> float:
    """The reference MLP called directly on batches of 64 (items/s): how fast the box is now."""
    import torch

    from bench.spine import direct

    torch.set_num_threads(1)
    return direct("examples.mlp:MLP", 64, 2.0, False).items_per_s


def run_arms(args: argparse.Namespace, trees: list[str]) -> list[dict[str, Any]]:
    from bench.http_bench import process, wait_workers
    from broker.devserver import RedisServer
    from broker.keys import ModelKeys

    root = Path(__file__).resolve().parent.parent
    arms = [(k, int(c)) for k, c in (a.split(":") for a in args.arms.split(","))]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    windows: list[dict[str, Any]] = []
    with RedisServer() as server:
        worker = [sys.executable, "-m", "gpu_worker.cli", "start"]
        worker += ["--model", "bench.models:Identity", "--redis", server.url, "--prefix", "cost"]
        with process([*worker, "--log-level", "WARNING"], env) as proc:
            wait_workers(server.url, ModelKeys("identity", "cost"), 1)
            assert server.process is not None
            base = {"redis_url": server.url, "prefix": "cost", "redis_pid": server.process.pid}
            base |= {"worker_pids": worker_pids(proc.pid), "warmup": args.warmup}
            base["duration"] = args.duration
            for round_ in range(args.rounds):
                for kind, c in arms:
                    for tree in trees:
                        spec = {**base, "kind": kind, "concurrency": c}
                        out = subprocess.run(
                            [sys.executable, __file__, "--child", json.dumps(spec)],
                            env={**env, "PYTHONPATH": tree},
                            capture_output=True,
                            text=True,
                            check=True,
                        ).stdout
                        row = {"tree": tree, "arm": f"{kind} c={c}", "round": round_}
                        windows.append(row | json.loads(out.strip().splitlines()[-1]))
                        print(json.dumps(windows[-1]), file=sys.stderr, flush=True)
    return windows


def medians(windows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per tree and arm, the median of each figure over the rounds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for w in windows:
        out.setdefault(w["tree"], {}).setdefault(w["arm"], {})
    for tree, arms in out.items():
        for arm in arms:
            rows = [w for w in windows if w["tree"] == tree and w["arm"] == arm]
            keys = [k for k, v in rows[0].items() if isinstance(v, float | int) and k != "round"]
            arms[arm] = {k: statistics.median(r[k] for r in rows) for k in keys}
    return out


def table(meds: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| code | arm | " + " | ".join(label for _, label, _ in SHOWN) + " |"]
    lines.append("|---|---|" + "---:|" * len(SHOWN))
    for tree, arms in meds.items():
        for arm, m in arms.items():
            cells = [f"{m[key]:,.{digits}f}" for key, _, digits in SHOWN]
            lines.append(f"| {tree} | {arm} | " + " | ".join(cells) + " |")
    lines.append("")
    for tree, arms in meds.items():
        for name in ("threads c=64", "submit c=64"):
            blocking = arms.get(name)
            for other in ("asyncio c=256", "asyncio c=64"):
                if blocking and other in arms:
                    ratio = blocking["items_per_s"] / arms[other]["items_per_s"]
                    cpu = blocking["cpu_us_per_item_client"] / arms[other]["cpu_us_per_item_client"]
                    lines.append(
                        f"- {tree}: {name} / {other}: {ratio:.0%} of its items/s, "
                        f"{cpu:.2f}x its client CPU per item"
                    )
        if "threads c=1" in arms and "asyncio c=1" in arms:
            gap = arms["threads c=1"]["p50_ms"] - arms["asyncio c=1"]["p50_ms"]
            lines.append(f"- {tree}: c=1 p50, blocking minus asyncio: {gap:+.3f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.client_cost", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--code", action="append", help="a tree to import broker from (repeat)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per window")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--arms", default=",".join(f"{k}:{c}" for k, c in ARMS))
    parser.add_argument("--json", help="write every window and the medians here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    root = Path(__file__).resolve().parent.parent
    trees = [str(Path(c).resolve()) for c in (args.code or [str(root)])]
    load_before, speed_before = os.getloadavg(), machine_speed()
    windows = run_arms(args, trees)
    speed_after, load_after = machine_speed(), os.getloadavg()
    meds = medians(windows)
    print(table(meds))
    print(
        f"- machine: reference MLP direct, batches of 64: {speed_before:,.0f} items/s before, "
        f"{speed_after:,.0f} after; load average (1, 5, 15 min) before "
        f"{', '.join(f'{v:.2f}' for v in load_before)}, after "
        f"{', '.join(f'{v:.2f}' for v in load_after)}"
    )
    if args.json:
        report: dict[str, Any] = {"windows": windows, "medians": meds}
        report |= {"machine_items_per_s": [speed_before, speed_after]}
        report |= {"load": [load_before, load_after]}
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
