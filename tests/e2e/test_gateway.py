"""The HTTP gateway against the real stack: redis-server, `worker start`, gunicorn on a free port.

One stack is shared by the module: a gateway (gunicorn, two workers, bearer auth from a token
file) in front of workers for `tests.gateway_models:Doubler`, `:ByteStats` and `examples.mlp:MLP`
(two processes). Tests that must break something (Redis, a worker, the gateway) start their own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from broker.devserver import RedisServer, free_port
from broker.keys import ModelKeys
from tests.conftest import (
    ROOT,
    gateway_env,
    run_python,
    stop_process,
    wait_for_consumers,
    wait_for_healthz,
    wait_until,
    worker_process,
)
from tests.gateway_models import RECORD_ENV, ByteStats, fail_item, sleep_item

TOKEN = "test-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOUBLER = "tests.gateway_models:Doubler"
BYTESTATS = "tests.gateway_models:ByteStats"
MLP = "examples.mlp:MLP"
MAX_ITEMS = 64
MAX_BODY = 1024 * 1024


@contextmanager
def gateway_process(
    redis_url: str,
    models: list[str],
    prefix: str,
    *args: str,
    env: dict[str, str] | None = None,
    workers: int = 1,
    log_path: Path | None = None,
    port: int | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run `gateway start` (gunicorn) on ``port`` (default: a free one); yield its base URL
    and process.

    With ``log_path``, its log (stderr) goes to that file.
    """
    port = port or free_port()
    command = [sys.executable, "-m", "web_gateway.cli", "start", "--redis", redis_url]
    for model in models:
        command += ["--model", model]
    command += ["--prefix", prefix, "--port", str(port), "--workers", str(workers), *args]
    log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
    process = subprocess.Popen(command, cwd=ROOT, env=gateway_env(env), stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_healthz(base, process)
        yield base, process
    finally:
        stop_process(process)
        if log is not None:
            log.close()


def check_error(response: httpx.Response, status: int, type_: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "server" not in response.headers  # uvicorn's "server: uvicorn", left out
    body = response.json()
    assert set(body) == {"error"}
    assert body["error"]["type"] == type_
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in response.text
    return body["error"]


def check_v2_error(response: httpx.Response, status: int, type_: str) -> str:
    """/v2 routes answer errors in the Open Inference Protocol's format (error: a string)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == type_
    assert body["error"].startswith(f"{type_}: ")
    return str(body["error"])


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    prefix = f"g{uuid.uuid4().hex[:10]}"
    tmp = tmp_path_factory.mktemp("gateway")
    records = tmp / "records"
    records.mkdir()
    tokens = tmp / "tokens"
    tokens.write_text(f"# gateway tokens\n{TOKEN}\n")
    url = redis_server.url
    # every process starts at once (they need not wait for each other); then the workers' turn
    with (
        worker_process(url, DOUBLER, prefix, env={RECORD_ENV: str(records)}, expect_consumers=None),
        worker_process(url, BYTESTATS, prefix, "--max-latency", "0.002", expect_consumers=None),
        worker_process(url, MLP, prefix, "--workers", "2", expect_consumers=None),
        gateway_process(
            url,
            [DOUBLER, BYTESTATS, MLP],
            prefix,
            "--auth-tokens-file",
            str(tokens),
            "--max-items",
            str(MAX_ITEMS),
            "--max-body-bytes",
            str(MAX_BODY),
            workers=2,
        ) as (base, gateway),
    ):
        for name, count in (("doubler", 1), ("bytestats", 1), ("mlp", 2)):
            wait_for_consumers(url, ModelKeys(name, prefix), count)

        class Stack:
            pass

        stack = Stack()
        stack.base = base  # type: ignore[attr-defined]
        stack.gateway = gateway  # type: ignore[attr-defined]
        stack.prefix = prefix  # type: ignore[attr-defined]
        stack.records = records  # type: ignore[attr-defined]
        stack.redis_url = url  # type: ignore[attr-defined]
        stack.tokens = tokens  # type: ignore[attr-defined]
        yield stack


@pytest.fixture(scope="module")
def mlp_direct() -> Any:
    from examples.mlp import MLP as MLPModel

    model = MLPModel()
    model.init_model()
    return model


@pytest.fixture
def client(stack: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base, headers=AUTH, timeout=30) as http:
        yield http


def test_a_rotated_tokens_file_reaches_every_gateway_process_without_a_restart(
    stack: Any,
) -> None:
    """Tokens were read as each gateway process started: a rotated Secret needed a restart
    of every gateway, and until then the new token was refused."""
    path: Path = stack.tokens
    before = path.read_text()

    def statuses(token: str) -> set[int]:  # of enough requests to reach both processes
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=stack.base, headers=headers, timeout=10) as http:
            return {http.get("/v2/models/doubler").status_code for _ in range(16)}

    def rotate(text: str) -> None:
        fresh = path.with_suffix(".new")
        fresh.write_text(text)
        os.replace(fresh, path)

    assert statuses("rotated-token") == {401}
    try:
        rotate(f"{TOKEN}\nrotated-token\n")
        wait_until(lambda: statuses("rotated-token") == {200}, 10, "the new token accepted")
        assert statuses(TOKEN) == {200}
    finally:
        rotate(before)
    wait_until(lambda: statuses("rotated-token") == {401}, 10, "the old token refused again")
    assert statuses(TOKEN) == {200}


def test_importing_the_app_with_the_mlp_leaves_torch_out() -> None:
    code = (
        "import sys\n"
        "from web_gateway.app import create_app\n"
        "from web_gateway.settings import GatewaySettings\n"
        "app = create_app(GatewaySettings(model=['examples.mlp:MLP']))\n"
        "app.openapi()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_json_and_multipart_return_the_models_own_results(
    client: httpx.Client, mlp_direct: Any
) -> None:
    rng = np.random.default_rng(1)
    inputs = rng.standard_normal((3, 256)).astype(np.float32)
    response = client.post("/v1/models/mlp/predict", json={"inputs": inputs.tolist()})
    assert response.status_code == 200, response.text
    got = np.asarray(response.json()["outputs"], dtype=np.float32)
    want = np.stack(mlp_direct.predict(list(inputs)))
    assert got.shape == (3, 16)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    files = [b"hello, gateway", bytes(range(256)) * 3]
    response = client.post(
        "/v1/models/bytestats/predict",
        files=[("file", ("a.txt", files[0])), ("file", ("b.bin", files[1]))],
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"outputs": [ByteStats.expected(data) for data in files]}

    # the same model over JSON: its preprocess takes a string there
    response = client.post("/v1/models/bytestats/predict", json={"inputs": ["hello, gateway"]})
    assert response.json() == {"outputs": [ByteStats.expected(files[0])]}


def test_every_status_code_from_a_real_request(client: httpx.Client, stack: Any) -> None:
    predict = "/v1/models/doubler/predict"
    check_error(client.post(predict, content=b'{"inputs": [[1, 2'), 400, "BadRequest")
    check_error(client.post(predict, json={"items": []}), 400, "BadRequest")
    check_error(
        client.post(predict, json={"inputs": [[1, 2, 3, 4]]}, headers={"X-Request-Timeout": "x"}),
        400,
        "BadRequest",
    )
    check_v2_error(
        client.post("/v2/models/doubler/infer", json={"inputs": [{"name": "input"}]}),
        400,
        "BadRequest",
    )

    anonymous = httpx.post(f"{stack.base}{predict}", json={"inputs": [[1, 2, 3, 4]]})
    check_error(anonymous, 401, "Unauthorized")
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    wrong = {"Authorization": "Bearer not-the-token"}
    check_error(
        httpx.post(f"{stack.base}{predict}", json={"inputs": []}, headers=wrong),
        401,
        "Unauthorized",
    )
    for open_path in ("/healthz", "/v2/health/live", "/v2/health/ready", "/v2/models/mlp/ready"):
        assert httpx.get(f"{stack.base}{open_path}").status_code == 200, open_path

    check_error(client.post("/v1/models/nope/predict", json={"inputs": [1]}), 404, "ModelNotFound")
    check_v2_error(client.get("/v2/models/nope"), 404, "ModelNotFound")
    check_error(client.get("/no/such/route"), 404, "NotFound")

    check_error(
        client.post(predict, content=b"[" + b"0," * MAX_BODY + b"0]"), 413, "PayloadTooLarge"
    )
    too_many = {"inputs": [[1.0, 2.0, 3.0, 4.0]] * (MAX_ITEMS + 1)}
    check_error(client.post(predict, json=too_many), 413, "PayloadTooLarge")

    message = check_error(
        client.post(predict, json={"inputs": [[1, 2, 3, 4], [1, 2, 3]]}), 422, "InvalidInput"
    )["message"]
    assert "item 1" in message and "[4]" in message
    check_error(client.post(predict, json={"inputs": [["a", "b", "c", "d"]]}), 422, "InvalidInput")
    check_v2_error(
        client.post(
            "/v2/models/doubler/infer",
            json={"inputs": [{"name": "input", "shape": [1, 4], "datatype": "INT32",
                              "data": [1, 2, 3, 4]}]},
        ),
        422,
        "InvalidInput",
    )  # fmt: skip

    error = check_error(
        client.post(predict, json={"inputs": [[1, 2, 3, 4], fail_item()]}), 500, "ModelError"
    )
    assert "refuses the failure marker" in error["message"] and "item 1" in error["message"]
    # 503 (QueueFull, BrokerUnavailable) and 504 come from test_queue_bound_... and
    # test_readiness_...; a bad request never takes the gateway down:
    assert client.post(predict, json={"inputs": [[1, 2, 3, 4]]}).json() == {
        "outputs": [[2.0, 4.0, 6.0, 8.0]]
    }


def test_two_gateway_workers_and_two_model_workers_lose_nothing(
    stack: Any, mlp_direct: Any
) -> None:
    children = subprocess.run(
        ["ps", "--ppid", str(stack.gateway.pid), "-o", "pid="], capture_output=True, text=True
    ).stdout.split()
    assert len(children) == 2  # two gunicorn workers

    rng = np.random.default_rng(2)
    total = 240
    inputs = rng.standard_normal((total, 256)).astype(np.float32)
    want = np.stack(mlp_direct.predict(list(inputs)))

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(
            base_url=stack.base, headers=AUTH, timeout=30, limits=limits
        ) as http:
            semaphore = asyncio.Semaphore(32)

            async def one(i: int) -> httpx.Response:
                async with semaphore:
                    body = {"inputs": [inputs[i].tolist()]}
                    return await http.post("/v1/models/mlp/predict", json=body)

            return await asyncio.gather(*(one(i) for i in range(total)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * total
    got = np.stack([np.asarray(r.json()["outputs"][0], dtype=np.float32) for r in responses])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_disconnected_clients_queued_item_never_reaches_predict(stack: Any) -> None:
    predict = f"{stack.base}/v1/models/doubler/predict"
    keys = ModelKeys("doubler", stack.prefix)
    r = redis.Redis.from_url(stack.redis_url)
    victim = [9.0, 9.0, 9.0, 424242.0]
    results: dict[str, Any] = {}

    def sleeper() -> None:
        results["sleeper"] = httpx.post(
            predict, json={"inputs": [sleep_item(2.0, 1.0)]}, headers=AUTH, timeout=30
        )

    thread = threading.Thread(target=sleeper)
    thread.start()
    try:
        time.sleep(0.5)  # the worker is now busy with the sleeper
        queued: list[int] = []

        def watch() -> None:
            time.sleep(0.4)
            queued.append(int(r.xlen(keys.stream)))

        watcher = threading.Thread(target=watch)
        watcher.start()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(predict, json={"inputs": [victim]}, headers=AUTH, timeout=0.8)
        watcher.join()
        assert queued == [2], "the victim was not queued behind the sleeper"
    finally:
        thread.join()
    assert results["sleeper"].status_code == 200
    # the worker has moved on: one more request goes through it
    after = httpx.post(predict, json={"inputs": [[5.0, 6.0, 7.0, 8.0]]}, headers=AUTH, timeout=30)
    assert after.json() == {"outputs": [[10.0, 12.0, 14.0, 16.0]]}
    computed = [
        json.loads(line)
        for path in Path(stack.records).glob("items-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert [5.0, 6.0, 7.0, 8.0] in computed
    assert victim not in computed
    assert int(r.xlen(keys.stream)) == 0
    r.close()


@pytest.mark.slow
def test_queue_bound_holds_with_two_gateways_pushing_at_once(redis_server: RedisServer) -> None:
    prefix = f"q{uuid.uuid4().hex[:10]}"  # no worker consumes it: the queue only fills
    bound, total = 10, 48
    args = ("--max-queue-items", str(bound))
    url = redis_server.url
    with (
        gateway_process(url, [DOUBLER], prefix, *args) as (first, _),
        gateway_process(url, [DOUBLER], prefix, *args) as (second, _),
    ):
        keys = ModelKeys("doubler", prefix)
        r = redis.Redis.from_url(url)

        def queued() -> int:
            # the items queued (in entries that may each hold several: protocol.md, 5.1)
            return int(r.xlen(keys.stream)) + int(r.get(keys.packed_items) or 0)

        async def run() -> tuple[list[httpx.Response], list[int]]:
            async with httpx.AsyncClient(timeout=30) as http:
                posts = asyncio.gather(
                    *(
                        http.post(
                            f"{(first, second)[i % 2]}/v1/models/doubler/predict",
                            json={"inputs": [[float(i), 0.0, 0.0, 0.0]]},
                            headers={"X-Request-Timeout": "3"},
                        )
                        for i in range(total)
                    )
                )
                seen = []
                while not posts.done():  # until the deadlines: the queue at its bound
                    seen.append(queued())
                    await asyncio.sleep(0.05)
                return await posts, seen

        started = time.monotonic()
        responses, seen = asyncio.run(run())
        codes = sorted(response.status_code for response in responses)
        assert codes == [503] * (total - bound) + [504] * bound
        assert max(seen) == bound
        # at their deadline the expired requests' items were withdrawn
        settled = time.monotonic() + 5
        while queued() and time.monotonic() < settled:
            time.sleep(0.05)
        assert queued() == 0 and int(r.get(keys.queued_bytes) or 0) == 0
        for response in responses:
            if response.status_code == 503:
                check_error(response, 503, "QueueFull")
                assert response.headers["retry-after"] == "1"
            else:
                check_error(response, 504, "DeadlineExceeded")
        assert time.monotonic() - started < 15
        r.close()


def test_readiness_flips_with_the_worker_and_with_redis(tmp_path: Path) -> None:
    server = RedisServer().start()
    prefix = "ready"
    try:
        with gateway_process(server.url, [DOUBLER], prefix) as (base, _):
            assert httpx.get(f"{base}/v2/health/ready").json() == {"ready": True}
            assert httpx.get(f"{base}/v2/models/doubler/ready").status_code == 503
            with worker_process(server.url, DOUBLER, prefix):
                response = httpx.get(f"{base}/v2/models/doubler/ready")
                assert response.status_code == 200 and response.json()["ready"] is True
            # the worker stopped: its consumer leaves (or its heartbeat lapses)
            deadline = time.monotonic() + 20
            while httpx.get(f"{base}/v2/models/doubler/ready").status_code != 503:
                assert time.monotonic() < deadline, "model stayed ready without a worker"
                time.sleep(0.2)
            assert httpx.get(f"{base}/v2/health/ready").status_code == 200  # gateway still ready

            server.kill()
            response = httpx.get(f"{base}/v2/health/ready", timeout=10)
            assert response.status_code == 503 and response.json() == {"ready": False}
            assert httpx.get(f"{base}/healthz").status_code == 200  # alive, just not ready
            started = time.monotonic()
            response = httpx.post(
                f"{base}/v1/models/doubler/predict", json={"inputs": [[1, 2, 3, 4]]}, timeout=10
            )
            error = check_error(response, 503, "BrokerUnavailable")
            assert response.headers["retry-after"] == "1"
            assert "Redis" in error["message"]
            assert time.monotonic() - started < 3, "BrokerUnavailable must come at once"

            server.start()
            deadline = time.monotonic() + 10
            while httpx.get(f"{base}/v2/health/ready").status_code != 200:
                assert time.monotonic() < deadline, "gateway did not become ready again"
                time.sleep(0.2)
    finally:
        server.stop()


def test_sigterm_lets_in_flight_requests_finish(stack: Any) -> None:
    with gateway_process(stack.redis_url, [DOUBLER], stack.prefix) as (base, process):
        results: dict[str, httpx.Response] = {}

        def slow() -> None:
            results["slow"] = httpx.post(
                f"{base}/v1/models/doubler/predict",
                json={"inputs": [sleep_item(1.5, 2.0)]},
                timeout=30,
            )

        thread = threading.Thread(target=slow)
        thread.start()
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        thread.join()
        assert results["slow"].status_code == 200
        assert results["slow"].json() == {"outputs": [[-4.0, 3.0, 14.0, 4.0]]}
        assert process.wait(20) == 0


def test_tritonclient_with_binary_tensors_on_and_off(stack: Any, mlp_direct: Any) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=stack.base.removeprefix("http://"))
    try:
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready("mlp", headers=dict(AUTH))
        metadata = client.get_model_metadata("mlp", headers=dict(AUTH))
        assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 256]}]
        assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 16]}]

        batch = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
        want = np.stack(mlp_direct.predict(list(batch)))
        for binary in (True, False):
            tensor = triton.InferInput("input", list(batch.shape), "FP32")
            tensor.set_data_from_numpy(batch, binary_data=binary)
            if binary:  # the client's defaults: binary input, all outputs binary
                result = client.infer("mlp", [tensor], headers=dict(AUTH))
            else:
                wanted = [triton.InferRequestedOutput("output", binary_data=False)]
                result = client.infer("mlp", [tensor], outputs=wanted, headers=dict(AUTH))
            got = result.as_numpy("output")
            assert got.dtype == np.float32 and got.shape == (4, 16)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # BYTES tensors in binary, through the byte-taking model
        files = np.array([b"abc", b"\x00\xff"], dtype=np.object_)
        tensor = triton.InferInput("stats", [2], "BYTES")
        tensor.set_data_from_numpy(files)
        result = client.infer("bytestats", [tensor], headers=dict(AUTH))
        assert result.as_numpy("stats").tolist() == [[3.0, 294.0], [2.0, 255.0]]
        with pytest.raises(triton.InferenceServerException) as raised:
            client.infer("mlp", [tensor], headers=dict(AUTH))
        assert raised.value.status() == "422"
    finally:
        client.close()


def test_tritonclient_versioned_calls(stack: Any, mlp_direct: Any) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=stack.base.removeprefix("http://"))
    headers = dict(AUTH)
    try:
        assert client.is_model_ready("mlp", model_version="1", headers=headers)
        metadata = client.get_model_metadata("mlp", model_version="1", headers=headers)
        assert metadata["versions"] == ["1"]
        assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 256]}]
        batch = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
        tensor = triton.InferInput("input", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch)
        result = client.infer("mlp", [tensor], model_version="1", headers=headers)
        assert result.get_response()["model_version"] == "1"
        want = np.stack(mlp_direct.predict(list(batch)))
        np.testing.assert_allclose(result.as_numpy("output"), want, rtol=1e-4, atol=1e-5)

        # an unknown version: a clean 404 in the protocol's error shape, never a crash
        assert not client.is_model_ready("mlp", model_version="2", headers=headers)
        for call in (
            lambda: client.get_model_metadata("mlp", model_version="2", headers=headers),
            lambda: client.infer("mlp", [tensor], model_version="2", headers=headers),
        ):
            with pytest.raises(triton.InferenceServerException) as raised:
                call()
            assert raised.value.status() == "404"
            assert "model 'mlp' has no version '2'" in raised.value.message()
    finally:
        client.close()


def test_metrics_aggregate_every_gateway_process(client: httpx.Client) -> None:
    for _ in range(6):
        client.post("/v1/models/doubler/predict", json={"inputs": [[1, 1, 1, 1]]})

    def ok_lines() -> list[str]:
        text = httpx.get(f"{str(client.base_url).rstrip('/')}/metrics").text
        return [
            line
            for line in text.splitlines()
            if line.startswith("microbatch_gateway_requests_total{")
            and 'model="doubler"' in line
            and 'outcome="ok"' in line
            and 'route="v1"' in line
        ]

    # The scraped process's own requests are exact; the other's show up within its flush
    # interval (web_gateway.metrics.FLUSH_S).
    deadline = time.monotonic() + 10
    while len(ok := ok_lines()) != 1 or float(ok[0].rsplit(" ", 1)[1]) < 6:
        assert time.monotonic() < deadline, ok
        time.sleep(0.05)


def test_gateway_start_help_names_every_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "web_gateway.cli", "start", "--help"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for option in ("--model", "--prefix", "--redis", "--host", "--port", "--workers"):
        assert option in done.stdout
    assert "REDIS_URL" in done.stdout and "MICROBATCH_GATEWAY_MAX_QUEUE_ITEMS" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "web_gateway.cli", "start", "--model", "nope:Nope"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "nope" in bad.stderr


@pytest.mark.slow  # schemathesis over every route: ~7 s
def test_fuzzing_the_openapi_schema_finds_no_server_error(stack: Any) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{stack.base}/openapi.json")
    schema.config.update(base_url=stack.base)
    seen: dict[int, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=12,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                response = case.call(base_url=stack.base, headers=dict(AUTH), timeout=15)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    # the only 500 allowed is the model's own error; 503/504 cannot happen here
                    body = response.json()
                    assert response.status_code == 500, response.text
                    error_type = body.get("type") or body["error"]["type"]
                    assert error_type == "ModelError", response.text

            try:
                check()
            except Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE  # nothing to break in e.g. GET /healthz
    print("fuzzing status codes:", dict(sorted(seen.items())))
    assert seen.get(200, 0) > 0
    # the gateway is still healthy after all that
    assert httpx.get(f"{stack.base}/healthz").status_code == 200
