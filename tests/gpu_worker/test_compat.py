"""gpu_worker.compat against the real service_streamer 0.1.2.

The programs in tests/gpu_worker/compat_programs/ use service_streamer the way its README does (a
Flask app with ThreadedStreamer, the Future API, Streamer with a ManagedModel on cuda_devices and
with a predict function, RedisStreamer with run_redis_workers_forever on two prefixes). Each runs
twice: unchanged, under the real service_streamer 0.1.2 installed from PyPI into a virtualenv of its
own (cached in .cache/, see ``service_streamer_python``), and with only its import line changed to
``gpu_worker.compat``, under this project. Their answers must be the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest

from broker.devserver import RedisServer, free_port
from broker.errors import CodecError, DeadlineExceeded, ModelError
from gpu_worker import compat, supervisor
from gpu_worker.config import WorkerConfig
from gpu_worker.devices import DEVICE_COUNT_ENV
from tests.conftest import ROOT

PROGRAMS = Path(__file__).resolve().parent / "compat_programs"
REAL = "service_streamer==0.1.2"
VENV = ROOT / ".cache" / "service-streamer-0.1.2"
IMPORT = "from service_streamer import"
COMPAT_IMPORT = "from gpu_worker.compat import"
T = TypeVar("T")


# -- the two interpreters and the two copies of the programs ------------------------------------
@pytest.fixture(scope="session")
def service_streamer_python() -> str:
    """A python with the real service_streamer 0.1.2, redis, flask and torch (made once, then
    reused).

    Built with ``python -m venv`` + ``pip install service_streamer==0.1.2 redis flask`` under
    .cache/ (git-ignored); torch is this environment's, reached through a .pth file (after the
    virtualenv's own packages) rather than installed a second time. Rebuilt when it does not
    import the real package.
    """
    python = VENV / "bin" / "python"
    check = (
        "import importlib.metadata as m, service_streamer, flask, redis, torch; "
        "assert m.version('service_streamer') == '0.1.2'"
    )
    if python.exists() and subprocess.run([python, "-c", check], timeout=60).returncode == 0:
        return str(python)
    shutil.rmtree(VENV, ignore_errors=True)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
    install = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*install, REAL, "redis", "flask"], check=True, timeout=600)
    import torch

    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    torch_home = Path(torch.__file__).resolve().parent.parent
    (Path(site) / "microbatch-test-torch.pth").write_text(f"{torch_home}\n")
    subprocess.run([python, "-c", check], check=True, timeout=60)
    return str(python)


@pytest.fixture(scope="session")
def variants(
    service_streamer_python: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[str, Path, dict[str, str]]]:
    """name -> (python, directory of the programs, environment) for "real" and "compat"."""
    real = tmp_path_factory.mktemp("real")
    ours = tmp_path_factory.mktemp("compat")
    for program in PROGRAMS.glob("*.py"):
        source = program.read_text()
        changed = source.replace(IMPORT, COMPAT_IMPORT)
        # the one change: the import line (the programs are otherwise the same bytes)
        differ = [
            (a, b) for a, b in zip(source.splitlines(), changed.splitlines(), strict=True) if a != b
        ]
        assert all(a.startswith(IMPORT) and b.startswith(COMPAT_IMPORT) for a, b in differ)
        (real / program.name).write_text(source)
        (ours / program.name).write_text(changed)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MICROBATCH_", "PYTHON"))}
    return {
        "real": (service_streamer_python, real, base),
        # On a host without GPUs, devices 0 and 1 are emulated (worker start's test hook);
        # the real service_streamer does not check that they exist.
        "compat": (
            sys.executable,
            ours,
            {**base, "PYTHONPATH": str(ROOT), "MICROBATCH_CUDA_DEVICE_COUNT": "2"},
        ),
    }


def run_program(
    variant: tuple[str, Path, dict[str, str]],
    name: str,
    timeout: float = 120,
    args: tuple[str, ...] = (),
    **env: str,
) -> Any:
    python, directory, base = variant
    done = subprocess.run(
        [python, name, *args],
        cwd=directory,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def background(
    variant: tuple[str, Path, dict[str, str]], name: str, **env: str
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a program in its own process group; SIGTERM the group afterwards (its workers too)."""
    python, directory, base = variant
    process = subprocess.Popen(
        [python, name], cwd=directory, env={**base, **env}, start_new_session=True
    )
    try:
        yield process
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        deadline = time.monotonic() + 10  # spawned workers leave after their parent
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)


