"""The harness's verdicts and the open-loop SLA search, on made-up measurements (no servers)."""

from __future__ import annotations

from typing import Any

from bench.openloop import RunResult
from bench.report import targets, verdicts
from bench.sla import measure_point, sla_curve


def run(rate: float, p99_ms: float, ok: int = 1000) -> RunResult:
    return RunResult(
        rate=rate,
        duration_s=1.0,
        scheduled=1000,
        completed=ok,
        ok=ok,
        errors={} if ok == 1000 else {"timeout": 1000 - ok},
        achieved_rps=rate,
        p50_ms=p99_ms / 4,
        p90_ms=p99_ms / 2,
        p99_ms=p99_ms,
        p999_ms=p99_ms * 1.5,
        max_ms=p99_ms * 2,
        send_lag_p99_ms=0.5,
        dispatch_lag_p99_ms=0.5,
        generator_cpu=0.3,
        generator_saturated=False,
    )


def test_the_curve_climbs_to_the_first_miss_then_bisects_once() -> None:
    asked: list[float] = []

    def window(rate: float) -> tuple[RunResult, dict[str, float] | None]:
        asked.append(rate)
        return run(rate, 10.0 if rate < 950 else 80.0), {"server": 0.5, "total": 0.5}

    curve = sla_curve(window, 1000.0, repeats=3, sla_p99_ms=50.0, min_success=0.999)
    rates = [round(p.rate) for p in curve.points]
    assert rates == [300, 500, 700, 800, 900, 1000, 949]
    assert [p.passed for p in curve.points] == [True] * 5 + [False, True]
    assert round(curve.max_rate) == 949
    # a rate's majority is settled after two agreeing windows of three
    assert all(len(p.windows) == 2 for p in curve.points)
    assert curve.points[0].cpu_us_per_item == {"server": 0.5, "total": 0.5}
    points = curve.to_dict()["points"]
    assert [round(p["rate"]) for p in points] == sorted(round(r) for r in set(asked))


def test_a_rate_passes_on_most_of_its_windows_not_the_first() -> None:
    results = iter([run(100, 80.0), run(100, 10.0), run(100, 20.0)])
    point = measure_point(lambda _rate: (next(results), None), 100.0, 3, 50.0, 0.999)
    assert point.passed and len(point.windows) == 3
    assert point.median("p99_ms") == 20.0
    too_few = iter([run(100, 10.0, ok=990), run(100, 10.0, ok=995)])
    point = measure_point(lambda _rate: (next(too_few), None), 100.0, 3, 50.0, 0.999)
    assert not point.passed and len(point.windows) == 2


def test_a_lowest_rate_that_misses_ends_the_curve_with_nothing_within() -> None:
    curve = sla_curve(lambda r: (run(r, 90.0), None), 1000.0, repeats=1)
    assert curve.max_rate == 0.0 and len(curve.points) == 1
    assert curve.stopped == "the lowest rate missed the SLA"


def row(model: str, scenario: str, c: int, items: float, p99: float = 5.0, **extra: Any) -> Any:
    return {"model": model, "scenario": scenario, "concurrency": c, "items_per_s": items,
            "p50_ms": p99 / 3, "p99_ms": p99, **extra}  # fmt: skip


def test_http_targets_take_mosecs_better_setting_as_the_baseline() -> None:
    rows = [
        row("mlp", "http, gateway", 64, 4000, 30.0, cpu_us_per_item={"gateway": 100, "total": 250}),
        row("mlp", "mosec, batching (10 ms wait)", 64, 2800, 36.0, cpu_us_per_item={"total": 200}),
        row("mlp", "mosec, batching (1 ms wait)", 64, 3400, 33.0, cpu_us_per_item={"total": 220}),
    ]
    checked = {t: (m, v) for t, m, v in targets(rows)}
    rate = checked[
        "mlp over HTTP, c=64: >= 1.3x mosec's requests/s (baseline: its better max wait)"
    ]
    assert rate[1] == "**missed**" and "4,000 / 3,400 = 1.18x" in rate[0]
    assert checked["mlp over HTTP, c=64: p99 no higher than that baseline's"][1] == "met"
    cpu = [v for t, v in checked.items() if t.startswith("mlp over HTTP, c=64: CPU per request")]
    assert cpu == [("250 us (gateway 100) vs 220 us", "**missed**")]


def test_the_open_loop_target_and_the_client_targets_print_with_their_verdicts() -> None:
    def curve(max_rate: float) -> dict[str, Any]:
        return {"max_rate": max_rate, "capacity_rps": max_rate, "points": [], "stopped": ""}

    report = {
        "results": [
            row("identity", "redis, python client (asyncio)", 256, 30000),
            row("identity", "redis, python client (threads)", 64, 20000),
            row("identity", "service_streamer RedisStreamer (threads)", 64, 1900),
            row("mlp", "redis, python client (asyncio)", 1, 3000, 0.9),
            row("mlp", "redis, python client (threads)", 1, 2500, 1.2),
            row("identity", "redis, python client (asyncio)", 1, 5000, 0.6),
            row("identity", "redis, python client (threads)", 1, 4000, 1.5),
        ],
        "settings": {"device": "cpu"},
        "open_loop": {
            "mlp": {
                "http, gateway": curve(3600),
                "mosec, batching (10 ms wait)": curve(2500),
                "mosec, batching (1 ms wait)": curve(3000),
            }
        },
    }
    text = verdicts(report)
    assert "MET    identity, blocking predict from 64 threads >= 60% of apredict c=256" in text
    assert "MET    identity via Redis, asyncio c=256: >= 15x RedisStreamer's best" in text
    assert "MET    mlp, c=1: blocking predict's p50 within 0.2 ms of apredict's" in text
    assert "MISSED identity, c=1: blocking predict's p50 within 0.2 ms of apredict's" in text
    assert "MISSED mlp over HTTP, open loop: highest rate within the p99 SLA >= 1.3x" in text
    assert "3,600 / 3,000/s = 1.20x" in text  # against mosec's better setting


