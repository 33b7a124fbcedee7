"""The report of a tuning sweep (bench.tune): ``report.md`` and ``tune.png`` in its directory."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from bench.tune import Config, recommend


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def method(row: dict[str, Any]) -> str:
    runs = len(row["steps"])
    return f"{row['mode']}: {runs} run{'s' if runs != 1 else ''}, {row['stopped']}"


def table(rows: list[dict[str, Any]], best: dict[str, Any] | None) -> list[str]:
    lines = [
        "| rank | configuration | key | highest rate within the SLA, req/s | achieved req/s | "
        "p50 ms | p90 ms | p99 ms | p99.9 ms | answered | mean batch | closed-loop req/s | "
        "generator CPU | how found |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ordered = sorted(rows, key=lambda r: -r["max_rate"])
    for rank, row in enumerate(ordered, 1):
        config = Config(**row["config"])
        mark = " **(recommended)**" if best is not None and row["key"] == best["key"] else ""
        s = row["best"]
        capacity = fmt(row["capacity"]["rps"], 0)
        if s is None:
            note = no_rate(row)
            lines.append(
                f"| {rank} | {config.label} | `{row['key']}` | {note} | - | - | - | - | - | - | "
                f"- | {capacity} | - | {method(row)} |"
            )
            continue
        lines.append(
            f"| {rank} | {config.label}{mark} | `{row['key']}` | {row['max_rate']:,.0f} | "
            f"{s['achieved_rps']:,.0f} | {fmt(s['p50_ms'])} | {fmt(s['p90_ms'])} | "
            f"{fmt(s['p99_ms'])} | {fmt(s['p999_ms'])} | {s['ok_fraction']:.2%} | "
            f"{fmt(s['extra'].get('mean_batch'))} | {capacity} | "
            f"{s['generator_cpu']:.2f} | {method(row)} |"
        )
    return lines


def no_rate(row: dict[str, Any]) -> str:
    """Why a configuration has no rate: what its runs came closest to."""
    steps = row["steps"]
    if not steps:
        return "none"
    again = [s for s in steps if s["extra"].get("confirmation")]
    if again:
        first = max(again, key=lambda s: s["rate"])
        return (
            f"none confirmed (passed once at {first['rate']:,.0f}/s; again: p99 "
            f"{fmt(first['p99_ms'])} ms, {first['ok_fraction']:.2%} answered)"
        )
    lowest = min(steps, key=lambda s: s["rate"])
    return (
        f"none (at {lowest['rate']:,.0f}/s: p99 {fmt(lowest['p99_ms'])} ms, "
        f"{lowest['ok_fraction']:.2%} answered)"
    )


def plot(rows: list[dict[str, Any]], best: dict[str, Any] | None, sla: float, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(rows, key=lambda r: r["max_rate"])
    fig, (bars, curves) = plt.subplots(
        1, 2, figsize=(13, max(4.0, 0.32 * len(rows) + 1.5)), width_ratios=[1, 1.3]
    )
    colors = ["#d62728" if best and r["key"] == best["key"] else "#1f77b4" for r in ordered]
    bars.barh([r["key"] for r in ordered], [r["max_rate"] for r in ordered], color=colors)
    bars.set_xlabel("highest rate within the SLA (requests/s)")
    bars.set_title(f"p99 <= {sla:g} ms (red: recommended)")
    bars.tick_params(axis="y", labelsize=8)
    stopped_label: str | None = "stopped early (p99 so far)"
    for row in rows:
        chosen = best is not None and row["key"] == best["key"]
        color = "#d62728" if chosen else None
        runs = [s for s in row["steps"] if s["ok"] > 0]
        points = sorted((s["rate"], s["p99_ms"]) for s in runs if not s["aborted"])
        if points:
            (line,) = curves.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                markersize=5 if chosen else 3,
                linewidth=2.5 if chosen else 0.8,
                alpha=1.0 if chosen else 0.5,
                color=color,
                label=row["key"] if chosen else None,
            )
            color = line.get_color()
        stopped = [(s["rate"], s["p99_ms"]) for s in runs if s["aborted"]]
        if stopped:
            curves.scatter(
                [p[0] for p in stopped],
                [p[1] for p in stopped],
                marker="x",
                s=30 if chosen else 14,
                color=color,
                alpha=1.0 if chosen else 0.5,
                label=stopped_label,
            )
            stopped_label = None
    curves.axhline(sla, color="black", linestyle="--", linewidth=1, label=f"SLA {sla:g} ms")
    curves.set_yscale("log")
    curves.set_xlabel("offered rate (requests/s, open loop)")
    curves.set_ylabel("p99 latency (ms, from the scheduled send time)")
    curves.set_title("p99 against offered load, every run of every configuration")
    curves.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(
    out: Path,
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    verified: dict[str, Any] | None,
    context: dict[str, Any],
) -> Path:
    """Write ``out/report.md`` (and ``out/tune.png``); return the markdown's path."""
    best = recommend(rows)
    sla, success = args.sla_p99_ms, args.min_success
    path_text = (
        "HTTP POSTs to `gateway start`'s v1 route (one item per request, JSON)"
        if args.http
        else "the Python client, `Streamer.apredict([item])` from one process"
    )
    model_name = rows[0]["model"] if rows else args.model
    lines = [
        f"# Tuning sweep: `{model_name}` through {'HTTP' if args.http else 'the Python client'}",
        "",
        f"Written by `{context['command']}` on {context['date']}, in "
        f"{context['elapsed_s'] / 60:.1f} minutes (this run; configurations measured by earlier "
        "runs of the same sweep are read back from `results.jsonl`).",
        "",
        f"**SLA**: p99 latency at most {sla:g} ms, at least {success:.1%} of the requests "
        "answered 200, and the offered rate sustained (answers arrived at 90% of it or more "
        "during the measured span).",
        "",
        f"**Machine**: {context['machine']}; load average (1, 5, 15 min) "
        + ", ".join(f"{v:.2f}" for v in context["load_before"])
        + " before, "
        + ", ".join(f"{v:.2f}" for v in context["load_after"])
        + " after. This is a shared 2-core machine on which other engineers run test suites "
        "at the same time: the load generator, Redis, the workers (and gateways) share the "
        "same 2 cores with them. Absolute rates are rough and vary from run to run; compare "
        "configurations within one report, and read neighbouring configurations as ties when "
        "they are within about 10-15% of each other.",
        "",
        "## Recommendation",
        "",
    ]
    if best is None:
        lines.append(f"No configuration met the SLA (p99 <= {sla:g} ms) at any rate tried.")
    else:
        config = Config(**best["config"])
        s = best["best"]
        lines.append(
            f"**{config.label}** (`{best['key']}`): {best['max_rate']:,.0f} requests/s within "
            f"the SLA, the highest of the {len(rows)} configurations measured; at that rate "
            f"p50 {fmt(s['p50_ms'])} ms, p90 {fmt(s['p90_ms'])} ms, p99 {fmt(s['p99_ms'])} ms, "
            f"{s['ok_fraction']:.2%} answered."
        )
        lines.append("")
        lines.append("```")
        lines.append(" ".join(worker_command(args.model, config)))
        if config.gateway_workers:
            lines.append(f"gateway start --model {args.model} --workers {config.gateway_workers}")
        lines.append("```")
        lines.append("")
        if verified is not None:
            lines += verification(verified, sla, success)
        else:
            lines.append("Not re-measured (`--verify-repeats 0`, or the re-measurement failed).")
    modes = sorted({r["mode"] for r in rows})
    lines += [
        "",
        "## Every configuration",
        "",
        "Best first. The latency columns are those of the run at the configuration's highest "
        "rate within the SLA; *closed-loop req/s* is the rate the stack reached with callers "
        "that never wait for work (the capacity the search starts from, above what the SLA "
        "allows when queues form); *generator CPU* is the load generator's own user + system "
        "CPU seconds per second (one event loop: above 0.85 it is flagged saturated).",
        "",
        *table(rows, best),
        "",
    ]
    if context["missing"]:
        lines += [
            "Not measured (the budget ran out, or the configuration failed to start; a rerun "
            "of the same command measures them): "
            + ", ".join(f"`{k}`" for k in context["missing"])
            + ".",
            "",
        ]
    saturated = sum(1 for r in rows for s in r["steps"] if s["generator_saturated"])
    lines += [
        f"Load generator saturated (over 0.85 of a core) in {saturated} of "
        f"{sum(len(r['steps']) for r in rows)} runs.",
        "",
    ]
    picture = out / "tune.png"
    if plot(rows, best, sla, picture):
        lines += [f"![tuning sweep]({picture.name})", ""]
    lines += [
        "## How it was measured",
        "",
        f"- Load: {path_text}, open loop (`bench/openloop.py`): request *i* is due at "
        "start + i / rate whatever happened before it, and its latency runs from that "
        "scheduled time to its answer, so queueing in the generator (a 1 ms timer tick, or "
        "waiting for one of the "
        f"{context['lanes']} connections or tasks) counts against the stack. The generator runs "
        "in a process of its own.",
        "- Each configuration: a private redis-server (shared by the sweep; a key prefix per "
        "configuration), `worker start` with the configuration's `--batch-size`, "
        "`--max-latency` and `--workers` and every other flag at its default"
        + (", `gateway start --workers N` at its defaults otherwise" if args.http else "")
        + "; torch threads per worker: "
        + (
            "torch's default"
            if context["torch_threads"] == 0
            else f"{context['torch_threads']} (OMP_NUM_THREADS)"
        )
        + ".",
        f"- Then a {args.probe_s:g} s closed-loop capacity probe, then open-loop runs of "
        f"{args.warmup_s:g} s warm-up + {args.window_s:g} s measured each, waiting for the "
        "model's stream to empty between runs. A run stops early once it cannot meet the SLA "
        "any more (over 1% of its requests slower than the SLA, or more errors than allowed).",
        "- Methods used in this report: "
        + "; ".join(
            {
                "search": "**search**: from 60% of the capacity, step up x1.5 while within "
                "the SLA (down x2.25 while not), then bisect (geometric mean) until the highest "
                "pass and the lowest failure are within 10%, at most "
                f"{args.max_steps} runs",
                "ladder": "**ladder** (the budget per configuration was too small for a "
                "search): as many rates as fit (3 to 7), evenly spaced on a log scale from 30% "
                "to 100% of the capacity, up to the first that fails",
            }[m]
            for m in modes
        )
        + ".",
        "- Then the best rate found is measured once more and counts only if it meets the "
        "SLA again (otherwise the next lower rate that passed is measured again, if the "
        "configuration's runs allow): on this machine a single window can pass by luck. The "
        "table's latencies are those of the worse of the two runs. *How found* ends with "
        "`confirmed` when that second run passed, and the configuration has no rate when none "
        "was confirmed.",
        "- Finally the recommendation is started again and re-measured (below its "
        "*Recommendation*).",
        "- Raw data: `results.jsonl` (one line per configuration, every run's figures, the "
        "errors by type; and the re-measurement).",
        "",
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def verification(verified: dict[str, Any], sla: float, success: float) -> list[str]:
    """The re-measurement of the recommendation, rate by rate."""
    windows = len(verified["attempts"][0]["windows"])
    lines = [
        f"Re-measured on a fresh start of that configuration, {windows} window"
        f"{'s' if windows != 1 else ''} per rate with no early stop (within the SLA: median "
        f"p99 at most {sla:g} ms and every window at least {success:.1%} answered; a miss is "
        "re-measured at 80% of the rate):",
        "",
    ]
    for attempt in verified["attempts"]:
        p99s = ", ".join(fmt(w["p99_ms"]) for w in attempt["windows"])
        oks = ", ".join(f"{w['ok_fraction']:.2%}" for w in attempt["windows"])
        verdict = "**meets the SLA**" if attempt["met"] else "misses the SLA"
        lines.append(
            f"- at {attempt['rate']:,.0f} requests/s: p99 {p99s} ms (median "
            f"{fmt(attempt['p99_ms_median'])}), answered {oks}: {verdict}"
        )
    lines.append("")
    if verified["met"]:
        lines.append(
            f"**Shown to meet the SLA at {verified['rate']:,.0f} requests/s** on a fresh start."
        )
    else:
        lines.append(
            "**Not shown to meet the SLA at any rate re-measured**: the sweep's single window "
            "was a lucky one on this machine; rerun on a quieter machine, or with longer "
            "windows (`--window-s`)."
        )
    return lines


def worker_command(model: str, config: Config) -> list[str]:
    command = ["worker start", "--model", model, "--batch-size", str(config.batch_size)]
    command += ["--max-latency", f"{config.max_latency_ms / 1000:g}"]
    if config.workers > 1:
        command += ["--workers", str(config.workers)]
    return command
