"""Proof, on a machine with a CUDA device, that `worker start --cuda` pins its workers, and
what pinned, non-blocking copies change for the reference MLP.

    python -m bench.gpu_check [--output bench/results/gpu_pinning.json]
    python -m bench.gpu_check --transfers-only [--output bench/results/gpu_transfers.json]

Starts a private redis-server, then one `worker start` after another, serving
bench.models:DeviceReport (the reference MLP, answering with where it ran):

1. ``--cuda 0 --workers-per-device 1``: one child;
2. ``--cuda 0 --workers-per-device 2``: two children on the same device;
3. ``--cuda 0`` (``--workers-per-device auto``): as many children as the rule gives for a
   model of under 1 GiB (3 where the host has 3 cores), its log saying so;
4. ``--cuda N`` where N is the number of devices (one past the last): must fail at once, naming
   the devices that exist;
5. ``CUDA_VISIBLE_DEVICES=<device 0's UUID>`` and ``--cuda 0``: the index is relative to what
   the command sees, and the child inherits that entry.

For each child that answered: its CUDA_VISIBLE_DEVICES read from outside (/proc/PID/environ),
its parent (the supervisor), what its own torch reports (device count and name, the device the
output tensor was on), whether nvidia-smi lists it as a compute process, and the largest
difference between its answer and the same model on this process's CPU. Prints each check and
the worker's log, writes everything as JSON, and exits 1 if a check failed.

Then, in this process (``--transfers-only``: that alone), the MLP's direct batched speed
(``predict`` called back to back on one batch, as the harness's "direct, batched" arm) with its
batches moved two ways: pageable memory and blocking copies (``np.stack``, ``.to(device)``,
``.cpu().numpy()``: ``HostStaging(staged=False)``), and pinned buffers with non-blocking copies
(``HostStaging`` on CUDA). Items/s, the median of repeats, each arm's repeats interleaved with
the other's; and whether both gave the same outputs. Without CUDA it says so and measures
nothing (``--transfers-only`` then exits 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.http_bench import python_path, wait_workers
from broker import Streamer
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from examples.mlp import MLP
from gpu_worker.devices import auto_workers_per_device
from gpu_worker.polling import usable_cores
from gpu_worker.staging import HostStaging

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench.models:DeviceReport"
NAME = "device_report"
TOLERANCE = 1e-4  # FP32 on both sides; cuBLAS and the CPU sum in different orders
TRANSFER_TOLERANCE = 1e-6  # the same kernels on the same data: expected 0
SAME_OUTPUTS = "the same outputs both ways (max abs diff)"
TRANSFER_ARMS = {
    "pageable": False,  # np.stack into a new array, .to(device), .cpu().numpy()
    "pinned": True,  # HostStaging: reused pinned buffers, non_blocking copies
}


def smi(*query: str) -> list[str]:
    """nvidia-smi's CSV answer, one line per row (empty if it cannot be run)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    pairs = (entry.decode(errors="replace").partition("=") for entry in raw if entry)
    return {key: value for key, _, value in pairs}


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


class Worker:
    """One `worker start` command, its output in a file."""

    def __init__(self, url: str, prefix: str, options: list[str], env: dict[str, str]) -> None:
        self.log_path = Path(tempfile.mkstemp(prefix="gpu-check-", suffix=".log")[1])
        self.command = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", MODEL]
        self.command += ["--redis", url, "--prefix", prefix, "--log-level", "INFO", *options]
        self.started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait(self, url: str, prefix: str, count: int, timeout: float = 180) -> None:
        try:
            wait_workers(url, ModelKeys(NAME, prefix), count, timeout, self.process)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{self.log()}") from None

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(60)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def ask(url: str, prefix: str, x: np.ndarray, want_pids: int) -> list[dict[str, Any]]:
    """Answers to rounds of 256 concurrent requests, until WANT_PIDS processes have answered."""
    answers: list[dict[str, Any]] = []
    with Streamer(NAME, redis_url=url, prefix=prefix) as streamer:
        for _ in range(20):
            futures = [streamer.submit([x]) for _ in range(256)]
            answers += [future.result(timeout=60)[0] for future in futures]
            if len({a["pid"] for a in answers}) >= want_pids:
                break
    return answers


