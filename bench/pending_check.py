"""Outputs returned pending, on a CUDA device: correct, and what one batch costs three ways.

Run on a GPU machine (docs/gpu.md, section 6)::

    python -m bench.pending_check

It loads the reference MLP on ``cuda:0`` and on the CPU and prints: whether ``predict``'s
outputs come pending (``HostStaging.to_host_later``) and are not done the moment it returns;
the largest difference from the CPU's outputs; that two batches in flight before either is
taken each get their own outputs; and the milliseconds per batch of 64 when ``predict`` waits
for its outputs (``to_host``), when the pending outputs are taken at once, and pipelined (the
next batch handed over before the last one's outputs are taken, as the worker does).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def per_batch_ms(step: Callable[[], Any], seconds: float = 2.0) -> float:
    import torch

    with torch.inference_mode():
        for _ in range(50):
            step()
        started, count = time.perf_counter(), 0
        while time.perf_counter() - started < seconds:
            step()
            count += 1
    return 1000 * (time.perf_counter() - started) / count


def main() -> None:
    import torch

    from examples.mlp import MLP
    from gpu_worker.outcomes import is_pending, outputs_now
    from gpu_worker.staging import OutputCopy

    gpu, cpu = MLP("cuda:0"), MLP("cpu")
    gpu.init_model()
    gpu.warmup()
    cpu.init_model()
    batch = [np.random.default_rng(i).standard_normal(256).astype(np.float32) for i in range(64)]
    pending = gpu.predict(batch)
    assert isinstance(pending, OutputCopy)
    print("pending", is_pending(pending), "done at once", pending.done())
    got = np.stack(pending.result())
    print("max abs diff vs cpu", float(np.abs(got - np.stack(list(cpu.predict(batch)))).max()))
    first, second = gpu.predict(batch[:32]), gpu.predict(batch[32:])
    print("two in flight equal", np.allclose(np.stack([*first, *second]), got, atol=1e-5))

    def waits() -> Any:
        return list(gpu.staging.to_host(gpu.net(gpu.staging.stack(batch, np.float32))))

    print("sync ms per batch", per_batch_ms(waits))
    print("later ms per batch", per_batch_ms(lambda: outputs_now(gpu.predict(batch))))
    with torch.inference_mode():
        started, count, last = time.perf_counter(), 0, gpu.predict(batch)
        while time.perf_counter() - started < 2:
            current = gpu.predict(batch)
            outputs_now(last)
            last, count = current, count + 1
        outputs_now(last)
    print("pipelined ms per batch", 1000 * (time.perf_counter() - started) / count)


if __name__ == "__main__":
    main()
