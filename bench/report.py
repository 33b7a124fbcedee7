"""docs/benchmarks.md and its plots, from the harness' JSON (bench/results/harness.json).

    python -m bench.report [bench/results/harness.json]

Tables per model, the spine table, the targets checked against ratios taken within the one run,
memory, the exact commands, and bench/analysis.md (written by hand: what the numbers mean and
where the time goes) included verbatim.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
ANALYSIS = ROOT / "bench" / "analysis.md"
SPINE_NOTES = ROOT / "bench" / "spine_notes.md"  # the spine script's own earlier write-up
LENGTH_NOTES = ROOT / "bench" / "length_batching.md"  # bench.length_batching, by hand
SOAK = ROOT / "bench" / "results" / "soak.json"  # python -m bench.soak

BATCHED, ONE = "direct, batched", "direct, one at a time"
REDIS_ASYNC, HTTP = "redis, python client (asyncio)", "http, gateway"
REDIS_THREADS = "redis, python client (threads)"
SS_REDIS = "service_streamer RedisStreamer (threads)"
MOSECS = ["mosec, batching (10 ms wait)", "mosec, batching (1 ms wait)"]
NAIVE = "fastapi, per request"  # bench/naive_fastapi.py: the naive server the targets name
ALTERNATIVE_SCENARIOS = [
    SS_REDIS,
    "service_streamer ThreadedStreamer (Flask)",
    "fastapi, per request",
    "litserve, batching",
    *MOSECS,
    "mosec, batching",  # runs before mosec had two arms
]
HTTP_ALTERNATIVES = [
    "service_streamer ThreadedStreamer (Flask)",
    "fastapi, per request",
    "litserve, batching",
    *MOSECS,
    "mosec, batching",  # runs before mosec had two arms
]


def find(rows: list[dict[str, Any]], model: str, scenario: str, c: int | None = None) -> Any:
    for r in rows:
        same = r["model"] == model and r["scenario"] == scenario and "items_per_s" in r
        if same and (c is None or r["concurrency"] == c):
            return r
    return None


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def model_table(rows: list[dict[str, Any]], model: str) -> str:
    lines = [
        "| scenario | concurrency | items/s | p50 ms | p90 ms | p99 ms | mean batch | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["model"] != model:
            continue
        if "error" in r:
            lines.append(f"| {r['scenario']} | - | failed: {r['error'][:120]} | | | | | |")
            continue
        lines.append(
            f"| {r['scenario']} | {r['concurrency']} | {fmt(r['items_per_s'], 0)} | "
            f"{fmt(r['p50_ms'])} | {fmt(r['p90_ms'])} | {fmt(r['p99_ms'])} | "
            f"{fmt(r['mean_batch'], 1)} | {r['errors']} |"
        )
    return "\n".join(lines)


def cpu_table(rows: list[dict[str, Any]], model: str) -> str | None:
    """CPU time per request of each server process tree, and of the load generator."""
    measured = [r for r in rows if r["model"] == model and r.get("cpu_us_per_item")]
    if not measured:
        return None
    lines = [
        "| scenario | concurrency | requests/s | server processes, CPU us per request | total "
        "| load generator |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for r in measured:
        cpu = r["cpu_us_per_item"]
        trees = ", ".join(f"{name} {value:,.0f}" for name, value in cpu.items() if name != "total")
        generator = r.get("load_cpu_us_per_item") or r.get("generator_cpu_us_per_item")
        lines.append(
            f"| {r['scenario']} | {r['concurrency']} | {fmt(r['items_per_s'], 0)} | {trees} | "
            f"{fmt(cpu['total'], 0)} | {fmt(generator, 0)} |"
        )
    return "\n".join(lines)


def spine_table(rows: list[dict[str, Any]], model: str) -> str:
    batched, one = find(rows, model, BATCHED), find(rows, model, ONE)
    c1, c256 = find(rows, model, REDIS_ASYNC, 1), find(rows, model, REDIS_ASYNC, 256)
    if not (batched and one and c1 and c256):
        return "(not measured in this run)"
    return "\n".join(
        [
            "| direct batched items/s | direct one-at-a-time items/s | Redis c=1 items/s "
            "(p50 / p99 ms) | Redis c=256 items/s (p50 / p99 ms) | added p50 at c=1 | "
            "c=256 / direct batched |",
            "|---:|---:|---:|---:|---:|---:|",
            f"| {fmt(batched['items_per_s'], 0)} | {fmt(one['items_per_s'], 0)} | "
            f"{fmt(c1['items_per_s'], 0)} ({fmt(c1['p50_ms'])} / {fmt(c1['p99_ms'])}) | "
            f"{fmt(c256['items_per_s'], 0)} ({fmt(c256['p50_ms'])} / {fmt(c256['p99_ms'])}) | "
            f"{c1['p50_ms'] - one['p50_ms']:+.2f} ms | "
            f"{c256['items_per_s'] / batched['items_per_s']:.0%} |",
        ]
    )


def targets(
    rows: list[dict[str, Any]],
    brackets: dict[str, dict[str, Any]] | None = None,
    settings: dict[str, Any] | None = None,
    open_loop: dict[str, dict[str, Any]] | None = None,
    cores: int | None = None,
) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each target this run can check; with the machine's
    ``cores``, a served share also says the most those cores could serve at its CPU per item.

    A model's share of its direct batched speed is judged on the bracketed windows where the
    run has them (each served window against direct windows taken just before and after it),
    and shown against the direct arm measured at the start of the model's run too."""
    out: list[tuple[str, str, str]] = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    ours = find(rows, "identity", REDIS_ASYNC, 256)
    ss = [
        r
        for r in rows
        if r["model"] == "identity" and r["scenario"] == SS_REDIS and r.get("items_per_s")
    ]
    if ours and ss:
        best = max(ss, key=lambda r: r["items_per_s"])
        ratio = ours["items_per_s"] / best["items_per_s"]
        out.append(
            (
                "identity via Redis, c=256: >= 10x service_streamer RedisStreamer's best",
                f"{ours['items_per_s']:,.0f} vs {best['items_per_s']:,.0f} items/s "
                f"(c={best['concurrency']}): {ratio:.1f}x",
                verdict(ratio >= 10),
            )
        )
    on_cpu = (settings or {}).get("device", "cpu") == "cpu"  # a GPU has targets of its own
    for model, goal in (("mlp", 0.70), ("heavy", 0.97)) if on_cpu else ():
        batched, served = find(rows, model, BATCHED), find(rows, model, REDIS_ASYNC, 256)
        if not (batched and served):
            continue
        ratio = served["items_per_s"] / batched["items_per_s"]
        measured = f"{served['items_per_s']:,.0f} / {batched['items_per_s']:,.0f} = {ratio:.0%}"
        bracket = (brackets or {}).get(model)
        if bracket and bracket["concurrency"] == 256:
            shares = ", ".join(f"{s:.1%}" for s in bracket["shares"])
            directs = ", ".join(f"{d:,.0f}" for d in bracket["direct_items_per_s"])
            measured = (
                f"bracketed: {bracket['share']:.1%} (median of {shares}; direct windows "
                f"{directs} items/s); against the direct arm at the start: {measured}"
            )
            ratio = bracket["share"]
        out.append(
            (f"{model} via Redis, c=256: >= {goal:.0%} of direct batched", measured,
             verdict(ratio >= goal))
        )  # fmt: skip
    one = find(rows, "mlp", ONE)
    for scenario, limit in ((REDIS_ASYNC, 0.5), (HTTP, 1.5)):
        served = find(rows, "mlp", scenario, 1)
        if one and served:
            added = served["p50_ms"] - one["p50_ms"]
            out.append(
                (
                    f"mlp, c=1, {scenario}: added p50 over direct one-at-a-time <= {limit} ms",
                    f"{served['p50_ms']:.2f} - {one['p50_ms']:.2f} = {added:+.2f} ms",
                    verdict(added <= limit),
                )
            )
    gateway, mosec = find(rows, "mlp", HTTP, 64), mosec_baseline(rows, "mlp", 64)
    naive = find(rows, "mlp", NAIVE, 64)
    if gateway and naive:
        ratio = gateway["items_per_s"] / naive["items_per_s"]
        out.append(
            (
                "mlp over HTTP, c=64: >= 3x the naive FastAPI server's requests/s",
                f"{gateway['items_per_s']:,.0f} / {naive['items_per_s']:,.0f} = {ratio:.1f}x",
                verdict(ratio >= 3),
            )
        )
        tail = gateway["p99_ms"] / naive["p99_ms"]
        out.append(
            (
                "mlp over HTTP, c=64: p99 under a tenth of the naive server's",
                f"{gateway['p99_ms']:.1f} / {naive['p99_ms']:.1f} ms = {tail:.2f}",
                verdict(tail < 0.1),
            )
        )
    if gateway and mosec:
        ratio = gateway["items_per_s"] / mosec["items_per_s"]
        out.append(
            (
                "mlp over HTTP, c=64: >= 75% of mosec's requests/s",
                f"{gateway['items_per_s']:,.0f} / {mosec['items_per_s']:,.0f} = {ratio:.0%}",
                verdict(ratio >= 0.75),
            )
        )
        others = [find(rows, "mlp", s, 64) for s in HTTP_ALTERNATIVES[:3]]
        others = [o for o in others if o]
        if others:
            best = max(others, key=lambda r: r["items_per_s"])
            out.append(
                (
                    "mlp over HTTP, c=64: well ahead (here: >= 1.5x) of LitServe, "
                    "service_streamer, FastAPI",
                    f"{gateway['items_per_s']:,.0f} vs best of them {best['items_per_s']:,.0f} "
                    f"({best['scenario']}): {gateway['items_per_s'] / best['items_per_s']:.1f}x",
                    verdict(gateway["items_per_s"] >= 1.5 * best["items_per_s"]),
                )
            )
    out += defaults_targets(rows, brackets, verdict, settings, open_loop, cores)
    return out


