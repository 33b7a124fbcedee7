"""Latency against offered load, and the highest rate within a p99 SLA, for one served stack.

The open-loop arm of ``python -m bench``: requests are sent on a fixed schedule by a
``python -m bench.openloop serve`` process (apart from the harness and the servers, its own CPU
reported), at rates that are fractions of the stack's closed-loop capacity, lowest first, up to
the first rate that misses the SLA; then once between the highest pass and that miss. Each rate
is measured in up to ``repeats`` windows: it passes when most of them meet the SLA (p99 within
it, enough answered 200, the rate sustained: bench.openloop.meets), and its figures are the
medians of its windows. Windows stop early once they can no longer meet the SLA, and a rate
stops being measured once its majority is settled.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.openloop import RunResult, meets

# Rates tried, as fractions of the closed-loop capacity (denser where the SLA usually breaks).
FRACTIONS = (0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6, 1.8, 2.0)


@dataclass
class Point:
    """One offered rate: its windows and whether most of them met the SLA."""

    rate: float
    windows: list[RunResult]
    passed: bool
    cpu_us_per_item: dict[str, float] | None = None  # the servers', median over the windows

    def median(self, key: str) -> float:
        values = [getattr(w, key) for w in self.windows]
        values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
        return float(statistics.median(values)) if values else math.nan

    def mean_batch(self) -> float | None:
        """The median over the windows of the items per model call (where the server says)."""
        values = [w.extra.get("mean_batch") for w in self.windows]
        known = [v for v in values if v is not None]
        return float(statistics.median(known)) if known else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "passed": self.passed,
            "p50_ms": self.median("p50_ms"),
            "p90_ms": self.median("p90_ms"),
            "p99_ms": self.median("p99_ms"),
            "p999_ms": self.median("p999_ms"),
            "ok_fraction": statistics.median(w.ok_fraction for w in self.windows),
            "achieved_rps": self.median("achieved_rps"),
            "mean_batch": self.mean_batch(),
            "generator_cpu": self.median("generator_cpu"),
            "generator_cpu_max": max(w.generator_cpu for w in self.windows),
            "generator_saturated": any(w.generator_saturated for w in self.windows),
            "aborted": sum(1 for w in self.windows if w.aborted),
            "cpu_us_per_item": self.cpu_us_per_item,
            "windows": [w.to_dict() for w in self.windows],
        }


@dataclass
class Curve:
    """Every rate measured (in the order measured) and the highest that passed."""

    capacity_rps: float
    points: list[Point] = field(default_factory=list)
    stopped: str = ""

    @property
    def max_rate(self) -> float:
        return max((p.rate for p in self.points if p.passed), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        ordered = sorted(self.points, key=lambda p: p.rate)
        return {
            "capacity_rps": self.capacity_rps,
            "max_rate": self.max_rate,
            "stopped": self.stopped,
            "points": [p.to_dict() for p in ordered],
        }


def measure_point(
    window: Callable[[float], tuple[RunResult, dict[str, float] | None]],
    rate: float,
    repeats: int,
    sla_p99_ms: float,
    min_success: float,
) -> Point:
    """Up to ``repeats`` windows at ``rate``, stopping once most have passed or failed."""
    need = repeats // 2 + 1
    windows: list[RunResult] = []
    cpus: list[dict[str, float]] = []
    passes = fails = 0
    while passes < need and fails < need:
        result, cpu = window(rate)
        windows.append(result)
        if cpu:
            cpus.append(cpu)
        if meets(result, sla_p99_ms, min_success):
            passes += 1
        else:
            fails += 1
    median_cpu = {key: statistics.median(c[key] for c in cpus) for key in cpus[0]} if cpus else None
    return Point(rate, windows, passes >= need, median_cpu)


def sla_curve(
    window: Callable[[float], tuple[RunResult, dict[str, float] | None]],
    capacity_rps: float,
    *,
    repeats: int = 3,
    sla_p99_ms: float = 50.0,
    min_success: float = 0.999,
    fractions: tuple[float, ...] = FRACTIONS,
) -> Curve:
    """Rates at ``fractions`` of the capacity, up to the first miss, then the geometric mean
    of the highest pass and that miss. ``window(rate)`` runs one open-loop window and returns
    its result and the servers' CPU per answered request (or None)."""
    curve = Curve(capacity_rps)
    failed: float | None = None
    for fraction in fractions:
        point = measure_point(window, fraction * capacity_rps, repeats, sla_p99_ms, min_success)
        curve.points.append(point)
        if not point.passed:
            failed = point.rate
            break
    if failed is None:
        curve.stopped = "every rate passed"
        return curve
    best = curve.max_rate
    if best == 0.0:
        curve.stopped = "the lowest rate missed the SLA"
        return curve
    middle = math.sqrt(best * failed)
    curve.points.append(measure_point(window, middle, repeats, sla_p99_ms, min_success))
    curve.stopped = "bisected once between the highest pass and the first miss"
    return curve
