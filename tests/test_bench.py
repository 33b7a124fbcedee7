"""The benchmark harness runs end to end (`python -m bench --quick`); no assertions on speed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_quick_harness_reports_every_scenario(tmp_path: Path) -> None:
    from bench.harness import OURS

    subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--output-dir", str(tmp_path)],
        cwd=ROOT,
        check=True,
        timeout=540,
    )
    report = json.loads((tmp_path / "harness-quick.json").read_text())
    rows = report["results"]
    failures = [r for r in rows if "error" in r]
    assert not failures, failures
    expected = OURS if shutil.which("wrk") else [s for s in OURS if not s.startswith("http")]
    concurrency = report["settings"]["concurrency"]
    for scenario in expected:
        found = [r for r in rows if r["scenario"] == scenario]
        levels = [1] if scenario.startswith("direct") else concurrency
        assert sorted(r["concurrency"] for r in found) == sorted(levels), scenario
        for r in found:
            assert r["items_per_s"] > 0, r
            assert r["errors"] == 0, r
            assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"], r
            assert r["mean_batch"] is not None and r["mean_batch"] >= 1, r
    assert {r["model"] for r in rows} == {"mlp"}
