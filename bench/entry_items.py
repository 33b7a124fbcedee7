"""Multi-item entries against one entry per item: throughput and CPU per item, same run.

    python -m bench.entry_items [--models mlp,identity] [--repeats 3] [--duration 6]

For each model, calls it directly on full batches (the ceiling) once, then serves it through
a private Redis and one `worker start` at its defaults, loaded by ``--concurrency`` asyncio
callers in this process (``bench.model_share``), once with the client's default packing
(``entry_items`` 32) and once with ``entry_items=1`` (wire v1 only), the two arms alternating
``--repeats`` times. Prints, per arm, the medians of items/s, items/s over direct and the CPU
microseconds per item of the worker, the client and Redis, and the packed arm's ratios to the
unpacked one; writes them to ``bench/results/entry_items.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness import MODELS
from bench.model_share import served
from bench.spine import direct
from broker.multi_item import DEFAULT_ENTRY_ITEMS

RESULTS = Path(__file__).parent / "results"
ARMS = {"packed": DEFAULT_ENTRY_ITEMS, "one_per_item": 1}
MEASURES = (
    "items_per_s",
    "mean_batch",
    "cpu_us_per_item_worker",
    "cpu_us_per_item_client",
    "cpu_us_per_item_redis",
)


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model: direct once, then the arms alternating; medians per arm."""
    alone = direct(MODELS[model], args.batch_size, args.duration, False, "cpu").items_per_s
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm, entry_items in ARMS.items():
            options = argparse.Namespace(**{**vars(args), "entry_items": entry_items})
            runs[arm].append(served(model, options))
    medians = {
        arm: {name: statistics.median(run[name] for run in got) for name in MEASURES}
        for arm, got in runs.items()
    }
    for arm in ARMS:
        medians[arm]["over_direct"] = medians[arm]["items_per_s"] / alone
    packed, plain = medians["packed"], medians["one_per_item"]
    return {
        "direct_batched_items_per_s": alone,
        **medians,
        "packed_over_one_per_item": {
            name: packed[name] / plain[name] for name in MEASURES if plain[name]
        },
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.entry_items", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--models", default="mlp,identity")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--output", default=str(RESULTS / "entry_items.json"))
    args = parser.parse_args()
    args.model_thread, args.cuda = "auto", None
    os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    report: dict[str, Any] = {
        "command": "python -m bench.entry_items "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k in ("models", "repeats", "duration", "concurrency", "batch_size")
        ),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "models": {},
    }
    for model in args.models.split(","):
        result = report["models"][model] = measure(model, args)
        print(f"\n{model}: direct batched {result['direct_batched_items_per_s']:,.0f} items/s")
        print(f"  {'arm':14} " + " ".join(f"{name:>24}" for name in MEASURES))
        for arm in ARMS:
            print(f"  {arm:14} " + " ".join(f"{result[arm][n]:>24,.1f}" for n in MEASURES))
        ratios = result["packed_over_one_per_item"]
        print(f"  {'packed/one':14} " + " ".join(f"{ratios.get(n, 0):>24.2f}" for n in MEASURES))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {args.output}")


if __name__ == "__main__":
    main()
