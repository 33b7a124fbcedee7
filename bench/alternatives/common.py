"""What every alternative's server shares: the same model, thread setting, payloads and batch log.

Environment: BENCH_MODEL (an import path such as ``examples.mlp:MLP``), BENCH_TORCH_THREADS,
BENCH_BATCH_LOG (a file that gets one line per model call: the batch size; the harness reads it
to report the mean batch size, as it reads our worker's metrics).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

MODEL = os.environ.get("BENCH_MODEL", "examples.mlp:MLP")
BATCH_SIZE = int(os.environ.get("BENCH_BATCH_SIZE", "64"))
MAX_WAIT_S = float(os.environ.get("BENCH_MAX_WAIT_MS", "5")) / 1000


def load_model() -> Any:
    """The benchmark's model, built exactly as our worker builds it (init_model, warmup)."""
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_TORCH_THREADS", "1")))
    from gpu_worker import load_model_class

    model = load_model_class(MODEL)()
    model.init_model()
    model.warmup()
    return model


class BatchLog:
    """Appends each batch size to BENCH_BATCH_LOG (one small O_APPEND write per model call)."""

    def __init__(self) -> None:
        path = os.environ.get("BENCH_BATCH_LOG")
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if path else None

    def __call__(self, size: int) -> None:
        if self.fd is not None:
            os.write(self.fd, b"%d\n" % size)


def decode_item(item: list[float]) -> np.ndarray:
    return np.asarray(item, dtype=np.float32)


def decode_body(body: bytes | str) -> list[np.ndarray]:
    """``{"inputs": [[256 floats], ...]}`` -> one float32 array per item."""
    return [decode_item(item) for item in json.loads(body)["inputs"]]


def encode_outputs(outputs: list[Any]) -> dict[str, Any]:
    return {"outputs": [np.asarray(output).tolist() for output in outputs]}
