"""The benchmark harness: microbatch side by side with the alternatives, on this machine.

    python -m bench                 # full: identity, mlp, heavy; every scenario; c = 1, 64, 256
    python -m bench --quick         # < 1 minute, our own scenarios only (CI runs it)
    python -m bench --cuda 0 ...    # on a GPU: the models on cuda:0, workers with --cuda 0

Scenarios (closed loop, fixed duration per window, one warm-up first, the median of --repeats
windows reported; items/s, p50/p90/p99 latency, mean batch size the model ran):

* ``direct, batched`` / ``direct, one at a time``: model.predict on full batches (the ceiling)
  and on one item per call (the floor), in this process;
* ``embedded (LocalStreamer)``: gpu_worker.LocalStreamer in the load process, asyncio callers;
* ``redis, python client (asyncio)`` / ``(threads)``: one ``worker start`` process and a private
  redis-server; the load in its own process: N asyncio tasks calling Streamer.apredict, or N
  threads calling Streamer.predict (``--load-processes K``: the asyncio tasks split among K
  processes, as several gateways feed one worker; ``--workers``, ``--model-thread`` and
  ``--busy-poll-us`` set the worker, a tuned variant). At the highest concurrency the asyncio
  arm's windows are bracketed: each is taken between two windows of ``direct, batched``, and
  its share of the direct speed is computed against their mean (``brackets`` in the JSON);
* ``http, gateway``: ``gateway start`` (gunicorn, --gateway-workers processes, default 1) +
  Redis + the worker, load from wrk with a Lua script posting the JSON body;
* the alternatives (full mode), each from its own virtualenv under .cache/bench-venvs/:
  ``service_streamer RedisStreamer`` (threads, the same thread load generator as ours) with its
  RedisWorker, and over HTTP with wrk: ``service_streamer ThreadedStreamer (Flask)``,
  ``fastapi, per request``, ``litserve, batching``, and mosec twice, at 10 ms and at 1 ms max
  wait (``mosec, batching (10 ms wait)``, ``(1 ms wait)``: the better is the baseline);
* ``open loop (gateway, mosec)`` (full mode, --open-loop-models, default mlp): latency against
  offered load for our gateway (a fresh worker and gateway at their defaults) and for mosec at
  both settings, from a ``bench.openloop`` generator process (bench/sla.py), and each one's
  highest rate whose p99 stays within --sla-p99-ms with --min-success answered 200.

Same payload (one 256-float vector per request; JSON ``{"inputs": [[...]]}`` over HTTP), same
model code and weights (bench.models / examples.mlp), same torch thread count everywhere
(--torch-threads: torch.set_num_threads and OMP_NUM_THREADS), max batch 64 and, for the
alternatives that wait for batch-mates, a max wait of --max-wait-ms. Everything runs on the
CPU unless --cuda N names a device: then the direct and embedded arms load the model on cuda:N
and the worker starts with ``--cuda N`` (--workers: processes on it), the alternatives are left
as they are (docs/gpu.md). Writes <output-dir>/harness.json (raw), prints which targets the run
met (bench.report.verdicts: each ratio between arms of this run) and, unless --no-report,
writes docs/benchmarks.md with PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

from bench import venvs
from bench.cpu import CpuMeter, children_cpu_seconds, per_item
from bench.http_bench import post_script, python_path, wait_workers, wrk_counts
from bench.load import BatchProbe, sample_input
from broker.devserver import free_port
from broker.keys import ModelKeys

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODELS = {
    "identity": "bench.models:Identity",
    "mlp": "examples.mlp:MLP",
    "heavy": "bench.models:HeavyMLP",
    "wide": "bench.models:WideMLP",  # GPU-sized: for --cuda runs (docs/gpu.md)
    # predict waits for the outputs instead of returning them pending (the GPU runs compare)
    "mlp_sync": "bench.models:SyncMLP",
    "wide_sync": "bench.models:SyncWideMLP",
}
OURS = [
    "direct, batched",
    "direct, one at a time",
    "embedded (LocalStreamer)",
    "redis, python client (asyncio)",
    "redis, python client (threads)",
    "http, gateway",
]
ALTERNATIVES = [
    "service_streamer RedisStreamer (threads)",
    "service_streamer ThreadedStreamer (Flask)",
    "fastapi, per request",
    "litserve, batching",
    "mosec, batching (10 ms wait)",
    "mosec, batching (1 ms wait)",
]
# mosec's max_wait_time per arm: the two settings; the better one is the baseline
MOSEC_WAIT_MS = {ALTERNATIVES[4]: 10.0, ALTERNATIVES[5]: 1.0}
# latency against offered load, open loop (bench.sla): our gateway and mosec at both settings
OPEN_LOOP = "open loop (gateway, mosec)"
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[dict[str, Any]] = []
        self.device = "cpu" if args.cuda is None else f"cuda:{args.cuda}"
        self.tmp = Path(tempfile.mkdtemp(prefix="microbatch-bench-"))
        self.env = {
            **os.environ,
            "PYTHONPATH": python_path(),
            "OMP_NUM_THREADS": str(args.torch_threads),
            "MKL_NUM_THREADS": str(args.torch_threads),
            "BENCH_TORCH_THREADS": str(args.torch_threads),
            "BENCH_BATCH_SIZE": str(args.batch_size),
            "BENCH_MAX_WAIT_MS": str(args.max_wait_ms),
        }
        body = json.dumps({"inputs": [[round(float(v), 6) for v in sample_input()]]})
        self.body = body
        self.lua = post_script(self.tmp / "post.lua", body)
        self.memory: dict[str, dict[str, float]] = {}
        self.workers_started: dict[str, int] = {}
        self.brackets: dict[str, dict[str, Any]] = {}
        self.open_loops: dict[str, dict[str, Any]] = {}
        self.redis_pid: int | None = None

    # -- bookkeeping -------------------------------------------------------------------------

    def record(
        self, model: str, scenario: str, concurrency: int, windows: list[dict[str, Any]]
    ) -> None:
        def med(key: str) -> float | None:
            values = [w[key] for w in windows if w.get(key) is not None]
            return statistics.median(values) if values else None

        row = {
            "model": model,
            "scenario": scenario,
            "concurrency": concurrency,
            "items_per_s": med("items_per_s"),
            "p50_ms": med("p50_ms"),
            "p90_ms": med("p90_ms"),
            "p99_ms": med("p99_ms"),
            "mean_batch": med("mean_batch"),
            "load_cpu_us_per_item": med("load_cpu_us_per_item"),  # Python-client arms
            # the servers' CPU per item, process tree by process tree (bench.cpu), and the
            # HTTP load generator's (wrk)
            "cpu_us_per_item": (servers := med_cpu(windows)),
            "generator_cpu_us_per_item": med("generator_cpu_us_per_item"),
            "errors": sum(int(w.get("errors") or 0) for w in windows),
            "requests": sum(int(w.get("requests") or 0) for w in windows),
            "windows": windows,
        }
        self.rows.append(row)
        batch = f"{row['mean_batch']:.1f}" if row["mean_batch"] else "-"
        cpu = row["load_cpu_us_per_item"] or row["generator_cpu_us_per_item"]
        log(
            f"{model:8} {scenario:42} c={concurrency:<3} {row['items_per_s']:9,.0f} items/s "
            f"p50 {row['p50_ms']:.2f} p99 {row['p99_ms']:.2f} ms batch {batch} "
            f"errors {row['errors']}"
            + (f" load generator CPU {cpu:.0f} us/item" if cpu else "")
            + (
                " CPU us/item: " + ", ".join(f"{k} {v:.0f}" for k, v in servers.items())
                if servers
                else ""
            )
        )

    def failed(self, model: str, scenario: str, concurrency: int, error: str) -> None:
        log(f"{model} {scenario} c={concurrency}: FAILED {error}")
        self.rows.append(
            {"model": model, "scenario": scenario, "concurrency": concurrency, "error": error}
        )

    def timing(self) -> dict[str, Any]:
        a = self.args
        return {"warmup": a.warmup, "duration": a.duration, "repeats": a.repeats}

    # -- processes ---------------------------------------------------------------------------

    @contextmanager
    def process(
        self, command: list[str], name: str, env: dict[str, str] | None = None
    ) -> Iterator[subprocess.Popen[bytes]]:
        with spawn(command, self.tmp / f"{name}.log", {**self.env, **(env or {})}) as proc:
            yield proc

    def load(self, python: str | Path, kind: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
        """The windows of a load generator process; for our asyncio client with
        ``--load-processes`` N, of N such processes at once, the concurrency split among them
        (their windows merged by ``merge_windows``)."""
        spec = {**self.timing(), **spec}
        timeout = 120 + spec["warmup"] + spec["repeats"] * spec["duration"] * 3
        processes = min(self.args.load_processes, spec["concurrency"]) if kind == "asyncio" else 1
        shares = [spec["concurrency"] // processes] * processes
        for i in range(spec["concurrency"] % processes):
            shares[i] += 1
        generators = [
            subprocess.Popen(
                [str(python), "-m", "bench.load", kind, json.dumps({**spec, "concurrency": c})],
                cwd=ROOT,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for c in shares
        ]
        results = []
        for generator in generators:
            try:
                stdout, stderr = generator.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other in generators:
                    other.kill()
                raise
            if generator.returncode != 0:
                raise RuntimeError(stderr.strip()[-2000:])
            results.append(json.loads(stdout.strip().splitlines()[-1]))
        return results[0] if processes == 1 else merge_windows(results)

    def wait_http(self, url: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
        """Until a POST of the benchmark's body answers 200."""
        wait_http_post(url, self.body, proc, timeout)

    def wrk_once(self, url: str, concurrency: int, duration: float) -> dict[str, Any]:
        threads = min(concurrency, 2)
        command = ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{max(1, round(duration))}s"]
        command += ["--latency", "--timeout", "30s", "-s", str(self.lua), url]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout

        def latency(q: int) -> float:
            text = re.search(rf"\s{q}%\s+(\S+)", out).group(1)  # type: ignore[union-attr]
            value = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
            return float(value.group(1)) * UNITS[value.group(2)]  # type: ignore[union-attr]

        requests, bad = wrk_counts(out)
        socket_errors = re.search(
            r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
        )
        errors = bad
        if socket_errors:
            errors += sum(int(v) for v in socket_errors.groups())
        return {
            "items_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
            "p50_ms": latency(50),
            "p90_ms": latency(90),
            "p99_ms": latency(99),
            "requests": requests,
            "errors": errors,
        }

    def wrk(
        self, url: str, concurrency: int, probe: BatchProbe, meter: CpuMeter | None = None
    ) -> list[dict[str, Any]]:
        """wrk's warm-up, then its windows; with a ``meter``, each window also has the CPU per
        request of the meter's process trees (``cpu_us_per_item``) and of wrk itself."""
        a = self.args
        self.wrk_once(url, concurrency, a.warmup)
        windows = []
        for _ in range(a.repeats):
            before = probe.totals()
            servers = meter.sample() if meter is not None else {}
            generator = children_cpu_seconds()
            window = self.wrk_once(url, concurrency, a.duration)
            generator = children_cpu_seconds() - generator
            window["mean_batch"] = probe.mean(before, probe.totals(), window["requests"])
            if meter is not None and window["requests"]:
                window["cpu_us_per_item"] = per_item(servers, meter.sample(), window["requests"])
                window["generator_cpu_us_per_item"] = generator / window["requests"] * 1e6
            windows.append(window)
        return windows

    def bracketed(
        self, model: str, concurrency: int, served_window: Callable[[], list[dict[str, Any]]]
    ) -> list[dict[str, Any]]:
        """The served arm's windows, each taken between two windows of the model called directly
        on full batches, so that each window's share of the direct speed is measured against
        the machine as it was then (on a shared machine its speed drifts by more than the
        share the serving costs). Recorded in ``self.brackets``; returns the served windows."""
        from bench.spine import direct

        a = self.args

        def direct_window() -> float:
            return direct(MODELS[model], a.batch_size, a.duration, False, self.device).items_per_s

        directs = [direct_window()]
        windows: list[dict[str, Any]] = []
        for _ in range(a.repeats):
            windows += served_window()
            directs.append(direct_window())
        shares = [
            window["items_per_s"] / ((directs[i] + directs[i + 1]) / 2)
            for i, window in enumerate(windows)
        ]
        self.brackets[model] = {
            "scenario": OURS[3],
            "concurrency": concurrency,
            "direct_items_per_s": directs,
            "served_items_per_s": [w["items_per_s"] for w in windows],
            "shares": shares,
            "share": statistics.median(shares),
        }
        log(
            f"{model:8} bracketed c={concurrency}: direct "
            + ", ".join(f"{d:,.0f}" for d in directs)
            + " items/s; shares "
            + ", ".join(f"{s:.1%}" for s in shares)
        )
        return windows

    # -- scenarios ---------------------------------------------------------------------------

    def direct(self, model: str) -> None:
        from bench.spine import direct

        for one, scenario in ((False, OURS[0]), (True, OURS[1])):
            if scenario not in self.args.scenarios:
                continue
            windows = []
            size, device = self.args.batch_size, self.device
            direct(MODELS[model], size, self.args.warmup, one, device)  # warm-up
            for _ in range(self.args.repeats):
                r = direct(MODELS[model], size, self.args.duration, one, device)
                windows.append(
                    {
                        "items_per_s": r.items_per_s,
                        "p50_ms": r.p50_ms,
                        "p90_ms": r.p90_ms,
                        "p99_ms": r.p99_ms,
                        "mean_batch": 1 if one else self.args.batch_size,
                    }
                )
            self.record(model, scenario, 1, windows)

    def embedded(self, model: str) -> None:
        for c in self.args.concurrency:
            spec = {
                "concurrency": c,
                "model": MODELS[model],
                "batch_size": self.args.batch_size,
                "torch_threads": self.args.torch_threads,
                "device": self.device,
            }
            self.record(model, OURS[2], c, self.load(sys.executable, "local", spec))

    def ours_served(self, model: str, redis_url: str) -> None:
        a = self.args
        prefix = f"bench{os.getpid()}"
        metrics_port, gateway_port = free_port(), free_port()
        worker = self.worker_command(model, redis_url, prefix, metrics_port)
        probe = BatchProbe(f"metrics:http://127.0.0.1:{metrics_port}/metrics")
        with ExitStack() as stack:
            worker_proc = stack.enter_context(self.process(worker, f"worker-{model}"))
            self.wait_worker(redis_url, model, prefix, worker_proc, f"worker-{model}")
            base: dict[str, Any] = {"name": model, "redis_url": redis_url, "prefix": prefix}
            base["probe"] = probe.kind + ":" + probe.where
            base["cpu_roots"] = {"worker": worker_proc.pid, "redis": self.redis_pid}
            for kind, scenario in (("asyncio", OURS[3]), ("threads", OURS[4])):
                if scenario not in a.scenarios:
                    continue
                for c in a.concurrency:
                    spec = {**base, "concurrency": c}
                    if kind == "asyncio" and c == max(a.concurrency) and OURS[0] in a.scenarios:
                        once = {**spec, "repeats": 1}
                        windows = self.bracketed(
                            model, c, partial(self.load, sys.executable, kind, once)
                        )
                    else:
                        windows = self.load(sys.executable, kind, spec)
                    self.record(model, scenario, c, windows)
            self.memory.setdefault(model, {})["worker_rss_mb"] = tree_rss_mb(worker_proc.pid)
            from bench.memory import bare_model_rss_mb  # (bench.memory imports this module)

            self.memory[model]["bare_model_rss_mb"] = bare_model_rss_mb(
                MODELS[model], a.torch_threads, self.device
            )
            if OURS[5] not in a.scenarios:
                return
            if shutil.which("wrk") is None:
                log("wrk is not on PATH (apt-get install wrk): skipping the HTTP scenarios")
                return
            gateway = self.gateway_command(model, redis_url, prefix, gateway_port)
            gateway_proc = stack.enter_context(self.process(gateway, f"gateway-{model}"))
            url = f"http://127.0.0.1:{gateway_port}/v1/models/{model}/predict"
            self.wait_http(url, gateway_proc)
            meter = CpuMeter(
                {"gateway": gateway_proc.pid, "worker": worker_proc.pid, "redis": self.redis_pid}
            )
            for c in a.concurrency:
                self.record(model, OURS[5], c, self.wrk(url, c, probe, meter))
            self.memory[model]["gateway_rss_mb"] = tree_rss_mb(gateway_proc.pid)
            self.memory[model]["gateway_processes"] = 1 + a.gateway_workers

    def worker_command(
        self, model: str, redis_url: str, prefix: str, metrics_port: int
    ) -> list[str]:
        """`worker start` at its defaults but for the run's batch size, placement and (when
        given) busy polling."""
        a = self.args
        worker = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", MODELS[model]]
        worker += ["--redis", redis_url, "--prefix", prefix, "--batch-size", str(a.batch_size)]
        # INFO: its few start-up lines say how many workers it started (rare at steady state)
        worker += ["--metrics-port", str(metrics_port), "--log-level", "INFO"]
        if a.busy_poll_us is not None:  # otherwise the worker's own default
            worker += ["--busy-poll-us", str(a.busy_poll_us)]
        if a.model_thread is not None:
            worker += ["--model-thread", a.model_thread]
        return worker + worker_placement(a.cuda, a.workers)

    def gateway_command(self, model: str, redis_url: str, prefix: str, port: int) -> list[str]:
        """`gateway start` at its defaults but for the number of its processes."""
        gateway = [sys.executable, "-m", "web_gateway.cli", "start", "--model", MODELS[model]]
        gateway += ["--redis", redis_url, "--prefix", prefix, "--port", str(port)]
        return [*gateway, "--workers", str(self.args.gateway_workers), "--log-level", "warning"]

    @contextmanager
    def our_http(
        self, model: str, redis_url: str, tuned: list[str] | None = None
    ) -> Iterator[tuple[str, CpuMeter, BatchProbe]]:
        """A fresh `worker start` (with the ``tuned`` options, if any) and `gateway start` for
        the model, ready: (URL, a CPU meter of the worker, the gateway and Redis, the worker's
        batch probe)."""
        prefix = f"open{os.getpid()}{'t' if tuned else ''}"
        metrics_port, port = free_port(), free_port()
        worker = self.worker_command(model, redis_url, prefix, metrics_port) + (tuned or [])
        gateway = self.gateway_command(model, redis_url, prefix, port)
        with ExitStack() as stack:
            worker_proc = stack.enter_context(self.process(worker, f"open-worker-{model}"))
            self.wait_worker(redis_url, model, prefix, worker_proc, f"open-worker-{model}")
            gateway_proc = stack.enter_context(self.process(gateway, f"open-gateway-{model}"))
            url = f"http://127.0.0.1:{port}/v1/models/{model}/predict"
            self.wait_http(url, gateway_proc)
            roots = {"gateway": gateway_proc.pid, "worker": worker_proc.pid}
            meter = CpuMeter({**roots, "redis": self.redis_pid})
            yield url, meter, BatchProbe(f"metrics:http://127.0.0.1:{metrics_port}/metrics")

    @contextmanager
    def mosec(self, model: str, scenario: str) -> Iterator[tuple[str, CpuMeter, BatchProbe]]:
        """mosec serving the model with the scenario's max wait, ready: (URL, a CPU meter of its
        whole process tree, its batch log's probe)."""
        index = ALTERNATIVES.index(scenario)
        batch_log = self.tmp / f"batches-{model}-{index}-{time.monotonic_ns()}.log"
        env = {"BENCH_MODEL": MODELS[model], "BENCH_BATCH_LOG": str(batch_log)}
        env["BENCH_MAX_WAIT_MS"] = f"{MOSEC_WAIT_MS[scenario]:g}"
        python, port = venvs.ensure("mosec"), free_port()
        command = [str(python), "-m", "bench.alternatives.mosec_server", "--port", str(port)]
        command += ["--timeout", "60000", "--log-level", "warning"]
        url = f"http://127.0.0.1:{port}/inference"
        name = f"alt-{model}-{index}"
        with self.process(command, name, env) as proc:
            try:
                self.wait_http(url, proc)
            except Exception as exc:
                raise RuntimeError(f"{exc}: {self.tail(name)}") from exc
            yield url, CpuMeter({"server": proc.pid}), BatchProbe(f"file:{batch_log}")

    def open_loop(self, model: str, redis_url: str) -> None:
        """Latency against offered load (bench.sla) for our gateway and for mosec at each of
        its settings, each arm's generator a process of its own; into ``self.open_loops``."""
        arms: list[tuple[str, Callable[[], Any]]] = [
            (OURS[5], partial(self.our_http, model, redis_url))
        ]
        if self.args.open_loop_tuned:
            tuned = shlex.split(self.args.open_loop_tuned)
            label = f"{OURS[5]}, tuned: worker {self.args.open_loop_tuned}"
            arms.append((label, partial(self.our_http, model, redis_url, tuned)))
        arms += [(s, partial(self.mosec, model, s)) for s in MOSEC_WAIT_MS]
        results = self.open_loops.setdefault(model, {})
        for scenario, stack in arms:
            try:
                with stack() as (url, meter, probe):
                    results[scenario] = self.sla_curve(model, scenario, url, meter, probe)
            except Exception as exc:
                self.failed(model, f"{OPEN_LOOP}: {scenario}", 0, repr(exc)[-3000:])
                results[scenario] = {"error": repr(exc)[-3000:]}

    def sla_curve(
        self, model: str, scenario: str, url: str, meter: CpuMeter, probe: BatchProbe
    ) -> dict[str, Any]:
        from bench.openloop import RunResult
        from bench.sla import sla_curve
        from bench.tune import Generator

        a = self.args
        slug = re.sub(r"\W+", "-", scenario)
        target = {"kind": "http", "url": url, "body": self.body}
        generator = Generator(target, self.tmp / f"openloop-{model}-{slug}.log", self.env)
        try:
            closed = {"closed": {"concurrency": 64, "duration": a.duration}}
            capacity = float(generator.ask(closed, timeout=60 + a.duration)["rps"])

            def window(rate: float) -> tuple[RunResult, dict[str, float] | None]:
                spec = {"rate": rate, "duration": a.duration, "warmup": a.warmup, "lanes": 256}
                spec.update(drain_s=5.0, sla_p99_ms=a.sla_p99_ms, min_success=a.min_success)
                before, batches, wall = meter.sample(), probe.totals(), time.monotonic()
                answer = generator.ask({"open": spec}, timeout=60 + a.warmup + a.duration)
                result = RunResult.from_dict(answer)
                seconds = time.monotonic() - wall
                after = meter.sample()
                # the servers' CPU over the whole run (warm-up and drain included), in cores
                cores = {k: (after[k] - before[k]) / seconds for k in before}
                cores["total"] = sum(cores.values())
                result.extra["mean_batch"] = probe.mean(batches, probe.totals(), result.ok)
                log(
                    f"{model:8} open loop {scenario:32} {result.line()} "
                    f"servers {cores['total']:.2f} cores"
                )
                if not result.ok_fraction or result.aborted:
                    time.sleep(1.0)  # let a backlog drain before the next window
                return result, cores

            curve = sla_curve(
                window,
                capacity,
                repeats=a.repeats,
                sla_p99_ms=a.sla_p99_ms,
                min_success=a.min_success,
            )
        finally:
            generator.close()
        log(
            f"{model:8} open loop {scenario:32} highest rate within p99 {a.sla_p99_ms:g} ms: "
            f"{curve.max_rate:,.0f}/s (closed-loop capacity {capacity:,.0f}/s; {curve.stopped})"
        )
        return curve.to_dict()

    def wait_worker(
        self, redis_url: str, model: str, prefix: str, proc: subprocess.Popen[bytes], name: str
    ) -> None:
        """Until the `worker start` ``proc`` (logging to ``name``.log) has all its workers
        live; their number (chosen by the worker where --workers was not given) is recorded."""
        count = self.args.workers
        try:
            if count is None:
                count = self.started_workers(name, proc)
            wait_workers(redis_url, ModelKeys(model, prefix), count, timeout=180, proc=proc)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: " + self.tail(name)) from None
        self.workers_started[model] = count

    def started_workers(self, name: str, proc: subprocess.Popen[bytes]) -> int:
        """How many workers `worker start` started, read from its log once all were ready."""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            found = re.search(r"all (\d+) worker\(s\) ready", self.tail(name, None))
            if found:
                return int(found.group(1))
            if proc.poll() is not None:
                raise RuntimeError(f"worker did not start (exit code {proc.returncode})")
            time.sleep(0.1)
        raise RuntimeError("worker did not say all its workers were ready within 180 s")

    def tail(self, name: str, size: int | None = 2000) -> str:
        try:
            text = (self.tmp / f"{name}.log").read_text(errors="replace")
            return text if size is None else text[-size:]
        except OSError:
            return ""

    def alternative(self, model: str, scenario: str, redis_port: int) -> None:
        a = self.args
        batch_log = self.tmp / f"batches-{model}-{ALTERNATIVES.index(scenario)}.log"
        env = {"BENCH_MODEL": MODELS[model], "BENCH_BATCH_LOG": str(batch_log)}
        probe = BatchProbe(f"file:{batch_log}")
        port = free_port()
        name = f"alt-{model}-{ALTERNATIVES.index(scenario)}"
        if scenario == ALTERNATIVES[0]:
            python = venvs.ensure("service_streamer")
            prefix = f"ss{os.getpid()}"
            broker = f"127.0.0.1:{redis_port}"
            command = [str(python), "-m", "bench.alternatives.ss_redis_worker", broker, prefix]
            with self.process(command, name, env) as proc:
                # RedisWorker has no readiness signal: wait for its first batch
                spec = {"concurrency": 1, "broker": broker, "prefix": prefix, "warmup": 0.0}
                spec.update({"duration": 0.1, "repeats": 1})
                deadline = time.monotonic() + 180
                while probe.totals()[1] == 0:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("RedisWorker did not start: " + self.tail(name))
                    self.load(python, "ss-redis", {**spec, "probe": "none"})
                for c in a.concurrency:
                    spec = {"concurrency": c, "broker": broker, "prefix": prefix}
                    spec["probe"] = f"file:{batch_log}"
                    spec["cpu_roots"] = {"server": proc.pid, "redis": self.redis_pid}
                    self.record(model, scenario, c, self.load(python, "ss-redis", spec))
            return
        if scenario == ALTERNATIVES[1]:
            python = venvs.ensure("service_streamer")
            command = [str(python), "-m", "bench.alternatives.ss_flask", str(port)]
            url = f"http://127.0.0.1:{port}/predict"
        elif scenario == ALTERNATIVES[2]:
            python = venvs.ensure("fastapi")
            command = [str(python), "-m", "uvicorn", "bench.naive_fastapi:app", "--port"]
            command += [str(port), "--log-level", "warning", "--no-access-log"]
            url = f"http://127.0.0.1:{port}/predict"
            probe = BatchProbe("none")  # one item per call, by construction
        elif scenario == ALTERNATIVES[3]:
            python = venvs.ensure("litserve")
            command = [str(python), "-m", "bench.alternatives.litserve_server", str(port)]
            url = f"http://127.0.0.1:{port}/predict"
        else:
            with self.mosec(model, scenario) as (url, meter, probe):
                for c in a.concurrency:
                    self.record(model, scenario, c, self.wrk(url, c, probe, meter))
            return
        with self.process(command, name, env) as proc:
            try:
                self.wait_http(url, proc)
            except Exception as exc:
                raise RuntimeError(f"{exc}: {self.tail(name)}") from exc
            meter = CpuMeter({"server": proc.pid})  # its whole process tree
            for c in a.concurrency:
                windows = self.wrk(url, c, probe, meter)
                if scenario == ALTERNATIVES[2]:
                    for w in windows:
                        w["mean_batch"] = 1
                self.record(model, scenario, c, windows)

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        import torch

        from broker.devserver import RedisServer

        torch.set_num_threads(self.args.torch_threads)
        load_before = os.getloadavg()
        started = time.time()
        alternatives = [s for s in ALTERNATIVES if s in self.args.scenarios]
        versions: dict[str, dict[str, str]] = {}
        with RedisServer() as server:
            assert server.process is not None
            self.redis_pid = server.process.pid
            for model in self.args.models:
                log(f"model {model}")
                # (scenarios a step may run, the step); each step runs only the selected ones
                steps: list[tuple[list[str], Any]] = [
                    (OURS[0:2], lambda m=model: self.direct(m)),
                    (OURS[2:3], lambda m=model: self.embedded(m)),
                    (OURS[3:6], lambda m=model: self.ours_served(m, server.url)),
                ]
                for scenarios, step in steps:
                    scenario = next((s for s in scenarios if s in self.args.scenarios), None)
                    if scenario is not None:
                        try:
                            step()
                        except Exception as exc:
                            self.failed(model, scenario, 0, repr(exc))
                for scenario in alternatives:
                    try:
                        self.alternative(model, scenario, server.port)
                    except Exception as exc:
                        self.failed(model, scenario, 0, repr(exc)[-3000:])
                if OPEN_LOOP in self.args.scenarios and model in self.args.open_loop_models:
                    self.open_loop(model, server.url)
        for name in ("service_streamer", "fastapi", "litserve", "mosec"):
            if venvs.python_of(name).exists() and alternatives:
                with suppress(Exception):
                    versions[name] = venvs.versions(name)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return {
            "command": "python -m bench " + shlex.join(sys.argv[1:]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "elapsed_s": round(time.time() - started, 1),
            "machine": machine(),
            "gpu": gpu(self.args.cuda),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "python": platform.python_version(),
            "versions": {"microbatch": our_versions(), **versions},
            "settings": {
                "torch_threads": self.args.torch_threads,
                "batch_size": self.args.batch_size,
                "max_wait_ms": self.args.max_wait_ms,
                "gateway_workers": self.args.gateway_workers,
                "duration_s": self.args.duration,
                "warmup_s": self.args.warmup,
                "repeats": self.args.repeats,
                "concurrency": self.args.concurrency,
                "wrk": wrk_version(),
                "pinning": f"none ({os.cpu_count()} cores shared by every process)",
                "device": self.device,
                "workers": "default" if self.args.workers is None else self.args.workers,
                "workers_started": self.workers_started,
                "busy_poll_us": self.args.busy_poll_us,
                "model_thread": self.args.model_thread,
                "load_processes": self.args.load_processes,
                "mosec_max_wait_ms": list(MOSEC_WAIT_MS.values()),
                "sla_p99_ms": self.args.sla_p99_ms,
                "open_loop_tuned": self.args.open_loop_tuned,
                "min_success": self.args.min_success,
            },
            "memory_mb": self.memory,
            "brackets": self.brackets,
            "results": self.rows,
            "open_loop": self.open_loops,
        }


def merge_windows(per_process: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One list of windows from those of load processes that ran side by side (window i of
    each at about the same time): items/s, requests and errors summed; CPU per item weighted
    by each process's requests (the servers' CPU, which every process measured over its own
    window, is counted once); p50 and p90 the median of the processes', p99 the highest (an
    upper bound: the processes' latencies are not pooled); the mean batch the median."""
    merged = []
    for windows in zip(*per_process, strict=True):
        requests = [max(1, int(w.get("requests") or 0)) for w in windows]
        total = sum(requests)
        window: dict[str, Any] = {
            "items_per_s": sum(w["items_per_s"] for w in windows),
            "requests": sum(int(w.get("requests") or 0) for w in windows),
            "errors": sum(int(w.get("errors") or 0) for w in windows),
            "p50_ms": statistics.median(w["p50_ms"] for w in windows),
            "p90_ms": statistics.median(w["p90_ms"] for w in windows),
            "p99_ms": max(w["p99_ms"] for w in windows),
            "load_processes": len(windows),
        }
        batches = [w["mean_batch"] for w in windows if w.get("mean_batch") is not None]
        window["mean_batch"] = statistics.median(batches) if batches else None
        weights = [n / total for n in requests]
        if all(w.get("load_cpu_us_per_item") is not None for w in windows):
            window["load_cpu_us_per_item"] = sum(
                w["load_cpu_us_per_item"] * share for w, share in zip(windows, weights, strict=True)
            )
        servers = [w["cpu_us_per_item"] for w in windows if w.get("cpu_us_per_item")]
        if len(servers) == len(windows):
            window["cpu_us_per_item"] = {
                key: sum(s[key] * share for s, share in zip(servers, weights, strict=True))
                / len(servers)
                for key in servers[0]
            }
        merged.append(window)
    return merged


def med_cpu(windows: list[dict[str, Any]]) -> dict[str, float] | None:
    """The median over windows of each process tree's CPU per item (and of their total)."""
    measured = [w["cpu_us_per_item"] for w in windows if w.get("cpu_us_per_item")]
    if not measured:
        return None
    return {key: statistics.median(m[key] for m in measured) for key in measured[0]}


@contextmanager
def spawn(
    command: list[str], log_path: Path, env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` in the repository root for the ``with`` block, its output to
    ``log_path``, in a session of its own; then SIGTERM its whole group (SIGKILL after 30 s)."""
    logfile = open(log_path, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # so that its children (gunicorn workers, ...) end with it
    )
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        logfile.close()


def wait_http_post(
    url: str, body: str, proc: subprocess.Popen[bytes], timeout: float = 180
) -> None:
    """Until a POST of ``body`` (JSON) to ``url`` answers 200; RuntimeError if PROC exits."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            request = urllib.request.Request(
                url, body.encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    json.loads(response.read())
                    return
        except Exception:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer")


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, MB."""
    total = 0.0
    pids = [pid]
    while pids:
        current = pids.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
            pids += [int(c) for c in children]
        except (OSError, AttributeError):
            pass
    return total


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or platform.processor()}, {os.cpu_count()} cores, {platform.platform()}"


def worker_placement(cuda: str | None, workers: int | None) -> list[str]:
    """`worker start` options: WORKERS processes on CUDA device CUDA, or on the CPU (None:
    the worker's default, `--workers-per-device auto` on a GPU and 1 process on the CPU)."""
    if cuda is not None:
        return ["--cuda", cuda] + (
            [] if workers is None else ["--workers-per-device", str(workers)]
        )
    return ["--workers", str(workers)] if workers is not None and workers > 1 else []


def gpu(cuda: str | None) -> dict[str, Any] | None:
    """The GPU a --cuda run used: name, memory, driver, torch and its CUDA (None on the CPU)."""
    if cuda is None:
        return None
    import torch

    props = torch.cuda.get_device_properties(int(cuda))
    info: dict[str, Any] = {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    with suppress(OSError, subprocess.CalledProcessError):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, check=True).stdout
        info["driver"] = out.split("\n")[0].strip()  # one driver serves every device
    return info


def our_versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("torch", "redis", "hiredis", "msgpack", "numpy", "fastapi", "uvicorn", "gunicorn"):
        with suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    try:
        server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
        out["redis-server"] = server.stdout.split()[2].removeprefix("v=")
    except (OSError, IndexError):
        pass
    return out


def wrk_version() -> str:
    if shutil.which("wrk") is None:
        return "not installed"
    out = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "wrk"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="< 1 minute, our scenarios only")
    parser.add_argument("--models", help="comma-separated, of: identity,mlp,heavy")
    parser.add_argument("--concurrency", help="comma-separated (default 1,64,256)")
    parser.add_argument(
        "--scenarios",
        help="comma-separated substrings of scenario names, e.g. 'gateway,mosec,one at a time' "
        "(the names themselves contain commas: pick parts without one)",
    )
    parser.add_argument("--no-alternatives", action="store_true")
    parser.add_argument("--duration", type=float, help="seconds per measured window")
    parser.add_argument("--warmup", type=float, help="seconds of warm-up per arm")
    parser.add_argument("--repeats", type=int, help="measured windows per arm (median)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--torch-threads", type=int, default=1)
    # one gateway process: on 2 cores shared with wrk, Redis and the model worker, a second one
    # only adds contention (measured: 6.5-6.9k req/s, p99 15 ms with 1; 5.1-5.9k, 20-24 ms with 2)
    parser.add_argument("--gateway-workers", type=int, default=1)
    parser.add_argument(
        "--cuda",
        help="a CUDA device index: the direct and embedded arms load the model on cuda:N, the "
        "worker starts with --cuda N (default: everything on the CPU)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="model worker processes of the `worker start` arms (with --cuda: on that device; "
        "default: the worker's own, 1 on the CPU and `--workers-per-device auto` on a GPU)",
    )
    parser.add_argument(
        "--busy-poll-us",
        type=int,
        default=None,
        help="`worker start --busy-poll-us` of our worker, a tuned variant (default: not given, "
        "so the worker runs at its defaults, as a new user's does; 1000: a worker with nothing "
        "to do polls 1 ms before it sleeps)",
    )
    parser.add_argument(
        "--model-thread",
        choices=["auto", "on", "off"],
        help="`worker start --model-thread` of our worker, a tuned variant (default: not given)",
    )
    parser.add_argument(
        "--load-processes",
        type=int,
        default=1,
        help="processes the asyncio client's load is split among (each gets an equal share of "
        "the concurrency; default 1): several callers, as several gateways are",
    )
    parser.add_argument(
        "--open-loop-models",
        default="mlp",
        help="comma-separated: the models the open-loop scenario runs for (default mlp)",
    )
    parser.add_argument(
        "--open-loop-tuned",
        metavar="WORKER-OPTIONS",
        help="open loop: also an arm of our gateway whose worker runs with these `worker start` "
        "options, labelled as tuned (e.g. '--max-latency 0.005'); the targets judge the "
        "defaults' arm",
    )
    parser.add_argument("--sla-p99-ms", type=float, default=50.0, help="open loop: p99 SLA")
    parser.add_argument(
        "--min-success", type=float, default=0.999, help="open loop: least fraction answered 200"
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS)
    parser.add_argument("--no-report", action="store_true", help="skip docs/benchmarks.md")
    args = parser.parse_args(argv)
    quick = args.quick
    args.models = (args.models or ("mlp" if quick else "identity,mlp,heavy")).split(",")
    args.concurrency = [
        int(c) for c in (args.concurrency or ("1,64" if quick else "1,64,256")).split(",")
    ]
    args.duration = args.duration or (0.5 if quick else 3.0)
    args.warmup = args.warmup or (0.3 if quick else 1.0)
    args.repeats = args.repeats or (1 if quick else 3)
    every = OURS + ([] if (quick or args.no_alternatives) else [*ALTERNATIVES, OPEN_LOOP])
    if args.scenarios:
        wanted = [w.strip() for w in args.scenarios.split(",")]
        every = [s for s in every if any(w in s for w in wanted)]
    args.scenarios = every
    args.open_loop_models = args.open_loop_models.split(",")
    if args.cuda is not None and not args.cuda.isdigit():
        parser.error(f"--cuda takes one device index, not {args.cuda!r}")
    if args.workers is not None and args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.load_processes < 1:
        parser.error("--load-processes must be at least 1")
    for model in args.models:
        if model not in MODELS:
            parser.error(f"unknown model {model!r}: one of {', '.join(MODELS)}")
    return args


def not_run(report: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """Requested (model, scenario) pairs that produced no row at all (HTTP arms without wrk
    excepted: they are skipped, and said so, on purpose)."""
    ran = {(r["model"], r["scenario"]) for r in report["results"]}
    ran |= {(model, OPEN_LOOP) for model in report.get("open_loop", {})}
    ran |= {(m, OPEN_LOOP) for m in args.models if m not in args.open_loop_models}
    skipped = {OURS[5]} if shutil.which("wrk") is None else set()
    return [
        f"{model}: {scenario}"
        for model in args.models
        for scenario in args.scenarios
        if (model, scenario) not in ran and scenario not in skipped
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = Harness(args).run()
    report["quick"] = args.quick
    args.output_dir.mkdir(parents=True, exist_ok=True)
    name = "harness-quick.json" if args.quick else "harness.json"
    path = args.output_dir / name
    path.write_text(json.dumps(report, indent=2))
    log(f"wrote {path}")
    from bench import report as report_module

    print(report_module.verdicts(report))
    missing = not_run(report, args)
    if missing:
        raise SystemExit("requested but not run: " + "; ".join(missing))
    if not args.no_report and not args.quick:
        report_module.main(path)


if __name__ == "__main__":
    main()
