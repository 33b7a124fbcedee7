"""gpu_worker.staging: batches stacked into reused host buffers, outputs copied back out.

No GPU here: the staged path runs on the CPU (reused buffers, unpinned), and the decision to
pin is tested on device strings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.outcomes import is_pending
from gpu_worker.staging import MIN_BUFFER_BYTES, HostBuffer, HostStaging, pins_memory


def items(count: int, width: int = 8, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(width).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize(
    ("device", "cuda_available", "pins"),
    [
        ("cuda", True, True),
        ("cuda:0", True, True),
        ("cuda:3", True, True),
        (torch.device("cuda", 1), True, True),
        ("cuda", False, False),  # a CUDA device asked for on a machine without CUDA
        ("cuda:0", False, False),
        ("cpu", True, False),
        ("cpu", False, False),
        (torch.device("cpu"), True, False),
        ("mps", True, False),
        ("xpu:0", True, False),
        ("meta", True, False),
    ],
)
def test_only_a_cuda_device_with_cuda_available_pins(
    device: object, cuda_available: bool, pins: bool
) -> None:
    assert pins_memory(device, cuda_available) is pins


def test_a_cpu_device_takes_the_plain_path() -> None:
    staging = HostStaging("cpu")
    assert (staging.staged, staging.pinned) == (False, False)
    forced = HostStaging("cpu", staged=True)
    assert (forced.staged, forced.pinned) == (True, False)  # pinning needs CUDA


@pytest.mark.parametrize("staged", [False, True])
def test_stack_equals_np_stack(staged: bool) -> None:
    staging = HostStaging("cpu", staged=staged)
    batch = items(5)
    got = staging.stack(batch, np.float32)
    want = np.stack([np.asarray(item, dtype=np.float32) for item in batch])
    assert got.dtype == torch.float32 and got.device == torch.device("cpu")
    assert np.array_equal(got.numpy(), want)
    # lists and other dtypes are converted as np.asarray(item, dtype) converts them
    mixed = [[1, 2, 3], np.array([4.5, 5.5, 6.5]), (7, 8, 9)]
    want = np.stack([np.asarray(item, dtype=np.float32) for item in mixed])
    assert np.array_equal(staging.stack(mixed, np.float32).numpy(), want)
    images = [np.full((4, 4, 3), value, np.uint8) for value in (0, 7, 255)]
    assert np.array_equal(staging.stack(images, np.uint8).numpy(), np.stack(images))


@pytest.mark.parametrize("staged", [False, True])
def test_items_of_different_shapes_fail_as_np_stack_does(staged: bool) -> None:
    staging = HostStaging("cpu", staged=staged)
    with pytest.raises(ValueError, match="same shape"):
        staging.stack([np.zeros(3, np.float32), np.zeros(4, np.float32)], np.float32)
    with pytest.raises(ValueError, match="at least one"):
        staging.stack([], np.float32)


def test_the_staged_and_plain_paths_give_the_same_outputs() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    plain, staged = HostStaging("cpu"), HostStaging("cpu", staged=True)
    for count in (1, 7, 64, 3):
        batch = items(count, seed=count)
        with torch.inference_mode():
            a = plain.to_host(net(plain.stack(batch, np.float32)))
            b = staged.to_host(net(staged.stack(batch, np.float32)))
        assert a.dtype == b.dtype == np.float32
        assert np.array_equal(a, b)


def test_a_buffer_is_reused_and_grows_for_a_bigger_batch() -> None:
    buffer = HostBuffer()
    assert buffer.capacity == 0
    first, _ = buffer.view((4, 8), np.float32)
    assert buffer.capacity == MIN_BUFFER_BYTES and buffer.grown == 1
    again, tensor = buffer.view((2, 8), np.float32)
    assert np.shares_memory(first, again) and buffer.grown == 1  # reused
    assert np.shares_memory(again, tensor.numpy())  # numpy and torch views of one memory
    big, _ = buffer.view((64, 1024), np.float32)  # 256 KiB
    assert buffer.capacity == 256 * 1024 and buffer.grown == 2
    assert not np.shares_memory(big, first)
    odd, _ = buffer.view((3, 1000, 30), np.float32)  # 360,000 bytes: the next power of two
    assert buffer.capacity == 512 * 1024 and buffer.grown == 3
    small, _ = buffer.view((2, 2), np.int64)  # never shrunk
    assert buffer.capacity == 512 * 1024 and buffer.grown == 3
    assert np.shares_memory(small, odd)
    assert buffer.view((0, 8), np.float32)[0].shape == (0, 8)


def test_a_buffer_takes_numbers_and_booleans_only() -> None:
    buffer = HostBuffer()
    for dtype in (np.float16, np.float64, np.int8, np.uint64, np.bool_, np.complex64):
        array, tensor = buffer.view((2, 3), dtype)
        assert array.dtype == np.dtype(dtype) and tuple(tensor.shape) == (2, 3)
    for dtype in (object, "U4", ">f4"):
        with pytest.raises(TypeError, match="cannot stage"):
            buffer.view((2,), dtype)


def test_staged_inputs_go_through_one_buffer_per_slot() -> None:
    staging = HostStaging("cpu", staged=True)
    ids = staging.empty((2, 5), np.int64, "input_ids")
    mask = staging.empty((2, 5), np.int64, "mask")
    assert not np.shares_memory(ids, mask)
    ids[:] = 3
    mask[:] = 1
    assert staging.to_device(ids).sum().item() == 30
    assert staging.to_device(mask).sum().item() == 10
    assert np.shares_memory(staging.empty((1, 5), np.int64, "input_ids"), ids)  # reused
    # an array that is no slot's is copied as torch.from_numpy(a).to(device)
    other = np.arange(4)
    assert staging.to_device(other).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("staged", [False, True])
def test_outputs_do_not_alias_across_calls(staged: bool) -> None:
    """What predict returns may be encoded while the next batch computes (the model thread
    starts it before the last one is answered): the next call must not overwrite it."""
    staging = HostStaging("cpu", staged=staged)
    kept = []
    for count in (4, 4, 2, 8):
        batch = items(count, seed=count + len(kept))
        with torch.inference_mode():
            # the identity: on the staged CPU path the input tensor is the reused buffer
            rows = list(staging.to_host(staging.stack(batch, np.float32)))
        kept.append((rows, np.stack(batch)))
    for rows, want in kept:
        assert np.array_equal(np.stack(rows), want)
    firsts = [rows[0] for rows, _ in kept]
    for i, first in enumerate(firsts):
        assert not any(np.shares_memory(first, other) for other in firsts[i + 1 :])


def test_to_host_works_in_and_out_of_inference_mode() -> None:
    staging = HostStaging("cpu", staged=True)
    with torch.inference_mode():
        first = staging.to_host(torch.ones(2, 3))  # the output buffer is allocated in here
    second = staging.to_host(torch.full((2, 3), 2.0, requires_grad=True) * 1)
    with torch.inference_mode():
        third = staging.to_host(staging.stack(items(2, width=3), np.float32) * 0)
    assert first.tolist() == [[1.0] * 3] * 2
    assert second.tolist() == [[2.0] * 3] * 2
    assert third.tolist() == [[0.0] * 3] * 2


def test_to_host_keeps_the_dtype_and_shape() -> None:
    staging = HostStaging("cpu", staged=True)
    for tensor in (
        torch.arange(6, dtype=torch.int32).view(2, 3),
        torch.tensor([[True, False]]),
        torch.arange(12, dtype=torch.float16).view(2, 3, 2).transpose(1, 2),  # not contiguous
        torch.zeros(0, 4),
    ):
        got = staging.to_host(tensor)
        assert got.shape == tuple(tensor.shape)
        assert np.array_equal(got, tensor.numpy())
    with pytest.raises(TypeError):  # no numpy bfloat16: refused as .cpu().numpy() refuses it
        staging.to_host(torch.zeros(2, dtype=torch.bfloat16))


def test_importing_the_module_leaves_torch_out() -> None:
    from tests.conftest import run_python

    code = "import sys, gpu_worker.staging; print('torch' in sys.modules)"
    result = run_python(code)
    assert result.stdout.strip() == "False", result.stderr


class FakeCuda:
    """torch.cuda's events, logged: what waits for which copy, without a GPU."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def current_stream(self, device: object) -> str:
        return "stream"

    def Event(self) -> FakeCuda:  # torch.cuda.Event
        return self

    def record(self, stream: str) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


