"""Small models for tests: deterministic, light, each behaviour triggered by its input."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from gpu_worker import ManagedModel, TensorSpec

RECORD_ENV = "MICROBATCH_TEST_RECORD_DIR"
TAG_ENV = "MICROBATCH_TEST_TAG"
DELAY_ENV = "MICROBATCH_TEST_BATCH_DELAY"
INIT_UNTIL_ENV = "MICROBATCH_TEST_INIT_UNTIL"  # Toy's init_model waits for this file (60 s at most)


def _record(kind: str, payload: Any) -> None:
    directory = os.environ.get(RECORD_ENV)
    if directory:
        with open(os.path.join(directory, f"{kind}-{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(payload) + "\n")


class Toy(ManagedModel):
    """Returns each item with the order it was computed in and the size of its batch.

    ``{"fail": msg}`` makes predict raise ValueError(msg); ``{"sleep": s}`` sleeps s seconds
    first; ``{"until": path}`` holds the batch until that file exists (60 s at most; with
    ``"started": path2`` beside it, the file path2 is made first). With
    MICROBATCH_TEST_RECORD_DIR set, every computed item is recorded per process; with
    MICROBATCH_TEST_INIT_UNTIL, init_model waits for that file (60 s at most).
    """

    name = "toy"
    # no declared tensors: it takes any value (its markers are objects), unchecked
    batch_size = 8

    def init_model(self) -> None:
        until = os.environ.get(INIT_UNTIL_ENV)
        deadline = time.monotonic() + 60
        while until and not os.path.exists(until) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.counter = itertools.count()
        self.batches = itertools.count()
        self.tag = os.environ.get(TAG_ENV, "")
        self.delay = float(os.environ.get(DELAY_ENV, "0"))

    def predict(self, batch: list[Any]) -> list[Any]:
        for item in batch:
            if isinstance(item, dict) and "fail" in item:
                raise ValueError(item["fail"])
        for item in batch:
            if isinstance(item, dict) and "sleep" in item:
                time.sleep(item["sleep"])
            if isinstance(item, dict) and "until" in item:
                if "started" in item:  # say that the batch is being computed
                    Path(item["started"]).touch()
                deadline = time.monotonic() + 60
                while not os.path.exists(item["until"]) and time.monotonic() < deadline:
                    time.sleep(0.01)
        if self.delay:
            time.sleep(self.delay)
        for item in batch:
            _record("items", item)
        batch_no = next(self.batches)
        return [
            {
                "item": item,
                "seq": next(self.counter),
                "batch": len(batch),
                "tag": self.tag,
                "pid": os.getpid(),
                "batch_no": batch_no,
            }
            for item in batch
        ]


class DeviceProbe(ManagedModel):
    """Records, at start, which device the worker process was given and what it can see."""

    name = "probe"

    def init_model(self) -> None:
        from gpu_worker.devices import device_count

        _record(
            "device",
            {
                "pid": os.getpid(),
                "device": self.device,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "device_count": device_count(),
            },
        )

    def predict(self, batch: list[Any]) -> list[Any]:
        return [{"device": self.device, "pid": os.getpid()} for _ in batch]


class SmallProbe(DeviceProbe):
    """A DeviceProbe holding a small torch module (a few KiB of weights)."""

    name = "smallprobe"

    def init_model(self) -> None:
        import torch

        self.net = torch.nn.Linear(16, 16)
        super().init_model()


class LargeProbe(DeviceProbe):
    """A DeviceProbe whose module has 2 GiB of weights, on torch's meta device (no memory)."""

    name = "largeprobe"

    def init_model(self) -> None:
        import torch

        self.net = torch.nn.Linear(32768, 16384, bias=False, device="meta")
        super().init_model()


class UnsizableProbe(DeviceProbe):
    """A DeviceProbe whose module fails as its size is taken (as a CUDA error surfacing at the
    first synchronisation would)."""

    name = "unsizableprobe"

    def init_model(self) -> None:
        import torch

        class Broken(torch.nn.Module):
            def parameters(self, recurse: bool = True) -> Any:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

        self.net = Broken()
        super().init_model()


