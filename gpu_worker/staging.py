"""Moving a batch to the model's device and its outputs back: pinned buffers, async copies.

A model's ``predict`` gets a list of numpy items. :class:`HostStaging` stacks them and copies
the batch to the device, and copies outputs back to numpy::

    def init_model(self) -> None:
        ...
        self.staging = HostStaging(self.device)

    def predict(self, batch):
        with torch.inference_mode():
            out = self.net(self.staging.stack(batch, np.float32))
        return list(self.staging.to_host(out))

On a CUDA device the items are stacked straight into a reused page-locked (pinned) host buffer
and copied with ``non_blocking=True``; outputs come back through another pinned buffer, the
copy is waited for, and the caller gets its own array (a copy: the worker may encode a batch's
outputs while the next batch computes). ``to_host_later`` starts that copy and returns at
once: ``predict`` returns it, and the worker reads and prepares the next batch while the
device computes this one. Elsewhere (CPU, or no CUDA) it is the plain path:
``np.stack`` into a new array, ``.to(device)``, ``.cpu().numpy()``. Both give the same values.

torch is imported when a :class:`HostStaging` is made, never by importing this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["HostBuffer", "HostStaging", "OutputCopy", "pins_memory"]

MIN_BUFFER_BYTES = 4096  # a page: buffers grow to powers of two from there


def pins_memory(device: object, cuda_available: bool) -> bool:
    """Whether batches for ``device`` (``"cuda"``, ``"cuda:1"``, ``"cpu"``, a torch.device)
    go through pinned host memory: only for a CUDA device, and only when CUDA is available
    (page-locking is done by the CUDA driver)."""
    return cuda_available and str(device).partition(":")[0] == "cuda"


def _torch() -> Any:
    import torch

    return torch


class HostBuffer:
    """One reusable host buffer, page-locked when ``pin``; grown (to a power of two bytes)
    when a bigger array is asked for, never shrunk.

    :meth:`view` hands out its start as an array of any shape and numeric dtype, both as numpy
    and as a torch tensor on the same memory. A view is valid until the next :meth:`view`.
    """

    def __init__(self, pin: bool = False) -> None:
        self.torch = _torch()
        self.pin = pin
        self._bytes: Any = None  # a 1-D uint8 CPU tensor
        self._pending: Any = None  # a CUDA event: a copy from or into the buffer not yet done
        self.grown = 0  # how many times the buffer was (re)allocated

    @property
    def capacity(self) -> int:
        """Its size in bytes (0 before the first view)."""
        return 0 if self._bytes is None else int(self._bytes.numel())

    def view(self, shape: Sequence[int], dtype: Any) -> tuple[np.ndarray, Any]:
        """The buffer's start as an array of ``shape`` and ``dtype``: (numpy, torch) views.

        Waits first for a copy still reading or writing the buffer (:meth:`copied`).
        """
        torch = self.torch
        dtype = np.dtype(dtype)
        if dtype.kind not in "biufc" or not dtype.isnative:
            raise TypeError(f"cannot stage {dtype} data: numbers or booleans only")
        shape = tuple(int(dim) for dim in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        self.wait()
        if self._bytes is None or nbytes > self.capacity:
            size = max(MIN_BUFFER_BYTES, 1 << (nbytes - 1).bit_length())
            # never an inference tensor (if first asked for under inference_mode): those
            # cannot be written to in place outside it
            with torch.inference_mode(False):
                self._bytes = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.grown += 1
        tensor = self._bytes[:nbytes].view(_torch_dtype(torch, dtype)).view(shape)
        return tensor.numpy(), tensor

    def copied(self, device: Any) -> Any:
        """A non-blocking copy from or into the buffer was just queued on ``device``'s current
        stream: the next :meth:`view` waits for it. Returns the CUDA event that marks the
        copy done; None (and nothing to wait for) for a device that is not CUDA."""
        torch = self.torch
        if torch.device(device).type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._pending = event
        return event

    def wait(self) -> None:
        """Block until the copy noted by :meth:`copied`, if any, is done."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.synchronize()


