"""Programs that never close their streamer exit cleanly, with torch imported.

A loop thread still running when the interpreter finalises used to crash it (a uvloop timer
calling back into a half-torn-down interpreter): about half the runs of the README's
LocalStreamer quick start without ``close()``, and of a service_streamer program on the compat
ThreadedStreamer without ``destroy_workers()``, ended in SIGSEGV.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from broker import loop_thread
from gpu_worker import LocalStreamer
from tests.conftest import ROOT
from tests.models import Toy

QUICK_START = """\
import torch  # noqa: F401  (the crash needed torch loaded)
from gpu_worker import LocalStreamer
from examples.mlp import MLP

local = LocalStreamer(MLP, batch_size=64)  # runs init_model() and warmup() here
outputs = local.predict([[0.0] * 256])
print(len(outputs[0]))
"""

THREADED = """\
import torch
from gpu_worker.compat import ThreadedStreamer


def predict(batch):
    return [float(torch.as_tensor(item).sum()) for item in batch]


streamer = ThreadedStreamer(predict, batch_size=8, max_latency=0.01)
futures = [streamer.submit([[1.0, 2.0]]) for _ in range(4)]
print(streamer.predict([[1.0, 2.0]] * 3), [f.result() for f in futures])
"""

RUNS = 20


def run_program(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("microbatch-") and t.daemon]


def test_loop_threads_still_running_at_exit_are_stopped_and_joined() -> None:
    streamer = LocalStreamer(Toy, batch_size=4)
    assert [out["item"] for out in streamer.predict(["a", "b"])] == ["a", "b"]
    assert loop_threads()
    loop_thread.stop_all()  # what the interpreter runs as it exits
    assert not loop_threads()
    assert streamer.batches_run >= 1
    streamer.close()  # closing again is harmless


@pytest.mark.slow
@pytest.mark.timeout(600)  # 40 runs of torch programs on a shared 2-core machine
def test_unclosed_streamers_exit_cleanly_every_time(tmp_path: Path) -> None:
    programs = {"quick_start.py": QUICK_START, "threaded_streamer.py": THREADED}
    paths = []
    for name, source in programs.items():
        (tmp_path / name).write_text(source)
        paths += [tmp_path / name] * RUNS
    with ThreadPoolExecutor(2) as pool:  # two at a time: the machine has two cores
        results = list(pool.map(run_program, paths))
    failures = [
        (path.name, done.returncode, done.stderr[-500:])
        for path, done in zip(paths, results, strict=True)
        if done.returncode != 0
    ]
    assert failures == []
    assert {done.stdout.strip() for done in results[:RUNS]} == {"16"}
    threaded = "[3.0, 3.0, 3.0] [[3.0], [3.0], [3.0], [3.0]]"
    assert {done.stdout.strip() for done in results[RUNS:]} == {threaded}
