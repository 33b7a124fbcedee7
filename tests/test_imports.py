"""Gateways import model classes without torch: importing must stay light."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_importing_gpu_worker_and_the_example_model_leaves_torch_out() -> None:
    code = (
        "import sys, gpu_worker, examples.mlp, broker; "
        "m = examples.mlp.MLP(); m.preprocess([0.0]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; print('light')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "light"


def test_broker_imports_neither_torch_nor_web_frameworks() -> None:
    code = (
        "import sys, broker, broker.client, broker.redis_transport, broker.memory_transport; "
        "bad = [m for m in ('torch', 'gpu_worker', 'web_gateway', 'fastapi', 'starlette') "
        "if m in sys.modules]; print(bad)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_a_model_class_comes_without_the_batch_loop() -> None:
    # what a gateway imports of gpu_worker: the package and model classes, never the worker
    code = (
        "import sys, gpu_worker, examples.mlp; from gpu_worker import ManagedModel, TensorSpec; "
        "bad = [m for m in ('gpu_worker.batching', 'gpu_worker.local', 'gpu_worker.runners', "
        "'gpu_worker.model_thread', 'broker.memory_transport') if m in sys.modules]; print(bad)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "[]", result.stderr
