"""Models for the gateway tests: light, deterministic, behaviours triggered by marker inputs."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from gpu_worker import ManagedModel, TensorSpec

RECORD_ENV = "MICROBATCH_TEST_RECORD_DIR"

FAIL = 7.0  # [-1, FAIL, *, *] makes predict raise; [-2, seconds, SLEEP, *] sleeps first
SLEEP = 7.0


def fail_item() -> list[float]:
    return [-1.0, FAIL, 0.0, 0.0]


def sleep_item(seconds: float, marker: float = 0.0) -> list[float]:
    return [-2.0, seconds, SLEEP, marker]


class Doubler(ManagedModel):
    """FP32[4] -> FP32[4], each item times two. Records every computed item when asked to."""

    name = "doubler"
    inputs = [TensorSpec("input", "FP32", [4])]
    outputs = [TensorSpec("output", "FP32", [4])]
    batch_size = 8

    def predict(self, batch: list[Any]) -> list[Any]:
        directory = os.environ.get(RECORD_ENV)
        if directory:
            with open(os.path.join(directory, f"items-{os.getpid()}.jsonl"), "a") as out:
                for item in batch:
                    out.write(json.dumps([float(v) for v in item]) + "\n")
        for item in batch:
            if item[0] == -1.0 and item[1] == FAIL:
                raise ValueError("doubler refuses the failure marker")
        for item in batch:
            if item[0] == -2.0 and item[2] == SLEEP:
                time.sleep(min(float(item[1]), 5.0))
        return [np.asarray(item, dtype=np.float32) * 2 for item in batch]


class ByteStats(ManagedModel):
    """Takes raw bytes (a file upload, or a string): preprocess -> [length, byte sum].

    postprocess turns the model's FP64[2] into [length, checksum] as integers.
    """

    name = "bytestats"
    request_inputs = [TensorSpec("stats", "BYTES", [])]  # what a caller sends: the bytes
    inputs = [TensorSpec("stats", "FP64", [2])]
    outputs = [TensorSpec("stats", "FP64", [2])]
    batch_size = 8

    def preprocess(self, item: Any) -> Any:
        if isinstance(item, str):
            item = item.encode()
        if not isinstance(item, bytes):
            raise TypeError("bytestats takes a file or a string")
        data = np.frombuffer(item, dtype=np.uint8)
        return np.array([len(item), int(data.sum(dtype=np.uint64))], dtype=np.float64)

    def predict(self, batch: list[Any]) -> list[Any]:
        return [np.asarray(item, dtype=np.float64) for item in batch]

    def postprocess(self, output: Any) -> Any:
        return [int(value) for value in output]

    @staticmethod
    def expected(data: bytes) -> list[int]:
        return [len(data), sum(data)]


class Tally(ManagedModel):
    """INT32[-1] -> INT64[1]: the sum of each item's counts (integer inputs, checked)."""

    name = "tally"
    inputs = [TensorSpec("counts", "INT32", [-1])]
    outputs = [TensorSpec("total", "INT64", [1])]
    batch_size = 8

    def predict(self, batch: list[Any]) -> list[Any]:
        return [np.asarray([int(np.sum(item, dtype=np.int64))]) for item in batch]


class Labeller(ManagedModel):
    """FP32[1] -> a label: postprocess raises KeyError for a value it has no label for."""

    name = "labeller"
    inputs = [TensorSpec("score", "FP32", [1])]
    outputs = [TensorSpec("score", "FP32", [1])]
    LABELS = {0.0: "cat", 1.0: "dog"}

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch

    def postprocess(self, output: Any) -> Any:
        return self.LABELS[float(output[0])]


class Codes(ManagedModel):
    """A text -> its characters' code points, INT32[-1]: a request sends a BYTES tensor named
    ``text``, the worker gets one named ``codes``."""

    name = "codes"
    request_inputs = [TensorSpec("text", "BYTES", [])]
    inputs = [TensorSpec("codes", "INT32", [-1])]
    outputs = [TensorSpec("count", "INT64", [1])]

    def preprocess(self, item: Any) -> Any:
        text = item.decode() if isinstance(item, bytes) else item
        if not isinstance(text, str):
            raise TypeError("codes takes a text")
        return np.asarray([ord(char) for char in text], dtype=np.int32)

    def predict(self, batch: list[Any]) -> list[Any]:
        return [np.asarray([len(item)]) for item in batch]
