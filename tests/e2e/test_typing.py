"""User code type-checks against the public API: `mypy --strict` passes a program that uses
every documented call, with the types the docs promise, and flags calls with wrong types."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

CORRECT = """
import asyncio
from concurrent.futures import Future
from typing import Any

import numpy as np
from typing_extensions import assert_type

from broker import (
    BrokerUnavailable, CodecError, DeadlineExceeded, InvalidInput, InvalidOutput,
    MicrobatchError, ModelError, NoWorkers, PoisonRequest, ProtocolError, QueueFull, Streamer,
)
from broker.client_settings import ClientSettings
from broker.redis_url import RedisURLError
from gpu_worker import LocalStreamer, ManagedModel, TensorSpec


class MLP(ManagedModel):
    name = "mlp"
    inputs = [TensorSpec("input", "FP32", [256])]
    outputs = [TensorSpec("output", "FP32", [16])]
    batch_size = 64
    max_latency = 0.0
    max_batch_cost = None

    def init_model(self) -> None: ...
    def predict(self, batch: list[Any]) -> list[Any]:
        return batch
    def warmup(self) -> None: ...
    def item_cost(self, item: Any) -> int:
        return 1
    def preprocess(self, item: Any) -> Any:
        return item
    def postprocess(self, output: Any) -> Any:
        return output


x = np.ones(256, np.float32)
settings = ClientSettings.from_values(prefix="p", timeout=2.0)
streamer = Streamer(
    "mlp", "redis://127.0.0.1:6379/0", "default", MLP, timeout=5.0, max_queue_items=0,
    max_queue_bytes=0, wait_for_workers=False, workers_grace=10, priority="high", entry_items=32,
    settings=settings,
)
assert_type(streamer.predict([x], 2.0, priority="normal", traceparent=None), list[Any])
assert_type(streamer.submit((x,), timeout=1), Future[list[Any]])
assert_type(streamer.client_settings, ClientSettings)
assert_type(streamer.name, str)
streamer.close()
with Streamer("mlp", settings=ClientSettings()) as same:
    assert_type(same, Streamer)
with LocalStreamer(MLP, batch_size=64, max_latency=0.0, timeout=3.0) as local:
    assert_type(local, LocalStreamer)
    assert_type(local.predict([[0.0] * 256]), list[Any])


async def main() -> None:
    async with Streamer("mlp") as client:
        assert_type(client, Streamer)
        assert_type(await client.apredict([x], timeout=2.0), list[Any])
        assert_type(client.astart([x]), asyncio.Future[list[Any]])
        assert_type(await client.aconnect(), bool)
    async with LocalStreamer(MLP) as local:
        assert_type(local, LocalStreamer)


try:
    asyncio.run(main())
except (
    ModelError, DeadlineExceeded, QueueFull, BrokerUnavailable, NoWorkers, PoisonRequest,
    InvalidInput, InvalidOutput, CodecError, ProtocolError,
) as error:
    assert_type(error.index, int | None)
    assert_type(error.message, str)
    assert_type(error.type, str)
except MicrobatchError:
    pass
except RedisURLError as error:
    refused: ValueError = error  # a ValueError, as the settings' others
"""

WRONG = {
    "Streamer(123)": "incompatible type",
    'Streamer("m").predict([1], timeout="5")': "incompatible type",
    'Streamer("m").submit([1], 1.0, "high")': "positional",
    'Streamer("m", "redis://h:1/0", "p", None, 5.0)': "positional",
    'Streamer("m", timeout="3")': "incompatible type",
    'TensorSpec("x", 5, [1])': "incompatible type",
    "LocalStreamer(int)": "incompatible type",
}


def test_mypy_strict_passes_documented_usage_and_flags_wrong_types(tmp_path: Path) -> None:
    (tmp_path / "correct.py").write_text(CORRECT)
    imports = "from broker import Streamer\nfrom gpu_worker import LocalStreamer, TensorSpec\n"
    (tmp_path / "wrong.py").write_text(imports + "".join(f"{line}\n" for line in WRONG))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         "--no-error-summary", str(tmp_path / "correct.py"), str(tmp_path / "wrong.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    assert [line for line in lines if "correct.py" in line] == [], result.stdout
    for number, (line, error) in enumerate(WRONG.items(), start=3):
        said = [said for said in lines if f"wrong.py:{number}: error" in said]
        assert said and error in said[0], (line, said)
