"""``python -m bench.scale``: latency and Redis round trips across namespace hosts, and
throughput over 1, 2 and 3 Redis Cluster shards (docs/scaling.md).

(a) *hosts*: Linux network-namespace hosts (tests/hosts): one Redis, a worker host, a gateway
host and a client host, every Redis connection through the harness's delaying relay (about
0.25 ms each way per hop). Calls at concurrency 1 through the Python client and through the
gateway: p50/p99 latency, and from the relay's counters the Redis round trips, commands and
bytes per request of each host.

(b) *shards*: a Redis Cluster of 1, 2 and 3 primaries on this machine's loopback, each
redis-server capped by a cgroup (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``) at ``--redis-cpu``
CPUs, serving one :class:`bench.models.Identity` model whose queue is partitioned six ways
(``worker start --partitions 6``), named so that its six partition streams fall in the six
sixths of the slot space: every primary serves the same number of partitions
(``--layout models``: six unpartitioned models spread the same way instead, the earlier
stand-in). Caller processes keep many calls open; the items/s answered, each process kind's
CPU per item, and each primary's Redis CPU.

Results go to ``bench/results/scale/``. Needs root (namespaces, cgroups). ``--quick``: a smoke
run of about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np

from broker.cluster_lane import key_slot
from broker.devserver import RedisServer, find_redis_server, free_port
from broker.keys import ModelKeys

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "scale"
SLOTS = 16384
PREFIX = "scale"
IDENTITY = "bench.models:Identity"
MODELS = 6  # spread evenly over 1, 2 or 3 shards
PARTITIONS = 6  # of the one model of the partitioned layout, spread the same way
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", flush=True)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# -- process CPU -----------------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with suppress(OSError):
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by these processes and their descendants."""
    tree, total, todo = _children(), 0.0, list(pids)
    while todo:
        pid = todo.pop()
        with suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
        todo += tree.get(pid, [])
    return total


# -- cgroups ---------------------------------------------------------------------------------
class CpuCap:
    """A cgroup capping its processes at ``cpus`` CPUs (v2 ``cpu.max`` where the cpu controller
    is in the unified hierarchy, else v1 ``cpu.cfs_quota_us``)."""

    def __init__(self, name: str, cpus: float) -> None:
        # a short period keeps the stalls short; the kernel's smallest quota is 1 ms
        self.period_us = max(10_000, int(1000 / cpus))
        quota = max(1000, round(cpus * self.period_us))
        v1 = Path("/sys/fs/cgroup/cpu")
        if (v1 / "cpu.cfs_quota_us").exists():
            self.path, self.kind = v1 / name, "v1 cpu.cfs_quota_us"
            settings = {"cpu.cfs_period_us": str(self.period_us), "cpu.cfs_quota_us": str(quota)}
        else:
            self.path, self.kind = Path("/sys/fs/cgroup") / name, "v2 cpu.max"
            settings = {"cpu.max": f"{quota} {self.period_us}"}
        self.path.mkdir()
        try:
            for setting, value in settings.items():
                (self.path / setting).write_text(value)
        except OSError:
            self.remove()
            raise

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        with suppress(OSError):
            self.path.rmdir()


# -- (b) a cluster of N primaries on loopback ------------------------------------------------
def model_names(count: int = MODELS) -> list[str]:
    """One model name per 1/count of the slot space, so that any shard count dividing
    ``count`` serves the same number of models."""
    names: list[str] = []
    for part in range(count):
        low, high = part * SLOTS // count, (part + 1) * SLOTS // count
        names.append(
            next(
                f"id{k}"
                for k in range(100_000)
                if low <= key_slot(ModelKeys(f"id{k}", PREFIX).stream) < high
            )
        )
    return names


