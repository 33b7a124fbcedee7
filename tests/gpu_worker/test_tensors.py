"""TensorSpec.coerce and gpu_worker.tensors: what each datatype takes, and where it says no."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from broker.errors import InvalidInput
from gpu_worker import ManagedModel, TensorSpec


@pytest.mark.parametrize(
    ("datatype", "value", "want"),
    [
        ("FP32", [1, 2.5, np.float64(3)], np.array([1, 2.5, 3], np.float32)),
        ("FP16", [65504.0, -1], np.array([65504, -1], np.float16)),
        # past each type's largest value, but rounding to it (FP32's largest as JSON writes it)
        ("FP16", [65519.0, -65519.0], np.array([65504, -65504], np.float16)),
        (
            "FP32",
            [3.4028235e38, -3.4028235e38],
            np.array([1, -1], np.float32) * np.float32(3.4028235e38),
        ),
        ("FP64", [1e300, float("nan")], np.array([1e300, np.nan])),
        ("INT8", [-128, 127, 3.0], np.array([-128, 127, 3], np.int8)),
        ("UINT64", [2**64 - 1, 0], np.array([2**64 - 1, 0], np.uint64)),
        ("INT64", [2**60 + 1, 1.0], np.array([2**60 + 1, 1], np.int64)),  # exact, not via float
        ("INT64", np.array([1, 2], np.int32), np.array([1, 2], np.int64)),
        ("INT32", np.array([1.0, -2.0]), np.array([1, -2], np.int32)),
        ("BOOL", [True, np.bool_(False)], np.array([True, False])),
    ],
)
def test_numbers_that_fit_are_converted(datatype: str, value: Any, want: np.ndarray) -> None:
    got = TensorSpec("x", datatype, [-1]).coerce(value)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("datatype", "value", "message"),
    [
        ("FP32", [1.0, None], "input 'x' at [1]: null is not a number (FP32)"),
        ("FP32", [[1.0], [True]], "input 'x' at [1, 0]: a boolean (true) is not a number (FP32)"),
        ("FP64", ["1.0"], "input 'x' at [0]: a string is not a number (FP64)"),
        ("FP32", [{"a": 1}], "input 'x' at [0]: an object is not a number (FP32)"),
        ("FP32", np.array(["1"]), "input 'x' at [0]: a string is not a number (FP32)"),
        ("FP32", np.array([True]), "input 'x' at [0]: a boolean (true) is not a number (FP32)"),
        ("FP32", np.array([1.0, None]), "input 'x' at [1]: null is not a number (FP32)"),
        ("FP16", [1.0, 70000.0], "input 'x' at [1]: 70000.0 is out of range for FP16"),
        ("FP32", [1e39], "input 'x' at [0]: 1e+39 is out of range for FP32"),
        ("FP16", [65520.0], "input 'x' at [0]: 65520.0 is out of range for FP16"),  # rounds up
        ("INT8", [1, 128], "input 'x' at [1]: 128 is out of range for INT8"),
        ("UINT8", [-1], "input 'x' at [0]: -1 is out of range for UINT8"),
        ("UINT64", [2**64], f"input 'x' at [0]: {2**64} is out of range for UINT64"),
        ("INT64", [2.0**63], "input 'x' at [0]: 9.223372036854776e+18 is out of range for INT64"),
        ("INT16", np.array([70000]), "input 'x' at [0]: 70000 is out of range for INT16"),
        ("INT32", [0.5], "input 'x' at [0]: 0.5 is not a whole number (INT32)"),
        ("INT32", [float("nan")], "input 'x' at [0]: nan is not a whole number (INT32)"),
        ("BOOL", [True, 1], "input 'x' at [1]: the number 1 is not a boolean (BOOL)"),
        ("BOOL", [None], "input 'x' at [0]: null is not a boolean (BOOL)"),
    ],
)
def test_values_that_do_not_fit_name_their_position(
    datatype: str, value: Any, message: str
) -> None:
    shape = [-1, 1] if isinstance(value, list) and isinstance(value[0], list) else [-1]
    with pytest.raises(InvalidInput) as raised:
        TensorSpec("x", datatype, shape).coerce(value)
    assert str(raised.value) == message


def test_scalars_and_shapes() -> None:
    assert TensorSpec("x", "FP32", []).coerce(2).shape == ()
    with pytest.raises(InvalidInput, match=r"^input 'x': null is not a number \(FP32\)$"):
        TensorSpec("x", "FP32", []).coerce(None)
    with pytest.raises(InvalidInput, match=r"has shape \[3\], the model takes \[2\]"):
        TensorSpec("x", "FP32", [2]).coerce([1, 2, 3])
    with pytest.raises(InvalidInput, match="is not a tensor of FP32"):
        TensorSpec("x", "FP32", [2, -1]).coerce([[1, 2], [3]])
    same = np.zeros(4, np.float32)
    assert TensorSpec("x", "FP32", [4]).coerce(same) is same  # already fits: no copy


class TwoInputs(ManagedModel):
    inputs = [TensorSpec("ids", "INT64", [-1]), TensorSpec("mask", "BOOL", [-1])]

    def preprocess(self, item: Any) -> Any:
        if item == "boom":
            raise RuntimeError("cannot read it")
        return item


def test_prepare_items_checks_every_input_and_names_the_item() -> None:
    model = TwoInputs()
    [item] = model.prepare_items([{"ids": [1, 2], "mask": [True, False]}])
    assert item["ids"].dtype == np.int64 and item["mask"].dtype == np.bool_
    cases = [
        ({"ids": [1], "mask": [1]}, "item 1: input 'mask' at [0]: the number 1 is not a boolean"),
        ({"ids": [1]}, "item 1: input 'mask' is missing"),
        ({"ids": [1], "mask": [True], "x": 1}, "item 1: unknown inputs ['x']"),
        ([1, 2], "item 1: the model takes an object with the inputs ['ids', 'mask']"),
        ("boom", "item 1: preprocess failed: RuntimeError: cannot read it"),
    ]
    for bad, message in cases:
        with pytest.raises(InvalidInput) as raised:
            model.prepare_items([{"ids": [0], "mask": [True]}, bad])
        assert str(raised.value).startswith(message), str(raised.value)
        assert raised.value.index == 1


def test_lists_nested_deeper_than_the_stack_are_refused_as_the_input_s_fault() -> None:
    """Not "preprocess failed" (the model has none) nor a RecursionError let through."""

    class Plain(ManagedModel):
        inputs = [TensorSpec("x", "FP32", [-1])]

    deep: list[Any] = [1.0]
    for _ in range(sys.getrecursionlimit() + 100):
        deep = [deep]
    with pytest.raises(InvalidInput) as raised:
        Plain().prepare_items([[1.0], deep])
    assert str(raised.value) == "item 1: nested too deep to be a tensor"
    assert raised.value.index == 1


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ({"batch_size": 0}, "Bad.batch_size must be a positive int, not 0"),
        ({"batch_size": "8"}, "Bad.batch_size must be a positive int, not '8'"),
        ({"batch_size": 8.0}, "Bad.batch_size must be a positive int, not 8.0"),
        ({"max_latency": -1.0}, "Bad.max_latency must be a number of seconds >= 0, not -1.0"),
        ({"max_latency": "0.1"}, "Bad.max_latency must be a number of seconds >= 0"),
        ({"inputs": [("x", "FP32", [2])]}, "Bad.inputs must be a list of TensorSpec"),
        ({"outputs": {"y": "FP32"}}, "Bad.outputs must be a list of TensorSpec"),
        (
            {"inputs": [TensorSpec("x", "FP32", [2]), TensorSpec("x", "INT8", [2])]},
            "Bad.inputs declares 'x' more than once",
        ),
        (
            {"inputs": [TensorSpec("text", "BYTES", [-1])]},
            "Bad.inputs: the BYTES input 'text' takes one string or bytes per item: declare it "
            "with shape [], not [-1]",
        ),
        ({"request_inputs": [("x", "BYTES", [])]}, "Bad.request_inputs must be a list of"),
        ({"request_inputs": TensorSpec("x", "BYTES", [])}, "Bad.request_inputs must be a list"),
        (
            {"request_inputs": [TensorSpec("t", "BYTES", []), TensorSpec("t", "FP32", [1])]},
            "Bad.request_inputs declares 't' more than once",
        ),
        (
            {"request_inputs": [TensorSpec("text", "BYTES", [1])]},
            "Bad.request_inputs: the BYTES input 'text' takes one string or bytes per item: "
            "declare it with shape [], not [1]",
        ),
    ],
)
def test_a_model_class_declared_wrong_fails_as_it_is_defined(
    attributes: dict[str, Any], message: str
) -> None:
    """Rather than in every worker started with it (each restarted, failing again)."""
    with pytest.raises(ValueError) as caught:
        type("Bad", (ManagedModel,), attributes)
    assert str(caught.value).startswith(message)


def test_a_model_class_declared_right_is_taken() -> None:
    attributes = {"batch_size": 4, "max_latency": 0, "inputs": (TensorSpec("x", "FP32", [2]),)}
    assert type("Good", (ManagedModel,), attributes).batch_size == 4
    assert ManagedModel.request_inputs is None  # by default, a request sends the inputs
    text = [TensorSpec("text", "BYTES", [])]
    assert type("Text", (ManagedModel,), {"request_inputs": text}).request_inputs == text


def test_numpy_scalars_are_taken_as_the_plain_numbers_they_are() -> None:
    """A model written with numpy at hand (``np.int64(32)``, ``np.float32(0.005)``)."""
    attributes = {
        "batch_size": np.int64(32), "max_latency": np.float32(0.005),
        "max_batch_cost": np.int32(4096),
    }  # fmt: skip
    model = type("Numpy", (ManagedModel,), attributes)
    assert (model.batch_size, model.max_batch_cost) == (32, 4096)
    assert model.max_latency == pytest.approx(0.005)
    assert type(model.batch_size) is int and type(model.max_latency) is float
    assert type(model.max_batch_cost) is int
    with pytest.raises(ValueError, match="batch_size must be a positive int, not True"):
        type("Flag", (ManagedModel,), {"batch_size": True})
