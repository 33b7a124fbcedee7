"""The console scripts of pyproject.toml: a Ctrl-C at any moment ends them quietly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT

# Each blocks once started: its Redis (a socket that accepts and never answers) says nothing.
ARGS = {
    "broker": ["status", "--watch"],
    "worker": ["start", "--model", "tests.models:Toy"],
    "gateway": ["start", "--model", "tests.models:Toy", "--port", "0"],
}


def scripts() -> dict[str, str]:
    """pyproject.toml's console scripts: name -> "module:function"."""
    import tomllib  # (Python 3.11)

    found: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "scripts"
    ]
    return found


@pytest.fixture(scope="module")
def silent_redis() -> Iterator[str]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"


def run_script(name: str, redis_url: str, delay_s: float) -> subprocess.CompletedProcess[str]:
    """Run script ``name`` as its console script does (import its entry point, call it) and
    send it SIGINT ``delay_s`` after its entry point is called, as a Ctrl-C at a terminal
    would. (Before that, the interpreter starts and imports the entry point's module: a Ctrl-C
    there is Python's own; timed from the process's start, a loaded machine's slower start
    made the signal land there.)"""
    module, function = scripts()[name].split(":")
    called = "sys.stdout.write('called\\n'); sys.stdout.flush()"
    code = f"import sys; from {module} import {function}; {called}; sys.exit({function}())"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REDIS_URL": redis_url}
    process = subprocess.Popen(
        [sys.executable, "-c", code, *ARGS[name]],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as at a terminal, even where pytest runs with SIGINT ignored (a background job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stdout is not None and process.stdout.readline() == "called\n"
    time.sleep(delay_s)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_a_ctrl_c_while_a_script_starts_exits_130_without_a_traceback(
    name: str, silent_redis: str
) -> None:
    """Each script takes a few tenths of a second to import its command; a Ctrl-C then printed
    the traceback of whatever import it stopped."""
    assert set(ARGS) == set(scripts())
    for delay_s in (0.0, 0.05, 0.1, 0.2):  # (its command takes 0.3 s or more to import)
        ended = run_script(name, silent_redis, delay_s)
        said = f"{name} interrupted after {delay_s} s: {ended.returncode}\n{ended.stderr}"
        # 130, or killed by the signal before Python could handle it (quiet too)
        assert ended.returncode in (130, -signal.SIGINT), said
        assert "Traceback" not in ended.stderr and "KeyboardInterrupt" not in ended.stderr, said
        assert len(ended.stderr.strip().splitlines()) <= 1, said
