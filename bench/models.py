"""Models used only by the benchmarks."""

from __future__ import annotations

import os
from typing import Any

from examples.mlp import MLP
from gpu_worker import ManagedModel, TensorSpec
from gpu_worker.staging import HostStaging


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


class WideMLP(MLP):
    """A GPU-sized MLP: 256 -> 8192, six 8192x8192 layers, -> 16 (1.6 GB of FP32 weights).

    On a GPU one call reads every weight once whatever the batch, so a batch of one is bound by
    memory bandwidth and a batch of 64 costs little more: the case batching exists for. Made for
    the GPU runs (docs/gpu.md): on a CPU one batch of 64 takes about a second.
    """

    name = "wide"
    hidden = 8192
    layers = 8  # Linear layers

    def init_model(self) -> None:
        import torch

        torch.manual_seed(0)
        self.torch = torch
        nn, width = torch.nn, self.hidden
        # built on the device: initialising 1.6 GB on the CPU first would take seconds
        modules: list[Any] = [nn.Linear(256, width, device=self.device), nn.ReLU()]
        for _ in range(self.layers - 2):
            modules += [nn.Linear(width, width, device=self.device), nn.ReLU()]
        modules.append(nn.Linear(width, 16, device=self.device))
        self.net = nn.Sequential(*modules).eval()
        self.staging = HostStaging(self.device)


class SyncMLP(MLP):
    """The reference MLP with a ``predict`` that waits for its outputs (``to_host``) instead of
    returning them pending: the arm that shows what pending outputs change (docs/gpu.md)."""

    name = "mlp_sync"

    def predict(self, batch: list[Any]) -> list[Any]:
        return list(MLP.predict(self, batch))  # waits for the copy, as to_host does


class SyncWideMLP(WideMLP):
    """The wide model with a ``predict`` that waits for its outputs, as :class:`SyncMLP`."""

    name = "wide_sync"
    predict = SyncMLP.predict


class DeviceReport(MLP):
    """The reference MLP, answering with where it ran (bench/gpu_check.py proves --cuda with it).

    Each output is a map: the MLP's output vector, and the worker process's pid, its
    CUDA_VISIBLE_DEVICES, the device count and name its torch sees, and the output tensor's
    device before it was copied back to the host.
    """

    name = "device_report"

    def init_model(self) -> None:
        super().init_model()
        torch = self.torch
        cuda = self.device != "cpu"
        self.where = {
            "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": self.device,
            "device_count": torch.cuda.device_count() if cuda else 0,
            "device_name": torch.cuda.get_device_name(self.device) if cuda else "cpu",
        }

    def predict(self, batch: list[Any]) -> list[Any]:
        import numpy as np

        with self.torch.inference_mode():
            out = self.net(self.staging.stack(batch, np.float32))
        where = {**self.where, "tensor_device": str(out.device)}
        return [{**where, "output": row} for row in self.staging.to_host(out)]
