"""Models whose predict returns its outputs pending, served end to end by LocalStreamer (the
same batch loop as a Redis worker): a Future from the model's own thread, and the reference
MLP's OutputCopy on the staged path."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from broker.errors import ModelError
from examples.mlp import MLP
from gpu_worker import LocalStreamer, ManagedModel, TensorSpec
from gpu_worker.staging import HostStaging, OutputCopy


class Squares(ManagedModel):
    """Squares its items on a thread of its own, returning a Future of them; 13 fails there."""

    name = "squares"
    inputs = [TensorSpec("x", "INT64", [])]
    outputs = [TensorSpec("y", "INT64", [])]
    batch_size = 4

    def init_model(self) -> None:
        self.device_thread = ThreadPoolExecutor(max_workers=1)
        self.callers: set[str] = set()

    def predict(self, batch: list[Any]) -> Future[list[Any]]:
        self.callers.add(threading.current_thread().name)
        return self.device_thread.submit(self._compute, [int(x) for x in batch])

    @staticmethod
    def _compute(batch: list[int]) -> list[int]:
        if 13 in batch:
            raise RuntimeError("unlucky")
        return [x * x for x in batch]


def test_a_model_returning_futures_answers_every_item_and_fails_only_the_bad_one() -> None:
    with LocalStreamer(Squares) as local:
        futures = [local.submit([x]) for x in range(40)]
        results: dict[int, Any] = {}
        for x, future in enumerate(futures):
            try:
                results[x] = future.result(timeout=30)[0]
            except ModelError as exc:
                results[x] = exc
    for x in range(40):
        if x == 13:
            assert isinstance(results[x], ModelError) and "unlucky" in str(results[x])
        else:
            assert results[x] == x * x


class StagedMLP(MLP):
    """The reference MLP through reused host buffers (the GPU's path, unpinned on a CPU)."""

    name = "staged_mlp"

    def init_model(self) -> None:
        super().init_model()
        self.staging = HostStaging(self.device, staged=True)


@pytest.mark.parametrize("model", [MLP, StagedMLP])
def test_the_reference_mlp_serves_its_pending_outputs(model: type[MLP]) -> None:
    direct = MLP()
    direct.init_model()
    rng = np.random.default_rng(1)
    items = [rng.standard_normal(256).astype(np.float32) for _ in range(150)]
    want = np.stack(list(direct.predict(items)))
    assert isinstance(direct.predict(items[:3]), OutputCopy)
    with LocalStreamer(model, batch_size=16) as local:
        futures = [local.submit([item]) for item in items]
        got = np.stack([future.result(timeout=60)[0] for future in futures])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
