"""Tuning sweep: the serving configuration with the most throughput within a latency SLA.

    python -m bench.tune --model examples.mlp:MLP --sla-p99-ms 50
    python -m bench.tune --model examples.embedder:Embedder --sla-p99-ms 200
    python -m bench.tune --model examples.mlp:MLP --sla-p99-ms 50 --http   # through the gateway

For every configuration of the grid (default: ``--batch-size`` 8/16/32/64 x ``--max-latency``
0/2/5 ms x ``--workers`` 1/2; with ``--http`` also ``gateway start --workers`` 1/2) it starts the
real stack on this machine (a private redis-server, ``worker start``, with ``--http`` ``gateway
start``), measures the rate the stack reaches in a closed loop (a capacity estimate), then finds
the highest *open-loop* rate (bench.openloop: requests sent on a fixed schedule, latency counted
from each one's scheduled time) whose p99 stays within ``--sla-p99-ms`` with at least
``--min-success`` of the requests answered: a search (step up x1.5 from 60% of the capacity,
then bisect to 10%) or, when the budget left per configuration is too small for that, a fixed
ladder of rates (30%...100% of the capacity, up to the first that fails); the best rate found
is measured once more and counts only if it passes again (else the next lower pass is tried).
The load goes through the Python client (``Streamer.apredict``) or, with ``--http``, POSTs to
the gateway's v1 route.

The whole sweep keeps within ``--budget-min`` (printed up front with the plan; configurations
that do not fit are left for a rerun). Each configuration's result is appended to
``<out>/results.jsonl`` as soon as it is measured; a rerun skips the configurations already there
(same model, load path, SLA), so an interrupted sweep resumes. At the end the best
configuration (the highest rate within the SLA) is started again and re-measured at that rate
(``--verify-repeats`` windows; if their median p99 misses the SLA, again at 80% of the rate,
up to 3 rates), and ``<out>/report.md`` and ``<out>/tune.png`` are written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import machine, spawn, wait_http_post
from bench.http_bench import wait_workers
from bench.load import BatchProbe
from bench.openloop import RunResult, Sweep, confirm, find_max_rate, ladder, meets
from broker.devserver import free_port
from broker.keys import ModelKeys

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_TEXT = "A man is eating food."  # the item for a model whose preprocess takes text
STEP_OVERHEAD_S = 0.8  # per open-loop run beyond warm-up + window: drain, settle, bookkeeping
# A ladder's rungs: fractions of the closed-loop capacity, evenly spaced on a log scale.
LADDER_LOW, LADDER_HIGH, LADDER_MAX_RUNGS = 0.3, 1.0, 7
# A p99 needs samples: a run at a low rate lasts until it has sent this many (up to 4 windows).
MIN_REQUESTS = 300
# The search goes no lower than this fraction of the capacity (below it: noise, not capacity).
LOWEST_FRACTION = 0.05
# A recommendation that misses the SLA when re-measured is re-measured at this fraction of
# its rate, at most VERIFY_TRIES times in all.
VERIFY_STEP, VERIFY_TRIES = 0.8, 3


@dataclass(frozen=True)
class Config:
    """One point of the grid: worker and gateway flags."""

    batch_size: int
    max_latency_ms: float
    workers: int
    gateway_workers: int = 0  # 0: the load uses the Python client, no gateway

    @property
    def key(self) -> str:
        key = f"b{self.batch_size}-l{self.max_latency_ms:g}ms-w{self.workers}"
        return key + (f"-g{self.gateway_workers}" if self.gateway_workers else "")

    @property
    def label(self) -> str:
        text = (
            f"batch {self.batch_size}, max latency {self.max_latency_ms:g} ms, "
            f"{self.workers} worker{'s' if self.workers > 1 else ''}"
        )
        if self.gateway_workers:
            text += f", {self.gateway_workers} gateway process"
            text += "es" if self.gateway_workers > 1 else ""
        return text


def grid(args: argparse.Namespace) -> list[Config]:
    gateways = args.gateway_workers if args.http else [0]
    return [
        Config(b, lat, w, g)
        for w in args.workers
        for g in gateways
        for b in args.batch_sizes
        for lat in args.max_latency_ms
    ]


# -- the results file ------------------------------------------------------------------------


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by an interrupted run: measured again
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def same_sweep(record: dict[str, Any], args: argparse.Namespace) -> bool:
    return (
        record.get("model") == args.model
        and record.get("path") == ("http" if args.http else "client")
        and record.get("sla_p99_ms") == args.sla_p99_ms
        and record.get("min_success") == args.min_success
    )


def measured(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The configurations already measured for this sweep, by key (the latest record wins)."""
    return {r["key"]: r for r in records if r.get("type") == "config" and same_sweep(r, args)}