def partitioned_name(partitions: int = PARTITIONS) -> str:
    """A model name whose ``partitions`` partition streams fall one in each 1/partitions of
    the slot space, so that any shard count dividing ``partitions`` serves as many of them."""

    def parts(name: str) -> list[int]:
        keys = ModelKeys(name, PREFIX, partitions=partitions)
        return sorted(key_slot(each.stream) * partitions // SLOTS for each in keys.each())

    return next(f"p{k}" for k in range(1_000_000) if parts(f"p{k}") == list(range(partitions)))


@contextmanager
def cluster(shards: int, cpus: float) -> Iterator[tuple[str, list[RedisServer], str]]:
    """(redis+cluster:// URL, nodes, cgroup kind) of ``shards`` capped primaries, slots in
    even ranges."""
    config = {"cluster-enabled": "yes", "cluster-config-file": "nodes.conf", "protected-mode": "no"}
    nodes = [RedisServer({**config, "cluster-port": str(free_port())}) for _ in range(shards)]
    caps: list[CpuCap] = []
    try:
        for index, node in enumerate(nodes):
            node.start()
            assert node.process is not None
            caps.append(CpuCap(f"mbscale{os.getpid()}-{shards}-{index}", cpus))
            caps[-1].add(node.process.pid)
            client = node.client()
            low, high = index * SLOTS // shards, (index + 1) * SLOTS // shards - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
            if index:
                bus = nodes[0].config["cluster-port"]
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port, bus)
            client.close()
        deadline = time.monotonic() + 30
        while not all(_cluster_ok(node, shards) for node in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a {shards}-node cluster did not form")
            time.sleep(0.1)
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in nodes)
        yield url, nodes, caps[0].kind
    finally:
        for node in nodes:
            node.stop()
        for cap in caps:
            cap.remove()


def _cluster_ok(node: RedisServer, shards: int) -> bool:
    client = node.client()
    try:
        info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        return fields.get("cluster_state") == "ok" and int(fields["cluster_known_nodes"]) == shards
    finally:
        client.close()


def redis_counters(nodes: list[RedisServer]) -> dict[str, Any]:
    """Summed over nodes: CPU seconds used and commands' microseconds (INFO); and each node's
    CPU seconds."""
    cpu = usec = calls = 0.0
    each: list[float] = []
    for node in nodes:
        client = node.client()
        info = client.info("cpu")
        each.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
        cpu += each[-1]
        for stats in client.info("commandstats").values():
            usec += float(stats["usec"])
            calls += float(stats["calls"])
        client.close()
    return {"cpu_s": cpu, "command_usec": usec, "commands": calls, "node_cpu_s": each}


def _packing(config: dict[str, Any]) -> dict[str, Any]:
    """The Streamer's ``entry_items`` when the run names one (else the client's default)."""
    return {} if config.get("entry_items") is None else {"entry_items": config["entry_items"]}