class CudaTorch:
    """torch, but every device is a CUDA one and its events are FakeCuda's."""

    def __init__(self, log: list[str]) -> None:
        self.cuda = FakeCuda(log)

    def device(self, device: object) -> object:
        return torch.device("cuda", 0)

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)


def test_a_buffer_is_written_again_only_after_its_last_copy_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gpu_worker.staging as staging_module

    log: list[str] = []
    staging = HostStaging("cpu", staged=True)
    monkeypatch.setattr(staging_module, "_torch", lambda: CudaTorch(log))  # buffers made now
    ids = staging.empty((2, 3), np.int64, "ids")
    ids[:] = 1
    mask = staging.empty((2, 3), np.int64, "mask")
    mask[:] = 1
    assert log == []
    staging.to_device(ids)
    assert log == ["record"]  # the copy from the ids buffer, noted
    staging.to_device(mask)
    staging.empty((2, 3), np.int64, "mask")
    assert log == ["record", "record", "synchronize"]  # mask's copy waited for; not ids'
    log.clear()
    out = staging.to_host(torch.ones(2, 2))
    assert log == ["record", "synchronize"] and out.tolist() == [[1.0, 1.0]] * 2  # waited for
    log.clear()
    staging.empty((4, 3), np.int64, "ids")  # a bigger batch: waits, then grows
    assert log == ["synchronize"]


