"""gpu_worker.oom: a worker process's SIGKILL told apart as the OOM killer's or a kill -9,
from its memory cgroup's OOM kill count (read from fake /proc and /sys/fs/cgroup trees)."""

from __future__ import annotations

from pathlib import Path

from gpu_worker.oom import oom_kills, sigkill_cause
from gpu_worker.supervisor import exit_reason


def tree(tmp_path: Path, cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(text)
    return str(proc), str(cgroups)


def test_cgroup_v2_memory_events_are_read(tmp_path: Path) -> None:
    paths = tree(tmp_path, "0::/kubepods/pod1/c1\n", {
        "kubepods/pod1/c1/memory.events": "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\n",
    })  # fmt: skip
    assert oom_kills(*paths) == 2


def test_a_container_s_own_namespace_reads_the_root_of_its_tree(tmp_path: Path) -> None:
    paths = tree(tmp_path, "0::/\n", {"memory.events": "oom 1\noom_kill 1\n"})
    assert oom_kills(*paths) == 1


def test_cgroup_v1_oom_control_is_read_beside_an_empty_unified_hierarchy(tmp_path: Path) -> None:
    paths = tree(tmp_path, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n", {
        "memory/docker/abc/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n",
        "unified/cgroup.procs": "",
    })  # fmt: skip
    assert oom_kills(*paths) == 5


def test_no_readable_count_is_none(tmp_path: Path) -> None:
    assert oom_kills(str(tmp_path / "nowhere"), str(tmp_path)) is None
    paths = tree(tmp_path, "4:memory:/x\n", {"memory/x/memory.oom_control": "under_oom 0\n"})
    assert oom_kills(*paths) is None


def test_a_sigkill_is_told_apart_by_the_counts() -> None:
    """Every SIGKILL was said to be the OOM killer's, also an operator's kill -9."""
    assert "the out-of-memory killer: this container's memory cgroup counted 1 OOM kill" in (
        exit_reason(-9, (4, 5))
    )
    assert exit_reason(-9, (4, 4)).startswith(
        "killed by SIGKILL (not this container's out-of-memory killer"
    )
    assert "or someone's kill -9" in exit_reason(-9)
    assert exit_reason(-15, (4, 5)) == "killed by SIGTERM"
    assert sigkill_cause(None, 3) == sigkill_cause(3, None)
