"""`worker start` fails with one clear line for bad input, and drains on SIGTERM."""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from broker import Streamer, acl, functions
from broker.devserver import RedisServer, free_port
from broker.keys import ModelKeys
from gpu_worker.config import WorkerConfig
from tests.conftest import wait_for_consumers, wait_for_line, worker_process
from tests.gpu_worker.test_devices import run_worker_cli


def test_a_bad_model_path_gives_one_line() -> None:
    result = run_worker_cli("--model", "examples.nope:Missing")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "Error: cannot import module 'examples.nope': No module named 'examples.nope'"
    ]
    result = run_worker_cli("--model", "examples.mlp")
    assert "must look like 'package.module:ClassName'" in result.stderr
    # a package not found at all: where it was looked for, and what to do
    result = run_worker_cli("--model", "elsewhere.models:Model", "--app-dir", "/tmp")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "Error: cannot import module 'elsewhere.models': No module named 'elsewhere' (neither "
        "installed nor in /tmp: run from the directory that holds it, or name that directory "
        "with --app-dir)"
    ]
    result = run_worker_cli("--model", "broker.client:Streamer")
    assert "is not a ManagedModel subclass" in result.stderr


def test_a_model_module_that_raises_on_import_gives_one_line(tmp_path: Path) -> None:
    """The module's error and the line of it that raised, not a traceback and exit 1."""
    (tmp_path / "typo_model.py").write_text("from gpu_worker import ManagedModel\nclass A(\n")
    (tmp_path / "zero_model.py").write_text(
        "from gpu_worker import ManagedModel\n\nclass Zero(ManagedModel):\n    batch_size = 0\n"
    )
    result = run_worker_cli("--model", "typo_model:A", "--app-dir", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("Error: cannot import module 'typo_model': SyntaxError: ")
    assert "Traceback" not in result.stderr
    result = run_worker_cli("--model", "zero_model:Zero", "--app-dir", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "Error: cannot import module 'zero_model': ValueError: Zero.batch_size must be a "
        f"positive int, not 0 (at {tmp_path / 'zero_model.py'}:3)"
    ]


def test_an_init_model_that_raises_stops_the_worker_with_its_reason(
    redis_server: RedisServer, prefix: str
) -> None:
    result = run_worker_cli(
        "--model", "tests.models:BrokenInit", "--redis", redis_server.url, "--prefix", prefix
    )
    assert result.returncode == 1
    assert "RuntimeError: weights file missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_help_gives_the_exit_statuses_of_a_bad_model_and_a_failing_init() -> None:
    help_text = " ".join(run_worker_cli("--help").stdout.split())
    assert "1 when the workers cannot start (the model's init_model raised" in help_text
    assert "2 for a bad option, a --model that cannot be imported" in help_text


def test_options_read_their_environment_variables(redis_server: RedisServer, prefix: str) -> None:
    env = {"MICROBATCH_WORKER_BATCH_SIZE": "0", "REDIS_URL": redis_server.url}
    result = run_worker_cli("--model", "tests.models:Toy", env=env)
    assert result.returncode == 2 and "batch-size" in result.stderr.lower()


def test_a_bad_value_from_a_variable_is_one_line_naming_the_variable() -> None:
    """MICROBATCH_WORKER_BATCH_SIZE=abc (from an environment file, say) was refused with
    click's usage lines and "Invalid value for '--batch-size'", an option nobody gave."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {"MICROBATCH_WORKER_BATCH_SIZE": "abc", "MICROBATCH_WORKER_REDIS_WAIT": "0"}
    result = run_worker_cli("--model", "tests.models:Toy", "--redis", url, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "Error: Invalid value for '--batch-size' (from MICROBATCH_WORKER_BATCH_SIZE): "
        "Input should be a valid integer, unable to parse string as an integer"
    )
    result = run_worker_cli("--model", "tests.models:Toy", "--redis", url, "--workers", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "Error: Invalid value for '--workers': Input should be greater than or equal to 1"
    )


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_drains_and_exits_zero(
    redis_server: RedisServer, prefix: str, stop: signal.Signals
) -> None:
    """SIGHUP (a closed terminal, `systemctl reload`) killed `worker start` alone, at once,
    and its workers served on without it."""
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--batch-size", "4") as proc:
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        streamer.predict(["warm"])
        future = streamer.submit([{"sleep": 1.0}, "a", "b"])
        time.sleep(0.3)  # the worker is inside the slow batch when the signal arrives
        proc.send_signal(stop)
        outputs = future.result(timeout=20)
        assert [out["item"] for out in outputs] == [{"sleep": 1.0}, "a", "b"]
        assert {out["batch"] for out in outputs} == {3}
        assert proc.wait(30) == 0
        streamer.close()


def test_a_worker_whose_supervisor_was_killed_stops_after_its_batch(
    redis_server: RedisServer, prefix: str
) -> None:
    """With `worker start` killed (SIGKILL), its worker process was re-parented and served on,
    unwatched and without heartbeats, with the model's old code after a redeploy."""
    import subprocess

    with worker_process(redis_server.url, "tests.models:Toy", prefix) as proc:
        found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        (child,) = [int(pid) for pid in found.stdout.split()]
        with Streamer("toy", redis_url=redis_server.url, prefix=prefix) as streamer:
            future = streamer.submit([{"sleep": 1.5}])
            time.sleep(0.5)  # inside the batch
            proc.kill()
            assert [out["item"] for out in future.result(timeout=20)] == [{"sleep": 1.5}]
        deadline = time.monotonic() + 20
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(child), "the worker process outlived its supervisor"


def running(pid: int) -> bool:
    """Whether a process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_model_returning_the_wrong_number_of_outputs_gets_a_clear_error() -> None:
    import pytest

    from broker import InvalidOutput
    from gpu_worker import LocalStreamer
    from tests.models import WrongCount

    with LocalStreamer(WrongCount) as streamer, pytest.raises(InvalidOutput) as caught:
        streamer.predict([1, 2, 3])
    assert "2 outputs for a batch of 3" in str(caught.value)


def test_model_thread_chooses_where_predict_runs(redis_server: RedisServer, prefix: str) -> None:
    for mode, thread in (("on", "microbatch-model_0"), ("off", "MainThread")):
        model, name = "tests.models:WhichThread", f"which-{mode}"
        args = ("--model-thread", mode, "--name", name)
        with worker_process(redis_server.url, model, prefix, *args, name=name) as proc:
            streamer = Streamer(name, redis_url=redis_server.url, prefix=prefix)
            assert streamer.predict(["a", "b"]) == [thread, thread]
            streamer.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0


def test_an_unknown_model_thread_mode_gives_one_line() -> None:
    result = run_worker_cli("--model", "tests.models:Toy", "--model-thread", "yes")
    assert result.returncode == 2
    assert result.stderr.strip() == "Error: --model-thread must be one of auto, on, off"


def test_a_second_model_is_refused_not_ignored() -> None:
    """`worker start --model A --model B` served B alone, without a word of A."""
    result = run_worker_cli("--model", "tests.models:Toy", "--model", "tests.models:Echo")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "Error: --model was given 2 times (tests.models:Toy, tests.models:Echo): a worker "
        "start serves one model; run one per model (a gateway serves several)"
    )


def test_a_kubernetes_service_link_named_like_a_setting_is_ignored() -> None:
    """A Service named microbatch-worker-metrics gives every pod
    MICROBATCH_WORKER_METRICS_PORT=tcp://..., which --metrics-port read and refused."""
    env = {"MICROBATCH_WORKER_METRICS_PORT": "tcp://10.96.0.9:9100"}
    result = run_worker_cli("--model", "no_such_module:Model", env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == (
        "Warning: MICROBATCH_WORKER_METRICS_PORT holds a Kubernetes service link's address "
        "(of a Service named microbatch-worker-metrics), not a setting: ignored"
    )
    assert "no_such_module" in lines[-1], lines


def test_a_busy_polling_worker_serves_and_says_so(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    log_path = tmp_path / "worker.log"
    args = ("--busy-poll-us", "2000", "--batch-size", "4")
    with worker_process(redis_server.url, "tests.models:Toy", prefix, *args, log_path=log_path):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        for round_ in range(20):  # one at a time: each read after a batch polls first
            items = [f"{round_}-{i}" for i in range(1 + round_ % 5)]
            assert [out["item"] for out in streamer.predict(items)] == items
        streamer.close()
    assert "busy_poll=2000us" in log_path.read_text()


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", "--busy-poll-us must be auto or between 0 and 100000"),
        ("100001", "--busy-poll-us must be auto or between 0 and 100000"),
        ("soon", "--busy-poll-us must be auto or a number of microseconds, not 'soon'"),
    ],
)
def test_a_bad_busy_poll_gives_one_line(value: str, message: str) -> None:
    result = run_worker_cli("--model", "tests.models:Toy", "--busy-poll-us", value)
    assert result.returncode == 2
    assert result.stderr.strip() == f"Error: {message}"


def test_busy_polling_is_automatic_by_default(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    log_path = tmp_path / "worker.log"
    with worker_process(redis_server.url, "tests.models:Toy", prefix, log_path=log_path):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        assert [out["item"] for out in streamer.predict(["a", "b"])] == ["a", "b"]
        streamer.close()
    assert "busy_poll=auto" in log_path.read_text()


# -- Redis at start-up, and after ------------------------------------------------------------------
def test_redis_unreachable_at_start_exits_2_after_redis_wait() -> None:
    port = free_port()
    url = f"redis://worker:s3cret@127.0.0.1:{port}/0"
    env = {"MICROBATCH_WORKER_REDIS_WAIT": "2"}
    started = time.monotonic()
    result = run_worker_cli("--model", "tests.models:Toy", "--redis", url, env=env)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 2 + 30  # the wait is bounded (generously: shared CPUs)
    lines = result.stderr.strip().splitlines()
    assert len([line for line in lines if "waiting for Redis" in line]) == 1  # one per 10 s
    assert lines[-1].startswith(
        f"Error: Redis at redis://worker:***@127.0.0.1:{port}/0 "
        "did not answer within 2 s (--redis-wait)"
    )
    assert "ready" not in result.stderr and "serving" not in result.stderr
    assert "s3cret" not in result.stderr


def test_a_command_refused_to_the_workers_user_stops_them_in_one_line(
    redis_server: RedisServer, prefix: str
) -> None:
    """A NOPERM is the ACL's doing, not an outage: each restarted worker met it again, with a
    traceback, without end."""
    admin = redis_server.client()
    admin.execute_command(*functions.LOAD_COMMAND)  # the operator's job
    lines, _ = acl.render([prefix], password_env="PW_{ROLE}", environ={"PW_WORKER": "s3cret"})
    line = next(line for line in lines if line.startswith(f"user {prefix}-worker "))
    rules = re.findall(r"\([^)]*\)|\S+", line)[1:]  # a selector in parentheses is one rule
    admin.execute_command("ACL", "SETUSER", *rules, "-xreadgroup")
    url = f"redis://{prefix}-worker:s3cret@127.0.0.1:{redis_server.port}/0"
    try:
        result = run_worker_cli(
            "--model", "tests.models:Toy", "--redis", url, "--prefix", prefix, "--workers", "2"
        )
    finally:
        admin.acl_deluser(f"{prefix}-worker")
        admin.close()
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: Redis refused a command to the worker's user: this user has no permissions to "
        "run the 'xreadgroup' command (give the user what `broker acl` grants <prefix>-worker: "
        "docs/deployment.md, ACL users)"
    )
    assert "Traceback" not in result.stderr and "restarting" not in result.stderr
    assert "s3cret" not in result.stderr


def test_waiting_for_redis_says_so_every_10_s(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    from gpu_worker import supervisor

    monkeypatch.setattr(supervisor, "REDIS_WAIT_LOG_EVERY_S", 1.0)  # 10 s, scaled down
    config = WorkerConfig(
        model="tests.models:Toy", redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_wait=2.5
    )
    with (
        caplog.at_level(logging.INFO, "microbatch.supervisor"),
        pytest.raises(supervisor.RedisUnreachable, match=r"within 2\.5 s"),
    ):
        supervisor.Supervisor(config).run()
    waiting = [r.getMessage() for r in caplog.records if "waiting for Redis" in r.getMessage()]
    assert len(waiting) == 3  # at 0, 1 and 2 s
    assert "giving up in 2 s" in waiting[1] or "giving up in 1 s" in waiting[1]


def test_a_stop_while_waiting_for_redis_says_no_worker_started(caplog: Any) -> None:
    from gpu_worker import supervisor

    config = WorkerConfig(
        model="tests.models:Toy", redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_wait=60
    )
    waiting = supervisor.Supervisor(config)
    threading.Timer(0.5, waiting.request_stop).start()
    with caplog.at_level(logging.INFO, "microbatch.supervisor"):
        assert waiting.run() == 0
    said = [record.getMessage() for record in caplog.records]
    assert "stopping before any worker started" in said
    assert not any(message.startswith("stopping 1 worker") for message in said)


@pytest.mark.slow
def test_a_worker_waits_for_redis_then_rides_out_its_outages(tmp_path: Path, prefix: str) -> None:
    server = RedisServer()
    log_path = tmp_path / "worker.log"
    keys = ModelKeys("toy", prefix)
    args = ("--redis-wait", "60", "--heartbeat-ttl", "1")
    try:
        with worker_process(
            server.url, "tests.models:Toy", prefix, *args, expect_consumers=None, log_path=log_path
        ) as proc:
            wait_for_line(log_path, "waiting for Redis", proc)
            server.start()  # Redis comes up during the wait: the worker starts serving
            wait_for_consumers(server.url, keys, 1)
            with Streamer("toy", redis_url=server.url, prefix=prefix) as streamer:
                assert streamer.predict(["before"])[0]["item"] == "before"
            log = log_path.read_text()
            assert log.index("waiting for Redis") < log.index("answers") < log.index("ready")

            server.kill()  # an outage longer than --redis-wait does not stop a worker that served
            wait_for_line(log_path, "broker unavailable", proc)
            time.sleep(3)
            assert proc.poll() is None
            server.start()
            wait_for_consumers(server.url, keys, 1)
            with Streamer("toy", redis_url=server.url, prefix=prefix) as streamer:
                assert streamer.predict(["after"])[0]["item"] == "after"
            assert proc.poll() is None
        assert proc.returncode == 0
    finally:
        server.stop()
    log = log_path.read_text()
    # outage messages: a line when it starts, then one every 10 s at most (not one per retry)
    assert log.count("broker unavailable") == 1
    assert log.count("cannot renew heartbeats") == 1


def test_workers_store_the_queue_bound_with_the_model(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    from broker.keys import ModelKeys

    client, keys = redis_server.client(), ModelKeys("toy", prefix)
    log_path = tmp_path / "worker.log"
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--batch-size", "4",
                        log_path=log_path):  # fmt: skip
        # auto: 8 batches per live worker, 256 MiB in all
        assert client.hgetall(keys.queue_bound) == {b"items": b"32", b"bytes": b"268435456"}
    assert "queue bound of toy: 32 items per live worker, 268435456 bytes in all" in (
        log_path.read_text()
    )
    env = {"MICROBATCH_WORKER_MAX_QUEUE_ITEMS": "5"}
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--max-queue-bytes", "0",
                        env=env):  # fmt: skip
        deadline = time.monotonic() + 5
        while client.hget(keys.queue_bound, "items") != b"5" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.hgetall(keys.queue_bound) == {b"items": b"5", b"bytes": b"0"}


@pytest.mark.parametrize("value", ["-1", "lots"])
def test_a_bad_queue_bound_gives_one_line(value: str) -> None:
    result = run_worker_cli("--model", "tests.models:Toy", "--max-queue-items", value)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("Error: --max-queue-items must be auto")


@pytest.mark.parametrize(
    "option, value, least",
    [
        ("--heartbeat-ttl", "nan", "more than 0"),
        ("--heartbeat-ttl", "inf", "more than 0"),
        ("--batch-timeout", "1e308", "more than 0"),
        ("--start-timeout", "0", "more than 0"),
        ("--start-timeout", "-1", "more than 0"),
        ("--graceful-timeout", "nan", "0 or more"),
        ("--redis-wait", "inf", "0 or more"),
        ("--max-latency", "inf", "0 or more"),
    ],
)
def test_a_duration_that_is_not_a_finite_number_of_seconds_gives_one_line(
    option: str, value: str, least: str
) -> None:
    """NaN and inf turned watchdogs and deadlines off in silence, or ended in a traceback."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run_worker_cli("--model", "tests.models:Toy", "--redis", url, option, value)
    assert result.returncode == 2, result.stderr
    shown = repr(float(value))
    assert result.stderr.strip() == (
        f"Error: {option} must be {least} seconds and at most 31536000 (a year), not {shown}"
    )


@pytest.mark.parametrize("port", ["0", "-1", "70000"])
def test_a_metrics_port_out_of_range_gives_one_line(port: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run_worker_cli("--model", "tests.models:Toy", "--redis", url, "--metrics-port", port)
    assert result.returncode == 2
    assert result.stderr.strip() == "Error: --metrics-port must be between 1 and 65535"


def test_a_metrics_port_in_use_gives_one_line(redis_server: RedisServer, prefix: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_worker_cli(
            "--model", "tests.models:Toy", "--redis", redis_server.url, "--prefix", prefix,
            "--metrics-port", str(port),
        )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: --metrics-port {port}: Address already in use"
    )
    assert "Traceback" not in result.stderr


def listening_address(port: int) -> str:
    """The IPv4 address a socket of this machine listens on ``port`` at (from /proc)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # LISTEN
            return ".".join(str(b) for b in reversed(bytes.fromhex(address)))
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_the_metrics_port_listens_on_metrics_host(
    redis_server: RedisServer, prefix: str, tmp_path: Path, host: str | None
) -> None:
    """The metrics port listened on every interface, with no way to keep it to loopback (a
    host-network pod, a machine shared with others): --metrics-host chooses."""
    port = free_port()
    given = ("--metrics-host", host) if host else ()
    log = tmp_path / "worker.log"
    with worker_process(
        redis_server.url, "tests.models:Toy", prefix, "--metrics-port", str(port), *given,
        log_path=log,
    ) as worker:  # fmt: skip
        wait_for_line(log, "metrics on http://", worker)
        bound = listening_address(port)
    expected = host or "0.0.0.0"
    assert bound == expected
    assert f"metrics on http://{expected}:{port}/metrics" in log.read_text()


@pytest.mark.parametrize(
    "variable, hint",
    [
        ("MICROBATCH_WORKER_BATCHSIZE", " (did you mean MICROBATCH_WORKER_BATCH_SIZE?)"),
        ("MICROBATCH_WORKER_REDIS_URL", " (--redis reads REDIS_URL)"),
        ("MICROBATCH_WORKER_NOTHING_LIKE_IT", ""),
    ],
)
def test_a_misspelt_variable_of_the_prefix_is_one_warning_line(variable: str, hint: str) -> None:
    """It was ignored in silence: the worker ran with the default the operator meant to change.
    A warning, not an error (other programs' variables may share the prefix)."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {variable: "4", "MICROBATCH_WORKER_REDIS_WAIT": "0"}
    result = run_worker_cli("--model", "tests.models:Toy", "--redis", url, env=env)
    assert result.returncode == 2  # past the settings: Redis did not answer
    first, *rest = result.stderr.strip().splitlines()
    assert first == f"Warning: {variable} is not a setting of `worker start`: ignored{hint}"
    assert "did not answer within 0 s (--redis-wait)" in rest[-1]


def test_the_compose_files_and_kubernetes_own_variables_of_the_prefix_are_no_typos() -> None:
    """.env.example's MICROBATCH_WORKER_CPU_WORKERS and the like, exported to a shell, and the
    service links Kubernetes gives every pod (a Service named microbatch-worker-metrics)."""
    env = {"MICROBATCH_WORKER_CPU_WORKERS": "2", "MICROBATCH_WORKER_IMAGE": "w:latest",
           "MICROBATCH_WORKER_REDIS_WAIT": "0", "MICROBATCH_WORKER_MAX_LATENCY": "",
           "MICROBATCH_WORKER_METRICS_SERVICE_HOST": "10.96.0.9",
           "MICROBATCH_WORKER_METRICS_SERVICE_PORT": "9100",
           "MICROBATCH_WORKER_METRICS_SERVICE_PORT_METRICS": "9100",
           "MICROBATCH_WORKER_METRICS_PORT_9100_TCP": "tcp://10.96.0.9:9100",
           "MICROBATCH_WORKER_METRICS_PORT_9100_TCP_ADDR": "10.96.0.9",
           "MICROBATCH_WORKER_SIDECAR_PORT": "tcp://10.96.0.7:80"}  # fmt: skip
    url = f"redis://127.0.0.1:{free_port()}/0"
    result = run_worker_cli("--model", "tests.models:Toy", "--redis", url, env=env)
    assert result.returncode == 2  # past the settings: Redis did not answer
    assert "did not answer within 0 s (--redis-wait)" in result.stderr
    assert "Warning" not in result.stderr, result.stderr
