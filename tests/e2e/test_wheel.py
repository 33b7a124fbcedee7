"""The wheel `pip install microbatch` gets: what user code needs of it beyond the modules."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import ROOT


def test_the_wheel_marks_its_packages_typed(tmp_path: Path) -> None:
    # Without py.typed, mypy skips the installed packages ("missing library stubs or py.typed
    # marker"): a user's calls of Streamer, ManagedModel, ... would go unchecked.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("microbatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f"{p}/py.typed" for p in ("broker", "gpu_worker", "web_gateway")]
    assert [name for name in missing if name not in names] == []
