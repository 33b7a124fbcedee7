"""The wheel `pip install microbatch` gets: what user code needs of it beyond the modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("broker", "gpu_worker", "web_gateway")


def test_the_wheel_marks_its_packages_typed(tmp_path: Path) -> None:
    # Without py.typed, mypy skips the installed packages ("missing library stubs or py.typed
    # marker"): a user's calls of Streamer, ManagedModel, ... would go unchecked.
    source = tmp_path / "source"  # a copy: setuptools leaves build/ and *.egg-info behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in PACKAGES:
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / package, source / package, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("microbatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f"{package}/py.typed" for package in PACKAGES]
    assert [name for name in missing if name not in names] == []