async def _callers(config: dict[str, Any]) -> dict[str, Any]:
    """One caller process: ``concurrency`` call loops split evenly over the models, for
    warm-up + seconds."""
    from broker import Streamer

    streamers = [
        Streamer(name, redis_url=config["url"], prefix=PREFIX, **_packing(config))
        for name in config["models"]
    ]
    item = np.zeros(256, dtype=np.float32)
    start = time.monotonic() + config["warmup"]
    end = start + config["seconds"]
    counted = [0]
    errors: dict[str, int] = {}
    cpu: dict[str, float] = {}

    async def loop(streamer: Streamer) -> None:
        while (now := time.monotonic()) < end:
            try:
                await streamer.apredict([item], timeout=30)
            except Exception as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                continue
            if now >= start:
                counted[0] += 1

    async def mark() -> None:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        cpu["start"] = time.process_time()
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        cpu["end"] = time.process_time()

    each = max(1, config["concurrency"] // len(streamers))
    tasks = [loop(s) for s in streamers for _ in range(each)]
    await asyncio.gather(mark(), *tasks)
    for streamer in streamers:
        await streamer.aclose()
    return {"items": counted[0], "errors": errors, "cpu_s": cpu["end"] - cpu["start"]}


def caller_main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    result = asyncio.run(_callers(config))
    Path(config["out"]).write_text(json.dumps(result))


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log_path.open("wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each (a worker answers what it holds and goes), SIGKILL what outlives 15 s."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _start_workers(
    url: str, names: list[str], args: argparse.Namespace, log_to: Path
) -> list[subprocess.Popen[bytes]]:
    """One `worker start` per model: of ``--workers`` processes over ``PARTITIONS``
    partitions (partitioned layout), or of one process (six models)."""
    partitioned = args.layout == "partitions"
    extra = ["--partitions", str(PARTITIONS), "--workers", str(args.workers)] if partitioned else []
    workers = []
    for name in names:
        cmd = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", IDENTITY,
               "--name", name, "--redis", url, "--prefix", PREFIX,
               "--max-latency", "0", "--batch-size", str(args.batch_size), *extra]  # fmt: skip
        workers.append(_spawn(cmd, log_to.with_name(f"{log_to.name}-{name}.log")))
    _wait_workers(url, names, PARTITIONS if partitioned else 1, args.workers if partitioned else 1)
    return workers


def run_shards(shards: int, cpus: float, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    names = [partitioned_name()] if args.layout == "partitions" else model_names()
    with cluster(shards, cpus) as (url, nodes, cap_kind):
        workers: list[subprocess.Popen[bytes]] = []
        callers: list[subprocess.Popen[bytes]] = []
        try:
            workers = _start_workers(url, names, args, workdir / f"worker-{shards}")
            outs = []
            for index in range(args.callers):
                outs.append(workdir / f"caller-{shards}-{index}.json")
                config = {"url": url, "models": names, "concurrency": args.concurrency,
                          "warmup": args.warmup, "seconds": args.seconds,
                          "entry_items": args.entry_items, "out": str(outs[-1])}  # fmt: skip
                config_path = workdir / f"caller-{shards}-{index}-config.json"
                config_path.write_text(json.dumps(config))
                cmd = [sys.executable, "-m", "bench.scale", "--caller", str(config_path)]
                callers.append(_spawn(cmd, workdir / f"caller-{shards}-{index}.log"))
            time.sleep(args.warmup)
            worker_cpu0 = tree_cpu_s([w.pid for w in workers])
            redis0 = redis_counters(nodes)
            began = time.monotonic()
            time.sleep(args.seconds)
            worker_cpu = tree_cpu_s([w.pid for w in workers]) - worker_cpu0
            redis1 = redis_counters(nodes)
            wall = time.monotonic() - began
            for caller in callers:
                if caller.wait(args.seconds + 120) != 0:
                    raise RuntimeError(f"a caller failed: see {workdir}/caller-{shards}-*.log")
        finally:
            _stop(callers + workers)
    got = [json.loads(path.read_text()) for path in outs]
    items = sum(g["items"] for g in got)
    errors: dict[str, int] = {}
    for g in got:
        for kind, n in g["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    redis_cpu = redis1["cpu_s"] - redis0["cpu_s"]
    node_cpu = [
        (b - a) / wall for a, b in zip(redis0["node_cpu_s"], redis1["node_cpu_s"], strict=True)
    ]
    per_item = max(items, 1)
    partitioned = args.layout == "partitions"
    result = {
        "shards": shards,
        "layout": args.layout,
        "models": names,
        "partitions": PARTITIONS if partitioned else 1,
        "worker_processes": args.workers if partitioned else len(names),
        "cgroup": cap_kind,
        "redis_cpu_cap": cpus,
        "items": items,
        "seconds": args.seconds,
        "items_per_s": items / args.seconds,
        "errors": errors,
        "redis_cpu_used": redis_cpu / wall,  # CPUs, summed over shards
        "redis_cpu_used_per_shard": node_cpu,  # the first holds partition 0 (and the inboxes)
        "redis_cpu_us_per_item": redis_cpu / per_item * 1e6,
        "redis_command_us_per_item": (redis1["command_usec"] - redis0["command_usec"]) / per_item,
        "redis_commands_per_item": (redis1["commands"] - redis0["commands"]) / per_item,
        "worker_cpu_us_per_item": worker_cpu / per_item * 1e6,
        "caller_cpu_us_per_item": sum(g["cpu_s"] for g in got) / per_item * 1e6,
    }
    per_shard = ", ".join(f"{used:.3f}" for used in node_cpu)
    log(
        f"{shards} shard(s): {result['items_per_s']:.0f} items/s, Redis at "
        f"{result['redis_cpu_used']:.2f} CPU of {shards * cpus:.2f} ({per_shard}), "
        f"errors {errors}"
    )
    return result


def _wait_workers(url: str, names: list[str], partitions: int, processes: int) -> None:
    """Until each model has ``processes`` live workers, every partition stream exists and the
    partition count is stored (callers read it before their first call)."""
    from broker.connections import sync_client
    from broker.liveness import live_consumers

    client = sync_client(url)
    deadline = time.monotonic() + 120

    def ready(keys: ModelKeys) -> bool:
        streams = all(client.exists(each.stream) for each in keys.each())
        stored = partitions == 1 or client.get(keys.partitions_key) == str(partitions).encode()
        return streams and stored and len(live_consumers(client, keys)) >= processes

    try:
        for name in names:
            keys = ModelKeys(name, PREFIX, partitions=partitions)
            while not ready(keys):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}'s workers were not ready within 120 s")
                time.sleep(0.2)
    finally:
        client.close()


# -- (a) latency and round trips on namespace hosts ------------------------------------------
def run_hosts(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import httpx

    from broker import Streamer
    from tests.hosts.netns import Network
    from tests.hosts.redis_topologies import SingleRedis
    from tests.hosts.services import (
        CALLER_TAG,
        MODEL_NAME,
        start_gateway,
        start_worker,
        wait_for_gateway,
        wait_for_workers,
    )

    calls = args.calls
    with Network(workdir / "hosts") as network:
        topology = SingleRedis(network.host("redis")).start()
        worker, gateway, client = (network.host(n) for n in ("worker", "gateway", "client"))
        start_worker(worker, topology.url, PREFIX, 1, "--max-latency", "0")
        base = start_gateway(gateway, topology.url, PREFIX)
        wait_for_workers(topology, PREFIX, 1)
        wait_for_gateway(base, client)
        relay = topology.nodes[0].relay

        def measure(kind: str) -> dict[str, Any]:
            def run() -> list[float]:
                latencies = []
                if kind == "client":
                    streamer = Streamer(MODEL_NAME, redis_url=topology.url, prefix=PREFIX)
                    for i in range(calls + 20):
                        item = np.asarray([float(i), CALLER_TAG], dtype=np.float32)
                        began = time.perf_counter()
                        streamer.predict([item], timeout=10)
                        latencies.append(time.perf_counter() - began)
                        if i == 19:
                            marks.append(time.monotonic())
                    streamer.close()
                else:
                    url = f"{base}/v1/models/{MODEL_NAME}/predict"
                    with httpx.Client(timeout=10) as http:
                        for i in range(calls + 20):
                            began = time.perf_counter()
                            answer = http.post(url, json={"inputs": [[float(i), CALLER_TAG]]})
                            answer.raise_for_status()
                            latencies.append(time.perf_counter() - began)
                            if i == 19:
                                marks.append(time.monotonic())
                return latencies[20:]

            marks: list[float] = []
            latencies = client.call(run)
            done = time.monotonic()
            time.sleep(0.5)  # the relay writes its counters every 0.2 s
            stats = relay.stats(fresh_after=done)
            # counters from the 20th call on: the warm-up's are read from a snapshot
            return {"latencies": latencies, "marks": marks, "stats_after": stats}

        before_client = relay.stats(fresh_after=time.monotonic())
        served = {"worker": worker, "gateway": gateway}
        cpu0 = {role: tree_cpu_s(host.pids()) for role, host in served.items()}
        client_run = measure("client")
        cpu1 = {role: tree_cpu_s(host.pids()) for role, host in served.items()}
        gateway_run = measure("gateway")
        cpu2 = {role: tree_cpu_s(host.pids()) for role, host in served.items()}
        client_run["cpu_us"] = {r: (cpu1[r] - cpu0[r]) / (calls + 20) * 1e6 for r in cpu0}
        gateway_run["cpu_us"] = {r: (cpu2[r] - cpu1[r]) / (calls + 20) * 1e6 for r in cpu0}
        addresses = {"caller": client.addr, "gateway": gateway.addr, "worker": worker.addr}
        result = {
            "delay_method": network.delay_method,
            "delay_s_per_hop": network.delay_s,
            "calls": calls,
        }
        previous = before_client
        for name, run_result in (("client", client_run), ("gateway", gateway_run)):
            stats = run_result["stats_after"]
            per_host = {}
            for role, addr in addresses.items():
                now = stats["peers"].get(addr, {})
                then = previous["peers"].get(addr, {})
                per_host[role] = {
                    key: (now.get(key, 0) - then.get(key, 0)) / (calls + 20)
                    for key in ("round_trips", "bytes_up", "bytes_down", "command_count")
                }
            lat = run_result["latencies"]
            result[name] = {
                "p50_ms": percentile(lat, 50) * 1e3,
                "p99_ms": percentile(lat, 99) * 1e3,
                "mean_ms": float(np.mean(lat)) * 1e3,
                "per_request": per_host,
                "cpu_us_per_request": run_result["cpu_us"],  # at concurrency 1: no batching
            }
            trips = {role: each["round_trips"] for role, each in per_host.items()}
            log(
                f"{name}: p50 {result[name]['p50_ms']:.2f} ms p99 {result[name]['p99_ms']:.2f} ms,"
                f" Redis round trips per request {trips}"
            )
            previous = stats
    return result


# -- report ---------------------------------------------------------------------------------
def machine() -> str:
    model = ""
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model or platform.processor()}, {os.cpu_count()} cores, {platform.platform()}"


def plot(caps: list[dict[str, Any]], path: Path) -> bool:
    """items/s against shard count relative to the first, one line per Redis CPU cap
    (False: no matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for cap in caps:
        xs = [r["shards"] for r in cap["runs"]]
        ys = [r["items_per_s"] / cap["runs"][0]["items_per_s"] for r in cap["runs"]]
        first = cap["runs"][0]["items_per_s"]
        shape = (
            "six models" if cap.get("layout") == "models" else f"one model, {PARTITIONS} partitions"
        )
        label = f"{shape}, Redis at {cap['redis_cpu']:g} CPU each ({first:,.0f}/s at {xs[0]})"
        ax.plot(xs, ys, "o-", label=label)
        ax.set_xticks(xs)
    ax.plot(xs, [x / xs[0] for x in xs], ":", color="grey", label="linear")
    ax.set_xlabel("cluster primaries")
    ax.set_ylabel(f"items/s, relative to {xs[0]} primary")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a ~1 min smoke run")
    parser.add_argument("--only", choices=["hosts", "shards"], help="run one part only")
    parser.add_argument("--calls", type=int, default=300, help="(a) calls per path")
    parser.add_argument("--shards", default="1,2,3", help="(b) shard counts to measure")
    parser.add_argument(
        "--redis-cpu",
        default="0.25,0.03",
        help="(b) CPUs per redis-server, comma-separated: one series each",
    )
    parser.add_argument(
        "--layout",
        choices=["partitions", "models"],
        default="partitions",
        help=f"(b) one model of {PARTITIONS} partitions, or {MODELS} unpartitioned models",
    )
    parser.add_argument("--callers", type=int, default=2, help="(b) caller processes")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=192,
        help="(b) open calls per caller process (split evenly over the models)",
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="(b) worker processes of the partitioned model"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="(b) worker batch size")
    parser.add_argument("--seconds", type=float, default=12.0, help="(b) measured seconds")
    parser.add_argument("--warmup", type=float, default=4.0, help="(b) seconds before measuring")
    parser.add_argument(
        "--entry-items",
        type=int,
        help="(b) the callers' items per stream entry (default: the client's; 1: v1 entries only)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    parser.add_argument("--caller", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.calls, args.seconds, args.warmup = 60, 4.0, 2.0
        args.shards, args.redis_cpu = "1,3", "0.03"
        if args.out == RESULTS / "scale.json":
            args.out = RESULTS / "scale-quick.json"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.caller:
        caller_main(args.caller)
        return
    find_redis_server()
    if os.geteuid() != 0:
        sys.exit("bench.scale needs root: network namespaces (part a) and cgroups (part b)")
    report: dict[str, Any] = {
        "command": "python -m bench.scale" + (" --quick" if args.quick else ""),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "redis": subprocess.run(
            [find_redis_server(), "--version"], capture_output=True, text=True
        ).stdout.strip(),
    }
    with tempfile.TemporaryDirectory(prefix="mbscale-") as tmp:
        workdir = Path(tmp)
        if args.only in (None, "hosts"):
            report["hosts"] = run_hosts(args, workdir)
        if args.only in (None, "shards"):
            caps = []
            for cpus in (float(c) for c in args.redis_cpu.split(",")):
                runs = [run_shards(int(n), cpus, args, workdir) for n in args.shards.split(",")]
                cap: dict[str, Any] = {"redis_cpu": cpus, "layout": args.layout, "runs": runs}
                if len(runs) > 1 and runs[0]["items_per_s"]:
                    cap["ratio_last_to_first"] = runs[-1]["items_per_s"] / runs[0]["items_per_s"]
                    log(
                        f"Redis at {cpus:g} CPU each: {runs[-1]['shards']} / {runs[0]['shards']}"
                        f" shards = {cap['ratio_last_to_first']:.2f}"
                    )
                caps.append(cap)
            knobs = ("layout", "callers", "concurrency", "workers", "batch_size", "seconds",
                     "entry_items")  # fmt: skip
            settings = {k: getattr(args, k) for k in (*knobs, "warmup")}
            report["shards"] = {"settings": settings, "caps": caps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if "shards" in report:
        plot(report["shards"]["caps"], args.out.with_suffix(".png"))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