class LateExtraProbe(SmallProbe):
    """A SmallProbe whose first process loads at once and whose others finish loading
    ``LATE_S`` seconds after the first did (told apart through MICROBATCH_TEST_RECORD_DIR);
    with ``LATE_S`` None they fail to load."""

    name = "lateextraprobe"
    LATE_S: float | None = 5.0

    def init_model(self) -> None:
        super().init_model()
        first = os.path.join(os.environ[RECORD_ENV], "first-loaded")
        try:
            with open(first, "x") as out:
                out.write(str(time.time()))
        except FileExistsError:
            if self.LATE_S is None:
                raise RuntimeError("only the first process loads") from None
            with open(first) as record:
                loaded = float(record.read())
            time.sleep(max(0.0, loaded + self.LATE_S - time.time()))


class StuckExtraProbe(LateExtraProbe):
    """A SmallProbe whose first process loads at once and whose others take a minute."""

    name = "stuckextraprobe"
    LATE_S = 60.0


class FlakyExtraProbe(LateExtraProbe):
    """A SmallProbe that loads in the first process only."""

    name = "flakyextraprobe"
    LATE_S = None


class BrokenInit(ManagedModel):
    """A model whose init_model raises."""

    name = "broken"

    def init_model(self) -> None:
        raise RuntimeError("weights file missing")

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch


class WrongCount(ManagedModel):
    """A model that returns one output too few."""

    name = "wrongcount"

    def predict(self, batch: list[Any]) -> list[Any]:
        return batch[:-1]


class WhichThread(ManagedModel):
    """Answers each item with the name of the thread its batch was computed on."""

    name = "which_thread"
    batch_size = 4

    def predict(self, batch: list[Any]) -> list[Any]:
        import threading

        return [threading.current_thread().name] * len(batch)


class HostTagged(ManagedModel):
    """FP32[2] -> FP32[3]: ``[2 * a, b + 1, tag]``, where tag is the number in
    MICROBATCH_TEST_TAG (which host computed it; 0 if unset). Every batch sleeps
    MICROBATCH_TEST_BATCH_DELAY seconds, so a worker holds its items for a while."""

    name = "hosttagged"
    inputs = [TensorSpec("input", "FP32", [2])]
    outputs = [TensorSpec("output", "FP32", [3])]
    batch_size = 8

    def init_model(self) -> None:
        self.tag = float(os.environ.get(TAG_ENV) or 0)
        self.delay = float(os.environ.get(DELAY_ENV, "0"))

    def predict(self, batch: list[Any]) -> list[Any]:
        import numpy as np

        if self.delay:
            time.sleep(self.delay)
        return [np.array([2 * item[0], item[1] + 1, self.tag], dtype=np.float32) for item in batch]


def host_tagged_expected(item: list[float]) -> list[float]:
    """What :class:`HostTagged` answers for ``item``, without the tag."""
    return [2 * item[0], item[1] + 1]


class Costed(ManagedModel):
    """Items are strings; each costs its length (a budget of 24 per batch, 8 items at most).
    Answers each item with its batch's lengths, the batch's number and the process; every
    batch sleeps MICROBATCH_TEST_BATCH_DELAY seconds."""

    name = "costed"
    batch_size = 8
    max_batch_cost = 24

    def init_model(self) -> None:
        self.batches = itertools.count()
        self.delay = float(os.environ.get(DELAY_ENV, "0"))

    def item_cost(self, item: Any) -> int:
        return len(item)

    def predict(self, batch: list[Any]) -> list[Any]:
        if self.delay:
            time.sleep(self.delay)
        lengths = [len(item) for item in batch]
        number = next(self.batches)
        return [
            {"item": item, "batch": lengths, "batch_no": number, "pid": os.getpid()}
            for item in batch
        ]
