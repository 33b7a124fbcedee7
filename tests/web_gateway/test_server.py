"""The gateway's two ways into gunicorn: `gateway start` (gunicorn's application API, no file
or repository path needed, so any working directory does) and `gunicorn -c
deploy/gunicorn.conf.py` (settings from the environment, REDIS_URL included)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from broker.devserver import RedisServer, free_port
from tests.conftest import ROOT, gateway_env, stop_process, wait_for_healthz

DOUBLER = "tests.gateway_models:Doubler"


@contextmanager
def serving(command: list[str], cwd: Path, env: dict[str, str], port: int) -> Iterator[str]:
    """Run a gateway command until its /healthz answers; yield its base URL; SIGTERM it."""
    process = subprocess.Popen(command, cwd=cwd, env=gateway_env(env))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_healthz(base, process)
        yield base
    finally:
        stop_process(process)
    assert process.returncode == 0


def check_serving(base: str) -> None:
    """Redis reached (ready), the model served (a bad input refused before queueing)."""
    assert httpx.get(f"{base}/v2/health/ready").json() == {"ready": True}
    refused = httpx.post(f"{base}/v1/models/doubler/predict", json={"inputs": [[1, 2]]})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["message"] == (
        "item 0: input 'input' has shape [2], the model takes [4]"
    )


def test_gateway_start_runs_from_any_directory(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "web_gateway.cli", "start", "--model", DOUBLER]
    command += ["--port", str(port), "--prefix", prefix]
    with serving(command, tmp_path, {"REDIS_URL": redis_server.url}, port) as base:
        check_serving(base)


def test_gunicorn_with_the_deploy_config_reads_the_environment(
    redis_server: RedisServer, prefix: str
) -> None:
    port = free_port()
    env = {
        "MICROBATCH_GATEWAY_MODEL": DOUBLER,
        "MICROBATCH_GATEWAY_PREFIX": prefix,
        "MICROBATCH_GATEWAY_PORT": str(port),
        "REDIS_URL": redis_server.url,
    }
    command = [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py"]
    with serving(command, ROOT, env, port) as base:
        check_serving(base)


def test_gateway_start_listens_on_an_ipv6_address(redis_server: RedisServer, prefix: str) -> None:
    """--host ::1 ended at once: gunicorn read '::1:PORT' as host ':' and port ''."""
    port = free_port()
    command = [sys.executable, "-m", "web_gateway.cli", "start", "--model", DOUBLER]
    command += ["--host", "::1", "--port", str(port), "--prefix", prefix]
    process = subprocess.Popen(command, cwd=ROOT, env=gateway_env({"REDIS_URL": redis_server.url}))
    try:
        wait_for_healthz(f"http://[::1]:{port}", process)
    finally:
        stop_process(process)
    assert process.returncode == 0


def test_an_empty_host_is_refused_not_every_address() -> None:
    """--host '' listened on every address, the opposite of the loopback default."""
    command = [sys.executable, "-m", "web_gateway.cli", "start", "--model", DOUBLER]
    env = gateway_env({"REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})
    for host in ("", " "):
        args = ["--host", host, "--port", str(free_port())]
        refused = subprocess.run(
            [*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2
        assert refused.stderr.strip() == (
            f"Error: --host must be an address or a host name, not {host!r}"
        )


@pytest.mark.parametrize("seconds", [0.0, 0.9, 2.5, 30.0])
def test_gunicorn_gives_in_flight_requests_at_least_the_graceful_timeout(seconds: float) -> None:
    """gunicorn takes whole seconds: --graceful-timeout 0.9 became 0, and SIGTERM dropped a
    request 0.5 s from its answer (the client saw the connection closed without one)."""
    from web_gateway.server import gunicorn_options
    from web_gateway.settings import GatewaySettings

    given = gunicorn_options(GatewaySettings(graceful_timeout=seconds))["graceful_timeout"]
    assert isinstance(given, int) and seconds <= given < seconds + 1


def test_the_address_check_lets_sockets_handed_down_be(monkeypatch: pytest.MonkeyPatch) -> None:
    """A USR2 upgrade's new master (GUNICORN_FD) or systemd's sockets (LISTEN_FDS) listen on
    a port that is in use by design: the check that refuses a port in use must let them be."""
    import socket

    from web_gateway.server import check_address

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--port {port}: "):
            check_address("127.0.0.1", port)
        for variable in ("GUNICORN_FD", "LISTEN_FDS"):
            with monkeypatch.context() as env:
                env.setenv(variable, "3")
                check_address("127.0.0.1", port)


def test_max_requests_and_its_jitter_reach_gunicorn() -> None:
    from web_gateway.server import gunicorn_options
    from web_gateway.settings import GatewaySettings

    options = gunicorn_options(GatewaySettings(max_requests=1000, max_requests_jitter=50))
    assert (options["max_requests"], options["max_requests_jitter"]) == (1000, 50)
    assert gunicorn_options(GatewaySettings())["max_requests"] == 0  # never, by default
