"""The gateway's processes under gunicorn's signals, with requests in flight: each accepted
request answered, the master's exit status, its workers' log lines.

Real processes: the session's redis-server, a `worker start` of `tests.gateway_models:Doubler`
and `gateway start` (or gunicorn with deploy/gunicorn.conf.py) on a free port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.devserver import RedisServer, free_port
from tests.conftest import (
    ROOT,
    gateway_env,
    stop_process,
    wait_for_healthz,
    wait_until,
    worker_process,
)
from tests.e2e.test_gateway import DOUBLER, gateway_process
from tests.gateway_models import sleep_item


@pytest.fixture
def doubler(redis_server: RedisServer, prefix: str) -> Iterator[str]:
    """A Doubler worker under ``prefix``; yields the Redis URL."""
    with worker_process(redis_server.url, DOUBLER, prefix):
        yield redis_server.url


def post_slow(base: str, seconds: float, results: list[httpx.Response | Exception]) -> None:
    """POST an item the Doubler sleeps ``seconds`` on; its response (or error) appended."""
    try:
        results.append(
            httpx.post(
                f"{base}/v1/models/doubler/predict",
                json={"inputs": [sleep_item(seconds, 1.0)]},
                timeout=30,
            )
        )
    except Exception as exc:
        results.append(exc)


def workers_of(process: subprocess.Popen[bytes]) -> list[int]:
    """The pids of the gunicorn master's worker processes."""
    path = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    return [int(pid) for pid in path.read_text().split()]


