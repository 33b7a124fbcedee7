"""Device pinning: which CUDA device each worker process gets.

``--cuda`` indices are relative to the devices this process can see, so they compose with a
``CUDA_VISIBLE_DEVICES`` set by Kubernetes or Docker. Each child gets exactly one device through
its own ``CUDA_VISIBLE_DEVICES``, set before its interpreter (and so torch) starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import ManagedModel

# Overrides the device count (for tests, and for hosts where torch cannot count devices). A
# child pinned to one device then sees a count of 1, as it would with a real driver.
DEVICE_COUNT_ENV = "MICROBATCH_CUDA_DEVICE_COUNT"


class DeviceError(ValueError):
    """A requested device does not exist or cannot be used."""


# Run by a short-lived interpreter where this process has not imported torch itself.
COUNT_PROGRAM = "import torch; print(torch.cuda.device_count())"
COUNT_TIMEOUT_S = 120.0  # importing a CUDA build of torch from a cold disk can take a while


def device_count(*, in_process: bool = False) -> int:
    """How many CUDA devices this process can see.

    With ``in_process`` (a worker child, whose model needs torch anyway) torch is imported
    here. Otherwise a process that has not imported torch (a `worker start` supervisor) asks
    a short-lived interpreter: importing a CUDA build of torch for one number would keep
    ~0.5 GB resident in it for its whole life.
    """
    override = os.environ.get(DEVICE_COUNT_ENV)
    if override is not None:
        return int(override)
    torch = sys.modules.get("torch")
    if torch is None and in_process:
        try:
            import torch
        except ImportError:
            return 0
    if torch is not None:
        return int(torch.cuda.device_count())
    return _count_in_subprocess()


def _count_in_subprocess() -> int:
    try:
        done = subprocess.run(
            [sys.executable, "-c", COUNT_PROGRAM],
            capture_output=True,
            text=True,
            timeout=COUNT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DeviceError(f"could not count CUDA devices: {exc}") from exc
    if done.returncode != 0:
        if "No module named 'torch'" in done.stderr:
            return 0
        reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DeviceError(f"could not count CUDA devices: {reason}")
    try:
        return int(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError) as exc:
        raise DeviceError(f"could not count CUDA devices: got {done.stdout!r}") from exc


def visible_devices() -> list[str]:
    """The devices this process sees, as entries usable in a child's CUDA_VISIBLE_DEVICES."""
    count = device_count()
    preset = os.environ.get("CUDA_VISIBLE_DEVICES")
    if preset is None:
        return [str(index) for index in range(count)]
    entries = [entry.strip() for entry in preset.split(",") if entry.strip()]
    return entries[:count]


def parse_cuda(spec: str) -> list[int]:
    """Parse ``--cuda 0,1`` into indices; raise DeviceError for anything else."""
    indices = []
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit():
            raise DeviceError(f"--cuda takes device indices like '0,1', not {spec!r}")
        indices.append(int(part))
    if len(set(indices)) != len(indices):
        raise DeviceError(f"--cuda lists a device twice: {spec!r}")
    return indices


def plan_devices(indices: list[int], workers_per_device: int = 1) -> list[str]:
    """One CUDA_VISIBLE_DEVICES value per worker process, checked against what exists."""
    if workers_per_device < 1:
        raise DeviceError("--workers-per-device must be at least 1")
    visible = visible_devices()
    for index in indices:
        if index >= len(visible):
            seen = ", ".join(str(i) for i in range(len(visible))) or "none"
            raise DeviceError(
                f"CUDA device {index} does not exist: this process sees "
                f"{len(visible)} device(s) ({seen})"
            )
    return [visible[index] for index in indices for _ in range(workers_per_device)]


def child_environment(cuda_visible: str | None) -> dict[str, str]:
    """The environment of a worker child pinned to ``cuda_visible`` (None: CPU only)."""
    env = dict(os.environ)
    if cuda_visible is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
        if DEVICE_COUNT_ENV in env:
            env[DEVICE_COUNT_ENV] = "0"
    else:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
        if DEVICE_COUNT_ENV in env:
            env[DEVICE_COUNT_ENV] = "1"
    return env


# Automatic workers per device. A model this small on its device is, on a GPU, almost always one
# whose batch takes well under a millisecond there: one worker process spends more time on the
# host work of a batch (reading, decoding, answering) than the GPU spends on it, and a second or
# third process on the same device overlaps that host work. Larger models are bound by the GPU
# (or by reading their weights) and lose from smaller batches and extra copies of the weights.
AUTO_SMALL_MODEL_BYTES = 1 << 30
AUTO_MAX_WORKERS_PER_DEVICE = 3


def auto_workers_per_device(device_bytes: int | None, devices: int, cores: float) -> int:
    """How many worker processes `--workers-per-device auto` runs on each device.

    ``device_bytes``: what the first worker's model holds on its device (None: unknown).
    Up to 3 for a model holding at most 1 GiB, one host core per process (``cores`` shared by
    ``devices`` devices); 1 for a larger model, or one whose size is unknown.
    """
    if device_bytes is None or device_bytes > AUTO_SMALL_MODEL_BYTES:
        return 1
    per_device = int(cores // max(1, devices))
    return max(1, min(AUTO_MAX_WORKERS_PER_DEVICE, per_device))


def device_footprint(model: ManagedModel) -> int | None:
    """Bytes the loaded ``model`` holds on its device; None where that cannot be told.

    On a CUDA device: the memory torch has allocated there (the weights and whatever else the
    model keeps on the GPU). Elsewhere: the parameters and buffers of the ``torch.nn.Module``
    attributes of the model. A model without torch, with no module to count, or that put
    nothing on its GPU through torch (ONNX Runtime, TensorRT, JAX, CuPy): None.
    """
    torch: Any = sys.modules.get("torch")
    if torch is None:
        return None
    # str(): a model may have made its device a torch.device
    if str(model.device).startswith("cuda") and torch.cuda.is_available():
        # Every CUDA worker imports torch (to check its device), so torch being there says
        # nothing; one that never initialised CUDA did not put the model there, and
        # synchronize() would create a CUDA context (hundreds of MiB of the GPU) to report 0.
        if not torch.cuda.is_initialized():
            return None
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated()) or None
    modules = [
        value
        for value in getattr(model, "__dict__", {}).values()
        if isinstance(value, torch.nn.Module)
    ]
    if not modules:
        return None
    counted: dict[int, int] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            counted[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(counted.values())