def side_by_side(
    variants: dict[str, Any], run: Callable[[str, tuple[str, Path, dict[str, str]]], T]
) -> dict[str, T]:
    """``run(name, variant)`` for the real and the compat variant at once: their processes
    spend most of their time starting up and waiting, so the two overlap well."""
    with ThreadPoolExecutor(len(variants)) as pool:
        futures = {name: pool.submit(run, name, variant) for name, variant in variants.items()}
        return {name: future.result() for name, future in futures.items()}


def expected(sentence: str, suffix: str = "") -> str:
    return f"{len(sentence.split())}:{sentence.upper()}{suffix}"


# -- the programs, both ways ------------------------------------------------------------------
def test_future_api_gives_the_same_results(variants: dict[str, Any]) -> None:
    results = side_by_side(variants, lambda _, variant: run_program(variant, "future_api.py"))
    assert results["compat"] == results["real"]
    head = [expected("How are you ?"), expected("Fine .")]
    want = [[*head, expected(f"Thank you {i}")] for i in range(200)]
    assert results["real"]["results"] == want
    assert results["compat"]["batched"]  # 200 submits did not run one by one


@pytest.mark.slow  # long end to end: both libraries' worker processes load torch
def test_streamer_with_managed_model_and_cuda_devices(
    variants: dict[str, Any], tmp_path: Path
) -> None:
    def run(name: str, variant: tuple[str, Path, dict[str, str]]) -> Any:
        records = tmp_path / name
        records.mkdir()
        return run_program(variant, "managed_streamer.py", RECORD_DIR=str(records))

    outputs, gpu_ids = side_by_side(variants, run), {}
    for name in variants:
        seen = [json.loads(path.read_text()) for path in (tmp_path / name).glob("worker-*.json")]
        gpu_ids[name] = sorted(worker["gpu_id"] for worker in seen)
        if name == "compat":  # each worker process is pinned to its device before it starts
            assert all(worker["visible"] == str(worker["gpu_id"]) for worker in seen)
    assert outputs["compat"] == outputs["real"]
    batch = ["twinkle twinkle little star", "Happy birthday to you", "the answer to life"]
    assert outputs["real"]["outputs"] == [expected(s, "!") for s in batch]
    assert outputs["real"]["futures"] == [
        [expected(s, "!"), expected(s + " again", "!")] for s in batch * 10
    ]
    assert outputs["real"]["function"] == [expected(s, "~") for s in batch]
    # worker_num=4 over cuda_devices=(0, 1): two workers per device, both ways
    assert gpu_ids["compat"] == gpu_ids["real"] == [0, 0, 1, 1]


def test_flask_app_with_threaded_streamer(variants: dict[str, Any]) -> None:
    rng = np.random.default_rng(7)
    words = ["deep", "learning", "service", "batch", "gpu", "web", "streamer", "flask"]
    requests = [
        [" ".join(rng.choice(words, size=int(rng.integers(1, 6)))) for _ in range(int(n))]
        for n in rng.integers(1, 4, size=48)
    ]
    answers = {}
    for name, variant in variants.items():
        port = free_port()
        with background(variant, "flask_threaded.py", PORT=str(port)):
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{base}/batches", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"{name}: the Flask app did not start"
                time.sleep(0.1)
            with httpx.Client(base_url=base, timeout=30) as http:

                def ask(sentences: list[str], http: httpx.Client = http) -> Any:
                    response = http.post("/stream", data={"s": sentences})
                    assert response.status_code == 200, response.text
                    return response.json()

                with ThreadPoolExecutor(16) as pool:
                    answers[name] = list(pool.map(ask, requests))
                naive = http.post("/naive", data={"s": ["plain call"]}).json()
                assert naive == [expected("plain call")]
                assert http.get("/batches").json() > 1  # concurrent requests were batched
    assert answers["compat"] == answers["real"]
    assert answers["real"] == [[expected(s) for s in sentences] for sentences in requests]