def children(answers: list[dict[str, Any]], reference: np.ndarray, supervisor: int) -> list[Any]:
    """What each answering child says of itself, and what /proc and nvidia-smi say of it."""
    on_gpu = {int(line.split(",")[0]) for line in smi("--query-compute-apps=pid")}
    out = []
    for pid in sorted({int(a["pid"]) for a in answers}):
        mine = [a for a in answers if a["pid"] == pid]
        diff = max(float(np.abs(np.asarray(a["output"]) - reference).max()) for a in mine)
        first = {k: v for k, v in mine[0].items() if k != "output"}
        out.append(
            {
                **first,
                "answers": len(mine),
                "environ_cuda_visible_devices": environ_of(pid).get("CUDA_VISIBLE_DEVICES"),
                "parent_is_supervisor": parent_of(pid) == supervisor,
                "in_nvidia_smi_compute_apps": pid in on_gpu,
                "max_abs_diff_vs_cpu": diff,
            }
        )
    return out


def served_case(
    title: str, options: list[str], env: dict[str, str], expect: dict[str, Any], url: str
) -> dict[str, Any]:
    """Start a worker with OPTIONS, ask it, and check each child against EXPECT."""
    prefix = f"check-{time.monotonic_ns()}"
    worker = Worker(url, prefix, options, env)
    x = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    cpu = MLP()
    cpu.init_model()
    reference = np.asarray(cpu.predict([x])[0])
    try:
        worker.wait(url, prefix, expect["workers"])
        ready_s = time.monotonic() - worker.started
        found = children(ask(url, prefix, x, expect["workers"]), reference, worker.process.pid)
    finally:
        code = worker.stop()
    checks = {
        "children answered": len(found) == expect["workers"],
        "each child's CUDA_VISIBLE_DEVICES (from /proc)": all(
            c["environ_cuda_visible_devices"] == expect["cuda_visible_devices"] for c in found
        ),
        "each child sees exactly 1 device": all(c["device_count"] == 1 for c in found),
        "each child's output tensor on cuda:0": all(c["tensor_device"] == "cuda:0" for c in found),
        "each child is listed by nvidia-smi": all(c["in_nvidia_smi_compute_apps"] for c in found),
        "each child is the supervisor's": all(c["parent_is_supervisor"] for c in found),
        f"answers match the CPU within {TOLERANCE:g}": all(
            c["max_abs_diff_vs_cpu"] <= TOLERANCE for c in found
        ),
        "stopped cleanly (exit 0)": code == 0,
    }
    if "log" in expect:
        checks[f"the log says {expect['log']!r}"] = expect["log"] in worker.log()
    return {
        "case": title,
        "command": " ".join(["worker start", *worker.command[4:]]),
        "env": {k: v for k, v in env.items() if k == "CUDA_VISIBLE_DEVICES"},
        "ready_after_s": round(ready_s, 2),
        "children": found,
        "exit_code": code,
        "checks": checks,
        "log": worker.log(),
    }


def refused_case(index: int, url: str, env: dict[str, str]) -> dict[str, Any]:
    """`worker start --cuda INDEX` for a device that does not exist must fail at once."""
    worker = Worker(url, "refused", ["--cuda", str(index)], env)
    try:
        code = worker.process.wait(60)
    except subprocess.TimeoutExpired:
        code = worker.stop()
    elapsed = time.monotonic() - worker.started
    log = worker.log()
    message = f"CUDA device {index} does not exist"
    return {
        "case": f"--cuda {index} (no such device)",
        "command": " ".join(["worker start", *worker.command[4:]]),
        "exit_code": code,
        "failed_after_s": round(elapsed, 2),
        "checks": {
            "exits non-zero": code != 0,
            "names the missing device and those that exist": message in log,
            "within 30 s (no child started)": elapsed < 30 and "started worker" not in log,
        },
        "log": log,
    }


def transfer_arms(
    device: str, batch_size: int = 64, batches: int = 500, repeats: int = 9
) -> dict[str, Any]:
    """The MLP's direct batched speed on ``device`` with each way of moving its batches:
    ``repeats`` timings of ``batches`` back-to-back ``predict`` calls per arm, interleaved."""
    rng = np.random.default_rng(0)
    batch = [rng.standard_normal(256).astype(np.float32) for _ in range(batch_size)]
    models = {}
    for arm, staged in TRANSFER_ARMS.items():
        model = MLP(device)
        model.init_model()
        model.staging = HostStaging(device, staged=staged)
        model.warmup()
        models[arm] = model
    pageable, pinned = (np.stack(model.predict(batch)) for model in models.values())
    rates: dict[str, list[float]] = {arm: [] for arm in models}
    for _ in range(repeats):
        for arm, model in models.items():
            predict = model.predict
            started = time.perf_counter()
            for _ in range(batches):
                predict(batch)
            rates[arm].append(batches * batch_size / (time.perf_counter() - started))
    arms = {}
    for arm, model in models.items():
        staging = model.staging
        arms[arm] = {
            "staged": staging.staged,
            "pinned": staging.pinned,
            "items_per_s_median": round(float(np.median(rates[arm])), 1),
            "items_per_s": [round(rate, 1) for rate in rates[arm]],
        }
    return {
        "device": device,
        "batch_size": batch_size,
        "batches_per_repeat": batches,
        "repeats": repeats,
        "arms": arms,
        "max_abs_diff": float(np.abs(pageable - pinned).max()),
    }


