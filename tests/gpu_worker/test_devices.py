"""Device pinning, checked through what each worker process was given and sees.

The test machines have no GPU, so the device count is faked with MICROBATCH_CUDA_DEVICE_COUNT;
everything else (the children's environment, the check a child makes) is the real code path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from broker import Streamer
from broker.devserver import RedisServer
from gpu_worker.devices import (
    DEVICE_COUNT_ENV,
    DeviceError,
    auto_workers_per_device,
    device_footprint,
    parse_cuda,
    plan_devices,
)
from gpu_worker.polling import usable_cores
from tests.conftest import ROOT, wait_for_line, worker_process
from tests.models import RECORD_ENV, DeviceProbe, SmallProbe


def probes(directory: Path) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for path in directory.glob("device-*.jsonl")
        for line in path.read_text().splitlines()
    ]


def run_pinned(
    redis_url: str, prefix: str, tmp_path: Path, args: list[str], env: dict[str, str], workers: int
) -> list[dict[str, object]]:
    with worker_process(
        redis_url,
        "tests.models:DeviceProbe",
        prefix,
        *args,
        env={RECORD_ENV: str(tmp_path), **env},
        expect_consumers=workers,
        name="probe",
        log_path=tmp_path / "worker.log",
    ):
        pass
    return probes(tmp_path)


def test_one_process_per_listed_device(
    redis_server: RedisServer, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = run_pinned(
        redis_server.url, prefix, tmp_path, ["--cuda", "0,1"], {DEVICE_COUNT_ENV: "2"}, workers=2
    )
    assert sorted(p["cuda_visible_devices"] for p in seen) == ["0", "1"]
    assert {p["device"] for p in seen} == {"cuda:0"}
    assert {p["device_count"] for p in seen} == {1}  # each child sees exactly its one device
    assert len({p["pid"] for p in seen}) == 2
    log = (tmp_path / "worker.log").read_text()
    for p in seen:  # the supervisor's log says where each child is
        assert f"ready (pid {p['pid']}) on cuda:0" in log


def test_workers_per_device(
    redis_server: RedisServer, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = ["--cuda", "1,2", "--workers-per-device", "2"]
    seen = run_pinned(redis_server.url, prefix, tmp_path, args, {DEVICE_COUNT_ENV: "3"}, 4)
    assert sorted(p["cuda_visible_devices"] for p in seen) == ["1", "1", "2", "2"]


def test_indices_are_relative_to_a_preset_cuda_visible_devices(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    env = {DEVICE_COUNT_ENV: "2", "CUDA_VISIBLE_DEVICES": "5,7"}
    seen = run_pinned(redis_server.url, prefix, tmp_path, ["--cuda", "1"], env, workers=1)
    assert [p["cuda_visible_devices"] for p in seen] == ["7"]


def test_cpu_workers_see_no_cuda_device(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    seen = run_pinned(
        redis_server.url, prefix, tmp_path, ["--workers", "2"], {DEVICE_COUNT_ENV: "2"}, workers=2
    )
    assert [p["device"] for p in seen] == ["cpu", "cpu"]
    assert {p["cuda_visible_devices"] for p in seen} == {""}


def run_worker_cli(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpu_worker.cli", "start", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_device_that_does_not_exist_fails_at_start_with_a_clear_message() -> None:
    result = run_worker_cli(
        "--model",
        "examples.mlp:MLP",
        "--cuda",
        "0,2",
        "--redis",
        "redis://127.0.0.1:1/0",
        env={DEVICE_COUNT_ENV: "2"},
    )
    assert result.returncode != 0
    assert "CUDA device 2 does not exist: this process sees 2 device(s) (0, 1)" in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_devices_and_parse_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_COUNT_ENV, "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d")
    assert plan_devices([3, 0], 1) == ["GPU-d", "GPU-a"]
    assert plan_devices([1], 3) == ["GPU-b"] * 3
    assert parse_cuda("0, 1") == [0, 1]
    for bad in ("a", "0,0", "-1", ""):
        with pytest.raises(DeviceError):
            parse_cuda(bad)
    with pytest.raises(DeviceError, match="does not exist"):
        plan_devices([4])


def test_counting_devices_does_not_import_torch_into_the_supervisor() -> None:
    # A fresh interpreter, as a `worker start` supervisor is: the count comes from a
    # short-lived child, and torch (hundreds of MB with CUDA) never loads in this one.
    env = {k: v for k, v in os.environ.items() if k != DEVICE_COUNT_ENV}
    program = (
        "import sys; from gpu_worker.devices import device_count; "
        "print(device_count(), 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    count, torch_loaded = done.stdout.split()
    import torch

    assert int(count) == torch.cuda.device_count()
    assert torch_loaded == "False"


def test_a_device_count_that_fails_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_worker import devices

    monkeypatch.setattr(devices, "COUNT_PROGRAM", "raise SystemExit('driver gone')")
    with pytest.raises(DeviceError, match="could not count CUDA devices: driver gone"):
        devices._count_in_subprocess()
    monkeypatch.setattr(devices, "COUNT_PROGRAM", "print('many')")
    with pytest.raises(DeviceError, match="could not count CUDA devices"):
        devices._count_in_subprocess()
    monkeypatch.setattr(devices, "COUNT_PROGRAM", "import no_such_torch_module_here as torch")
    with pytest.raises(DeviceError):  # an import error other than torch's own is not "0"
        devices._count_in_subprocess()


@contextmanager
def auto_worker(
    redis_url: str, prefix: str, tmp_path: Path, model: str, *args: str
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`worker start --cuda 0` at the default (auto) workers per device, on a faked device:
    the process and the path of its log."""
    log_path = tmp_path / "worker.log"
    with worker_process(
        redis_url, f"tests.models:{model}", prefix, "--cuda", "0", *args,
        env={RECORD_ENV: str(tmp_path), DEVICE_COUNT_ENV: "1"}, expect_consumers=None,
        log_path=log_path,
    ) as process:  # fmt: skip
        yield process, log_path


