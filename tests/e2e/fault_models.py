"""Models for the fault-injection suite (tests/e2e/test_faults.py).

Each fault is triggered by an input or by the environment, so a test decides what happens from
outside the worker process. Every model records what it is given and what it computes, per
process, under ``MICROBATCH_TEST_RECORD_DIR`` (like tests/models.py):

- ``batches-<pid>.jsonl``: one line per ``predict`` call, the items it was given (written on
  entry, before any fault fires, so a batch that kills the process is still on record);
- ``items-<pid>.jsonl``: one line per item actually computed (written once the batch is done).

String items carry the triggers of :class:`Faulty`:

- ``"poison:<tag>"``: ``os._exit(1)``, the whole process dies at once, unless the file named by
  ``MICROBATCH_FAULT_FIXED_FILE`` exists (the model has been "fixed");
- ``"hang:<tag>"``: never returns;
- ``"fail:<message>"``: ``predict`` raises ``ValueError(message)``;
- ``"sleep:<seconds>:<tag>"``: the batch sleeps that long first;
- anything else is computed normally.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gpu_worker import ManagedModel, TensorSpec

RECORD_ENV = "MICROBATCH_TEST_RECORD_DIR"
FIXED_ENV = "MICROBATCH_FAULT_FIXED_FILE"  # poison items are harmless once this file exists
BATCH_SLEEP_ENV = "MICROBATCH_FAULT_BATCH_SLEEP"  # seconds every batch sleeps (Faulty, Sleeper)
GIL_SECONDS_ENV = "MICROBATCH_FAULT_GIL_SECONDS"  # seconds of pure-Python loop per batch (GilHog)


def record(kind: str, payload: Any) -> None:
    """Append one JSON line to ``<kind>-<pid>.jsonl`` in the record directory, if one is set."""
    directory = os.environ.get(RECORD_ENV)
    if directory:
        with open(os.path.join(directory, f"{kind}-{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(payload) + "\n")


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def _fixed() -> bool:
    marker = os.environ.get(FIXED_ENV)
    return bool(marker) and os.path.exists(marker)


class Faulty(ManagedModel):
    """Strings in, ``{"item", "pid", "batch"}`` out; the faults of the module docstring."""

    name = "faulty"
    inputs = [TensorSpec("input", "BYTES", [])]
    outputs = [TensorSpec("output", "BYTES", [])]
    batch_size = 8

    def init_model(self) -> None:
        self.batch_sleep = _env_seconds(BATCH_SLEEP_ENV, 0.0)

    def predict(self, batch: list[Any]) -> list[Any]:
        record("batches", batch)
        for item in batch:
            text = item if isinstance(item, str) else ""
            if text.startswith("poison:") and not _fixed():
                sys.stderr.flush()
                os._exit(1)
            if text.startswith("hang:"):
                threading.Event().wait()  # forever
            if text.startswith("fail:"):
                raise ValueError(text.removeprefix("fail:"))
        pause = self.batch_sleep
        for item in batch:
            if isinstance(item, str) and item.startswith("sleep:"):
                pause += float(item.split(":")[1])
        if pause:
            time.sleep(pause)
        for item in batch:
            record("items", item)
        pid = os.getpid()
        return [{"item": item, "pid": pid, "batch": len(batch)} for item in batch]


class PendingFaulty(Faulty):
    """:class:`Faulty` computing on a thread of its own: ``predict`` returns a Future of the
    outputs (pending outputs, as a GPU model's), so the faults fire while the batch is pending
    and the next one may be handed over already."""

    name = "pendingfaulty"

    def init_model(self) -> None:
        super().init_model()
        self.computing = ThreadPoolExecutor(max_workers=1)  # its "device"

    def predict(self, batch: list[Any]) -> Any:
        return self.computing.submit(Faulty.predict, self, batch)


class GilHog(ManagedModel):
    """Holds the GIL in a pure-Python loop for MICROBATCH_FAULT_GIL_SECONDS (3 s) per batch.

    The switch interval is raised for the duration, so no other thread of the process gets the
    GIL either: only another process (the supervisor) can vouch for this worker meanwhile.
    """

    name = "gilhog"
    batch_size = 4

    def init_model(self) -> None:
        self.seconds = _env_seconds(GIL_SECONDS_ENV, 3.0)

    def predict(self, batch: list[Any]) -> list[Any]:
        record("batches", batch)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(self.seconds + 1.0)
        try:
            end = time.perf_counter() + self.seconds
            spins = 0
            while time.perf_counter() < end:
                spins += 1
        finally:
            sys.setswitchinterval(interval)
        for item in batch:
            record("items", item)
        pid = os.getpid()
        return [{"item": item, "pid": pid, "spins": spins} for item in batch]


class Sleeper(ManagedModel):
    """FP32[4] -> FP32[4] (times two) that sleeps MICROBATCH_FAULT_BATCH_SLEEP (0.2 s) per
    batch: its capacity is known, batch_size / sleep items per second per worker."""

    name = "sleeper"
    inputs = [TensorSpec("input", "FP32", [4])]
    outputs = [TensorSpec("output", "FP32", [4])]
    batch_size = 4

    def init_model(self) -> None:
        self.batch_sleep = _env_seconds(BATCH_SLEEP_ENV, 0.2)

    def predict(self, batch: list[Any]) -> list[Any]:
        time.sleep(self.batch_sleep)
        for item in batch:
            record("items", [float(value) for value in item])
        return [np.asarray(item, dtype=np.float32) * 2 for item in batch]


DEVICE_ITEMS_ENV = "MICROBATCH_FAULT_DEVICE_ITEMS"  # items Hungry's "device" holds at once (4)


class _Block:
    """One item's share of :class:`Hungry`'s device memory, given back when it is freed (as
    a CUDA tensor's memory is, once nothing refers to it)."""

    live = 0

    def __init__(self) -> None:
        _Block.live += 1

    def __del__(self) -> None:
        _Block.live -= 1


class Hungry(Faulty):
    """:class:`Faulty` on a "device" that holds MICROBATCH_FAULT_DEVICE_ITEMS items at once
    (4): each item takes a block of it while its batch is computed, and ``predict`` raises
    ``torch.cuda.OutOfMemoryError`` when no block is left, as torch does; ``"huge:<tag>"``
    items never fit."""

    name = "hungry"

    def init_model(self) -> None:
        super().init_model()
        self.capacity = int(_env_seconds(DEVICE_ITEMS_ENV, 4))

    def predict(self, batch: list[Any]) -> list[Any]:
        import torch

        held = []  # the batch's activations: freed when predict's frame is
        for item in batch:
            if _Block.live >= self.capacity or str(item).startswith("huge:"):
                record("batches", batch)
                raise torch.cuda.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate 2.00 GiB; {_Block.live} of "
                    f"{self.capacity} blocks in use"
                )
            held.append(_Block())
        return super().predict(batch)