def test_a_served_share_says_the_most_the_machines_cores_serve_at_its_cpu_per_item() -> None:
    cpu = {"load_cpu_us_per_item": 30.0, "cpu_us_per_item": {"worker": 50, "total": 70.0}}
    report = {
        "results": [
            row("mlp", "direct, batched", 64, 30000),
            row("mlp", "redis, python client (asyncio)", 256, 18000, **cpu),
            row("identity", "redis, python client (asyncio)", 256, 18000, **cpu),
            row("identity", "service_streamer RedisStreamer (threads)", 64, 2000),
        ],
        "settings": {"device": "cpu"},
        "machine": "Some CPU, 2 cores, Linux",
    }
    text = verdicts(report)
    # 2 cores / (30 + 70 us an item) = 20,000 items/s; the worker 1 / 50 us = 20,000 too
    assert (
        "60.0% (against the direct arm at the start; at this CPU per item (30 us client, 50 "
        in text
    )
    assert (
        "worker, 20 Redis) 2 cores serve at most 20,000 items/s, the worker 20,000: 67% of " in text
    )
    assert "= 9.0x (at this CPU per item" in text and "the worker 20,000: 10.0x)" in text
    cpu["cpu_us_per_item"]["worker"] = 62.5  # the worker's own core binds first: 16,000 items/s
    assert "the worker 16,000: 53% of direct)" in verdicts(report)
    del report["machine"]  # a core count unknown: no ceiling
    assert "at most" not in verdicts(report)


def test_the_open_loop_counts_as_run_only_for_its_models() -> None:
    from bench.harness import OPEN_LOOP, not_run, parse_args

    args = parse_args(["--models", "identity,mlp", "--scenarios", "open loop,mosec"])
    assert args.scenarios == [
        "mosec, batching (10 ms wait)",
        "mosec, batching (1 ms wait)",
        OPEN_LOOP,
    ]
    rows = [
        row(model, scenario, 64, 1000.0)
        for model in ("identity", "mlp")
        for scenario in args.scenarios[:2]
    ]
    assert not_run({"results": rows, "open_loop": {"mlp": {}}}, args) == []
    assert not_run({"results": rows, "open_loop": {}}, args) == [f"mlp: {OPEN_LOOP}"]


def test_windows_of_load_processes_side_by_side_merge_into_one() -> None:
    """``--load-processes``: throughput and counts add up; the CPU per item is over all the
    items, the servers' counted once; p99 is the worst process's (not pooled)."""
    from bench.harness import merge_windows

    def window(items_per_s: float, requests: int, p99: float, load_cpu: float) -> dict[str, Any]:
        return {
            "items_per_s": items_per_s, "requests": requests, "errors": 0,
            "p50_ms": p99 / 4, "p90_ms": p99 / 2, "p99_ms": p99, "mean_batch": 64.0,
            "load_cpu_us_per_item": load_cpu,
            # each process divides the servers' CPU of the whole window by its own items
            "cpu_us_per_item": {"worker": 3000.0 / requests, "total": 4500.0 / requests},
        }  # fmt: skip

    (merged,) = merge_windows([[window(1000, 100, 8.0, 30.0)], [window(3000, 300, 6.0, 10.0)]])
    assert merged["items_per_s"] == 4000 and merged["requests"] == 400
    assert merged["p99_ms"] == 8.0 and merged["load_processes"] == 2
    assert merged["load_cpu_us_per_item"] == (30 * 100 + 10 * 300) / 400
    assert merged["cpu_us_per_item"] == {"worker": 3000 / 400, "total": 4500 / 400}
    assert merged["mean_batch"] == 64.0


def test_a_gpu_target_names_the_settings_it_ran_with() -> None:
    from bench.report import tuned_label

    rows = [
        {"model": "mlp", "scenario": "direct, batched", "concurrency": 1, "items_per_s": 200_000},
        {"model": "mlp", "scenario": "redis, python client (asyncio)", "concurrency": 256,
         "items_per_s": 70_000, "p50_ms": 3.0, "p99_ms": 6.0},
    ]  # fmt: skip
    settings = {"device": "cuda:0", "workers": 3, "load_processes": 6, "model_thread": None}
    (share,) = [t for t in targets(rows, None, settings) if "via Redis" in t[0]]
    assert share[0].startswith("mlp via Redis, c=256 (on cuda:0; 3 workers on the device, 6 load")
    assert share[0].endswith(">= 30% of direct batched") and share[2] == "met"
    assert tuned_label({"device": "cpu", "workers": 1, "load_processes": 1}) == ", defaults"
    assert tuned_label({"model_thread": "on", "busy_poll_us": 0}) == (
        "; --model-thread on, --busy-poll-us 0"
    )