def print_transfers(result: dict[str, Any]) -> None:
    print(
        f"\n== transfers: the MLP on {result['device']}, direct, batches of "
        f"{result['batch_size']}, median of {result['repeats']} repeats of "
        f"{result['batches_per_repeat']} batches"
    )
    for arm, numbers in result["arms"].items():
        rates = numbers["items_per_s"]
        print(
            f"   {arm:<9} {numbers['items_per_s_median']:>12,.0f} items/s "
            f"(repeats {min(rates):,.0f} .. {max(rates):,.0f}; pinned: {numbers['pinned']})"
        )
    verdict = "ok" if same_outputs(result) else "FAILED"
    print(f"   [{verdict}] {SAME_OUTPUTS}: {result['max_abs_diff']:g}")


def same_outputs(result: dict[str, Any]) -> bool:
    return bool(result["max_abs_diff"] <= TRANSFER_TOLERANCE)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument(
        "--output",
        type=Path,
        help="the JSON report (default: bench/results/gpu_pinning.json; with "
        "--transfers-only, bench/results/gpu_transfers.json)",
    )
    parser.add_argument(
        "--transfers-only",
        action="store_true",
        help="only the pageable vs pinned comparison (no workers started)",
    )
    parser.add_argument("--transfer-batch-size", type=int, default=64)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: pageable vs pinned transfers not measured", flush=True)
        if args.transfers_only:
            return
        raise SystemExit("no CUDA device: the pinning checks need one")
    torch.set_num_threads(1)  # as the harness's direct arms
    if args.transfers_only:
        transfers = transfer_arms("cuda:0", args.transfer_batch_size)
        print_transfers(transfers)
        output = args.output or ROOT / "bench/results/gpu_transfers.json"
        report: dict[str, Any] = {
            "gpus": smi("--query-gpu=index,name,uuid,driver_version,memory.total"),
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "transfers": transfers,
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2, default=str))
        print(f"\nwrote {output}")
        sys.exit(0 if same_outputs(transfers) else 1)
    count = torch.cuda.device_count()
    base = {**os.environ, "PYTHONPATH": python_path(), "OMP_NUM_THREADS": "1"}
    base.pop("CUDA_VISIBLE_DEVICES", None)
    uuids = smi("--query-gpu=uuid")
    cases = []
    with RedisServer() as server:
        for workers in (1, 2):
            title = f"--cuda 0 --workers-per-device {workers}"
            expect = {"workers": workers, "cuda_visible_devices": "0"}
            cases.append(served_case(title, title.split(), base, expect, server.url))
        auto = auto_workers_per_device(0, 1, usable_cores())  # the MLP holds a few MB
        expect = {"workers": auto, "cuda_visible_devices": "0", "log": f"{auto} worker(s) on it"}
        cases.append(served_case("--cuda 0 (auto)", ["--cuda", "0"], base, expect, server.url))
        cases.append(refused_case(count, server.url, base))
        if uuids:
            by_uuid = {**base, "CUDA_VISIBLE_DEVICES": uuids[0]}
            expect = {"workers": 1, "cuda_visible_devices": uuids[0]}
            title = "CUDA_VISIBLE_DEVICES=<UUID> --cuda 0"
            options = ["--cuda", "0", "--workers-per-device", "1"]
            cases.append(served_case(title, options, by_uuid, expect, server.url))
    transfers = transfer_arms("cuda:0", args.transfer_batch_size)
    report = {
        "gpus": smi("--query-gpu=index,name,uuid,driver_version,memory.total"),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device_count": count,
        "cases": cases,
        "transfers": transfers,
    }
    failed = []
    for case in cases:
        print(f"\n== {case['case']}: {case['command']}")
        for child in case.get("children", []):
            print("   child", json.dumps(child))
        for check, ok in case["checks"].items():
            print(f"   [{'ok' if ok else 'FAILED'}] {check}")
            if not ok:
                failed.append(f"{case['case']}: {check}")
        print("   log:\n     " + "\n     ".join(case["log"].strip().splitlines()))
    print_transfers(transfers)
    if not same_outputs(transfers):
        failed.append(f"transfers: {SAME_OUTPUTS}")
    output = args.output or ROOT / "bench/results/gpu_pinning.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {output}; {'FAILED: ' + '; '.join(failed) if failed else 'all checks ok'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