@pytest.mark.slow
def test_redis_streamers_on_two_prefixes(variants: dict[str, Any], redis_server: Any) -> None:
    broker = f"127.0.0.1:{redis_server.port}"

    def run(_: str, variant: tuple[str, Path, dict[str, str]]) -> Any:
        tag = uuid.uuid4().hex[:8]  # each variant on prefixes of its own
        one, two = f"channel_1_{tag}", f"channel_2_{tag}"
        env = {"REDIS_BROKER": broker}
        with (
            background(variant, "redis_workers.py", PREFIX=one, MODEL_TAG="/one", **env),
            background(variant, "redis_workers.py", PREFIX=two, MODEL_TAG="/two", **env),
        ):
            return run_program(variant, "redis_client.py", PREFIX_1=one, PREFIX_2=two, **env)

    results = side_by_side(variants, run)
    assert results["compat"] == results["real"]
    batch = ["hello redis", "one two three", "service streamer"]
    assert results["real"]["output_1"] == [expected(s, "/one") for s in batch]
    assert results["real"]["output_2"] == [expected(s, "/two") for s in batch]
    assert results["real"]["futures"] == [[expected(s, "/one")] for s in batch] + [
        [expected(s, "/two")] for s in batch
    ]


def test_workers_see_the_programs_own_arguments(variants: dict[str, Any]) -> None:
    args = ("--suffix", "+argv")
    results = side_by_side(
        variants, lambda _, variant: run_program(variant, "argv_streamer.py", args=args)
    )
    assert results["compat"] == results["real"]
    batch = ["hello world", "the arguments reach the workers"]
    assert results["real"]["outputs"] == [expected(s, "+argv") for s in batch]


@pytest.mark.slow  # long end to end: both libraries' worker processes load torch
def test_torch_tensors_arrive_and_return_as_tensors(variants: dict[str, Any]) -> None:
    results = side_by_side(variants, lambda _, variant: run_program(variant, "torch_streamers.py"))
    assert results["compat"] == results["real"]
    threaded = results["real"]["threaded"]
    assert threaded[0]["seen"] == {"tensor": "torch.float32", "shape": [2, 3], "data": [
        [0.0, 1.0, 2.0], [3.0, 4.0, 5.0]
    ]}  # fmt: skip
    assert threaded[0]["doubled"]["data"] == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    assert threaded[2]["seen"]["ids"] == {"tensor": "torch.int64", "shape": [1, 3], "data": [
        [101, 7592, 102]
    ]}  # fmt: skip
    assert threaded[2]["doubled"]["mask"]["tensor"] == "torch.int32"
    assert threaded[3]["seen"] == {"tensor": "torch.bfloat16", "shape": [], "data": 1.5}
    assert results["real"]["streamer"] == threaded


# -- what microbatch changes: errors at once, never a 20 s hang ----------------------------------
class Picky:
    """A predict function's owner: fails on 'boom', sleeps on 'sleep'."""

    def predict(self, batch: list[Any]) -> list[Any]:
        if "sleep" in batch:
            time.sleep(1.0)
        if "boom" in batch:
            raise ValueError("the model refuses 'boom'")
        return [item if isinstance(item, list) else str(item).upper() for item in batch]


class BrokenModel(compat.ManagedModel):
    def init_model(self) -> None:
        raise RuntimeError("no weights here")

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


picky = Picky()