def run_auto(
    redis_url: str, prefix: str, tmp_path: Path, model: str, expect: int
) -> tuple[list[dict[str, object]], str]:
    """The probes of an :func:`auto_worker`'s children and its log, once all its workers
    were ready."""
    with auto_worker(redis_url, prefix, tmp_path, model) as (process, log_path):
        wait_for_line(log_path, f"all {expect} worker(s) ready", process)
    return probes(tmp_path), log_path.read_text()


@pytest.fixture
def small_model_workers(monkeypatch: pytest.MonkeyPatch) -> int:
    """How many workers auto runs on a device here for a small model (one per core, up to 3),
    with no CUDA_VISIBLE_DEVICES preset."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return auto_workers_per_device(0, 1, usable_cores())


@pytest.fixture
def extra_workers(small_model_workers: int) -> int:
    """small_model_workers, where auto starts extra workers at all (not on one core)."""
    if small_model_workers == 1:
        pytest.skip("one core: auto starts no extra worker")
    return small_model_workers


def test_auto_runs_more_workers_on_a_device_for_a_small_model(
    redis_server: RedisServer, prefix: str, tmp_path: Path, small_model_workers: int
) -> None:
    expect = small_model_workers
    seen, log = run_auto(redis_server.url, prefix, tmp_path, "SmallProbe", expect)
    assert len(seen) == len({p["pid"] for p in seen}) == expect
    assert {p["cuda_visible_devices"] for p in seen} == {"0"}
    assert "--workers-per-device auto: the model holds 0.0 MiB on device 0" in log
    assert f"{expect} worker(s) on it" in log


@pytest.mark.slow  # waits out a worker's start timeout
def test_the_extra_workers_of_auto_have_their_own_start_timeout(
    redis_server: RedisServer, prefix: str, tmp_path: Path, extra_workers: int
) -> None:
    """--start-timeout is each worker's time to load: the extras, started once the first has
    loaded, are not held to what the first left of it (here 6 s, the extras ready 5 s after
    the first, itself ready 1-3 s after its start)."""
    with auto_worker(
        redis_server.url, prefix, tmp_path, "LateExtraProbe", "--start-timeout", "6"
    ) as (process, log_path):
        wait_for_line(log_path, f"all {extra_workers} worker(s) ready", process, timeout=30)


@pytest.mark.slow  # worker processes failing to start
def test_an_extra_worker_of_auto_that_cannot_start_is_left_out(
    redis_server: RedisServer, prefix: str, tmp_path: Path, extra_workers: int
) -> None:
    # auto's choice, not the user's: a second copy that cannot load (out of GPU memory, say)
    # leaves the device with the workers that did, instead of stopping worker start
    with auto_worker(redis_server.url, prefix, tmp_path, "FlakyExtraProbe") as (
        process,
        log_path,
    ):
        wait_for_line(log_path, "all 1 worker(s) ready", process)
        with Streamer("flakyextraprobe", redis_url=redis_server.url, prefix=prefix) as client:
            assert client.predict([1], timeout=10)[0]["device"] == "cuda:0"
        assert process.poll() is None
    log = log_path.read_text()
    assert "an extra worker of --workers-per-device auto, could not start" in log
    assert "RuntimeError: only the first process loads" in log
    assert "device 0 runs 1 worker(s)" in log


def test_a_model_whose_size_cannot_be_taken_fails_to_start_with_the_reason(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    result = run_worker_cli(
        "--model", "tests.models:UnsizableProbe", "--cuda", "0", "--redis", redis_server.url,
        env={RECORD_ENV: str(tmp_path), DEVICE_COUNT_ENV: "1"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "model tests.models:UnsizableProbe failed to start" in result.stderr
    assert "CUDA error: an illegal memory access" in result.stderr


@pytest.mark.slow  # waits out a worker's start timeout
def test_an_extra_worker_of_auto_not_ready_in_time_is_left_out(
    redis_server: RedisServer, prefix: str, tmp_path: Path, extra_workers: int
) -> None:
    with auto_worker(
        redis_server.url, prefix, tmp_path, "StuckExtraProbe", "--start-timeout", "8"
    ) as (process, log_path):
        wait_for_line(log_path, "all 1 worker(s) ready", process, timeout=40)
        assert process.poll() is None
    log = log_path.read_text()
    assert (
        "an extra worker of --workers-per-device auto, could not start: not ready within 8 s" in log
    )


@pytest.mark.parametrize("model", ["LargeProbe", "DeviceProbe"])
def test_auto_runs_one_worker_per_device_for_a_large_or_unknown_model(
    redis_server: RedisServer, prefix: str, tmp_path: Path, model: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen, log = run_auto(redis_server.url, prefix, tmp_path, model, 1)
    assert len(seen) == 1
    held = "2048.0 MiB" if model == "LargeProbe" else "an unknown size"
    assert f"the model holds {held} on device 0" in log
    assert "1 worker(s) on it" in log


def test_auto_workers_per_device_rule() -> None:
    small, large = 200 * 2**20, 2 * 2**30
    assert auto_workers_per_device(small, 1, 16) == 3  # a GPU host: up to 3
    assert auto_workers_per_device(small, 1, 2) == 2  # one per core
    assert auto_workers_per_device(small, 8, 16) == 2  # the cores shared among the devices
    assert auto_workers_per_device(small, 4, 2) == 1
    assert auto_workers_per_device(small, 1, 1.5) == 1  # a CPU quota of 1.5 cores
    assert auto_workers_per_device(2**30, 1, 16) == 3
    assert auto_workers_per_device(large, 1, 16) == 1
    assert auto_workers_per_device(None, 1, 16) == 1  # unknown: one copy of the weights


def test_workers_per_device_takes_auto_or_a_positive_count() -> None:
    for bad, reason in (("0", "must be auto or at least 1"), ("two", "must be auto or a number")):
        result = run_worker_cli("--model", "tests.models:Toy", "--cuda", "0",
                                "--workers-per-device", bad)  # fmt: skip
        assert result.returncode == 2
        assert f"--workers-per-device {reason}" in result.stderr


def test_a_model_that_put_nothing_on_its_gpu_through_torch_is_of_unknown_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every CUDA worker has torch imported; an ONNX Runtime or JAX model never initialises
    torch's CUDA: unknown (one worker), not 0 bytes (three), and no CUDA context made for it."""
    import torch

    synchronized: list[bool] = []
    initialized = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synchronized.append(True))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    model = DeviceProbe(device="cuda:0")
    assert device_footprint(model) is None
    assert not synchronized
    initialized[0] = True  # torch's CUDA in use, yet nothing allocated through it
    assert device_footprint(model) is None
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 3 * 2**20)
    assert device_footprint(model) == 3 * 2**20