_TORCH_DTYPES: dict[np.dtype[Any], Any] = {}


def _torch_dtype(torch: Any, dtype: np.dtype[Any]) -> Any:
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return found


class OutputCopy(Sequence[np.ndarray]):
    """A batch's outputs on their way to host memory (:meth:`HostStaging.to_host_later`).

    What ``predict`` returns to let the worker overlap the device with its own work
    (:class:`gpu_worker.outcomes.PendingOutputs`): :meth:`done` says whether the copy has
    landed, :meth:`result` waits for it and gives one array per item (rows the caller owns).
    It is also a sequence of those rows (``len``, indexing and iterating wait as ``result``
    does), so code that calls ``predict`` directly can use it as the list it was.
    """

    def __init__(
        self, array: np.ndarray, event: Any = None, release: Callable[[], None] | None = None
    ) -> None:
        self._array = array  # in the staging buffer while ``release`` is set
        self._event = event  # a CUDA event recorded after the copy, or None: landed
        self._release = release  # gives the buffer back once the rows are copied out
        self._rows: list[np.ndarray] | None = None

    def done(self) -> bool:
        """True once the copy has landed (:meth:`result` returns without waiting)."""
        event = self._event
        return event is None or bool(event.query())

    def array(self) -> np.ndarray:
        """The outputs as one array (out of the staging buffer), waiting for the copy first."""
        event, release = self._event, self._release
        if event is not None:
            event.synchronize()
        if release is not None:
            self._array = self._array.copy()
            release()
        self._event, self._release = None, None
        return self._array

    def result(self) -> list[np.ndarray]:
        """One array per item (the first axis), waiting for the copy first."""
        if self._rows is None:
            self._rows = list(self.array())
        return self._rows

    def __len__(self) -> int:
        return int(self._array.shape[0]) if self._array.ndim else 0

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.result())

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        return self.result()[index]


