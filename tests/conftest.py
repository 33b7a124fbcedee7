"""Fixtures: a real redis-server on a free port, and real `worker start` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker import liveness
from broker.connections import sync_client
from broker.devserver import RedisServer
from broker.keys import ModelKeys

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread for the test, as at a terminal, even
    where pytest was started with SIGINT ignored (a background job of a non-interactive shell
    inherits it so, and Python then installs no handler of its own)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server for the session (tests isolate themselves by prefix)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def prefix() -> str:
    """A prefix no other test uses."""
    return f"t{uuid.uuid4().hex[:10]}"


def wait_for_consumers(url: str, keys: ModelKeys, count: int, timeout: float = 60.0) -> None:
    """Wait until ``count`` live workers are vouched for by their supervisor."""
    client = sync_client(url)  # any URL microbatch takes, a Sentinel one too
    try:
        liveness.wait_for_consumers(client, keys, count, timeout)
    finally:
        client.close()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``check`` until it is true; return how long that took."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - started


def stop_process(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM a process we started; SIGKILL it if it is not gone within ``grace`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def worker_process(
    redis_url: str,
    model: str,
    prefix: str,
    *args: str,
    env: dict[str, str] | None = None,
    expect_consumers: int | None = 1,
    name: str | None = None,
    log_path: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `worker start` as a real process; stop it with SIGTERM afterwards.

    With ``log_path``, its log (stderr) goes to that file.
    """
    command = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", model]
    command += ["--redis", redis_url, "--prefix", prefix, *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
    process = subprocess.Popen(command, cwd=ROOT, env=full_env, stderr=log)
    try:
        if expect_consumers:
            model_name = name or model.rsplit(":", 1)[1].lower()
            wait_for_consumers(redis_url, ModelKeys(model_name, prefix), expect_consumers)
        yield process
    finally:
        stop_process(process)
        if log is not None:
            log.close()


def wait_for_line(path: Path, text: str, proc: Any, timeout: float = 60.0) -> None:
    """Wait until ``text`` is in the log at ``path``; fail if ``proc`` exits or time is up."""
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert proc.poll() is None, path.read_text()
        assert time.monotonic() < deadline, f"{text!r} never appeared in the worker's log"
        time.sleep(0.05)


def gateway_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a gateway a test starts: nothing of the test process's own gateway
    settings or metrics directory, the checkout on PYTHONPATH, warnings only; then ``extra``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MICROBATCH_GATEWAY_")}
    clean.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return {**clean, "PYTHONPATH": str(ROOT), "MICROBATCH_GATEWAY_LOG_LEVEL": "warning",
            **(extra or {})}  # fmt: skip


def wait_for_healthz(base: str, process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Wait until the gateway at ``base`` answers /healthz; RuntimeError if ``process`` exits
    or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gateway did not start (exit code {process.poll()})")
        time.sleep(0.1)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in the checkout (on its PYTHONPATH too), as a
    process of the product would import it; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
