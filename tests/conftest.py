"""Fixtures: a real redis-server on a free port, and real `worker start` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from broker import liveness
from broker.connections import sync_client
from broker.devserver import RedisServer
from broker.keys import ModelKeys

ROOT = Path(__file__).resolve().parent.parent


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
