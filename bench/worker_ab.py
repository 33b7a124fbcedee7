"""The worker of two source trees, same load, arms alternating: CPU per item and items/s.

    python -m bench.worker_ab --base /tmp/base [--models identity,mlp] [--repeats 3]

Serves each model through a private Redis and one `worker start` at its defaults, loaded by
``--concurrency`` asyncio callers in this process (``bench.model_share``), once with the worker
(supervisor and child) run from ``--base`` (another checkout: the code before a change) and
once from this tree, the two alternating ``--repeats`` times; the client and Redis are this
tree's in both arms. Prints the medians of items/s and of the CPU microseconds per item of the
worker, the client and Redis, and this tree's ratios to the base; writes them to
``bench/results/worker_ab.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench import ab, http_bench, model_share
from bench.harness import MODELS, ROOT
from bench.spine import direct

RESULTS = Path(__file__).parent / "results"


def served_from(tree: Path, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """``model_share.served`` with the worker's code (cwd and PYTHONPATH) taken from ``tree``."""
    model_share.ROOT = http_bench.ROOT = tree  # type: ignore[attr-defined]
    try:
        return model_share.served(model, args)
    finally:
        model_share.ROOT = http_bench.ROOT = ROOT  # type: ignore[attr-defined]


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model: direct once, then the two trees alternating; medians per arm."""
    arms = {"base": Path(args.base).resolve(), "new": ROOT}
    alone = direct(MODELS[model], args.batch_size, args.duration, False, "cpu").items_per_s
    runs = ab.alternate(
        {arm: partial(served_from, tree, model, args) for arm, tree in arms.items()}, args.repeats
    )
    medians = ab.medians(runs)
    for arm in arms:
        medians[arm]["over_direct"] = medians[arm]["items_per_s"] / alone
    return {
        "direct_batched_items_per_s": alone,
        **medians,
        "new_over_base": ab.ratios(medians["new"], medians["base"]),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.worker_ab", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--base", required=True, help="the other checkout's root")
    parser.add_argument("--models", default="identity,mlp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--entry-items", type=int, default=None)
    parser.add_argument("--output", default=str(RESULTS / "worker_ab.json"))
    args = parser.parse_args()
    args.model_thread, args.cuda = "auto", None
    os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    report: dict[str, Any] = {
        "command": "python -m bench.worker_ab "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k in ("models", "repeats", "duration", "concurrency", "batch_size", "entry_items")
        ),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "models": {},
    }
    for model in args.models.split(","):
        result = report["models"][model] = measure(model, args)
        title = f"{model}: direct batched {result['direct_batched_items_per_s']:,.0f} items/s"
        ab.print_table(title, result, ["base", "new"], "new_over_base", "new/base")
    ab.write_report(report, args.output)


if __name__ == "__main__":
    main()
