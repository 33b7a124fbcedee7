"""Two arms of a served model, alternating: medians per arm, their ratios, a printed table.

The shared part of ``bench.entry_items`` (packed entries against one item each),
``bench.worker_ab`` (the worker of two source trees) and ``bench.revision_ab`` (two whole
checkouts): each runs ``bench.model_share.served`` (or the same in another checkout) once per
arm and repeat, and reports the same measures.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

MEASURES = (
    "items_per_s",
    "mean_batch",
    "cpu_us_per_item_worker",
    "cpu_us_per_item_client",
    "cpu_us_per_item_redis",
)


def alternate(
    arms: dict[str, Callable[[], dict[str, Any]]], repeats: int, swap_order: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Every arm's runs, the arms taking turns ``repeats`` times (with ``swap_order``, which
    goes first alternates too)."""
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for repeat in range(repeats):
        order = list(arms)[::-1] if swap_order and repeat % 2 else list(arms)
        for arm in order:
            runs[arm].append(arms[arm]())
    return runs


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per arm, the median of each measure over its runs."""
    return {
        arm: {name: statistics.median(run[name] for run in got) for name in MEASURES}
        for arm, got in runs.items()
    }


def ratios(new: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """``new`` over ``base``, measure by measure (where ``base`` is not zero)."""
    return {name: new[name] / base[name] for name in MEASURES if base[name]}


def print_table(
    title: str, result: dict[str, Any], arms: list[str], ratio: str, label: str
) -> None:
    """The arms' medians and their ratio (``result[ratio]``, its row named ``label``)."""
    width = max(len(label), *map(len, arms))
    print(f"\n{title}")
    print(f"  {'arm':{width}} " + " ".join(f"{name:>24}" for name in MEASURES))
    for arm in arms:
        print(f"  {arm:{width}} " + " ".join(f"{result[arm][n]:>24,.1f}" for n in MEASURES))
    row = result[ratio]
    print(f"  {label:{width}} " + " ".join(f"{row.get(n, 0):>24.2f}" for n in MEASURES))


def write_report(report: dict[str, Any], output: str) -> None:
    """Write ``report`` as JSON to ``output`` (its folder made if missing)."""
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {output}")