def test_auto_starts_no_worker_once_asked_to_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM handled just before the first worker's "ready" is read: the supervisor has
    signalled the workers it had and drains them; one started now would never be told."""
    from gpu_worker import supervisor
    from gpu_worker.config import WorkerConfig

    monkeypatch.setenv(DEVICE_COUNT_ENV, "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(supervisor, "usable_cores", lambda: 16.0)
    workers = supervisor.Supervisor(WorkerConfig(model="tests.models:SmallProbe", cuda=[0]))
    spawned: list[int] = []
    monkeypatch.setattr(workers, "_spawn", lambda slot: spawned.append(slot.index))
    workers.slots[0].ready, workers.slots[0].device_bytes = True, 2**20
    workers.request_stop()
    workers._size_devices()
    workers.heartbeats.close()
    assert spawned == [] and len(workers.slots) == 1


def test_a_model_may_make_its_device_a_torch_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`self.device = torch.device(self.device)` in init_model, a common idiom: the worker
    still reports its model's size (it crashed after loading, on the CPU too)."""
    import torch

    model = SmallProbe(device="cpu")
    model.net = torch.nn.Linear(16, 16)
    model.device = torch.device("cpu")  # type: ignore[assignment]
    assert device_footprint(model) == (16 * 16 + 16) * 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 5 * 2**20)
    model.device = torch.device("cuda:0")  # type: ignore[assignment]
    assert device_footprint(model) == 5 * 2**20


def test_the_restart_backoff_starts_anew_after_a_healthy_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After crashes that raised the backoff, a worker that then served for a while and
    crashed twice in a row waited 30 s for its second restart: the count never reset."""
    from gpu_worker import supervisor
    from gpu_worker.config import WorkerConfig

    workers = supervisor.Supervisor(WorkerConfig(model="tests.models:SmallProbe"))
    workers.all_ready_once = True
    slot = workers.slots[0]

    class Exited:
        returncode = 1

    def crash(after_s: float, ready: bool = True) -> float:
        now = 1000.0
        slot.process = Exited()  # type: ignore[assignment]
        slot.ready, slot.started_at = ready, now - after_s
        workers._reap(slot, now)
        assert slot.restart_at is not None
        return slot.restart_at - now

    try:
        assert [crash(1.0) for _ in range(6)] == list(supervisor.RESTART_BACKOFF_S)
        assert crash(3600.0) == supervisor.RESTART_BACKOFF_S[0]  # after a healthy hour
        assert crash(1.0) == supervisor.RESTART_BACKOFF_S[1]  # not RESTART_BACKOFF_S[-1]
    finally:
        workers.heartbeats.close()
