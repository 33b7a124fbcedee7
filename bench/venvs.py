"""Virtualenvs for the alternatives, built once under .cache/bench-venvs/NAME and then reused.

Each is ``python -m venv`` + ``pip install torch==2.13.0`` (the CPU wheel; from local disk where
pip's find-links has it) + the alternative's own packages from PyPI, plus numpy and msgpack so
that the servers import this repository's models (``bench.models``, ``examples.mlp``) through
PYTHONPATH: every arm runs the very same model code and weights.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench-venvs"
TORCH = "torch==2.13.0"
COMMON = ["numpy", "msgpack"]

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
    check = f"import torch, numpy, msgpack, {CHECK[name]}"
    return subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0


def ensure(name: str) -> Path:
    """The python of NAME's virtualenv, built first if it is missing or broken."""
    python = python_of(name)
    if _ok(name):
        return python
    print(f"[bench] building virtualenv {CACHE / name}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(CACHE / name)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # torch alone first (the CPU wheel from local disk if there), so pip never picks a CUDA build
    if subprocess.run([*pip, "--no-index", "--no-deps", TORCH]).returncode != 0:
        subprocess.run([*pip, "--no-deps", TORCH], check=True)
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
