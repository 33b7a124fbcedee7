"""Small torch stages and the pipelines made of them, for tests: deterministic, light.

``Embed`` maps an FP32 [8] input to FP32 [4]; ``Polarity`` (2 outputs) and ``Topic`` (3) are
heads on that. A head raises ValueError on an embedding holding NaN or a value of 1e6 or more
(send NaN, or 1e9, to the pipeline). With MICROBATCH_TEST_RECORD_DIR set, every stage records
the first value of each item it computes (``<stage>-<pid>.jsonl``); MICROBATCH_TEST_BATCH_DELAY
makes every batch sleep that long first.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from gpu_worker import ManagedModel, TensorSpec
from gpu_worker.pipeline import Pipeline, Stage
from tests.models import DELAY_ENV, RECORD_ENV


def _linear(seed: int, inputs: int, outputs: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(inputs, outputs)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(outputs, inputs, generator=generator))
        layer.bias.copy_(torch.randn(outputs, generator=generator))
    return layer.eval()


class _Layer(ManagedModel):
    seed = 0
    size = (8, 4)

    def init_model(self) -> None:
        self.layer = _linear(self.seed, *self.size)
        self.delay = float(os.environ.get(DELAY_ENV, "0"))
        self.record = os.environ.get(RECORD_ENV)

    def predict(self, batch: list[Any]) -> list[Any]:
        import torch

        if self.delay:
            time.sleep(self.delay)
        stacked = np.stack([np.asarray(item, dtype=np.float32) for item in batch])
        if self.name != "embed" and not np.all(np.abs(stacked) < 1e6):  # NaN too
            raise ValueError("head got an embedding out of range")
        if self.record:
            path = os.path.join(self.record, f"{self.name}-{os.getpid()}.jsonl")
            with open(path, "a") as out:
                for item in batch:
                    out.write(json.dumps(float(np.asarray(item)[0])) + "\n")
        with torch.no_grad():
            out = self.layer(torch.from_numpy(stacked)).numpy()
        return list(out)


class Embed(_Layer):
    name = "embed"
    inputs = [TensorSpec("input", "FP32", [8])]
    outputs = [TensorSpec("embedding", "FP32", [4])]
    seed, size = 1, (8, 4)


class Polarity(_Layer):
    name = "polarity"
    inputs = [TensorSpec("embedding", "FP32", [4])]
    outputs = [TensorSpec("logits", "FP32", [2])]
    seed, size = 2, (4, 2)


class Topic(_Layer):
    name = "topic"
    inputs = [TensorSpec("embedding", "FP32", [4])]
    outputs = [TensorSpec("logits", "FP32", [3])]
    seed, size = 3, (4, 3)


def double(item: Any) -> Any:
    """A transform between stages: runs in the next stage's worker."""
    return np.asarray(item, dtype=np.float32) * 2


class Chain(Pipeline):
    """embed -> polarity."""

    name = "chain"
    stages = [Stage("embed", Embed), Stage("polarity", "tests.pipeline_models:Polarity")]


class Half(Pipeline):
    """embed -> topic (tests serve its first stage only)."""

    name = "half"
    stages = [Stage("embed", Embed), Stage("topic", Topic)]


class Fan(Pipeline):
    """embed -> polarity, and (x2, in topic's worker) topic; joined."""

    name = "fan"
    stages = [
        Stage("embed", Embed),
        Stage("polarity", Polarity, after="embed"),
        Stage("topic", Topic, after="embed", transform="tests.pipeline_models:double"),
    ]


class MistypedTransform(Pipeline):
    """A transform path with a typo: its worker must refuse to start, naming the stage."""

    name = "mistyped"
    stages = [
        Stage("embed", Embed),
        Stage("polarity", Polarity, transform="tests.pipeline_models:dubble"),
    ]
