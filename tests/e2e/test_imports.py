"""Gateways import model classes without torch: importing must stay light."""

from __future__ import annotations

import ast
import contextlib
import re

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


def _requirement_closure(requirements: list[str]) -> set[str]:
    """The distributions these requirement strings name, and theirs, and so on (extras named
    in a requirement count: ``redis[hiredis]`` brings hiredis)."""
    from importlib.metadata import PackageNotFoundError, requires

    def normal(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        found = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*(\[([^\]]*)\])?", requirement)
        assert found, requirement
        name = normal(found.group(1))
        extras = frozenset(e.strip() for e in (found.group(3) or "").split(",") if e.strip())
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        with contextlib.suppress(PackageNotFoundError):  # not installed here: no further
            todo += [
                r
                for r in requires(name) or []
                if "extra" not in r.partition(";")[2]
                or any(re.search(rf"extra\s*==\s*['\"]{e}['\"]", r) for e in extras)
            ]
    return {name for name, _ in seen}


def _optional(tree: ast.AST) -> set[ast.AST]:
    """Import statements inside a ``try`` whose handlers catch ImportError: optional ones."""
    found: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            "ImportError" in ast.unparse(handler.type or ast.Name("BaseException"))
            for handler in node.handlers
        ):
            found.update(n for stmt in node.body for n in ast.walk(stmt))
    return found


def test_what_broker_and_gpu_worker_import_is_installed_by_the_core_dependencies() -> None:
    """`pip install microbatch` (no extras) gives every third-party module the client and the
    worker import (torch excepted: the worker extra), at any depth of any module; imports
    in a ``try`` that catches ImportError are optional."""
    import sys
    from importlib.metadata import packages_distributions

    import tomllib

    from tests.conftest import ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = _requirement_closure(project["dependencies"])
    providers = packages_distributions()
    own = {"broker", "gpu_worker", "web_gateway", "examples"}
    missing = set()
    for package in ("broker", "gpu_worker"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            optional = _optional(tree)
            for node in ast.walk(tree):
                if node in optional:
                    continue
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top in sys.stdlib_module_names or top in own or top == "torch":
                        continue
                    dists = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(top, [])}
                    if not dists & installed:
                        missing.add(f"{top} ({path.relative_to(ROOT)})")
    assert not missing, sorted(missing)