def mosec_baseline(rows: list[dict[str, Any]], model: str, c: int) -> Any:
    """mosec's better arm at concurrency ``c`` (the most requests/s of its max-wait settings;
    older runs have one arm, ``mosec, batching``)."""
    arms = [
        r
        for r in rows
        if r["model"] == model
        and r["scenario"].startswith("mosec")
        and r["concurrency"] == c
        and r.get("items_per_s")
    ]
    return max(arms, key=lambda r: r["items_per_s"]) if arms else None


def defaults_targets(
    rows: list[dict[str, Any]],
    brackets: dict[str, dict[str, Any]] | None,
    verdict: Callable[[bool], str],
    settings: dict[str, Any] | None = None,
    open_loop: dict[str, dict[str, Any]] | None = None,
    cores: int | None = None,
) -> list[tuple[str, str, str]]:
    """The targets for the shipped defaults, the blocking client, CPU per request and the open
    loop that this run can check (ratios between arms of this run)."""
    out: list[tuple[str, str, str]] = []
    out += client_targets(rows, verdict, cores, worker_count(settings))
    device = (settings or {}).get("device", "cpu")
    shares = {"mlp": 0.8} if device == "cpu" else {"mlp": 0.3, "wide": 0.9}
    for model, goal in shares.items():
        batched, served = find(rows, model, BATCHED), find(rows, model, REDIS_ASYNC, 256)
        if not (batched and served):
            continue
        bracket = (brackets or {}).get(model)
        share = served["items_per_s"] / batched["items_per_s"]
        direct = batched["items_per_s"]
        how = "against the direct arm at the start"
        if bracket and bracket["concurrency"] == 256:
            share, how = bracket["share"], "bracketed"
            direct = statistics.median(bracket["direct_items_per_s"])
        bound = ceiling(served, cores, worker_count(settings, model)) if device == "cpu" else None
        if bound is not None:
            how += f"; {bound[1]}: {bound[0] / direct:.0%} of direct"
        out.append(
            (f"{model} via Redis, c=256 (on {device}{tuned_label(settings, model)}): >= {goal:.0%} "
             "of direct batched", f"{share:.1%} ({how})", verdict(share >= goal))
        )  # fmt: skip
    out += http_targets(rows, verdict)
    out += open_loop_targets(open_loop or {}, verdict)
    return out