class HostStaging:
    """Stacks batches of numpy items onto ``device`` and brings outputs back as numpy.

    ``staged`` (default: :func:`pins_memory` of the device) chooses the path. Staged: reused
    host buffers, page-locked on a CUDA device, non-blocking copies, outputs copied out of
    their buffer. Plain: a new array per batch, blocking copies, as ``.cpu().numpy()`` gives.
    Staged on a CPU device reuses unpinned buffers (for tests of that path without a GPU).

    One per model: it is not thread-safe (a worker never runs ``predict`` calls at once).
    Its pinned memory, one input buffer per slot and one output buffer per output copy in
    flight (one for :meth:`to_host`, two in a worker for :meth:`to_host_later`), each at
    most twice the largest batch, stays page-locked for the worker's life.
    """

    def __init__(self, device: Any, staged: bool | None = None) -> None:
        torch = self.torch = _torch()
        self.device = torch.device(device)
        if staged is None:
            staged = pins_memory(self.device, torch.cuda.is_available())
        self.staged = staged
        self.pinned = staged and self.device.type == "cuda"
        self._slots: dict[str, HostBuffer] = {}
        self._handed: dict[str, tuple[np.ndarray, Any]] = {}  # slot: its last view
        self._spare_outs: list[HostBuffer] = []  # output buffers not in use

    def empty(self, shape: Sequence[int], dtype: Any, slot: str = "input") -> np.ndarray:
        """A host array to fill in, then give to :meth:`to_device`. Staged, it is the slot's
        buffer (valid until the slot's next ``empty`` or ``stack``); plain, a new array.
        Use one slot per tensor that one batch sends (e.g. ``"input_ids"`` and ``"mask"``)."""
        if not self.staged:
            return np.empty(shape, dtype)
        buffer = self._slots.get(slot)
        if buffer is None:
            buffer = self._slots[slot] = HostBuffer(self.pinned)
        array, tensor = buffer.view(shape, dtype)
        self._handed[slot] = (array, tensor)
        return array

    def to_device(self, array: np.ndarray) -> Any:
        """``array`` as a tensor on the device. From :meth:`empty` (staged), a non-blocking
        copy of the buffer; any other array is copied as ``torch.from_numpy(a).to(device)``."""
        for slot, (handed, tensor) in self._handed.items():
            if handed is array:
                moved = tensor.to(self.device, non_blocking=True)
                self._slots[slot].copied(self.device)
                return moved
        return self.torch.from_numpy(array).to(self.device)

    def stack(
        self, items: Sequence[Any], dtype: Any, slot: str = "input", casting: Any = "unsafe"
    ) -> Any:
        """Items of one shape (arrays, or what ``np.asarray`` takes) stacked into one tensor
        of ``dtype`` on the device: ``np.stack([np.asarray(item, dtype) ...])`` (with the
        default ``casting``), written straight into the host buffer. ValueError if the items'
        shapes differ, as ``np.stack`` says."""
        if not items:
            raise ValueError("need at least one item to stack")
        first = np.asarray(items[0])
        out = self.empty((len(items), *first.shape), dtype, slot)
        np.stack([first, *items[1:]], out=out, casting=casting)
        return self.to_device(out)

    def to_host(self, tensor: Any) -> np.ndarray:
        """A tensor's values as a numpy array the caller owns (no buffer of this object).

        Staged: a non-blocking copy into a (pinned, on CUDA) output buffer, waited for,
        then copied out of it. Plain: ``tensor.detach().cpu().numpy()`` (which, for a CPU
        tensor, shares its memory). :meth:`to_host_later`, waited for at once."""
        return self._copy(tensor).array()

    def to_host_later(self, tensor: Any) -> OutputCopy:
        """Start copying a batch's output tensor to the host and return at once: what
        ``predict`` returns to let the worker answer the batch before and read the next
        while the device computes (docs/gpu.md, section 6).

        Staged: a non-blocking copy into a pinned output buffer of its own (one per copy in
        flight, reused once :meth:`OutputCopy.result` has copied the rows out); plain, or for
        a dtype numpy lacks: ``tensor.detach().cpu().numpy()`` now, the copy done already.
        TypeError for anything but a tensor of one row per item.
        """
        if not isinstance(tensor, self.torch.Tensor):
            raise TypeError(
                f"to_host_later takes the batch's output tensor, not {type(tensor).__name__}"
            )
        if tensor.dim() == 0:
            raise TypeError("to_host_later takes a tensor of one row per item, not a 0-d one")
        return self._copy(tensor)

    def _copy(self, tensor: Any) -> OutputCopy:
        """:meth:`to_host_later` of any tensor (0-d too)."""
        tensor = tensor.detach()
        dtype = _numpy_dtype(self.torch, tensor.dtype) if self.staged else None
        if dtype is None:  # bfloat16 and the like: refused by .numpy() too
            return OutputCopy(tensor.cpu().numpy())
        spare = self._spare_outs
        buffer = spare.pop() if spare else HostBuffer(self.pinned)
        array, host = buffer.view(tuple(tensor.shape), dtype)
        host.copy_(tensor, non_blocking=True)
        event = buffer.copied(tensor.device)
        return OutputCopy(array, event, lambda: spare.append(buffer))


_NUMPY_DTYPES: dict[Any, np.dtype[Any] | None] = {}


def _numpy_dtype(torch: Any, dtype: Any) -> np.dtype[Any] | None:
    """The numpy dtype of a torch dtype; None for one numpy lacks (bfloat16, float8...)."""
    if dtype not in _NUMPY_DTYPES:
        try:
            _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            _NUMPY_DTYPES[dtype] = None
    return _NUMPY_DTYPES[dtype]
