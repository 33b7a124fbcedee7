"""Virtualenvs for the alternatives, built once under .cache/bench-venvs/NAME and then reused.

Each is ``python -m venv`` + ``pip install torch==2.13.0`` (the CPU wheel; from local disk where
pip's find-links has it) + the alternative's own packages from PyPI, plus numpy, msgpack and
redis so that the servers import this repository's models (``bench.models``, ``examples.mlp``,
loaded through ``gpu_worker.load_model_class``, whose package imports the broker's client)
through PYTHONPATH: every arm runs the very same model code and weights. A virtualenv that
exists but lacks a package (built before that package was needed) gets it installed in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench-venvs"
TORCH = "torch==2.13.0"
COMMON = ["numpy", "msgpack", "redis"]

# name -> (packages, module imported to check the venv)
ALTERNATIVES: dict[str, list[str]] = {
    # service_streamer 0.1.2 works with today's redis-py (it uses only lists and plain
    # commands); Flask for its ThreadedStreamer web arm, gunicorn is not needed
    "service_streamer": ["service_streamer==0.1.2", "redis", "flask"],
    "fastapi": ["fastapi", "uvicorn[standard]", "pydantic"],
    "litserve": ["litserve"],
    "mosec": ["mosec"],
}
CHECK = {
    "service_streamer": "service_streamer, flask, redis",
    "fastapi": "fastapi, uvicorn",
    "litserve": "litserve",
    "mosec": "mosec",
}
DISTRIBUTIONS = {
    "service_streamer": ["service_streamer", "redis", "flask"],
    "fastapi": ["fastapi", "uvicorn"],
    "litserve": ["litserve", "fastapi", "uvicorn"],
    "mosec": ["mosec"],
}


def python_of(name: str) -> Path:
    return CACHE / name / "bin" / "python"


def _ok(name: str) -> bool:
    python = python_of(name)
    if not python.exists():
        return False
    check = f"import torch, numpy, msgpack, redis, {CHECK[name]}; import gpu_worker"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(python), "-c", check], capture_output=True, cwd=ROOT, env=env)
    return out.returncode == 0


def ensure(name: str) -> Path:
    """The python of NAME's virtualenv, built first if it is missing or broken."""
    python = python_of(name)
    if _ok(name):
        return python
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if not python.exists():
        print(f"[bench] building virtualenv {CACHE / name}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(CACHE / name)], check=True)
        # torch alone first (the CPU wheel from local disk if there), so pip never picks a
        # CUDA build
        if subprocess.run([*pip, "--no-index", "--no-deps", TORCH]).returncode != 0:
            subprocess.run([*pip, "--no-deps", TORCH], check=True)
    else:
        print(f"[bench] completing virtualenv {CACHE / name}", file=sys.stderr, flush=True)
    subprocess.run([*pip, TORCH, *COMMON, *ALTERNATIVES[name]], check=True)
    if not _ok(name):
        raise RuntimeError(f"virtualenv {name} does not import {CHECK[name]}")
    return python


def versions(name: str) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json, sys; "
        "print(json.dumps({d: m.version(d) for d in sys.argv[1:]}))"
    )
    out = subprocess.run(
        [str(python_of(name)), "-c", code, "torch", *DISTRIBUTIONS[name]],
        capture_output=True,
        text=True,
        check=True,
    )
    import json

    result: dict[str, str] = json.loads(out.stdout)
    return result


if __name__ == "__main__":
    for arg in sys.argv[1:] or list(ALTERNATIVES):
        ensure(arg)
        print(arg, versions(arg))
