"""`module:Class` paths resolve against an app directory, like uvicorn's --app-dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker import Streamer
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from gpu_worker.model import ModelLoadError, load_model_class, use_app_dir
from tests.conftest import ROOT, stop_process, wait_for_consumers

MODEL = """
from gpu_worker import ManagedModel


class Echo(ManagedModel):
    name = "echo_app_dir"

    def predict(self, batch):
        return batch
"""


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project directory with a model module that nothing has put on the import path."""
    module = f"appdir_{tmp_path.name.replace('-', '_')}"
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / f"{module}.py").write_text(MODEL)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "project" / module


def test_a_model_outside_the_import_path_is_found_only_through_the_app_dir(app: Path) -> None:
    path = f"{app.name}:Echo"
    with pytest.raises(ModelLoadError, match="cannot import module"):
        load_model_class(path)
    assert use_app_dir(app.parent) == str(app.parent)
    assert load_model_class(path).name == "echo_app_dir"


def test_the_hint_names_the_app_dir_even_when_it_was_on_the_path_already(
    app: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run as .venv/bin/worker with PYTHONPATH=., the hint named the script's directory
    (sys.path[0]) as where the model was looked for."""
    import gpu_worker.model as model

    monkeypatch.setattr(model, "_app_dir", None, raising=False)
    monkeypatch.setattr(sys, "path", ["/somewhere/bin", str(app.parent), *sys.path])
    assert use_app_dir(app.parent) == str(app.parent)
    with pytest.raises(ModelLoadError, match=f"neither installed nor in {app.parent}:"):
        load_model_class("no_such_module_here:Model")


def test_the_default_app_dir_is_the_current_directory(
    app: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(app.parent)
    assert use_app_dir() == str(app.parent)
    assert load_model_class(f"{app.name}:Echo").name == "echo_app_dir"


def test_processes_started_afterwards_import_from_the_app_dir_too(app: Path) -> None:
    use_app_dir(app.parent)
    use_app_dir(app.parent)  # once is enough: the path is not repeated
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(app.parent), str(ROOT)]
    code = (
        f"from gpu_worker import load_model_class; print(load_model_class('{app.name}:Echo').name)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "echo_app_dir", result.stderr


def test_the_examples_are_not_installed_as_a_top_level_package() -> None:
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [package for package in packages if package.startswith("examples")]
    assert {"broker*", "gpu_worker*", "web_gateway*"} <= set(packages)


def test_worker_start_serves_a_model_of_its_app_dir(
    app: Path, redis_server: RedisServer, prefix: str
) -> None:
    """The CLI itself: `worker start --app-dir DIR` (run from elsewhere) serves a model that
    only DIR holds, in the worker processes it starts too."""
    command = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", f"{app.name}:Echo"]
    command += ["--app-dir", str(app.parent), "--redis", redis_server.url, "--prefix", prefix]
    process = subprocess.Popen(command, cwd=app.parent.parent)
    try:
        wait_for_consumers(redis_server.url, ModelKeys("echo_app_dir", prefix), 1)
        with Streamer("echo_app_dir", redis_url=redis_server.url, prefix=prefix) as streamer:
            assert streamer.predict([1, "two"]) == [1, "two"]
    finally:
        stop_process(process)


@pytest.mark.parametrize(
    "path, said",
    [
        # a file where a module belongs (uvicorn's users write module:app, newcomers a path)
        (
            "examples/mlp.py:MLP",
            "names a file: give its module, as Python imports it: 'examples.mlp:MLP'",
        ),
        (
            "./examples/mlp.py:MLP",
            "names a file: give its module, as Python imports it: 'examples.mlp:MLP'",
        ),
        # the class joined by a dot, as a Python name is written
        (
            "examples.mlp.MLP",
            "must look like 'package.module:ClassName' (did you mean 'examples.mlp:MLP'?)",
        ),
        # the base class itself: its empty name was refused as an invalid model name
        ("gpu_worker:ManagedModel", "is ManagedModel itself: name a subclass of it"),
        # a traceback (AttributeError: ... '_graph') in `worker start`
        ("gpu_worker.pipeline:Pipeline", "is Pipeline itself: name a subclass of it"),
    ],
)
def test_a_model_path_written_another_way_says_how_to_write_it(path: str, said: str) -> None:
    """'examples/mlp.py:MLP' was 'No module named examples/mlp', './examples/mlp.py:MLP'
    a TypeError about relative imports."""
    with pytest.raises(ModelLoadError) as refused:
        load_model_class(path)
    assert said in str(refused.value), str(refused.value)
