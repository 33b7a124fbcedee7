"""Models used only by the benchmarks."""

from __future__ import annotations

from typing import Any

from examples.mlp import MLP
from gpu_worker import ManagedModel, TensorSpec


class Identity(ManagedModel):
    """Returns its inputs: measures pure serving overhead."""

    name = "identity"
    inputs = [TensorSpec("input", "FP32", [256])]
    outputs = [TensorSpec("output", "FP32", [256])]
    batch_size = 64

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


class HeavyMLP(MLP):
    """The reference MLP with hidden width 4096: compute dominates (tens of ms per batch)."""

    name = "heavy"
    hidden = 4096