def test_model_errors_are_raised_at_once_and_fail_only_their_item() -> None:
    streamer = compat.ThreadedStreamer(picky.predict, batch_size=8, max_latency=0.05)
    try:
        started = time.monotonic()
        with pytest.raises(ModelError, match="refuses 'boom'") as raised:
            streamer.predict(["fine", "boom", "also fine"])
        assert raised.value.index == 1
        assert time.monotonic() - started < 5  # service_streamer: a 20 s hang, then TimeoutError
        futures = [streamer.submit([word]) for word in ("a", "boom", "b")]
        assert futures[0].result(5) == ["A"] and futures[2].result(5) == ["B"]
        with pytest.raises(ModelError):
            futures[1].result(5)
        assert streamer.predict(["still", "serving"]) == ["STILL", "SERVING"]
    finally:
        streamer.destroy_workers()


def test_values_travel_as_msgpack_never_pickle() -> None:
    streamer = compat.ThreadedStreamer(picky.predict, batch_size=8, max_latency=0)
    try:
        assert streamer.predict([("a", "tuple")]) == [["a", "tuple"]]  # tuples come back as lists
        with pytest.raises(CodecError, match="cannot be sent") as raised:
            streamer.predict(["fine", object()])
        assert raised.value.index == 1
    finally:
        streamer.destroy_workers()


def test_a_string_bytes_or_mapping_batch_is_refused_in_the_compat_api_terms() -> None:
    """The TypeError names what the compat streamers take (any sized iterable), not the
    microbatch Streamer's list-or-tuple and its async methods, which they do not have."""
    streamer = compat.ThreadedStreamer(picky.predict, batch_size=8, max_latency=0)
    try:
        assert streamer.predict(range(2)) == ["0", "1"]  # any sized iterable is a batch
        for batch in ("abc", b"abc", {"a": 1}, 3):
            for call in (streamer.predict, streamer.submit):
                with pytest.raises(TypeError) as raised:
                    call(batch)
                message = str(raised.value)
                assert "sized iterable" in message and type(batch).__name__ in message
                assert "apredict" not in message and "astart" not in message
    finally:
        streamer.destroy_workers()


def test_timeouts_are_timeout_errors_and_destroyed_streamers_refuse() -> None:
    streamer = compat.ThreadedStreamer(picky.predict, batch_size=8, max_latency=0)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as raised:
        streamer.predict(["sleep"], timeout=0.2)
    # at the caller's timeout, not once the model's 1 s is over (it computes on its own thread)
    assert time.monotonic() - started < 0.9
    assert isinstance(raised.value, DeadlineExceeded)
    with pytest.raises(TimeoutError):
        streamer.submit(["sleep"], timeout=0.2).result()
    streamer.destroy_workers()
    with pytest.raises(RuntimeError, match="destroy"):
        streamer.predict(["late"])


def test_streamer_refuses_what_workers_cannot_import_or_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(TypeError, match="by name"):
        compat.Streamer(lambda batch: batch, 8)
    local = Picky()
    with pytest.raises(TypeError, match="module-level"):
        compat.Streamer(local.predict, 8)
    with pytest.raises(TypeError, match="JSON"):
        compat.Streamer(BrokenModel, 8, model_init_args=[object()])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no weights here"):
        compat.Streamer(BrokenModel, 8)
    monkeypatch.setenv("MICROBATCH_CUDA_DEVICE_COUNT", "0")
    with pytest.raises(RuntimeError, match="CUDA device 1 does not exist"):
        compat.Streamer(picky.predict, 8, worker_num=2, cuda_devices=[1])
    assert time.monotonic() - started < 60


