"""``python -m bench.scale``: its partitioned model's streams (and its six models) spread
evenly over shards, and its quick run reports every part (no assertions on speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.scale import PARTITIONS, SLOTS, model_names, partitioned_name
from broker.cluster_lane import key_slot
from broker.keys import ModelKeys

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shards", [1, 2, 3, 6])
def test_the_models_fall_evenly_on_any_shard_count_dividing_them(shards: int) -> None:
    names = model_names()
    assert len(set(names)) == 6
    # the bench gives shard i the slots from i * SLOTS // shards on
    owners = Counter(key_slot(ModelKeys(name, "scale").stream) * shards // SLOTS for name in names)
    assert sorted(owners) == list(range(shards))
    assert set(owners.values()) == {6 // shards}


@pytest.mark.parametrize("shards", [1, 2, 3, 6])
def test_the_partitions_of_the_one_model_fall_evenly_on_any_shard_count_dividing_them(
    shards: int,
) -> None:
    keys = ModelKeys(partitioned_name(), "scale", partitions=PARTITIONS)
    streams = [each.stream for each in keys.each()]
    assert len(set(streams)) == PARTITIONS == 6
    owners = Counter(key_slot(stream) * shards // SLOTS for stream in streams)
    assert sorted(owners) == list(range(shards))
    assert set(owners.values()) == {PARTITIONS // shards}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_quick_run_reports_hosts_and_shards(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    command = [sys.executable, "-m", "bench.scale", "--quick", "--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=360)
    report = json.loads(out.read_text())
    hosts = report["hosts"]
    for path, role in (("client", "caller"), ("gateway", "gateway")):
        figures = hosts[path]
        assert figures["p50_ms"] > 0
        assert figures["per_request"][role]["round_trips"] > 0
        assert figures["per_request"]["worker"]["round_trips"] > 0
    [cap] = report["shards"]["caps"]
    assert [run["shards"] for run in cap["runs"]] == [1, 3]
    for run in cap["runs"]:
        assert run["items"] > 0 and run["errors"] == {}
        assert run["redis_cpu_us_per_item"] > 0
        # one model over six partitions, every primary's Redis CPU measured
        assert (run["layout"], run["partitions"], len(run["models"])) == ("partitions", 6, 1)
        assert len(run["redis_cpu_used_per_shard"]) == run["shards"]
    assert out.with_suffix(".png").exists()
