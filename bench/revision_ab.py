"""This checkout against another (a base revision), served the same way, arms alternating.

    git worktree add /tmp/base main
    python -m bench.revision_ab --base /tmp/base [--models identity,mlp] [--repeats 3]

For each model and repeat, runs ``bench.model_share.served`` (a private Redis, one
`worker start` at its defaults, ``--concurrency`` asyncio callers with the client's default
``entry_items``) once from the base checkout and once from this one, each in a fresh process
whose imports come from its checkout, the two alternating (which goes first alternates too).
Prints the medians of items/s and of the CPU microseconds per item of the worker, the client
and Redis, and this checkout's ratios to the base; writes them to
``bench/results/revision_ab.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench import ab

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

_RUN = """
import argparse, json, sys
from bench.model_share import served
options = argparse.Namespace(**json.loads(sys.argv[1]))
print(json.dumps(served(options.model, options)))
"""


def served_from(checkout: Path, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """One served run, in a process importing everything from ``checkout``."""
    options = {
        "model": model, "concurrency": args.concurrency, "duration": args.duration,
        "warmup": args.warmup, "batch_size": args.batch_size, "torch_threads": 1,
        "model_thread": "auto", "cuda": None, "entry_items": None,
    }  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _RUN, json.dumps(options)],
        cwd=checkout, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    arms = {"base": Path(args.base).resolve(), "this": ROOT}
    runs = ab.alternate(
        {arm: partial(served_from, tree, model, args) for arm, tree in arms.items()},
        args.repeats,
        swap_order=True,
    )
    medians = ab.medians(runs)
    return {**medians, "this_over_base": ab.ratios(medians["this"], medians["base"]), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.revision_ab", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--base", required=True, help="the base revision's checkout")
    parser.add_argument("--models", default="identity,mlp")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", default=str(RESULTS / "revision_ab.json"))
    args = parser.parse_args()
    base_rev = subprocess.run(
        ["git", "-C", args.base, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    this_rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report: dict[str, Any] = {
        "command": f"python -m bench.revision_ab --base {args.base} --models {args.models} "
        f"--repeats {args.repeats} --duration {args.duration}",
        "base": base_rev,
        "this": this_rev,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "models": {},
    }
    for model in args.models.split(","):
        result = report["models"][model] = measure(model, args)
        title = f"{model}: base {base_rev}, this {this_rev}"
        ab.print_table(title, result, ["base", "this"], "this_over_base", "this/base")
    ab.write_report(report, args.output)


if __name__ == "__main__":
    main()