# -- outputs copied later ------------------------------------------------------------------------
@pytest.mark.parametrize("staged", [False, True])
def test_to_host_later_gives_what_to_host_gives(staged: bool) -> None:
    staging = HostStaging("cpu", staged=staged)
    outputs = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    later = staging.to_host_later(outputs)
    assert is_pending(later)
    assert later.done()  # no device: the copy is done already
    assert len(later) == 4
    rows = later.result()
    assert np.array_equal(np.stack(rows), staging.to_host(outputs))
    assert later.result() is rows  # taken once
    assert [row.tolist() for row in later] == [row.tolist() for row in rows]
    assert later[3].tolist() == [9.0, 10.0, 11.0]


def test_copies_in_flight_each_get_a_buffer_and_give_it_back() -> None:
    staging = HostStaging("cpu", staged=True)
    first = staging.to_host_later(torch.ones(2, 3))
    second = staging.to_host_later(torch.full((2, 3), 2.0))  # before the first is taken
    assert np.stack(first.result()).tolist() == [[1.0] * 3] * 2
    assert np.stack(second.result()).tolist() == [[2.0] * 3] * 2
    # the rows are the caller's: a later copy through the same buffer leaves them alone
    third = staging.to_host_later(torch.full((2, 3), 3.0))
    assert np.stack(third.result()).tolist() == [[3.0] * 3] * 2
    assert np.stack(first.result()).tolist() == [[1.0] * 3] * 2
    assert len(staging._spare_outs) == 2  # two copies were in flight at most


def test_to_host_later_of_a_dtype_numpy_lacks_takes_the_plain_path() -> None:
    staging = HostStaging("cpu", staged=True)
    with pytest.raises(TypeError):  # as .numpy() refuses bfloat16 (to_host does the same)
        staging.to_host_later(torch.ones(2, 3, dtype=torch.bfloat16))


def test_to_host_later_of_what_is_no_batch_tensor_says_so_at_once() -> None:
    """Not later, as an AttributeError ('no attribute detach') or 'iteration over a 0-d
    array' once the worker reads the outputs."""
    staging = HostStaging("cpu", staged=True)
    with pytest.raises(TypeError, match="takes the batch's output tensor, not ndarray"):
        staging.to_host_later(np.ones((2, 3), np.float32))
    with pytest.raises(TypeError, match="one row per item, not a 0-d one"):
        staging.to_host_later(torch.tensor(1.0))
    assert staging.to_host(torch.tensor(1.0)).tolist() == 1.0  # to_host takes any tensor
