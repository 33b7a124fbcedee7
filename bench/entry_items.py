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
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import ab
from bench.harness import MODELS
from bench.model_share import served
from bench.spine import direct
from broker.multi_item import DEFAULT_ENTRY_ITEMS

RESULTS = Path(__file__).parent / "results"
ARMS = {"packed": DEFAULT_ENTRY_ITEMS, "one_per_item": 1}


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model: direct once, then the arms alternating; medians per arm."""
    alone = direct(MODELS[model], args.batch_size, args.duration, False, "cpu").items_per_s

    def serve(entry_items: int) -> Callable[[], dict[str, Any]]:
        options = argparse.Namespace(**{**vars(args), "entry_items": entry_items})
        return lambda: served(model, options)

    runs = ab.alternate({arm: serve(items) for arm, items in ARMS.items()}, args.repeats)
    medians = ab.medians(runs)
    for arm in ARMS:
        medians[arm]["over_direct"] = medians[arm]["items_per_s"] / alone
    return {
        "direct_batched_items_per_s": alone,
        **medians,
        "packed_over_one_per_item": ab.ratios(medians["packed"], medians["one_per_item"]),
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
        title = f"{model}: direct batched {result['direct_batched_items_per_s']:,.0f} items/s"
        ab.print_table(title, result, list(ARMS), "packed_over_one_per_item", "packed/one")
    ab.write_report(report, args.output)


if __name__ == "__main__":
    main()
