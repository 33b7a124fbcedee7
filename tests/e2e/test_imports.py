"""Gateways import model classes without torch: importing must stay light."""

from __future__ import annotations

from tests.conftest import run_python


def test_importing_gpu_worker_and_the_example_model_leaves_torch_out() -> None:
    code = (
        "import sys, gpu_worker, gpu_worker.staging, examples.mlp, broker; "
        "m = examples.mlp.MLP(); m.preprocess([0.0]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; print('light')"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "light"


def test_broker_imports_neither_torch_nor_web_frameworks() -> None:
    code = (
        "import sys, broker, broker.client, broker.redis_transport, broker.memory_transport; "
        "bad = [m for m in ('torch', 'gpu_worker', 'web_gateway', 'fastapi', 'starlette') "
        "if m in sys.modules]; print(bad)"
    )
    result = run_python(code)
    assert result.stdout.strip() == "[]", result.stderr


BATCH_LOOP = (
    "gpu_worker.batching",
    "gpu_worker.local",
    "gpu_worker.runners",
    "gpu_worker.model_thread",
    "broker.memory_transport",
    "torch",
)


def test_the_gateway_process_never_imports_the_batch_loop() -> None:
    # the app, its CLI and its gunicorn entry point (with a model class loaded, as a gateway does)
    code = (
        "import sys, web_gateway.app, web_gateway.cli, web_gateway.gunicorn_conf, "
        "web_gateway.server; "
        "from gpu_worker.model import load_model_class; load_model_class('examples.mlp:MLP'); "
        f"print([m for m in {BATCH_LOOP!r} if m in sys.modules])"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    # the embedded streamer still loads on first use
    code = (
        "import gpu_worker, sys; gpu_worker.LocalStreamer; print('gpu_worker.local' in sys.modules)"
    )
    result = run_python(code)
    assert result.stdout.strip() == "True", result.stderr


def test_a_model_class_comes_without_the_batch_loop() -> None:
    # what a gateway imports of gpu_worker: the package and model classes, never the worker
    code = (
        "import sys, gpu_worker, examples.mlp; from gpu_worker import ManagedModel, TensorSpec; "
        f"print([m for m in {BATCH_LOOP[:-1]!r} if m in sys.modules])"
    )
    result = run_python(code)
    assert result.stdout.strip() == "[]", result.stderr