def test_worker_num_is_all_the_worker_processes_on_cuda_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """worker_num=4 over cuda_devices=(0, 1) is 4 processes, as service_streamer starts, also
    for a small model on a host with many cores (no `worker start --workers-per-device auto`)."""
    monkeypatch.setenv(DEVICE_COUNT_ENV, "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(supervisor, "usable_cores", lambda: 16.0)
    target = compat._reference(picky.predict)
    group = compat._WorkerGroup(target, 8, 0.1, 4, (0, 1), None, None, "p", compat.COMPAT_NAME)
    workers = supervisor.Supervisor(WorkerConfig(**group.config))
    monkeypatch.setattr(workers, "_spawn", lambda slot: None)
    for slot in workers.slots:  # each has loaded a small model
        slot.ready, slot.device_bytes = True, 2**20
    workers._size_devices()
    workers.heartbeats.close()
    assert [slot.cuda_visible for slot in workers.slots] == ["0", "1", "0", "1"]


def test_redis_broker_addresses() -> None:
    assert compat.redis_url("localhost:6379") == "redis://localhost:6379/0"
    assert compat.redis_url("redis://:pw@h:1/2") == "redis://:pw@h:1/2"
    with pytest.raises(ValueError):
        compat.redis_url("localhost")
    with pytest.raises(ValueError, match="prefix"):
        compat.RedisStreamer(prefix="no spaces")


def test_streamer_on_a_redis_of_your_own(redis_server: RedisServer) -> None:
    streamer = compat.Streamer(picky.predict, 4, 0, worker_num=1, redis_url=redis_server.url)
    try:
        assert streamer.predict(["x", ["y"]]) == ["X", ["y"]]
    finally:
        streamer.destroy_workers()


def test_tensors_stay_tensors_and_arrays_stay_arrays() -> None:
    import torch

    from broker import codec
    from gpu_worker.compat_values import from_wire, to_wire

    seen: list[Any] = []

    def double(batch: list[Any]) -> list[Any]:
        seen.extend(batch)
        return [item * 2 for item in batch]

    streamer = compat.ThreadedStreamer(double, batch_size=8, max_latency=0)
    try:
        tensor, array = torch.arange(4, dtype=torch.int16), np.arange(3, dtype=np.float32)
        out_tensor, out_array = streamer.predict([tensor, array])
    finally:
        streamer.destroy_workers()
    assert isinstance(seen[0], torch.Tensor) and seen[0].dtype == torch.int16
    assert isinstance(seen[1], np.ndarray) and not isinstance(seen[1], torch.Tensor)
    assert torch.equal(out_tensor, tensor * 2) and out_tensor.dtype == torch.int16
    np.testing.assert_array_equal(out_array, array * 2)
    # at any depth, through the codec; what holds no tensor is passed through untouched
    value = {"a": [torch.ones(2, dtype=torch.bfloat16), "x"], "b": (1, 2.5)}
    back = from_wire(codec.decode(codec.encode(to_wire(value))))
    assert back["a"][0].dtype == torch.bfloat16 and torch.equal(back["a"][0], value["a"][0])
    assert back["a"][1] == "x" and back["b"] == [1, 2.5]
    plain = {"a": [1, "x"], "b": np.zeros(2)}
    assert to_wire(plain) is plain and from_wire(plain) is plain
    back["a"][0].add_(1)  # a writable copy, as unpickling gives


GEVENT_APP = """
from gevent import monkey; monkey.patch_all()  # as service_streamer's gevent examples begin
import sys
from gpu_worker.compat import RedisStreamer, ThreadedStreamer

try:
    if sys.argv[1] == "threaded":
        ThreadedStreamer(lambda batch: batch, batch_size=64).predict(["x"])
    else:
        RedisStreamer(redis_broker=sys.argv[2], prefix="channel_g")
except RuntimeError as exc:
    print(exc)
"""


@pytest.mark.parametrize("kind", ["threaded", "redis"])
def test_gevent_monkey_patching_is_refused_at_once(kind: str, redis_server: RedisServer) -> None:
    """service_streamer's gevent examples (monkey.patch_all()) hung forever at the first
    predict: the client's event loop ran on a greenlet and blocked every other one."""
    pytest.importorskip("gevent")
    done = subprocess.run(
        [sys.executable, "-c", GEVENT_APP, kind, f"127.0.0.1:{redis_server.port}"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gevent" in done.stdout and "--threads" in done.stdout, done.stdout


def test_a_batch_may_be_any_sized_iterable_as_service_streamer_took() -> None:
    """service_streamer iterated the batch: a numpy array or tensor was a batch of its rows."""
    import torch

    streamer = compat.ThreadedStreamer(lambda batch: [row * 2 for row in batch], 8, 0)
    try:
        rows = streamer.predict(np.arange(6, dtype=np.float32).reshape(3, 2))
        assert [row.tolist() for row in rows] == [[0, 2], [4, 6], [8, 10]]
        tensors = streamer.submit(torch.ones(2, 3, dtype=torch.int64)).result(5)
        assert [type(t) for t in tensors] == [torch.Tensor] * 2
        assert [t.tolist() for t in tensors] == [[2, 2, 2]] * 2
        assert streamer.predict(range(3)) == [0, 2, 4]
        with pytest.raises(TypeError, match="of items, not str"):
            streamer.predict("a sentence")  # a string is one item, not a batch of characters
    finally:
        streamer.destroy_workers()


def test_what_cannot_travel_is_refused_with_what_can() -> None:
    """service_streamer pickled anything; a migrant's own class or string array is refused with
    what to send instead."""
    streamer = compat.ThreadedStreamer(picky.predict, batch_size=8, max_latency=0)
    try:
        with pytest.raises(CodecError, match=r"type Picky cannot be sent \(send .*dicts") as err:
            streamer.predict([picky])
        assert "numpy arrays" in str(err.value) and "never pickled" in str(err.value)
        with pytest.raises(CodecError, match=r"dtype <U5 cannot be sent \(.*list of str"):
            streamer.predict([np.array(["hello", "world"])])
    finally:
        streamer.destroy_workers()


def test_cuda_devices_on_a_machine_without_them_say_to_pass_none(
    monkeypatch: pytest.MonkeyPatch, redis_server: RedisServer
) -> None:
    """service_streamer ran cuda_devices=(0, 1) on the CPU silently; the error says what to do."""
    monkeypatch.setenv(DEVICE_COUNT_ENV, "0")
    with pytest.raises(RuntimeError, match=r"does not exist.*pass cuda_devices=None"):
        compat.Streamer(picky.predict, 8, worker_num=2, cuda_devices=(0, 1))
    broker = f"127.0.0.1:{redis_server.port}"
    with pytest.raises(RuntimeError, match=r"does not exist.*pass cuda_devices=None"):
        compat.run_redis_workers_forever(BrokenModel, 8, cuda_devices=(0,), redis_broker=broker)


KILLED_APP = """
import sys
from gpu_worker.compat import Streamer


def shout(batch):
    return [item.upper() for item in batch]


if __name__ == "__main__":
    streamer = Streamer(shout, 8, 0)
    server = streamer._resources.server
    print(server.process.pid, server.dir, streamer.predict(["x"])[0], flush=True)
    sys.stdin.read()  # serves until killed
"""


@pytest.mark.slow  # kills a program and its worker processes
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_program_leaves_no_private_redis_behind(tmp_path: Path, sig: int) -> None:
    """`kill <pid>` of a program with a Streamer: its workers stop, and its private
    redis-server (a child of the program, not of the workers) stops with them."""
    program = tmp_path / "app.py"
    program.write_text(KILLED_APP)
    process = subprocess.Popen(
        [sys.executable, str(program)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
        text=True,
    )
    try:
        assert process.stdout is not None
        pid, directory, answer = process.stdout.readline().split()
        assert answer == "X"
        process.send_signal(sig)
        process.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the private redis-server outlived its program")
        while Path(directory).exists():  # removed once the server has stopped
            assert time.monotonic() < deadline, f"{directory} outlived its redis-server"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
