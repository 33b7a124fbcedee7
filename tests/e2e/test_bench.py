"""The benchmark harness runs end to end (`python -m bench --quick`); no assertions on speed."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # the benchmark smoke runs: minutes in all

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_quick_harness_reports_every_scenario(tmp_path: Path) -> None:
    from bench.harness import OURS

    subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        check=True,
        timeout=540,
    )
    report = json.loads((tmp_path / "harness-quick.json").read_text())
    rows = report["results"]
    failures = [r for r in rows if "error" in r]
    assert not failures, failures
    expected = OURS if shutil.which("wrk") else [s for s in OURS if not s.startswith("http")]
    concurrency = report["settings"]["concurrency"]
    for scenario in expected:
        found = [r for r in rows if r["scenario"] == scenario]
        levels = [1] if scenario.startswith("direct") else concurrency
        assert sorted(r["concurrency"] for r in found) == sorted(levels), scenario
        for r in found:
            assert r["items_per_s"] > 0, r
            assert r["errors"] == 0, r
            assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"], r
            assert r["mean_batch"] is not None and r["mean_batch"] >= 1, r
    assert {r["model"] for r in rows} == {"mlp"}
    # the asyncio arm at the top concurrency ran between windows of the model called directly
    bracket = report["brackets"]["mlp"]
    assert bracket["concurrency"] == max(concurrency)
    repeats = report["settings"]["repeats"]
    assert len(bracket["direct_items_per_s"]) == repeats + 1
    assert len(bracket["shares"]) == repeats and bracket["share"] > 0
    served = [r for r in rows if r["scenario"] == OURS[3] and r["concurrency"] == max(concurrency)]
    assert [w["items_per_s"] for w in served[0]["windows"]] == bracket["served_items_per_s"]


def test_the_share_targets_are_judged_on_the_bracketed_windows() -> None:
    from bench.report import targets

    def row(scenario: str, concurrency: int, items_per_s: float) -> dict[str, object]:
        return {"model": "heavy", "scenario": scenario, "concurrency": concurrency,
                "items_per_s": items_per_s, "p50_ms": 1.0, "p99_ms": 2.0}  # fmt: skip

    rows = [row("direct, batched", 1, 1600), row("redis, python client (asyncio)", 256, 1500)]
    bracket = {"concurrency": 256, "direct_items_per_s": [1520, 1540, 1530, 1510],
               "shares": [0.98, 0.975, 0.99], "share": 0.98}  # fmt: skip
    (unbracketed,) = targets(rows)
    assert unbracketed[2] == "**missed**" and "= 94%" in unbracketed[1]
    (judged,) = targets(rows, {"heavy": bracket})
    assert judged[2] == "met"
    assert "bracketed: 98.0%" in judged[1] and "1,600 = 94%" in judged[1]


@pytest.mark.timeout(300)
def test_soak_samples_memory_under_load(tmp_path: Path) -> None:
    """A short soak (the published one runs 10 minutes): samples and a summary come back."""
    from bench.report import soak_section

    output, picture = tmp_path / "soak.json", tmp_path / "soak.png"
    command = [sys.executable, "-m", "bench.soak", "--duration", "6", "--interval", "1"]
    command += ["--warmup", "2", "--client-concurrency", "4", "--http-concurrency", "4"]
    command += ["--output", str(output), "--plot", str(picture), "--busy-poll-us", "500"]
    subprocess.run(command, cwd=ROOT, check=True, timeout=240, capture_output=True)
    report = json.loads(output.read_text())
    assert report["busy_poll_us"] == 500 and report["model_thread"] == "auto"
    assert "process with `--busy-poll-us 500`" in "\n".join(soak_section(output))
    assert len(report["samples"]) >= 4
    assert report["client_answered"] > 0 and report["client_failed"] == 0
    if shutil.which("wrk"):
        assert report["wrk"]["requests"] > 0 and report["wrk"]["non_2xx"] == 0
    for key in ("worker_mb", "gateway_mb", "redis_mb"):
        summary = report["summary"][key]
        assert summary["first"] > 0 and summary["max"] > 0
    assert report["summary"]["worker_mb"]["first"] > 50  # torch and the model are resident
    assert picture.stat().st_size > 1000


@pytest.mark.timeout(300)
def test_model_share_reads_the_workers_own_inference_time() -> None:
    command = [sys.executable, "-m", "bench.model_share", "--model", "mlp", "--duration", "1"]
    command += ["--warmup", "0.5", "--concurrency", "32"]
    out = subprocess.run(command, cwd=ROOT, check=True, timeout=240, capture_output=True)
    result = json.loads(out.stdout)
    assert result["items_per_s"] > 0 and result["direct_batched_items_per_s"] > 0
    assert 1 <= result["mean_batch"] <= 64
    assert 0 < result["model_share_of_wall"] <= 1.05
    assert result["ms_per_batch_in_model"] > 0
    # the worker and the client spent CPU on the items (Redis too, but 1 s may be under a tick)
    assert result["cpu_us_per_item_worker"] > 0 and result["cpu_us_per_item_client"] > 0
    assert result["cpu_us_per_item_redis"] >= 0


@pytest.mark.timeout(300)
def test_a_scenario_filter_runs_exactly_the_scenarios_it_names(tmp_path: Path) -> None:
    """Each arm is chosen on its own (the HTTP arm once ran only if the asyncio arm did)."""
    # substrings of scenario names (the names themselves contain commas)
    names = {
        "one at a time": "direct, one at a time",
        "(threads)": "redis, python client (threads)",
    }
    if shutil.which("wrk"):
        names["gateway"] = "http, gateway"
    wanted = list(names.values())
    command = [sys.executable, "-m", "bench", "--quick", "--output-dir", str(tmp_path)]
    command += ["--concurrency", "1", "--scenarios", ",".join(names)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=240)
    rows = json.loads((tmp_path / "harness-quick.json").read_text())["results"]
    assert not [r for r in rows if "error" in r]
    assert sorted(r["scenario"] for r in rows) == sorted(wanted)
    (threads,) = [r for r in rows if r["scenario"] == "redis, python client (threads)"]
    assert threads["load_cpu_us_per_item"] > 0  # the load process's own CPU per item


def test_client_cost_alternates_trees_and_reports_each_arm(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    command = [sys.executable, "-m", "bench.client_cost", "--code", str(ROOT), "--code", "."]
    command += ["--rounds", "1", "--duration", "0.5", "--warmup", "0.2"]
    command += ["--arms", "threads:4,asyncio:4", "--json", str(out)]
    shown = subprocess.run(
        command, cwd=ROOT, check=True, timeout=120, capture_output=True, text=True
    ).stdout
    assert "threads c=4" in shown and "machine: reference MLP direct" in shown
    report = json.loads(out.read_text())
    assert [(w["tree"], w["arm"]) for w in report["windows"]] == [
        (str(ROOT), "threads c=4"),
        (str(ROOT), "threads c=4"),
        (str(ROOT), "asyncio c=4"),
        (str(ROOT), "asyncio c=4"),
    ]
    for window in report["windows"]:
        assert window["items_per_s"] > 0 and window["errors"] == 0
        assert window["cpu_us_per_item_client"] > 0
        assert window["cpu_us_per_item_worker"] > 0 and window["cpu_us_per_item_redis"] >= 0


@pytest.mark.parametrize(("calls_per_fcall", "entry_items"), [(1, 1), (4, 4)])
def test_enqueue_cost_measures_each_library_and_multi_exec(
    calls_per_fcall: int, entry_items: int
) -> None:
    import argparse

    from bench.enqueue_cost import measure

    args = argparse.Namespace(
        against="HEAD", items=2, item_bytes=100, calls_per_fcall=calls_per_fcall,
        entry_items=entry_items, calls=5, pipelines=2, rounds=2,
    )  # fmt: skip
    results = measure(args)
    assert list(results) == ["this tree", "HEAD", "MULTI/EXEC"]
    assert all(len(rounds) == 2 and min(rounds) >= 0 for rounds in results.values())
    assert sum(results["this tree"]) > 0  # Redis spent CPU on the calls it was sent


def test_function_args_measures_each_arm_at_each_size() -> None:
    from bench.function_args import ARMS, measure

    results = measure([100, 5000], calls=20, rounds=2)
    assert list(results) == [100, 5000]
    assert all(list(arms) == list(ARMS) and min(arms.values()) >= 0 for arms in results.values())
    assert sum(results[5000].values()) > 0  # Redis spent CPU on the calls it was sent


def test_a_requested_scenario_that_runs_nothing_is_reported() -> None:
    from bench.harness import not_run, parse_args

    args = parse_args(["--quick", "--models", "mlp", "--scenarios", "one at a time,asyncio"])
    report = {"results": [{"model": "mlp", "scenario": "direct, one at a time"}]}
    assert not_run(report, args) == ["mlp: redis, python client (asyncio)"]


def test_hops_measures_a_round_trip_through_redis() -> None:
    command = [sys.executable, "-m", "bench.hops", "--rounds", "50"]
    out = subprocess.run(command, cwd=ROOT, check=True, timeout=60, capture_output=True, text=True)
    assert "two hops through Redis" in out.stdout and "over 40 round trips" in out.stdout


def test_the_cuda_option_reaches_the_worker_command() -> None:
    """`python -m bench --cuda N` (docs/gpu.md); the default stays on the CPU, unchanged."""
    from bench.harness import parse_args, worker_placement

    assert parse_args(["--quick"]).cuda is None
    args = parse_args(["--quick", "--cuda", "0", "--workers", "2"])
    assert worker_placement(args.cuda, args.workers) == ["--cuda", "0", "--workers-per-device", "2"]
    assert worker_placement("0", None) == ["--cuda", "0"]  # the worker's own auto
    assert parse_args(["--quick"]).workers is None
    assert worker_placement(None, None) == worker_placement(None, 1) == []
    assert worker_placement(None, 3) == ["--workers", "3"]
    with pytest.raises(SystemExit):
        parse_args(["--cuda", "0,1"])


@pytest.mark.timeout(240)
def test_load_processes_split_the_callers_and_the_worker_options_reach_the_worker(
    tmp_path: Path,
) -> None:
    """``--load-processes 2``: two load processes share the asyncio arm's callers, their
    windows merged; ``--model-thread`` is passed to `worker start` and recorded."""
    from bench.harness import Harness, parse_args

    args = parse_args(["--model-thread", "on", "--quick"])
    assert Harness(args).worker_command("mlp", "redis://x", "p", 1)[-2:] == [
        "--model-thread",
        "on",
    ]
    command = [sys.executable, "-m", "bench", "--models", "identity", "--concurrency", "4"]
    command += ["--scenarios", "asyncio", "--no-alternatives", "--no-report", "--duration", "0.5"]
    command += ["--repeats", "1", "--warmup", "0.3", "--load-processes", "2"]
    command += ["--output-dir", str(tmp_path)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=200)
    report = json.loads((tmp_path / "harness.json").read_text())
    assert report["settings"]["load_processes"] == 2
    (row,) = report["results"]
    (window,) = row["windows"]
    assert window["load_processes"] == 2 and row["errors"] == 0 and row["requests"] > 0
    assert row["load_cpu_us_per_item"] > 0 and row["cpu_us_per_item"]["worker"] > 0


def test_device_report_answers_with_where_it_ran() -> None:
    """bench.gpu_check's model: the reference MLP's output, and the process and device."""
    import os

    import numpy as np

    from bench.models import DeviceReport
    from examples.mlp import MLP

    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    model, reference = DeviceReport(), MLP()
    model.init_model()
    reference.init_model()
    [answer] = model.predict([x])
    assert answer["pid"] == os.getpid()
    assert (answer["device"], answer["tensor_device"], answer["device_count"]) == ("cpu", "cpu", 0)
    assert np.allclose(answer["output"], reference.predict([x])[0])


def test_gpu_check_compares_the_mlps_transfers_and_says_no_cuda_without_it() -> None:
    """bench.gpu_check's pageable vs pinned arms run on the CPU here (nothing is pinned then,
    and the timings mean nothing): the same outputs both ways. The command itself says it
    has no CUDA and, with --transfers-only, exits 0."""
    import torch

    from bench.gpu_check import same_outputs, transfer_arms

    result = transfer_arms("cpu", batch_size=8, batches=2, repeats=2)
    assert set(result["arms"]) == {"pageable", "pinned"}
    assert result["arms"]["pageable"]["staged"] is False
    assert result["arms"]["pinned"]["staged"] is True
    assert not any(arm["pinned"] for arm in result["arms"].values())  # no CUDA on a CPU
    assert all(len(arm["items_per_s"]) == 2 for arm in result["arms"].values())
    assert result["max_abs_diff"] == 0.0 and same_outputs(result)
    if torch.cuda.is_available():
        return
    command = [sys.executable, "-m", "bench.gpu_check", "--transfers-only"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout


@pytest.mark.timeout(120)
def test_cold_model_measures_each_condition() -> None:
    from bench.cold_model import CONDITIONS

    command = [sys.executable, "-m", "bench.cold_model", "--model", "mlp", "--calls", "20"]
    out = subprocess.run(command, cwd=ROOT, check=True, timeout=100, capture_output=True)
    results = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert [r["condition"] for r in results] == list(CONDITIONS)
    assert all(0 < r["p50_ms"] <= r["p90_ms"] for r in results)


# -- open-loop load (bench/openloop.py) and the tuning sweep (bench/tune.py) ------------------


class SlowHttpServer:
    """A keep-alive HTTP/1.1 server on a free loopback port that answers every POST with 200
    after ``delay`` seconds, one request at a time across all connections (a server whose
    capacity is 1 / delay requests per second)."""

    def __init__(self, delay: float) -> None:
        import asyncio
        import threading

        self.delay = delay
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.answered = 0
        self.port = 0

    def __enter__(self) -> SlowHttpServer:
        import asyncio

        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _start(self) -> None:
        import asyncio

        self.lock = asyncio.Lock()
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        import asyncio

        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: Any, writer: Any) -> None:
        import asyncio

        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                async with self.lock:
                    await asyncio.sleep(self.delay)
                self.answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _open_loop(url: str, rate: float, duration: float, **options: Any) -> Any:
    from bench.openloop import HttpTarget, new_loop, run_open_loop

    loop = new_loop()
    try:
        target = HttpTarget(url, b'{"inputs": [1]}')
        return loop.run_until_complete(run_open_loop(target, rate, duration, **options))
    finally:
        loop.close()


def test_open_loop_sends_every_scheduled_request() -> None:
    with SlowHttpServer(0.0) as server:
        url = f"http://127.0.0.1:{server.port}/v1/models/m/predict"
        result = _open_loop(url, 200, 1.0, warmup=0.5)
        assert server.answered == 300  # warm-up (100) + measured (200), each sent once
    assert result.scheduled == 200 and result.completed == 200 and result.ok == 200
    assert result.errors == {} and result.ok_fraction == 1.0
    assert 0.8 * 200 <= result.achieved_rps <= 1.2 * 200  # generous: a shared machine
    assert 0 < result.p50_ms <= result.p90_ms <= result.p99_ms <= result.p999_ms
    assert result.generator_cpu > 0 and not result.generator_saturated
    # connections are opened as the concurrency needs them, not all 256 up front
    assert 1 <= result.extra["lanes_used"] < 100


def test_open_loop_latency_counts_from_the_scheduled_time() -> None:
    """Offered twice what a one-at-a-time server does, over one connection: each request waits
    for the ones before it, and that wait is part of its latency (a closed-loop generator would
    report the server's 20 ms for every request). Below capacity the same server looks fast."""
    with SlowHttpServer(0.02) as server:  # 50 requests/s at most
        url = f"http://127.0.0.1:{server.port}/"
        overloaded = _open_loop(url, 100, 1.0, lanes=1)
        relaxed = _open_loop(url, 10, 1.0, lanes=1)
    # request i is due at 10 i ms and answered at about 20 (i + 1) ms: p50 ~ 0.5 s, max ~ 1 s
    assert overloaded.scheduled == 100 and overloaded.ok == 100
    assert overloaded.p50_ms > 250 and overloaded.max_ms > 600
    assert overloaded.send_lag_p99_ms > 500  # most of it spent waiting for the connection
    assert overloaded.achieved_rps < 75
    assert relaxed.ok == 10 and relaxed.p50_ms < 250


def test_open_loop_names_errors_and_stops_early_when_the_sla_is_lost() -> None:
    from broker.devserver import free_port

    refused = _open_loop(f"http://127.0.0.1:{free_port()}/", 100, 0.5)
    assert refused.ok == 0 and refused.errors == {"ConnectionRefusedError": 50}
    with SlowHttpServer(0.02) as server:
        url = f"http://127.0.0.1:{server.port}/"
        stopped = _open_loop(url, 200, 2.0, lanes=1, sla_p99_ms=50, min_success=0.999)
    assert stopped.aborted == "p99 over the SLA"
    assert stopped.scheduled == 400 and stopped.errors.get("not sent", 0) > 0


def _run(rate: float, p99_ms: float, ok: float = 1.0, saturated: bool = False) -> Any:
    from bench.openloop import RunResult

    n = 1000
    return RunResult(
        rate=rate, duration_s=1.0, scheduled=n, completed=n, ok=round(ok * n),
        errors={} if ok == 1 else {"503": n - round(ok * n)}, achieved_rps=rate,
        p50_ms=p99_ms / 4, p90_ms=p99_ms / 2, p99_ms=p99_ms, p999_ms=p99_ms, max_ms=p99_ms,
        send_lag_p99_ms=1.0, dispatch_lag_p99_ms=1.0, generator_cpu=0.1,
        generator_saturated=saturated,
    )  # fmt: skip


def test_the_rate_search_brackets_the_highest_rate_within_the_sla() -> None:
    from bench.openloop import find_max_rate, ladder

    asked: list[float] = []

    def system(rate: float) -> Any:  # within the SLA up to 1234/s
        asked.append(rate)
        return _run(rate, 10.0 if rate <= 1234 else 80.0)

    sweep = find_max_rate(system, 50, 0.999, start_rate=500, tolerance=0.1, max_steps=20)
    assert sweep.stopped == "converged"
    assert 1234 / 1.1 <= sweep.max_rate <= 1234 and sweep.best is not None
    assert asked[:3] == [500, 750, 1125]  # stepped up by 1.5 while within the SLA
    assert [s.rate for s in sweep.steps] == asked
    # bounded: a step limit, and a first rate already over the SLA is stepped down
    assert len(find_max_rate(system, 50, 0.999, 500, max_steps=3).steps) == 3
    down = find_max_rate(system, 50, 0.999, start_rate=5000, max_steps=20)
    assert down.steps[1].rate == pytest.approx(5000 / 1.5) and down.max_rate <= 1234
    # errors fail a rate whatever its latency; so does a run the generator could not keep up
    failing = find_max_rate(lambda r: _run(r, 1.0, ok=0.99), 50, 0.999, 100, min_rate=10)
    assert failing.best is None and failing.stopped == "fails even at the lowest rate"
    saturated = find_max_rate(lambda r: _run(r, 1.0, saturated=True), 50, 0.999, 100)
    assert saturated.stopped == "generator saturated" and len(saturated.steps) == 1

    # bounded in time: no run is started that would end past the budget
    def slow(rate: float) -> Any:
        time.sleep(0.05)
        return _run(rate, 10.0)

    timed = find_max_rate(slow, 50, 0.999, 100, max_steps=50, budget_s=0.12)
    assert timed.stopped == "time limit" and len(timed.steps) < 50
    assert ladder(slow, [100.0] * 50, 50, 0.999, budget_s=0.12).stopped == "time limit"
    rungs = ladder(system, [1300, 400, 800, 1200, 1600], 50, 0.999)
    assert [s.rate for s in rungs.steps] == [400, 800, 1200, 1300]
    assert rungs.max_rate == 1200 and rungs.stopped == "failed a rung"


def test_a_rate_counts_when_it_meets_the_sla_twice() -> None:
    from bench.openloop import Sweep, confirm

    steps = [_run(400, 10.0), _run(800, 20.0), _run(1200, 30.0), _run(1600, 90.0)]
    lucky = Sweep(steps[2], steps, "converged")  # 1200/s passed once, by luck

    def again(rate: float) -> Any:
        return _run(rate, 90.0 if rate > 1000 else 25.0)

    confirmed = confirm(again, lucky, 50, 0.999, runs=2)
    assert [s.rate for s in confirmed.steps[4:]] == [1200, 800]
    assert confirmed.max_rate == 800 and confirmed.stopped == "converged; confirmed"
    assert confirmed.best is not None and confirmed.best.p99_ms == 25.0  # the worse of two
    assert confirmed.steps[-1].extra["confirmation"] is True
    alone = confirm(again, lucky, 50, 0.999, runs=1)
    assert alone.best is None and alone.stopped == "converged; not confirmed"
    assert confirm(again, Sweep(None, steps[3:], "x"), 50, 0.999).stopped == (
        "x; nothing to confirm"
    )


def test_tune_plans_a_search_or_a_ladder_from_the_budget() -> None:
    from bench.tune import grid, ladder_fractions, parse_args, plan_config

    args = parse_args(["--model", "examples.mlp:MLP", "--sla-p99-ms", "50"])
    assert len(grid(args)) == 24 and args.out.name == "tune-mlp" and args.lanes == 1024
    http = parse_args(["--model", "examples.mlp:MLP", "--sla-p99-ms", "50", "--http"])
    assert len(grid(http)) == 48 and http.out.name == "tune-mlp-http" and http.lanes == 256
    assert {c.gateway_workers for c in grid(http)} == {1, 2}
    # 1 s warm-up + 3 s window + overhead per run; 8 s start-up and a 2 s probe per config
    search = plan_config(args, 60, startup_s=8)
    assert search is not None and search.mode == "search" and search.steps == args.max_steps
    tight = plan_config(args, 32, startup_s=8)  # 4 runs: 3 rates and the confirmation
    assert tight is not None and tight.mode == "ladder" and tight.steps == 4
    assert plan_config(args, 25, startup_s=8) is None
    assert ladder_fractions(3) == [0.3, 0.548, 1.0] and len(ladder_fractions(7)) == 7


def _config_row(key_config: dict[str, int | float], max_rate: float, p99: float) -> dict[str, Any]:
    from dataclasses import asdict

    from bench.tune import Config

    config = Config(**key_config)  # type: ignore[arg-type]
    best = _run(max_rate, p99).to_dict() if max_rate else None
    if best:
        best["extra"] = {"mean_batch": 7.5}
    steps = [best] if best else [_run(300, 90.0).to_dict()]
    return {
        "type": "config", "model": "examples.mlp:MLP", "path": "client", "sla_p99_ms": 50.0,
        "min_success": 0.999, "key": config.key, "config": asdict(config), "mode": "search",
        "steps": steps, "stopped": "converged", "max_rate": max_rate, "best": best,
        "capacity": {"rps": 2 * max_rate + 500},
    }  # fmt: skip


def _report_table(text: str) -> list[dict[str, str]]:
    """The rows of report.md's "Every configuration" table, by column name."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
        for line in lines[1:]
    ]


def _check_report(report: str, sla_ms: float = 50) -> None:
    """The recommendation is the table's fastest row within the SLA, and says so everywhere."""
    rows = _report_table(report)
    rate_column = "highest rate within the SLA, req/s"
    rates = {
        r["key"].strip("`"): float(r[rate_column].replace(",", ""))
        for r in rows
        if r[rate_column][0].isdigit()
    }
    marked = [r["key"].strip("`") for r in rows if "(recommended)" in r["configuration"]]
    recommendation = report.split("## Recommendation")[1].split("## ")[0]
    if not rates:
        assert marked == [] and "No configuration met the SLA" in recommendation
        return
    fastest = max(rates, key=lambda k: rates[k])
    assert marked == [fastest]
    assert f"(`{fastest}`): {rates[fastest]:,.0f} requests/s within the SLA" in recommendation
    for row in rows:  # each passing row's p99 meets the SLA stated in the report
        if row["key"].strip("`") in rates:
            assert float(row["p99 ms"]) <= sla_ms


def test_tune_report_recommends_the_fastest_configuration_within_the_sla(
    tmp_path: Path,
) -> None:
    from bench.tune import parse_args
    from bench.tune_report import write_report

    args = parse_args(["--model", "examples.mlp:MLP", "--sla-p99-ms", "50"])
    rows = [
        _config_row({"batch_size": 8, "max_latency_ms": 0, "workers": 1}, 900, 20.0),
        _config_row({"batch_size": 32, "max_latency_ms": 2, "workers": 2}, 2500, 45.0),
        _config_row({"batch_size": 64, "max_latency_ms": 5, "workers": 1}, 0, 0),
        _config_row({"batch_size": 16, "max_latency_ms": 0, "workers": 1}, 1800, 30.0),
    ]
    missed = {"rate": 2500, "windows": [_run(2500, 61.0).to_dict()], "met": False,
              "p99_ms_median": 61.0, "ok_fraction_min": 1.0}  # fmt: skip
    met = {"rate": 2000, "windows": [_run(2000, 41.0).to_dict()], "met": True,
           "p99_ms_median": 41.0, "ok_fraction_min": 1.0}  # fmt: skip
    verified = {"key": "b32-l2ms-w2", "sweep_rate": 2500, "attempts": [missed, met],
                "met": True, "rate": 2000}  # fmt: skip
    context = {"command": "python -m bench.tune ...", "machine": "test", "date": "today",
               "load_before": (1.0, 1.0, 1.0), "load_after": (1.0, 1.0, 1.0), "elapsed_s": 60,
               "torch_threads": 1, "lanes": 1024, "missing": ["b8-l5ms-w2"]}  # fmt: skip
    text = write_report(tmp_path, args, rows, verified, context).read_text()
    _check_report(text)
    assert "`b32-l2ms-w2`" in text.split("## Every configuration")[0]
    assert "worker start --model examples.mlp:MLP --batch-size 32 --max-latency 0.002 " \
        "--workers 2" in text  # fmt: skip
    assert "- at 2,500 requests/s: p99 61.0 ms (median 61.0), answered 100.00%: misses" in text
    assert "**Shown to meet the SLA at 2,000 requests/s**" in text and "`b8-l5ms-w2`" in text
    assert "none (at 300/s: p99 90.0 ms" in text
    assert (tmp_path / "tune.png").stat().st_size > 1000
    # none within the SLA: no recommendation, and the report says so
    nothing = write_report(tmp_path, args, [rows[2]], None, context).read_text()
    _check_report(nothing)


def _tune(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "bench.tune", "--model", "examples.mlp:MLP"]
    command += ["--sla-p99-ms", "1000", "--max-latency-ms", "0", "--workers", "1"]
    command += ["--window-s", "0.5", "--warmup-s", "0.3", "--probe-s", "0.5", "--max-steps", "3"]
    command += ["--budget-min", "4", "--out", str(out), *extra]
    return subprocess.run(
        command, cwd=ROOT, check=True, timeout=300, capture_output=True, text=True
    )


@pytest.mark.timeout(300)
def test_tune_measures_the_grid_then_resumes_without_measuring_again(tmp_path: Path) -> None:
    """One configuration through the real stack, briefly; a rerun measures nothing."""
    _tune(tmp_path, "--batch-sizes", "16", "--verify-repeats", "0")
    results = tmp_path / "results.jsonl"
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["type"] for r in records] == ["config"] and records[0]["key"] == "b16-l0ms-w1"
    (record,) = records
    assert record["capacity"]["rps"] > 0 and 1 <= len(record["steps"]) <= 3
    for step in record["steps"]:
        assert step["scheduled"] > 0 and step["generator_cpu"] > 0
        assert step["extra"]["mean_batch"] is None or 1 <= step["extra"]["mean_batch"] <= 16
    assert (record["best"] is None) == (record["max_rate"] == 0)
    before = results.read_text()
    again = _tune(tmp_path, "--batch-sizes", "16", "--verify-repeats", "0")
    assert results.read_text() == before
    assert "1 measured before, 0 to measure" in " ".join(again.stderr.split())
    _check_report((tmp_path / "report.md").read_text(), sla_ms=1000)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tune_over_http_recommends_and_re_measures(tmp_path: Path) -> None:
    """Two configurations through `gateway start`; the best is started again and re-measured."""
    _tune(tmp_path, "--http", "--batch-sizes", "8,64", "--gateway-workers", "1")
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    configs = [r for r in records if r["type"] == "config"]
    assert sorted(r["key"] for r in configs) == ["b64-l0ms-w1-g1", "b8-l0ms-w1-g1"]
    assert all(r["path"] == "http" for r in configs)
    verified = [r for r in records if r["type"] == "verify"]
    best = max(configs, key=lambda r: r["max_rate"])
    if best["max_rate"] > 0:
        assert [v["key"] for v in verified] == [best["key"]]
        attempts = verified[0]["attempts"]
        assert attempts[0]["rate"] == best["max_rate"] == verified[0]["sweep_rate"]
        assert all(len(a["windows"]) == 3 for a in attempts)
        assert [a["met"] for a in attempts[:-1]] == [False] * (len(attempts) - 1)  # until met
        for before, after in itertools.pairwise(attempts):
            assert after["rate"] == pytest.approx(0.8 * before["rate"])
    _check_report((tmp_path / "report.md").read_text(), sla_ms=1000)