def worker_count(settings: dict[str, Any] | None, model: str | None = None) -> int:
    """The worker processes a run's `worker start` ran (for ``model``): as given by --workers,
    else as many as the worker chose (--workers-per-device auto on a GPU)."""
    settings = settings or {}
    chosen = settings.get("workers")
    if isinstance(chosen, int):
        return chosen
    started: dict[str, int] = settings.get("workers_started") or {}
    if model in started:
        return int(started[model])
    return max(started.values(), default=1)


def tuned_label(settings: dict[str, Any] | None, model: str | None = None) -> str:
    """What the served arms ran with beyond the shipped defaults, for a target's label (and
    how many workers the defaults chose, where more than one)."""
    settings = settings or {}
    parts = []
    workers = worker_count(settings, model)
    if isinstance(settings.get("workers"), int) and workers > 1:
        parts.append(f"{workers} workers on the device")
    elif workers > 1:
        parts.append(f"--workers-per-device auto: {workers} workers")
    if settings.get("model_thread"):
        parts.append(f"--model-thread {settings['model_thread']}")
    if settings.get("busy_poll_us") is not None:
        parts.append(f"--busy-poll-us {settings['busy_poll_us']}")
    if (settings.get("load_processes") or 1) > 1:
        parts.append(f"{settings['load_processes']} load processes")
    return f"; {', '.join(parts)}" if parts else ", defaults"


def ceiling(row: dict[str, Any], cores: int | None, workers: int = 1) -> tuple[float, str] | None:
    """The most items/s a Python-client arm could serve at its CPU per item, and a line saying
    so; None without the numbers. Two bounds: the ``cores`` of the machine, shared by the
    client, the worker and Redis; and the ``workers`` worker processes, each one event loop
    that reads, runs the model and answers in turn (one core each at most)."""
    client = row.get("load_cpu_us_per_item")
    servers = row.get("cpu_us_per_item") or {}
    total, worker = servers.get("total"), servers.get("worker")
    if not (cores and client and total and worker):
        return None
    shared = cores * 1e6 / (client + total)
    alone = workers * 1e6 / worker
    said = (
        f"at this CPU per item ({client:.0f} us client, {worker:.0f} worker, "
        f"{total - worker:.0f} Redis) {cores} cores serve at most {shared:,.0f} items/s, "
        f"{'the worker' if workers == 1 else f'{workers} workers'} {alone:,.0f}"
    )
    return min(shared, alone), said


