"""The reference model: a small MLP (256 -> 1024 -> 1024 -> 16), deterministic weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpu_worker import ManagedModel, TensorSpec
from gpu_worker.staging import HostStaging


class MLP(ManagedModel):
    """Linear 256->1024, ReLU, Linear 1024->1024, ReLU, Linear 1024->16, seeded with 0."""

    name = "mlp"
    inputs = [TensorSpec("input", "FP32", [256])]
    outputs = [TensorSpec("output", "FP32", [16])]
    batch_size = 64
    hidden = 1024

    def init_model(self) -> None:
        import torch

        torch.manual_seed(0)
        self.torch = torch
        self.net = (
            torch.nn.Sequential(
                torch.nn.Linear(256, self.hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(self.hidden, self.hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(self.hidden, 16),
            )
            .to(dtype=torch.float32, device=self.device)
            .eval()
        )
        # on a GPU: batches go through pinned host memory, copied without blocking
        self.staging = HostStaging(self.device)

    def warmup(self) -> None:
        self.predict([[0.0] * 256] * 2)

    def predict(self, batch: list[Any]) -> Sequence[Any]:
        with self.torch.inference_mode():
            out = self.net(self.staging.stack(batch, np.float32))
        # on a GPU: returns while the device computes (an OutputCopy: pending outputs, and a
        # sequence of one output per item once it lands); the worker meanwhile answers the
        # batch before and prepares the next
        return self.staging.to_host_later(out)
