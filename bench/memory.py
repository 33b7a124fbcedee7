"""The resident memory of each benchmark model loaded alone: what a worker costs over it.

    python -m bench.memory [bench/results/harness.json]

Loads each model of a harness run in a fresh Python process (``init_model``, which imports
torch where the model uses it, and ``warmup``; nothing of microbatch's serving), reads its
VmRSS, and adds it to the run's ``memory_mb`` as ``bare_model_rss_mb``, so that the report can
show the worker's memory over the bare model. The harness does the same at the end of each full run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.harness import MODELS, ROOT

# torch only if the model imports it (the identity model does not); threads from OMP_NUM_THREADS
_LOAD_ALONE = """
import re, sys
from gpu_worker import load_model_class
model = load_model_class(sys.argv[1])(device=sys.argv[2])
model.init_model()
model.warmup()
print(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
"""


def bare_model_rss_mb(model_path: str, torch_threads: int = 1, device: str = "cpu") -> float:
    """VmRSS (MB) of a process that has only loaded and warmed up ``model_path`` on ``device``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(torch_threads)}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_ALONE, model_path, device],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1]) / 1024


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results" / "harness.json"
    report = json.loads(path.read_text())
    settings = report.get("settings", {})
    threads, device = settings.get("torch_threads", 1), settings.get("device", "cpu")
    for model, memory in report.get("memory_mb", {}).items():
        memory["bare_model_rss_mb"] = round(bare_model_rss_mb(MODELS[model], threads, device), 1)
        print(model, memory)
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