def machine_cores(machine: str | None) -> int | None:
    """The core count a report's machine line gives ("..., 2 cores, ...")."""
    found = re.search(r"(\d+) cores", machine or "")
    return int(found.group(1)) if found else None


def client_targets(
    rows: list[dict[str, Any]],
    verdict: Callable[[bool], str],
    cores: int | None = None,
    workers: int = 1,
) -> list[tuple[str, str, str]]:
    """The blocking client against apredict, and asyncio against service_streamer (with the
    ceiling :func:`ceiling` puts on the latter, given the machine's ``cores``)."""
    out: list[tuple[str, str, str]] = []
    threads, asyncio_ = (
        find(rows, "identity", REDIS_THREADS, 64),
        find(rows, "identity", REDIS_ASYNC, 256),
    )
    if threads and asyncio_:
        ratio = threads["items_per_s"] / asyncio_["items_per_s"]
        ss = find(rows, "identity", SS_REDIS, 64)
        versus = (
            f"; {threads['items_per_s'] / ss['items_per_s']:.1f}x RedisStreamer c=64" if ss else ""
        )
        out.append(
            (
                "identity, blocking predict from 64 threads >= 60% of apredict c=256",
                f"{threads['items_per_s']:,.0f} / {asyncio_['items_per_s']:,.0f} = {ratio:.0%}"
                + versus,
                verdict(ratio >= 0.6),
            )
        )
    for model in ("identity", "mlp"):
        t1, a1 = find(rows, model, REDIS_THREADS, 1), find(rows, model, REDIS_ASYNC, 1)
        if t1 and a1:
            gap = t1["p50_ms"] - a1["p50_ms"]
            out.append(
                (
                    f"{model}, c=1: blocking predict's p50 within 0.2 ms of apredict's",
                    f"{t1['p50_ms']:.2f} - {a1['p50_ms']:.2f} = {gap:+.2f} ms",
                    verdict(gap <= 0.2),
                )
            )
    ss_rows = [r for r in rows if r["model"] == "identity" and r["scenario"] == SS_REDIS]
    ss_rows = [r for r in ss_rows if r.get("items_per_s")]
    if asyncio_ and ss_rows:
        best = max(ss_rows, key=lambda r: r["items_per_s"])
        ratio = asyncio_["items_per_s"] / best["items_per_s"]
        bound = ceiling(asyncio_, cores, workers)
        limit = f" ({bound[1]}: {bound[0] / best['items_per_s']:.1f}x)" if bound else ""
        out.append(
            (
                "identity via Redis, asyncio c=256: >= 15x RedisStreamer's best",
                f"{asyncio_['items_per_s']:,.0f} / {best['items_per_s']:,.0f} "
                f"(c={best['concurrency']}) = {ratio:.1f}x{limit}",
                verdict(ratio >= 15),
            )
        )
    return out


def http_targets(
    rows: list[dict[str, Any]], verdict: Callable[[bool], str]
) -> list[tuple[str, str, str]]:
    """HTTP MLP c=64 against mosec's better max-wait setting: requests/s, p99, CPU."""
    gateway, mosec = find(rows, "mlp", HTTP, 64), mosec_baseline(rows, "mlp", 64)
    if not (gateway and mosec):
        return []
    arms = [r for r in rows if r["model"] == "mlp" and r["scenario"].startswith("mosec")]
    settings = "; ".join(
        f"{r['scenario'].removeprefix('mosec, batching').strip(' ()') or 'one setting'}: "
        f"{r['items_per_s']:,.0f} req/s, p99 {r['p99_ms']:.1f} ms"
        for r in arms
        if r["concurrency"] == 64 and r.get("items_per_s")
    )
    ratio = gateway["items_per_s"] / mosec["items_per_s"]
    out = [
        (
            "mlp over HTTP, c=64: >= 1.3x mosec's requests/s (baseline: its better max wait)",
            f"{gateway['items_per_s']:,.0f} / {mosec['items_per_s']:,.0f} = {ratio:.2f}x "
            f"(mosec {settings})",
            verdict(ratio >= 1.3),
        ),
        (
            "mlp over HTTP, c=64: p99 no higher than that baseline's",
            f"{gateway['p99_ms']:.1f} vs {mosec['p99_ms']:.1f} ms",
            verdict(gateway["p99_ms"] <= mosec["p99_ms"]),
        ),
    ]
    ours, theirs = gateway.get("cpu_us_per_item"), mosec.get("cpu_us_per_item")
    if ours and theirs:
        parts = ", ".join(f"{k} {v:,.0f}" for k, v in ours.items() if k != "total")
        out.append(
            (
                "mlp over HTTP, c=64: CPU per request, all our processes and Redis <= mosec's "
                "whole process tree",
                f"{ours['total']:,.0f} us ({parts}) vs {theirs['total']:,.0f} us",
                verdict(ours["total"] <= theirs["total"]),
            )
        )
    return out


