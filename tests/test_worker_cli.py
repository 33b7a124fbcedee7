"""`worker start` fails with one clear line for bad input, and drains on SIGTERM."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from broker import Streamer
from broker.devserver import RedisServer
from tests.conftest import worker_process
from tests.test_devices import run_worker_cli


def test_a_bad_model_path_gives_one_line() -> None:
    result = run_worker_cli("--model", "examples.nope:Missing")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "Error: cannot import module 'examples.nope': No module named 'examples.nope'"
    ]
    result = run_worker_cli("--model", "examples.mlp")
    assert "must look like 'package.module:ClassName'" in result.stderr
    result = run_worker_cli("--model", "broker.client:Streamer")
    assert "is not a ManagedModel subclass" in result.stderr


def test_an_init_model_that_raises_stops_the_worker_with_its_reason(
    redis_server: RedisServer, prefix: str
) -> None:
    result = run_worker_cli(
        "--model", "tests.models:BrokenInit", "--redis", redis_server.url, "--prefix", prefix
    )
    assert result.returncode == 1
    assert "RuntimeError: weights file missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_options_read_their_environment_variables(redis_server: RedisServer, prefix: str) -> None:
    env = {"MICROBATCH_WORKER_BATCH_SIZE": "0", "REDIS_URL": redis_server.url}
    result = run_worker_cli("--model", "tests.models:Toy", env=env)
    assert result.returncode == 2 and "batch-size" in result.stderr.lower()


def test_sigterm_drains_and_exits_zero(redis_server: RedisServer, prefix: str) -> None:
    with worker_process(redis_server.url, "tests.models:Toy", prefix, "--batch-size", "4") as proc:
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        streamer.predict(["warm"])
        future = streamer.submit([{"sleep": 1.0}, "a", "b"])
        time.sleep(0.3)  # the worker is inside the slow batch when SIGTERM arrives
        proc.send_signal(signal.SIGTERM)
        outputs = future.result(timeout=20)
        assert [out["item"] for out in outputs] == [{"sleep": 1.0}, "a", "b"]
        assert {out["batch"] for out in outputs} == {3}
        assert proc.wait(30) == 0
        streamer.close()


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


@pytest.mark.parametrize("value", ["-1", "100001"])
def test_a_busy_poll_out_of_range_gives_one_line(value: str) -> None:
    result = run_worker_cli("--model", "tests.models:Toy", "--busy-poll-us", value)
    assert result.returncode == 2
    assert result.stderr.strip() == "Error: --busy-poll-us must be between 0 and 100000"


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
