"""The reference model: a small MLP (256 -> 1024 -> 1024 -> 16), deterministic weights."""

from __future__ import annotations

from typing import Any

from gpu_worker import ManagedModel, TensorSpec


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

    def warmup(self) -> None:
        self.predict([[0.0] * 256] * 2)

    def predict(self, batch: list[Any]) -> list[Any]:
        torch = self.torch
        import numpy as np

        stacked = np.stack([np.asarray(item, dtype=np.float32) for item in batch])
        with torch.inference_mode():
            out = self.net(torch.from_numpy(stacked).to(self.device))
        return list(out.cpu().numpy())
