"""The benchmark harness runs end to end (`python -m bench --quick`); no assertions on speed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    assert worker_placement(None, 1) == []
    assert worker_placement(None, 3) == ["--workers", "3"]
    with pytest.raises(SystemExit):
        parse_args(["--cuda", "0,1"])


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


@pytest.mark.timeout(120)
def test_cold_model_measures_each_condition() -> None:
    from bench.cold_model import CONDITIONS

    command = [sys.executable, "-m", "bench.cold_model", "--model", "mlp", "--calls", "20"]
    out = subprocess.run(command, cwd=ROOT, check=True, timeout=100, capture_output=True)
    results = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert [r["condition"] for r in results] == list(CONDITIONS)
    assert all(0 < r["p50_ms"] <= r["p90_ms"] for r in results)