@pytest.mark.slow  # a gunicorn master's stop, twice, with requests in flight
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGQUIT])
def test_sigint_and_sigquit_to_the_master_stop_gracefully(
    doubler: str, prefix: str, tmp_path: Path, sig: signal.Signals
) -> None:
    """gunicorn's quick shutdown sends its workers SIGQUIT: they stop accepting, answer what is
    in flight and exit (before, they ignored it, went on accepting connections, and were killed
    at the graceful timeout, mid-request, with "was sent SIGKILL! Perhaps out of memory?")."""
    log = tmp_path / "gateway.log"
    with gateway_process(
        doubler, [DOUBLER], prefix, "--graceful-timeout", "20", workers=2, log_path=log
    ) as (base, process):
        results: list[httpx.Response | Exception] = []
        threads = [threading.Thread(target=post_slow, args=(base, 1.0, results)) for _ in range(2)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        started = time.monotonic()
        process.send_signal(sig)
        assert process.wait(15) == 0
        stopped = time.monotonic() - started
        for thread in threads:
            thread.join()
        assert [getattr(r, "status_code", r) for r in results] == [200, 200]
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(f"{base}/healthz", timeout=2)
    assert stopped < 10  # well before the graceful timeout (20 s)
    text = log.read_text()
    assert "SIGKILL" not in text and "ERROR" not in text, text


def heartbeat_age(worker: int) -> float:
    """Seconds since the gunicorn worker's last heartbeat: the mtime of its temporary file
    (gunicorn's WorkerTmp, unlinked, which the worker touches with time.monotonic())."""
    for fd in Path(f"/proc/{worker}/fd").iterdir():
        if "wgunicorn-" in os.readlink(fd):
            return time.monotonic() - fd.stat().st_mtime
    raise AssertionError("no heartbeat file")


@pytest.mark.slow  # a gunicorn worker's event loop stalled on purpose
def test_a_worker_stalled_for_less_than_the_timeout_is_not_killed(
    doubler: str, prefix: str, tmp_path: Path
) -> None:
    """gunicorn's worker timeout (10 s here) counts from the worker's last heartbeat: a worker
    beats every second, so it survives a stall of 6.5 s whenever it starts (it beat every half
    timeout, 5 s: a stall starting 4.5 s after a beat had it killed, with its requests)."""
    log = tmp_path / "gateway.log"
    env = {"MICROBATCH_GATEWAY_MODEL": DOUBLER, "MICROBATCH_GATEWAY_PREFIX": prefix}
    env["REDIS_URL"] = doubler
    port = free_port()
    command = [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py"]
    command += ["--bind", f"127.0.0.1:{port}", "--workers", "1", "--timeout", "10"]
    with open(log, "ab") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=gateway_env(env), stderr=out)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_healthz(base, process)
        [worker] = workers_of(process)
        age = heartbeat_age(worker)
        while heartbeat_age(worker) >= age:  # until the next beat
            age = heartbeat_age(worker)
            time.sleep(0.05)
        time.sleep(4.5)
        os.kill(worker, signal.SIGSTOP)
        time.sleep(6.5)
        os.kill(worker, signal.SIGCONT)
        response = httpx.post(
            f"{base}/v1/models/doubler/predict", json={"inputs": [[1, 2, 3, 4]]}, timeout=10
        )
        assert response.status_code == 200, log.read_text()
        assert workers_of(process) == [worker], log.read_text()
    finally:
        stop_process(process)
    assert "WORKER TIMEOUT" not in log.read_text()


def pid_gone(pid: int) -> bool:
    """Whether a process has exited (a zombie counts: it no longer serves)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def kill_master_during_a_slow_request(
    base: str, master: subprocess.Popen[bytes], seconds: float
) -> list[httpx.Response | Exception]:
    """SIGKILL the gunicorn master half a second into a request its model takes ``seconds``
    on; that request's response (or error), once it ends."""
    results: list[httpx.Response | Exception] = []
    thread = threading.Thread(target=post_slow, args=(base, seconds, results))
    thread.start()
    time.sleep(0.5)
    master.kill()
    master.wait()
    thread.join()
    return results


@pytest.mark.slow  # kill -9 of a gunicorn master, then its graceful timeout
def test_a_killed_master_s_worker_drops_what_outlasts_the_graceful_timeout(
    doubler: str, prefix: str, tmp_path: Path
) -> None:
    """Past --graceful-timeout, a worker whose master was killed dropped its requests in flight
    as the master's SIGKILL would have: uvicorn's forced exit cancelled them instead, answering
    each with a 500 and logging two tracebacks as errors."""
    log = tmp_path / "gateway.log"
    with gateway_process(
        doubler, [DOUBLER], prefix, "--graceful-timeout", "1", workers=1, log_path=log
    ) as (base, process):
        [worker] = workers_of(process)
        results = kill_master_during_a_slow_request(base, process, 8.0)
        wait_until(lambda: pid_gone(worker), 30, "the worker's exit")
    [dropped] = results
    assert isinstance(dropped, httpx.RemoteProtocolError), dropped  # no response, not a 500
    text = log.read_text()
    assert "dropping the connections still open" in text and "ERROR" not in text, text


@pytest.mark.slow  # kill -9 of a gunicorn master
def test_workers_of_a_killed_master_stop_and_free_the_port(
    doubler: str, prefix: str, tmp_path: Path
) -> None:
    """A master killed with SIGKILL cannot stop its workers: each notices its parent is gone,
    answers what is in flight and exits, so a gateway started in its place can bind the port
    (before, they served on, orphaned, and the new gateway exited with "Can't connect")."""
    log = tmp_path / "gateway.log"
    with gateway_process(doubler, [DOUBLER], prefix, workers=2, log_path=log) as (base, process):
        workers = workers_of(process)
        results = kill_master_during_a_slow_request(base, process, 2.0)
        try:
            wait_until(lambda: all(pid_gone(pid) for pid in workers), 30, "the workers' exit")
        finally:
            for pid in workers:
                if not pid_gone(pid):
                    os.kill(pid, signal.SIGKILL)
    assert [getattr(r, "status_code", r) for r in results] == [200]
    assert "the gunicorn master (pid" in log.read_text()
    port = int(base.rsplit(":", 1)[1])
    with gateway_process(doubler, [DOUBLER], prefix, port=port) as (_, again):
        response = httpx.post(
            f"{base}/v1/models/doubler/predict", json={"inputs": [[1, 2, 3, 4]]}, timeout=10
        )
        assert response.json() == {"outputs": [[2.0, 4.0, 6.0, 8.0]]}
        assert again.poll() is None


@pytest.mark.slow  # two worker process replacements
def test_a_worker_at_max_requests_is_replaced_and_every_request_answered(
    doubler: str, prefix: str
) -> None:
    """`--max-requests 4`: gunicorn replaces the worker process after its 4th request (as after
    SIGTERM, its in-flight requests finish first, and a connection it accepted just before is
    served too); requests sent meanwhile wait in the listen queue and are answered by the new
    one. Requests go one after another, each on a new connection, until two replacements."""
    with gateway_process(doubler, [DOUBLER], prefix, "--max-requests", "4", workers=1) as (
        base,
        process,
    ):
        seen: set[int] = set(workers_of(process))
        for n in range(40):
            response = httpx.post(
                f"{base}/v1/models/doubler/predict", json={"inputs": [[float(n)] * 4]}, timeout=30
            )
            assert response.status_code == 200, response.text
            assert response.json()["outputs"] == [[2.0 * n] * 4]
            seen.update(workers_of(process))
            if len(seen) >= 3 and n >= 12:
                break
        assert len(seen) >= 3  # the first worker process and two that replaced it