def open_loop_targets(
    open_loop: dict[str, dict[str, Any]], verdict: Callable[[bool], str]
) -> list[tuple[str, str, str]]:
    """Open loop: our highest rate within the p99 SLA against mosec's better setting's."""
    out: list[tuple[str, str, str]] = []
    for model, arms in open_loop.items():
        ours = arms.get(HTTP) or {}
        mosecs = {k: v for k, v in arms.items() if k.startswith("mosec") and "max_rate" in v}
        if "max_rate" not in ours or not mosecs:
            continue
        best = max(mosecs.values(), key=lambda v: v["max_rate"])
        ratio = ours["max_rate"] / best["max_rate"] if best["max_rate"] else math.inf
        each = ", ".join(f"{k}: {v['max_rate']:,.0f}/s" for k, v in mosecs.items())
        out.append(
            (
                f"{model} over HTTP, open loop: highest rate within the p99 SLA >= 1.3x mosec's",
                f"{ours['max_rate']:,.0f} / {best['max_rate']:,.0f}/s = {ratio:.2f}x ({each})",
                verdict(ratio >= 1.3),
            )
        )
    return out


def report_targets(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """:func:`targets` for a whole report (a run's JSON)."""
    return targets(
        report["results"],
        report.get("brackets"),
        report.get("settings"),
        report.get("open_loop"),
        machine_cores(report.get("machine")),
    )


def verdicts(report: dict[str, Any]) -> str:
    """The targets this run checked, as printed at the end of ``python -m bench``."""
    lines = ["Targets (ratios within this run):"]
    for target, measured, result in report_targets(report):
        mark = "MET   " if result == "met" else "MISSED"
        lines.append(f"  {mark} {target}: {measured}")
    if len(lines) == 1:
        lines.append("  (none: the run measured none of the arms a target compares)")
    return "\n".join(lines)


def plot(report: dict[str, Any], model: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["model"] == model and "items_per_s" in r]
    scenarios = [
        s for s in dict.fromkeys(r["scenario"] for r in rows) if not s.startswith("direct")
    ]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.2))
    markers = "osD^v<>phX*"
    for i, scenario in enumerate(scenarios):
        points = sorted((r["concurrency"], r) for r in rows if r["scenario"] == scenario)
        xs = [c for c, _ in points]
        style = {"marker": markers[i % len(markers)], "label": scenario}
        style["linestyle"] = "--" if scenario in ALTERNATIVE_SCENARIOS else "-"
        ax1.plot(xs, [r["items_per_s"] for _, r in points], **style)
        ax2.plot(xs, [r["p50_ms"] for _, r in points], **style)
        ax3.plot(xs, [r["p99_ms"] for _, r in points], **style)
    for scenario, color in ((BATCHED, "black"), (ONE, "grey")):
        r = find(rows, model, scenario)
        if r:
            ax1.axhline(r["items_per_s"], color=color, linestyle=":", label=scenario)
    ax1.set(title=f"{model}: throughput", xlabel="concurrency", ylabel="items/s")
    ax2.set(title=f"{model}: p50 latency", xlabel="concurrency", ylabel="ms")
    ax3.set(title=f"{model}: p99 latency", xlabel="concurrency", ylabel="ms")
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log")
        levels = report["settings"]["concurrency"]
        ax.set_xlim(min(levels) / 1.5, max(levels) * 1.5)
        ax.set_xticks(levels)
        ax.set_xticks([], minor=True)
        ax.set_xticklabels([str(c) for c in levels])
        ax.grid(True, alpha=0.3)
    ax1.set_yscale("log")
    ax2.set_yscale("log")
    ax3.set_yscale("log")
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def open_loop_section(report: dict[str, Any], suffix: str = "") -> list[str]:
    """The open-loop curves: a table per model and a plot (docs/img/openloop-MODEL.png)."""
    parts: list[str] = []
    s = report.get("settings", {})
    for model, arms in (report.get("open_loop") or {}).items():
        parts += [
            "",
            f"### {model} over HTTP, open loop: latency against offered load",
            "",
            f"Requests sent on a fixed schedule (bench/openloop.py; latency from each one's "
            f"scheduled time), each rate measured in up to {s.get('repeats', 3)} windows of "
            f"{s.get('duration_s', 3):g} s after {s.get('warmup_s', 1):g} s of warm-up, the "
            "figures the medians of the windows; a rate passes when most of its windows keep "
            f"p99 within {s.get('sla_p99_ms', 50):g} ms with >= "
            f"{s.get('min_success', 0.999):.1%} answered 200 and the rate sustained "
            "(bench/sla.py). "
            "Rates are fractions of each stack's closed-loop capacity (the generator's own, "
            "64 connections), up to the first miss, then one between. Generator CPU: the load "
            "process's own, in cores (one event loop: over 0.85 it is flagged saturated); "
            "servers: CPU of the server processes (ours: gateway, worker, Redis; mosec: its "
            "whole tree) in cores over the whole window.",
            "",
            "| arm | offered/s | achieved/s | answered 200 | p50 ms | p90 ms | p99 ms | "
            "p99.9 ms | mean batch | within SLA | windows | generator cores | server cores |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for arm, curve in arms.items():
            if "error" in curve:
                parts.append(f"| {arm} | failed: {curve['error'][:120]} | | | | | | | | | | | |")
                continue
            for p in curve["points"]:
                cores = (p.get("cpu_us_per_item") or {}).get("total")
                flag = " (saturated)" if p["generator_saturated"] else ""
                parts.append(
                    f"| {arm} | {p['rate']:,.0f} | {p['achieved_rps']:,.0f} | "
                    f"{p['ok_fraction']:.2%} | {fmt(p['p50_ms'], 1)} | {fmt(p['p90_ms'], 1)} | "
                    f"{fmt(p['p99_ms'], 1)} | {fmt(p['p999_ms'], 1)} | "
                    f"{fmt(p.get('mean_batch'), 1)} | {'yes' if p['passed'] else 'no'} | "
                    f"{len(p['windows'])} | "
                    f"{p['generator_cpu']:.2f}{flag} | {fmt(cores)} |"
                )
        parts += [
            "",
            "Highest rate within the SLA: "
            + "; ".join(
                f"{arm} **{curve['max_rate']:,.0f}/s** (closed-loop capacity "
                f"{curve['capacity_rps']:,.0f}/s)"
                for arm, curve in arms.items()
                if "max_rate" in curve
            )
            + ".",
        ]
        png = IMG / f"openloop-{model}{suffix}.png"
        try:
            plot_open_loop(arms, model, s.get("sla_p99_ms", 50.0), png)
            parts += ["", f"![{model} open loop](img/{png.name})"]
        except ImportError:
            parts += ["", "(matplotlib is not installed: no plot)"]
    return parts


def plot_open_loop(
    arms: dict[str, dict[str, Any]], model: str, sla_p99_ms: float, path: Path
) -> None:
    """p50 and p99 against offered load per arm (passing rates filled), the SLA as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (arm, curve) in enumerate(arms.items()):
        points = curve.get("points") or []
        if not points:
            continue
        rates = [p["rate"] for p in points]
        color = f"C{i}"
        for ax, key in ((ax1, "p50_ms"), (ax2, "p99_ms")):
            ax.plot(rates, [p[key] for p in points], color=color, label=arm, marker="o",
                    markerfacecolor="none")  # fmt: skip
            passed = [p for p in points if p["passed"]]
            ax.plot([p["rate"] for p in passed], [p[key] for p in passed], "o", color=color)
        if curve.get("max_rate"):
            ax2.axvline(curve["max_rate"], color=color, linestyle=":", alpha=0.7)
    ax2.axhline(sla_p99_ms, color="black", linestyle="--", label=f"SLA p99 {sla_p99_ms:g} ms")
    ax1.set(title=f"{model} over HTTP, open loop: p50", xlabel="offered requests/s", ylabel="ms")
    ax2.set(
        title=f"{model}: p99 (filled: within the SLA; dotted: highest such rate)",
        xlabel="offered requests/s",
        ylabel="ms",
    )
    for ax in (ax1, ax2):
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def worker_options(soak: dict[str, Any]) -> str:
    """The soak worker's options that differ from the defaults (older soaks recorded none)."""
    options = []
    if soak.get("model_thread", "auto") != "auto":
        options.append(f"--model-thread {soak['model_thread']}")
    if soak.get("busy_poll_us"):
        options.append(f"--busy-poll-us {soak['busy_poll_us']}")
    return f" with `{' '.join(options)}`" if options else ""


def soak_section(path: Path) -> list[str]:
    """The memory soak's summary (bench/soak.py), if it has been run."""
    if not path.exists():
        return []
    soak = json.loads(path.read_text())
    load = f"{soak['client_concurrency']} asyncio Python-client tasks"
    if soak.get("http_concurrency"):
        load += f" and wrk with {soak['http_concurrency']} connections on the gateway"
    parts = [
        f"## Memory soak: `{soak['command']}`",
        "",
        f"Started {soak['started']}: {soak['duration_s'] / 60:g} minutes of {load} (MLP, one "
        f"`worker start` process{worker_options(soak)}, `gateway start --workers "
        f"{soak['gateway_workers']}`); memory "
        "sampled every few seconds. "
        f"Requests answered: {soak['client_answered']:,} by the Python client "
        f"({soak['client_failed']} failed)"
        + (
            f", {soak['wrk']['requests']:,} over HTTP ({soak['wrk']['non_2xx']} non-2xx)"
            if soak.get("wrk")
            else ""
        )
        + f". Growth is counted from the first sample after {soak['warmup_s']:g} s of warm-up.",
        "",
        "| process | after warm-up MB | last MB | max MB | growth MB | slope, 2nd half (MB/min) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    names = {
        "worker_mb": "worker (supervisor + model process, RSS)",
        "gateway_mb": "gateway (gunicorn master + workers, RSS)",
        "redis_mb": "redis-server used_memory",
    }
    for key, name in names.items():
        m = soak["summary"][key]
        parts.append(
            f"| {name} | {m['first']:,.1f} | {m['last']:,.1f} | {m['max']:,.1f} | "
            f"{m['growth']:+,.1f} | {m['slope_second_half_mb_per_min']:+.3f} |"
        )
    picture = IMG / "soak.png"
    if picture.exists():
        parts += ["", f"![memory soak](img/{picture.name})"]
    return [*parts, ""]


def write(
    report: dict[str, Any], doc: Path = DOC, extras: list[dict[str, Any]] | None = None
) -> None:
    rows = report["results"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    s = report["settings"]
    IMG.mkdir(parents=True, exist_ok=True)
    parts = [
        "# Benchmarks",
        "",
        "Generated by `python -m bench.report` from `bench/results/harness.json` (the raw "
        "numbers: every window of every arm); the commentary comes from `bench/analysis.md`. "
        "Regenerate both with `make bench`.",
        "",
        "**These numbers come from a shared 2-core CPU machine** on which other engineers run "
        "their test suites: the load generator, Redis, our worker and gateway (or the "
        "alternative's server) all share the same 2 cores. Treat absolute numbers as rough; the "
        "ratios are taken between arms of the same run, measured one after another.",
        "",
        "On a GPU (an H100: `--cuda` pinning checked, and the batching speed-ups with the models "
        "on the device; an H200: the serving path at the defaults and with workers per GPU): "
        "[gpu.md](gpu.md).",
        "",
        "Which `--batch-size`, `--max-latency` and `--workers` give the most throughput within a "
        "p99 latency SLA, under open-loop load (`python -m bench.tune`): "
        "[tuning.md](tuning.md).",
        "",
        "## Setup",
        "",
        f"- Machine: {report['machine']}",
        f"- Load average (1, 5, 15 min) before the run: "
        f"{', '.join(f'{v:.2f}' for v in report['load_average_before'])}; after: "
        f"{', '.join(f'{v:.2f}' for v in report['load_average_after'])}",
        f"- Run: {report['started']}, {report['elapsed_s'] / 60:.0f} minutes",
        f"- Python {report['python']}; ours: "
        + ", ".join(f"{k} {v}" for k, v in report["versions"]["microbatch"].items()),
    ]
    for name, vs in report["versions"].items():
        if name != "microbatch":
            parts.append(
                f"- `{name}` virtualenv (.cache/bench-venvs/{name}): "
                + ", ".join(f"{k} {v}" for k, v in vs.items())
            )
    parts += [
        f"- Every arm: torch threads = {s['torch_threads']} (torch.set_num_threads and "
        f"OMP_NUM_THREADS), max batch {s['batch_size']}, the same model code and weights "
        "(examples/mlp.py, bench/models.py), one 256-float vector per request (JSON "
        '`{"inputs": [[...]]}` over HTTP). Alternatives that wait for batch-mates wait at most '
        f"{s['max_wait_ms']:g} ms (service_streamer max_latency, LitServe batch_timeout)"
        + (
            ", mosec (max_wait_time) at "
            + " and ".join(f"{w:g} ms" for w in s["mosec_max_wait_ms"])
            + ", each an arm of its own"
            if s.get("mosec_max_wait_ms")
            else ", mosec max_wait_time"
        )
        + "; our worker runs with its default `--max-latency 0` (it takes what is "
        "queued and never waits)"
        + (
            f" and `--busy-poll-us {s['busy_poll_us']}` (with nothing to do, it polls "
            f"{s['busy_poll_us'] / 1000:g} ms before it sleeps: a tuned setting, not the "
            "default)."
            if s.get("busy_poll_us")
            else " and every other `worker start` and `gateway start` default (`--busy-poll-us "
            "auto`: a worker with nothing to do polls up to 1 ms before it sleeps, only while "
            "requests arrive less than 1 ms apart and a whole core is spare by the load average: "
            "part of the worker's CPU per item at low concurrency)."
        ),
        f"- Closed loop: {s['warmup_s']:g} s warm-up, then {s['repeats']} windows of "
        f"{s['duration_s']:g} s per arm and concurrency; each figure is the median of the windows. "
        "Mean batch: our worker's `microbatch_worker_batch_size_sum / _count` (its "
        "`--metrics-port`), the alternatives' own batch log (one line per model call).",
        "- Bracketing: at the highest concurrency, each window of our asyncio arm runs between "
        "two windows of `direct, batched` (the worker idle meanwhile), and its share of the "
        "direct speed is taken against their mean; the median of those shares is the share "
        "the targets judge. The machine's speed drifts by more than the serving costs.",
        f"- Load generators: HTTP arms `{s['wrk']}` (2 threads, c connections, a Lua script "
        "posting the body); Python-client arms one process of N asyncio tasks (uvloop) or N "
        "threads (our Streamer.predict and service_streamer's RedisStreamer.predict run in the "
        "very same thread loop, bench/load.py).",
        f"- Our stack: one `worker start` process (1 model worker), `gateway start --workers "
        f"{s['gateway_workers']}`, a private redis-server. mosec: its Rust front + 1 Python "
        "worker; LitServe: 1 worker; service_streamer: Flask's threaded server with "
        "ThreadedStreamer, or 1 RedisWorker; FastAPI: 1 uvicorn process.",
        f"- Pinning: {s['pinning']}.",
        "",
        "Exact commands:",
        "",
        "```",
        "make bench                     # = .venv/bin/python -m bench (installs wrk if missing)",
        f"{report['command']}",
        "python -m bench --quick        # CI: < 1 minute, our scenarios only",
        "python -m bench.report         # docs/benchmarks.md + docs/img/*.png from the JSON",
        "```",
        "",
        "## Targets",
        "",
        "| target | measured (same run) | |",
        "|---|---|---|",
    ]
    checked = report_targets(report)
    parts += [f"| {t} | {m} | {v} |" for t, m, v in checked]
    parts += open_loop_section(report)
    parts += [
        "",
        "## Spine: MLP through Redis with the Python client (asyncio)",
        "",
        spine_table(rows, "mlp"),
        "",
    ]
    for model in models:
        png = IMG / f"bench-{model}.png"
        try:
            plot(report, model, png)
            figure = f"![{model}](img/{png.name})"
        except ImportError:
            figure = "(matplotlib is not installed: no plot)"
        parts += [f"## {model}", "", model_table(rows, model), "", figure, ""]
        cpu = cpu_table(rows, model)
        if cpu is not None:
            parts += [
                f"CPU time per request ({model}), user + system from /proc over each measured "
                "window, median of the windows: each server process tree (ours: the `worker "
                "start` supervisor and its model process, the gateway's gunicorn master and "
                "workers, redis-server; an alternative's whole server tree, and Redis where it "
                "uses one), and the load generator's own (the Python load process, or wrk).",
                "",
                cpu,
                "",
            ]
    memory = report.get("memory_mb") or {}
    if memory:
        parts += ["## Memory (RSS, MB, at the end of the model's run)", ""]
        parts += [
            "| model | worker process tree | the model loaded alone | worker over the bare "
            "model | gateway (all processes) |",
            "|---|---:|---:|---:|---:|",
        ]
        for model, m in memory.items():
            gw = m.get("gateway_rss_mb")
            per = f" ({gw / m['gateway_processes']:.0f} per process)" if gw else ""
            worker, bare = m.get("worker_rss_mb"), m.get("bare_model_rss_mb")
            over = f"{worker - bare:+,.0f}" if worker and bare else "-"
            parts.append(
                f"| {model} | {fmt(worker, 0)} | {fmt(bare, 0)} | {over} | {fmt(gw, 0)}{per} |"
            )
        parts += [
            "",
            "The worker process tree is the `worker start` supervisor (no torch) and its model "
            "process; the model alone is a Python process that has only run the model's "
            "`init_model` (which imports torch, for the MLPs) and `warmup` "
            "(`python -m bench.memory`). The difference is about 55 MB for the supervisor "
            "and ~20 MB for the model process's Redis client, asyncio and metrics.",
            "",
        ]
    parts += soak_section(SOAK)
    for extra in extras or []:
        load = ", ".join(f"{v:.2f}" for v in extra["load_average_before"])
        parts += [
            f"## Re-run at low load: `{extra['command']}`",
            "",
            f"Started {extra['started']}, load average before {load}; same settings. Ratios "
            "below are within this re-run.",
            "",
            "| target | measured (this re-run) | |",
            "|---|---|---|",
        ]
        checked = report_targets(extra)
        parts += [f"| {t} | {m} | {v} |" for t, m, v in checked]
        parts += open_loop_section(extra, suffix="-rerun")
        if find(extra["results"], "mlp", BATCHED):
            parts += ["", "Spine table (re-run):", "", spine_table(extra["results"], "mlp")]
        for model in dict.fromkeys(r["model"] for r in extra["results"]):
            parts += ["", f"### {model} (re-run)", "", model_table(extra["results"], model)]
        parts.append("")
    for notes in (ANALYSIS, SPINE_NOTES, LENGTH_NOTES):
        if notes.exists():
            parts += [notes.read_text().strip(), ""]
    doc.write_text("\n".join(parts))


def main(path: Path | None = None) -> None:
    if path is None:
        path = (
            Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results" / "harness.json"
        )
    # further runs kept beside it (bench/results/harness-*.json, e.g. a re-run of one model at
    # low load) get a section of their own; the quick run's JSON is not one of them
    extras = [
        json.loads(extra.read_text())
        for extra in sorted(path.parent.glob("harness-*.json"))
        if extra.name != "harness-quick.json"
    ]
    write(json.loads(path.read_text()), extras=extras)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