def test_cpu_meter_counts_a_process_tree_and_its_time_per_item() -> None:
    from bench.cpu import CpuMeter, per_item, tree

    # a parent that keeps a busy child: the child's CPU counts for the parent's tree
    script = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
    script += "'while True: pass']); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while len(tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        meter = CpuMeter({"server": parent.pid, "gone": None})
        before = meter.sample()
        time.sleep(0.5)
        after = meter.sample()
        assert list(before) == ["server"]  # a tree without a root pid is left out
        cpu = per_item(before, after, 1000)
        assert cpu is not None and cpu["total"] == cpu["server"] > 0
        assert per_item(before, after, 0) is None
    finally:
        for pid in reversed(tree(parent.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


def test_an_open_loop_run_s_line_says_what_the_docs_say_it_does() -> None:
    """docs/tuning.md: rates, success, percentiles and the maximum, the p99 wait before
    sending, errors, and the generator's CPU (flagged when saturated)."""
    from bench.openloop import RunResult

    run = RunResult(
        rate=500, duration_s=2, scheduled=1000, completed=999, ok=998, errors={"503": 1},
        achieved_rps=499, p50_ms=1.2, p90_ms=2.0, p99_ms=4.5, p999_ms=9.0, max_ms=12.3,
        send_lag_p99_ms=0.4, dispatch_lag_p99_ms=0.1, generator_cpu=0.9,
        generator_saturated=True,
    )  # fmt: skip
    assert run.line() == (
        "offered 500/s achieved 499/s ok 99.80% p50 1.2 p90 2.0 p99 4.5 p99.9 9.0 max 12.3 ms "
        "(p99 wait to send 0.4 ms) errors: 503 1; generator 0.90 core GENERATOR-SATURATED"
    )
