"""HTTP benchmark: MLP through gateway + Redis + worker vs the naive FastAPI server.

    .venv/bin/python bench/http_bench.py --duration 10 --gateway-workers 1

Starts a private redis-server, `worker start --model examples.mlp:MLP`, `gateway start` (gunicorn)
and `uvicorn bench.naive_fastapi:app`, all on this machine, checks that both servers give the
same outputs, then loads each with ``wrk`` (closed loop: each connection sends its next request
when the previous one is answered) at every concurrency asked for, one run each, and prints a
Markdown table (requests/s, p50, p99, errors). ``wrk`` must be on PATH (apt-get install wrk).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.connections import sync_client  # noqa: E402
from broker.devserver import RedisServer, free_port  # noqa: E402
from broker.keys import ModelKeys  # noqa: E402
from broker.liveness import wait_for_consumers  # noqa: E402


def python_path() -> str:
    """PYTHONPATH for the processes a benchmark starts: this tree first, then the caller's own
    (where packages installed outside the interpreter's site-packages may be)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


ENV = {**os.environ, "PYTHONPATH": python_path()}
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


@contextmanager
def process(
    command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (output discarded) in ``cwd`` (default: this module's ``ROOT`` as it is
    at the call, which bench.worker_ab points at another tree) for the ``with`` block; SIGTERM
    it, then SIGKILL. The cwd decides the code: ``python -m`` puts it ahead of PYTHONPATH."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT if cwd is None else cwd,
        env=env or ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_http(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer")


def wait_workers(
    redis_url: str,
    keys: ModelKeys,
    count: int,
    timeout: float = 120.0,
    proc: subprocess.Popen[Any] | None = None,
) -> None:
    """Until ``count`` live workers consume ``keys``; RuntimeError if they do not in time (or
    ``proc``, the process that should start them, exits first)."""

    def running() -> None:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"worker did not start (exit code {proc.returncode})")

    client = sync_client(redis_url)
    try:
        wait_for_consumers(client, keys, count, timeout, check=running)
    except TimeoutError as exc:
        raise RuntimeError(f"worker did not start: {exc}") from None
    finally:
        client.close()


def _post(url: str, body: str) -> dict[str, object]:
    response = httpx.post(
        url, content=body, headers={"Content-Type": "application/json"}, timeout=30
    )
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
    result: dict[str, object] = response.json()
    return result


def to_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not match:
        raise ValueError(f"cannot read wrk latency {text!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def post_script(path: Path, body: str) -> Path:
    """Write a wrk Lua script that POSTs ``body`` as JSON; returns ``path``."""
    path.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(body)}\n"
    )
    return path


def wrk_counts(out: str) -> tuple[int, int]:
    """(requests sent, non-2xx/3xx responses) from wrk's report."""
    total = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return (int(total.group(1)) if total else 0), (int(bad.group(1)) if bad else 0)


def run_wrk(url: str, script: Path, concurrency: int, duration: int) -> dict[str, float]:
    threads = min(concurrency, 2)
    command = ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{duration}s", "--latency"]
    command += ["--timeout", "30s", "-s", str(script), url]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = to_ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = to_ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    total, non_2xx = wrk_counts(out)
    errors = re.search(r"Socket errors:.*", out)
    return {
        "rps": rps,
        "p50_ms": p50,
        "p99_ms": p99,
        "requests": total,
        "non_2xx": non_2xx,
        "socket_errors": errors.group(0) if errors else "",  # type: ignore[dict-item]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--gateway-workers", type=int, default=1)
    parser.add_argument("--model-workers", type=int, default=1, help="worker processes")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads of the model worker and of the naive server alike (OMP_NUM_THREADS)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    threads = str(args.torch_threads)
    ENV.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, BENCH_TORCH_THREADS=threads)
    if shutil.which("wrk") is None:
        sys.exit("wrk is not on PATH: apt-get install wrk")

    rng = np.random.default_rng(0)
    item = [round(float(v), 4) for v in rng.standard_normal(256)]
    body = json.dumps({"inputs": [item]})
    tmp = Path(tempfile.mkdtemp(prefix="microbatch-bench-"))
    script = post_script(tmp / "post.lua", body)
    results: dict[str, dict[int, dict[str, float]]] = {}
    with ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        prefix = "bench"
        worker = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", "examples.mlp:MLP"]
        worker += ["--redis", server.url, "--prefix", prefix, "--workers", str(args.model_workers)]
        worker += ["--batch-size", str(args.batch_size), "--log-level", "WARNING"]
        stack.enter_context(process(worker))
        gateway_port, naive_port = free_port(), free_port()
        gateway = [sys.executable, "-m", "web_gateway.cli", "start", "--model", "examples.mlp:MLP"]
        gateway += ["--redis", server.url, "--prefix", prefix, "--port", str(gateway_port)]
        gateway += ["--workers", str(args.gateway_workers), "--log-level", "warning"]
        stack.enter_context(process(gateway))
        naive = [sys.executable, "-m", "uvicorn", "bench.naive_fastapi:app"]
        naive += ["--port", str(naive_port), "--log-level", "warning", "--no-access-log"]
        stack.enter_context(process(naive))
        wait_workers(server.url, ModelKeys("mlp", prefix), args.model_workers)
        targets = {
            "gateway": f"http://127.0.0.1:{gateway_port}/v1/models/mlp/predict",
            "naive": f"http://127.0.0.1:{naive_port}/predict",
        }
        wait_http(f"http://127.0.0.1:{gateway_port}/healthz")
        wait_http(f"http://127.0.0.1:{naive_port}/docs")
        answers = {name: np.asarray(_post(url, body)["outputs"]) for name, url in targets.items()}
        np.testing.assert_allclose(answers["gateway"], answers["naive"], rtol=1e-4, atol=1e-5)
        for name, url in targets.items():
            run_wrk(url, script, 8, 2)  # warm up
            results[name] = {}
            for concurrency in args.concurrency:
                results[name][concurrency] = run_wrk(url, script, concurrency, args.duration)
                print(name, concurrency, results[name][concurrency], flush=True)
    shutil.rmtree(tmp, ignore_errors=True)

    print()
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"gateway: {args.gateway_workers} gunicorn workers, {args.model_workers} model worker "
        f"process(es), batch size {args.batch_size}; naive: 1 uvicorn process; torch threads "
        f"{args.torch_threads} in both; "
        f"wrk, {args.duration} s per run"
    )
    print()
    print("| server | concurrency | requests/s | p50 (ms) | p99 (ms) | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, by_concurrency in results.items():
        for concurrency, row in by_concurrency.items():
            errors = int(row["non_2xx"]) + (1 if row["socket_errors"] else 0)
            print(
                f"| {name} | {concurrency} | {row['rps']:.0f} | {row['p50_ms']:.2f} | "
                f"{row['p99_ms']:.2f} | {errors} |"
            )
    for concurrency in args.concurrency:
        gateway, naive = results["gateway"][concurrency], results["naive"][concurrency]
        print(
            f"\nconcurrency {concurrency}: gateway/naive requests/s = "
            f"{gateway['rps'] / naive['rps']:.2f}x, p99 gateway/naive = "
            f"{gateway['p99_ms'] / naive['p99_ms']:.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