def recommend(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The configuration with the highest rate within the SLA (ties: fewer processes first)."""
    passing = [r for r in rows if r.get("max_rate", 0) > 0 and r.get("best")]
    if not passing:
        return None

    def order(r: dict[str, Any]) -> tuple[float, int]:
        c = r["config"]
        return (r["max_rate"], -(c["workers"] + c["gateway_workers"]))

    return max(passing, key=order)


# -- the stack and the generator -------------------------------------------------------------


class Generator:
    """A ``python -m bench.openloop serve`` process: the load runs apart from this one."""

    def __init__(self, target: dict[str, Any], log_path: Path, env: dict[str, str]) -> None:
        self.log = open(log_path, "ab")  # noqa: SIM115
        command = [sys.executable, "-m", "bench.openloop", "serve", json.dumps(target)]
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )

    def ask(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise TimeoutError(f"the load generator did not answer in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the load generator exited ({self.proc.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"load generator: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


@dataclass
class Stack:
    config: Config
    generator: Generator
    probe: BatchProbe
    redis_url: str
    stream: str
    startup_s: float


class Tuner:
    def __init__(self, args: argparse.Namespace, resources: ExitStack) -> None:
        from gpu_worker import load_model_class

        self.args = args
        self.resources = resources
        self._redis_url: str | None = None
        self.cls = load_model_class(args.model)
        self.name = self.cls.name
        self.item, self.dtype = sample_item(self.cls, args.item)
        self.body = json.dumps({"inputs": [self.item]})
        self.tmp = Path(tempfile.mkdtemp(prefix="microbatch-tune-"))
        threads = {} if args.torch_threads == 0 else {"OMP_NUM_THREADS": str(args.torch_threads)}
        if threads:
            threads["MKL_NUM_THREADS"] = threads["OMP_NUM_THREADS"]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **threads}
        self.count = 0

    @property
    def redis_url(self) -> str:
        """A private redis-server for the whole sweep, started when first needed."""
        if self._redis_url is None:
            from broker.devserver import RedisServer

            self._redis_url = self.resources.enter_context(RedisServer()).url
        return self._redis_url

    def target(self, prefix: str, gateway_port: int | None) -> dict[str, Any]:
        if gateway_port is not None:
            url = f"http://127.0.0.1:{gateway_port}/v1/models/{self.name}/predict"
            return {"kind": "http", "url": url, "body": self.body}
        model = self.args.model if overrides_preprocess(self.cls) else None
        return {
            "kind": "client",
            "name": self.name,
            "redis_url": self.redis_url,
            "prefix": prefix,
            "item": self.item,
            "dtype": self.dtype if model is None else None,
            "model": model,
        }

    @contextmanager
    def stack(self, config: Config) -> Iterator[Stack]:
        """The configuration's processes, ready to serve; stopped when the block ends."""
        self.count += 1
        prefix = f"tune{os.getpid()}n{self.count}"
        metrics_port = free_port()
        a = self.args
        worker = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", a.model]
        worker += ["--redis", self.redis_url, "--prefix", prefix]
        worker += ["--batch-size", str(config.batch_size)]
        worker += ["--max-latency", f"{config.max_latency_ms / 1000:g}"]
        worker += ["--workers", str(config.workers), "--metrics-port", str(metrics_port)]
        worker += ["--log-level", "WARNING"]
        started = time.monotonic()
        log = self.tmp / f"{config.key}-{self.count}"
        with ExitStack() as stack:
            worker_log = log.with_suffix(".worker.log")
            worker_proc = stack.enter_context(spawn(worker, worker_log, self.env))
            gateway_port, gateway_proc = None, worker_proc
            if config.gateway_workers:
                gateway_port = free_port()
                gateway = [sys.executable, "-m", "web_gateway.cli", "start", "--model", a.model]
                gateway += ["--redis", self.redis_url, "--prefix", prefix]
                gateway += ["--port", str(gateway_port), "--workers", str(config.gateway_workers)]
                gateway += ["--log-level", "warning"]
                gateway_proc = stack.enter_context(
                    spawn(gateway, log.with_suffix(".gateway.log"), self.env)
                )
            try:
                wait_workers(
                    self.redis_url, ModelKeys(self.name, prefix), config.workers, 180, worker_proc
                )
                if gateway_port is not None:
                    url = f"http://127.0.0.1:{gateway_port}/v1/models/{self.name}/predict"
                    wait_http_post(url, self.body, gateway_proc)
            except Exception as exc:
                tail = log.with_suffix(".worker.log").read_text(errors="replace")[-1500:]
                raise RuntimeError(f"{exc}: {tail}") from None
            generator = Generator(
                self.target(prefix, gateway_port), log.with_suffix(".load.log"), self.env
            )
            stack.callback(generator.close)

            yield Stack(
                config,
                generator,
                BatchProbe(f"metrics:http://127.0.0.1:{metrics_port}/metrics"),
                self.redis_url,
                ModelKeys(self.name, prefix).stream,
                time.monotonic() - started,
            )

    def capacity(self, stack: Stack) -> dict[str, Any]:
        """Closed loop, enough callers to fill every worker's batches twice over."""
        c = stack.config
        concurrency = min(self.args.lanes, max(64, 2 * c.batch_size * c.workers))
        spec = {"closed": {"concurrency": concurrency, "duration": self.args.probe_s}}
        return stack.generator.ask(spec, timeout=60 + self.args.probe_s)

    def measure(self, stack: Stack, rate: float, abort: bool = True) -> RunResult:
        a = self.args
        duration = min(max(a.window_s, MIN_REQUESTS / rate), 4 * a.window_s)
        spec: dict[str, Any] = {
            "rate": rate,
            "duration": duration,
            "warmup": a.warmup_s,
            "lanes": a.lanes,
            "drain_s": a.drain_s,
        }
        if abort:
            spec.update(sla_p99_ms=a.sla_p99_ms, min_success=a.min_success)
        before = stack.probe.totals()
        timeout = 60 + a.warmup_s + duration + a.drain_s
        result = RunResult.from_dict(stack.generator.ask({"open": spec}, timeout))
        result.extra["mean_batch"] = stack.probe.mean(before, stack.probe.totals(), result.ok)
        result.extra["settle_s"] = settle(stack)
        return result


def settle(stack: Stack, limit: float = 15.0) -> float:
    """Wait until the model's stream is empty (a failed run may leave a backlog): seconds."""
    import redis

    client = redis.Redis.from_url(stack.redis_url)
    start = time.monotonic()
    try:
        while client.xlen(stack.stream) > 0 and time.monotonic() - start < limit:
            time.sleep(0.05)
    finally:
        client.close()
    time.sleep(0.1)
    return round(time.monotonic() - start, 2)


def overrides_preprocess(cls: Any) -> bool:
    from gpu_worker import ManagedModel

    return bool(cls.preprocess is not ManagedModel.preprocess)


def sample_item(cls: Any, given: str | None) -> tuple[Any, str | None]:
    """One request's item (JSON-able) and the numpy dtype the Python client sends it as."""
    import numpy as np

    if given is not None:
        return json.loads(given), None
    spec = cls.inputs[0] if len(cls.inputs) == 1 else None
    if overrides_preprocess(cls):
        return DEFAULT_TEXT, None
    if spec is not None and spec.datatype.startswith("FP") and all(d > 0 for d in spec.shape):
        values = np.random.default_rng(0).standard_normal(int(np.prod(spec.shape)))
        item = np.round(values.astype(np.float32).astype(float), 6).reshape(spec.shape).tolist()
        return item, str(spec.numpy_dtype)
    raise SystemExit(f"no default item for {cls.__name__}'s inputs: pass --item JSON")


# -- the plan --------------------------------------------------------------------------------


@dataclass
class Plan:
    mode: str  # "search" or "ladder"
    steps: int  # open-loop runs at most
    seconds: float  # the configuration's share of the budget, start-up included


def step_s(args: argparse.Namespace) -> float:
    seconds: float = args.warmup_s + args.window_s + STEP_OVERHEAD_S
    return seconds


def plan_config(args: argparse.Namespace, seconds: float, startup_s: float) -> Plan | None:
    """What fits in ``seconds`` for one configuration, the confirming run included (None: not
    even a 3-rung ladder)."""
    steps = int((seconds - startup_s - args.probe_s - 1) // step_s(args))
    mode = args.mode
    if mode == "auto":
        mode = "search" if steps >= 5 else "ladder"
    if steps < 4:  # 3 rates and the run that confirms the best
        return None
    cap = LADDER_MAX_RUNGS + 1 if mode == "ladder" else steps
    return Plan(mode, min(steps, args.max_steps, cap), seconds)


def ladder_fractions(rungs: int) -> list[float]:
    """``rungs`` fractions of the capacity from LADDER_LOW to LADDER_HIGH, log-spaced."""
    if rungs == 1:
        return [LADDER_LOW]
    ratio = (LADDER_HIGH / LADDER_LOW) ** (1 / (rungs - 1))
    return [round(LADDER_LOW * ratio**i, 3) for i in range(rungs)]


def verify_s(args: argparse.Namespace, startup_s: float) -> float:
    """Time kept back for re-measuring the recommendation: every rate it may take."""
    return startup_s + VERIFY_TRIES * int(args.verify_repeats) * step_s(args)


# -- the sweep -------------------------------------------------------------------------------


def run_config(
    tuner: Tuner, config: Config, plan: Plan, progress: Any, task: Any
) -> dict[str, Any]:
    args = tuner.args
    started, clock = time.time(), time.monotonic()
    with tuner.stack(config) as stack:
        capacity = tuner.capacity(stack)
        runs_from = time.monotonic()
        budget_s = plan.seconds - (runs_from - clock)  # what is left for the runs
        cap = max(1.0, float(capacity["rps"]))

        def measure(rate: float) -> RunResult:
            progress.update(task, description=f"{config.key}: {rate:,.0f}/s")
            result = tuner.measure(stack, rate)
            mark = "within" if meets(result, args.sla_p99_ms, args.min_success) else "outside"
            progress.console.print(f"  {config.key:18} {result.line()} [{mark} the SLA]")
            return result

        # one run is kept to measure the best rate again (a pass counts when it repeats)
        runs = plan.steps - 1
        search_budget = budget_s * runs / plan.steps
        if plan.mode == "search":
            sweep = find_max_rate(
                measure,
                args.sla_p99_ms,
                args.min_success,
                start_rate=0.6 * cap,
                max_steps=runs,
                budget_s=search_budget,
                min_rate=LOWEST_FRACTION * cap,
            )
        else:
            rates = [f * cap for f in ladder_fractions(runs)]
            sweep = ladder(measure, rates, args.sla_p99_ms, args.min_success, search_budget)
        left = budget_s - (time.monotonic() - runs_from)
        # up to two confirming runs, within the plan's (and so --max-steps') runs
        sweep = confirm(
            measure,
            sweep,
            args.sla_p99_ms,
            args.min_success,
            runs=min(2, max(1, plan.steps - len(sweep.steps))),
            budget_s=max(left, step_s(args)),
        )
        startup = stack.startup_s
    return config_record(tuner, config, plan, capacity, sweep, startup, started)


def config_record(
    tuner: Tuner,
    config: Config,
    plan: Plan,
    capacity: dict[str, Any],
    sweep: Sweep,
    startup_s: float,
    started: float,
) -> dict[str, Any]:
    args = tuner.args
    return {
        "type": "config",
        **sweep_identity(args),
        "key": config.key,
        "config": asdict(config),
        "mode": plan.mode,
        "max_steps": plan.steps,
        "capacity": capacity,
        "steps": [s.to_dict() for s in sweep.steps],
        "stopped": sweep.stopped,
        "max_rate": sweep.max_rate,
        "best": sweep.best.to_dict() if sweep.best else None,
        "window_s": args.window_s,
        "warmup_s": args.warmup_s,
        "startup_s": round(startup_s, 2),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "elapsed_s": round(time.time() - started, 1),
    }


def sweep_identity(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": args.model,
        "path": "http" if args.http else "client",
        "sla_p99_ms": args.sla_p99_ms,
        "min_success": args.min_success,
    }


def verify(
    tuner: Tuner, best: dict[str, Any], deadline: float, progress: Any, task: Any
) -> dict[str, Any]:
    """Start the recommended configuration afresh and re-measure it at its rate (no early
    stop); if it misses the SLA there, again at VERIFY_STEP times that rate, while time is
    left (``deadline``, time.monotonic) and at most VERIFY_TRIES times in all."""
    args = tuner.args
    config = Config(**best["config"])
    rate = best["max_rate"]
    attempts: list[dict[str, Any]] = []
    with tuner.stack(config) as stack:
        for _ in range(VERIFY_TRIES):
            windows = []
            for i in range(args.verify_repeats):
                progress.update(task, description=f"verify {config.key} at {rate:,.0f}/s {i + 1}")
                result = tuner.measure(stack, rate, abort=False)
                progress.console.print(f"  verify {config.key:11} {result.line()}")
                windows.append(result)
            p99 = statistics.median(w.p99_ms for w in windows)
            ok = min(w.ok_fraction for w in windows)
            met = p99 <= args.sla_p99_ms and ok >= args.min_success
            attempts.append(
                {
                    "rate": rate,
                    "windows": [w.to_dict() for w in windows],
                    "p99_ms_median": p99,
                    "ok_fraction_min": ok,
                    "met": met,
                }
            )
            if met or time.monotonic() + args.verify_repeats * step_s(args) > deadline:
                break
            rate *= VERIFY_STEP
    return {
        "type": "verify",
        **sweep_identity(args),
        "key": config.key,
        "sweep_rate": best["max_rate"],
        "attempts": attempts,
        "met": attempts[-1]["met"],
        "rate": attempts[-1]["rate"] if attempts[-1]["met"] else None,
    }


def announce(
    console: Any, args: argparse.Namespace, total: int, done: int, pending: list[Config]
) -> None:
    """Print the sweep, its budget and what fits in it, before anything runs."""
    budget = args.budget_min * 60
    reserve = verify_s(args, args.startup_s) if args.verify_repeats else 0.0
    per_config = (budget - reserve) / len(pending) if pending else 0.0
    first_plan = plan_config(args, per_config, args.startup_s) if pending else None
    path = "HTTP POST to `gateway start`" if args.http else "the Python client (apredict)"
    console.print(
        f"[bold]bench.tune[/bold] {args.model} through {path}: {total} configurations, "
        f"{done} measured before, {len(pending)} to measure; SLA p99 <= "
        f"{args.sla_p99_ms:g} ms with >= {args.min_success:.1%} answered"
    )
    console.print(
        f"budget {args.budget_min:g} min: about {per_config:.0f} s per configuration"
        + (
            f" -> {first_plan.mode} (at most {first_plan.steps} open-loop runs of "
            f"{args.warmup_s:g} s warm-up + {args.window_s:g} s each, after a "
            f"{args.probe_s:g} s closed-loop capacity probe)"
            if first_plan
            else (" -> too little for every configuration: as many as fit" if pending else "")
        )
        + (f"; then the best re-measured {args.verify_repeats}x" if args.verify_repeats else "")
        + f"; ends by {time.strftime('%H:%M', time.localtime(time.time() + budget))}"
    )


def run(args: argparse.Namespace) -> Path:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    records = read_records(results)
    configs = grid(args)
    done = measured(records, args)
    pending = [c for c in configs if c.key not in done]
    console = Console(stderr=True, soft_wrap=True)
    budget = args.budget_min * 60
    startup_guess = args.startup_s
    announce(console, args, len(configs), len(done), pending)
    load_before = os.getloadavg()
    started = time.monotonic()
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("budget left {task.fields[left]}"),
    ]
    with ExitStack() as resources, Progress(*columns, console=console) as progress:
        tuner = Tuner(args, resources)
        task = progress.add_task("start", total=len(configs), completed=len(done), left="")
        startups: list[float] = []
        for index, config in enumerate(pending):
            left = budget - (time.monotonic() - started)
            progress.update(task, left=f"{left / 60:.1f} min")
            startup = statistics.median(startups) if startups else startup_guess
            reserve = verify_s(args, startup) if args.verify_repeats else 0.0
            plan = plan_config(args, (left - reserve) / (len(pending) - index), startup)
            if plan is None and plan_config(args, left - reserve, startup) is not None:
                plan = Plan("ladder", 4, left - reserve)  # the least that says anything
            if plan is None:
                progress.console.print(
                    f"budget spent: {len(pending) - index} configurations left for a rerun"
                )
                break
            try:
                record = run_config(tuner, config, plan, progress, task)
            except Exception as exc:
                record = {"type": "error", **sweep_identity(args), "key": config.key}
                record["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
                progress.console.print(f"  {config.key}: FAILED {record['error'][:300]}")
            else:
                startups.append(record["startup_s"])
                done[config.key] = record
                best = record["best"]
                progress.console.print(
                    f"{config.label}: highest rate within the SLA "
                    f"{record['max_rate']:,.0f}/s ({record['mode']}, {record['stopped']})"
                    + (f", p99 {best['p99_ms']:.1f} ms" if best else "")
                )
            append_record(results, record)
            records.append(record)
            progress.advance(task)
        rows = [done[c.key] for c in configs if c.key in done]
        best = recommend(rows)
        verified = latest_verify(records, args, best)
        if args.verify_repeats and best is not None and verified is None:
            progress.update(task, left=f"{(budget - time.monotonic() + started) / 60:.1f} min")
            try:
                deadline = started + budget
                verified = verify(tuner, best, deadline, progress, task)
            except Exception as exc:
                progress.console.print(f"verify failed: {type(exc).__name__}: {exc}")
            else:
                append_record(results, verified)
                records.append(verified)
        progress.update(task, description="done")
    context = {
        "command": " ".join(["python -m bench.tune", *args.argv]),
        "machine": machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "elapsed_s": time.monotonic() - started,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "torch_threads": args.torch_threads,
        "lanes": args.lanes,
        "missing": [c.key for c in configs if c.key not in done],
        "grid": [c.key for c in configs],
    }
    from bench.tune_report import write_report

    report = write_report(out, args, rows, verified, context)
    console.print(f"wrote {report} and {out / 'tune.png'}; raw results: {results}")
    return report


def latest_verify(
    records: list[dict[str, Any]], args: argparse.Namespace, best: dict[str, Any] | None
) -> dict[str, Any] | None:
    if best is None:
        return None
    found = [
        r
        for r in records
        if r.get("type") == "verify"
        and same_sweep(r, args)
        and r["key"] == best["key"]
        and math.isclose(r["sweep_rate"], best["max_rate"])
    ]
    return found[-1] if found else None


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.tune",
        description=__doc__.splitlines()[0],
        epilog="Grid values are comma-separated. docs/tuning.md explains the report.",
    )
    add = parser.add_argument
    add("--model", required=True, help="import path module:Class of the model")
    add("--sla-p99-ms", type=float, required=True, help="the p99 latency target, ms")
    add("--min-success", type=float, default=0.999, help="least fraction answered (0.999)")
    add("--http", action="store_true", help="load through gateway start (default: the client)")
    add(
        "--batch-sizes",
        type=ints,
        default=[8, 16, 32, 64],
        help="worker --batch-size values (8,16,32,64)",
    )
    add(
        "--max-latency-ms",
        type=floats,
        default=[0.0, 2.0, 5.0],
        help="worker --max-latency values, ms (0,2,5)",
    )
    add("--workers", type=ints, default=[1, 2], help="worker --workers values (1,2)")
    add(
        "--gateway-workers",
        type=ints,
        default=[1, 2],
        help="with --http: gateway start --workers values (1,2)",
    )
    add("--budget-min", type=float, default=18.0, help="bound on the whole sweep, min (18)")
    add(
        "--mode",
        choices=["auto", "search", "ladder"],
        default="auto",
        help="how each configuration's rate is found (auto: search when 5 runs fit)",
    )
    add("--window-s", type=float, default=3.0, help="measured seconds per rate (3)")
    add("--warmup-s", type=float, default=1.0, help="seconds sent before each window (1)")
    add("--probe-s", type=float, default=2.0, help="closed-loop capacity probe, s (2)")
    add("--drain-s", type=float, default=5.0, help="answers awaited after a run, s (5)")
    add("--max-steps", type=int, default=7, help="open-loop runs per configuration (7)")
    add(
        "--verify-repeats",
        type=int,
        default=3,
        help="windows per rate re-measuring the recommendation (3; 0: none)",
    )
    add(
        "--lanes",
        type=int,
        help="most requests in flight: HTTP connections (256) or client tasks (1024)",
    )
    add(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of the workers (1; 0: leave unset)",
    )
    add("--startup-s", type=float, default=8.0, help="start-up guess for the first plan (8)")
    add("--item", help="one request's item as JSON (default: made from the model's inputs)")
    add("--out", type=Path, help="results directory (bench/results/tune-<name>[-http])")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.lanes is None:
        args.lanes = 256 if args.http else 1024
    if args.out is None:
        from gpu_worker import load_model_class

        name = load_model_class(args.model).name
        args.out = RESULTS / (f"tune-{name}" + ("-http" if args.http else ""))
    if not 0 < args.min_success <= 1:
        parser.error("--min-success must lie in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
