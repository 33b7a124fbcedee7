"""KServe v2 bodies parsed and answered in isolation (no Redis, no app): web_gateway.kserve."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest

from gpu_worker.model import TensorSpec
from web_gateway import kserve
from web_gateway.errors import HTTPError, shown


def body(*inputs: dict[str, Any], **document: Any) -> bytes:
    return orjson.dumps({**document, "inputs": list(inputs)})


def tensor(name: str = "x", datatype: str = "FP32", shape: Any = (1, 2), **rest: Any) -> Any:
    return {"name": name, "datatype": datatype, "shape": list(shape), **rest}


def refused(raw: bytes, header_length: str | None = None) -> tuple[int, str]:
    with pytest.raises(HTTPError) as raised:
        kserve.parse_request(raw, header_length)
    return raised.value.status, raised.value.message


def test_json_tensors_become_arrays_of_their_datatype_and_shape() -> None:
    parsed = kserve.parse_request(
        body(tensor(data=[[1, 2], [3, 4]], shape=(2, 2)), id="r1", parameters={"timeout": 5}),
        None,
    )
    assert parsed.id == "r1" and parsed.parameters == {"timeout": 5}
    array = parsed.inputs["x"]
    assert array.dtype == np.float32 and array.shape == (2, 2)
    assert parsed.batch_size == 2 and parsed.datatypes == {"x": "FP32"}
    assert [row.tolist() for row in parsed.items()] == [[1.0, 2.0], [3.0, 4.0]]
    assert parsed.outputs is None


def test_several_inputs_make_one_dict_per_row() -> None:
    parsed = kserve.parse_request(
        body(
            tensor("a", "INT64", (2,), data=[1, 2]),
            tensor("b", "BYTES", (2,), data=["p", "q"]),
        ),
        None,
    )
    items = parsed.items()
    assert [item["a"] for item in items] == [1, 2]
    assert [item["b"] for item in items] == ["p", "q"]


def test_rows_of_a_1d_tensor_keep_their_datatype_on_the_wire() -> None:
    """A row of a 1-d tensor is a 0-d array, which the codec sends as one: a numpy scalar
    would reach the model as a Python number (an FP32 one as float64)."""
    from broker import codec

    for datatype, dtype in (("FP32", np.float32), ("FP16", np.float16), ("UINT8", np.uint8)):
        parsed = kserve.parse_request(
            body(tensor(datatype=datatype, shape=(2,), data=[1, 2])), None
        )
        for item in (*parsed.items(), *(row["x"] for row in two_inputs(datatype))):
            sent = codec.decode(codec.encode(item))
            assert isinstance(sent, np.ndarray) and sent.dtype == dtype and sent.shape == ()


def two_inputs(datatype: str) -> list[Any]:
    raw = body(
        tensor(datatype=datatype, shape=(2,), data=[1, 2]),
        tensor("y", "BYTES", (2,), data=["p", "q"]),
    )
    items = kserve.parse_request(raw, None).items()
    assert [item["y"] for item in items] == ["p", "q"]
    return items


def test_a_byte_order_mark_before_the_json_is_ignored() -> None:
    """RFC 8259 lets a parser ignore it; Windows PowerShell 5 writes UTF-8 files with one."""
    blob = np.array([[1.5, 2.5]], dtype="<f4").tobytes()
    head = b"\xef\xbb\xbf" + body(tensor(parameters={"binary_data_size": len(blob)}))
    parsed = kserve.parse_request(head + blob, str(len(head)))
    assert parsed.inputs["x"].tolist() == [[1.5, 2.5]]


def test_binary_tensors_follow_the_json_header() -> None:
    blob = np.array([[1.5, 2.5]], dtype="<f4").tobytes()
    strings = struct.pack("<I", 2) + b"hi" + struct.pack("<I", 0)
    head = body(
        tensor(parameters={"binary_data_size": len(blob)}),
        tensor("s", "BYTES", (1, 2), parameters={"binary_data_size": len(strings)}),
    )
    parsed = kserve.parse_request(head + blob + strings, str(len(head)))
    assert parsed.inputs["x"].tolist() == [[1.5, 2.5]]
    assert parsed.inputs["s"].tolist() == [[b"hi", b""]]


@pytest.mark.parametrize(
    ("raw", "header", "message"),
    [
        (b"{", None, "request body is not valid JSON"),
        (b"[]", None, "the request body must be a JSON object"),
        (orjson.dumps({"inputs": []}), None, "'inputs' must be a non-empty list of tensors"),
        (body(tensor(data=[1, 2]), id=3), None, "'id' must be a string"),
        (body(tensor(data=[1, 2]), parameters="p"), None, "'parameters' must be a JSON object"),
        # falsy non-objects too (they were taken as no parameters)
        (body(tensor(data=[1, 2]), parameters=False), None, "'parameters' must be a JSON object"),
        (body(tensor(data=[1, 2]), parameters=""), None, "'parameters' must be a JSON object"),
        (
            body(tensor(data=[1, 2], parameters=0)),
            None,
            "input 'parameters' must be a JSON object",
        ),
        (
            body(tensor(data=[1, 2]), outputs=[{"name": "y", "parameters": []}]),
            None,
            "output 'parameters' must be a JSON object",
        ),
        (body(["x"]), None, "each input must be a JSON object"),
        (body({"datatype": "FP32", "shape": [1], "data": [1]}), None, "every input needs a 'name'"),
        (body(tensor(datatype="FP128", data=[1, 2])), None, "input 'x': unknown datatype 'FP128'"),
        (body(tensor(shape=[], data=[])), None, "input 'x': shape needs a batch dimension"),
        (
            body(tensor(shape=[1, -2], data=[])),
            None,
            "input 'x': shape must be a list of non-negative integers",
        ),
        (body(tensor(shape=[1 << 20, 1 << 12])), None, "input 'x': shape [1048576, 4096] is too"),
        (body(tensor()), None, "input 'x' has neither 'data' nor binary data"),
        (
            body(tensor(data=[1, 2, 3])),
            None,
            "input 'x': 3 data elements do not match shape [1, 2]",
        ),
        (body(tensor("s", "BYTES", (1,), data=[1])), None, "input 's': BYTES data must be strings"),
        (
            body(tensor(data=[1, 2]), tensor(data=[3, 4])),
            None,
            "input 'x' appears twice",
        ),
        (
            body(tensor(data=[1, 2]), tensor("y", shape=(2, 1), data=[1, 2])),
            None,
            "all inputs must have the same batch size",
        ),
        (  # past numpy's 64 dimensions this was a 500
            body(tensor(shape=(1,) * 65, data=[1])),
            None,
            "input 'x': shape has 65 dimensions, at most 33",
        ),
        (body(tensor(data=[1, 2]), outputs={}), None, "'outputs' must be a list"),
        (body(tensor(data=[1, 2]), outputs=[{}]), None, "every requested output needs a 'name'"),
        (body(tensor(data=[1, 2])), "x", "Inference-Header-Content-Length must be an integer"),
        # int() took these as 10, 1 and 1: no length a client means
        (body(tensor(data=[1, 2])), "1_0", "Inference-Header-Content-Length must be an integer"),
        (body(tensor(data=[1, 2])), "+1", "Inference-Header-Content-Length must be an integer"),
        (body(tensor(data=[1, 2])), "\u0661", "Inference-Header-Content-Length must be an integer"),
        (body(tensor(data=[1, 2])), "100000", "Inference-Header-Content-Length is outside"),
        (
            body(tensor(parameters={"binary_data_size": True})),
            None,
            "binary_data_size must be a non-negative integer",
        ),
        (  # the header forgotten: the body is all JSON, and no data is short of its size
            body(tensor(parameters={"binary_data_size": 8})),
            None,
            "an input has binary_data_size 8, but the body has no binary data: send "
            "Inference-Header-Content-Length",
        ),
        (
            body(tensor(parameters={"binary_data_size": 8})) + bytes(4),
            str(len(body(tensor(parameters={"binary_data_size": 8})))),
            "binary tensor data is shorter than binary_data_size says",
        ),
        (  # which of the two was used was nowhere said (the binary data)
            body(tensor(data=[1, 2], parameters={"binary_data_size": 8})) + bytes(8),
            str(len(body(tensor(data=[1, 2], parameters={"binary_data_size": 8})))),
            "input 'x' has both 'data' and binary data",
        ),
    ],
)
def test_malformed_bodies_are_400_saying_what_is_wrong(
    raw: bytes, header: str | None, message: str
) -> None:
    status, said = refused(raw, header)
    assert status == 400
    assert said.startswith(message), said


def test_binary_framing_errors_are_400() -> None:
    head = body(tensor(shape=(1,) * 34, parameters={"binary_data_size": 4}))
    status, said = refused(head + b"\0" * 4, str(len(head)))
    assert status == 400 and said.startswith("input 'x': shape has 34 dimensions, at most 33")
    head = body(tensor(parameters={"binary_data_size": 8}))
    assert refused(head + b"\0" * 12, str(len(head))) == (
        400,
        "the body has binary data that no input claims",
    )
    head = body(tensor(parameters={"binary_data_size": 4}))
    status, said = refused(head + b"\0" * 4, str(len(head)))
    assert status == 400 and said == "input 'x': 4 binary bytes do not match shape [1, 2] of FP32"
    for strings, what in (
        (struct.pack("<I", 9) + b"ab", "truncated"),
        (b"\0\0", "truncated"),
        (struct.pack("<I", 1) + b"ab", "trailing bytes"),
    ):
        head = body(tensor("s", "BYTES", (1,), parameters={"binary_data_size": len(strings)}))
        assert refused(head + strings, str(len(head))) == (
            400,
            f"input 's': binary BYTES data has {what}"
            if what != "truncated"
            else "input 's': binary BYTES data is truncated",
        )


def test_a_value_that_does_not_fit_is_422_naming_its_item_and_position() -> None:
    status, said = refused(body(tensor("n", "INT32", (2, 2), data=[1, 2, 3, 1.5])))
    assert status == 422
    assert said == "item 1: input 'n' at [1]: 1.5 is not a whole number (INT32)"


def test_check_inputs_names_the_declared_inputs_and_types() -> None:
    specs = [TensorSpec("x", "FP32", [2])]
    ok = kserve.parse_request(body(tensor(data=[1, 2])), None)
    kserve.check_inputs(ok, specs, strict_datatypes=True)
    for raw, message in (
        (body(tensor("y", data=[1, 2])), "inputs are ['y'], the model takes ['x']"),
        (body(tensor(datatype="FP64", data=[1, 2])), "input 'x' is FP64, the model takes FP32"),
        (
            body(tensor(shape=(1, 3), data=[1, 2, 3])),
            "input 'x' has shape [1, 3], the model takes [-1, 2]",
        ),
    ):
        parsed = kserve.parse_request(raw, None)
        with pytest.raises(HTTPError) as raised:
            kserve.check_inputs(parsed, specs, strict_datatypes=True)
        assert (raised.value.status, raised.value.message) == (422, message)
    # a model with a preprocess of its own takes other datatypes (its preprocess converts)
    wider = kserve.parse_request(body(tensor(datatype="FP64", data=[1, 2])), None)
    kserve.check_inputs(wider, specs, strict_datatypes=False)


def answer(
    request: kserve.InferRequest, outputs: list[Any], specs: list[TensorSpec]
) -> tuple[dict[str, Any], bytes, dict[str, str]]:
    content, headers = kserve.build_response("m", request, outputs, specs)
    if not headers:
        return orjson.loads(content), b"", headers
    size = int(headers["Inference-Header-Content-Length"])
    return orjson.loads(content[:size]), content[size:], headers


def test_responses_in_json_or_binary_as_asked() -> None:
    spec = [TensorSpec("y", "FP32", [2])]
    outputs = [np.array([1, 2], dtype=np.float32), np.array([3, 4], dtype=np.float32)]
    request = kserve.parse_request(body(tensor(data=[0, 0]), id="q"), None)
    document, rest, _ = answer(request, outputs, spec)
    assert document == {
        "model_name": "m",
        "model_version": "1",
        "id": "q",
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2, 2], "data": [1, 2, 3, 4]}],
    }
    assert rest == b""
    binary = kserve.parse_request(
        body(tensor(data=[0, 0]), parameters={"binary_data_output": True}), None
    )
    document, rest, _ = answer(binary, outputs, spec)
    assert document["outputs"][0]["parameters"] == {"binary_data_size": 16}
    assert np.frombuffer(rest, dtype="<f4").tolist() == [1, 2, 3, 4]


def test_json_outputs_keep_their_datatype_s_precision() -> None:
    """FP32 values as v1 writes them (0.1, not the float64 0.10000000149011612), whatever
    the outputs' byte order or layout."""
    spec = [TensorSpec("y", "FP32", [2])]
    request = kserve.parse_request(body(tensor(data=[0, 0])), None)
    wide = np.array([[0.1, 9.0, 0.2], [0.3, 9.0, 0.4]], dtype=">f4")[:, ::2]  # strided, swapped
    for outputs in ([np.array([0.1, 0.2], np.float32), np.array([0.3, 0.4], np.float32)], wide):
        content, _ = kserve.build_response("m", request, list(outputs), spec)
        assert b'"data":[0.1,0.2,0.3,0.4]' in content


def test_requested_outputs_of_a_multi_output_model() -> None:
    specs = [TensorSpec("a", "INT64", [1]), TensorSpec("b", "BYTES", [])]
    outputs = [{"a": [1], "b": b"x"}, {"a": [2], "b": b"yz"}]
    request = kserve.parse_request(
        body(tensor(data=[0, 0]), outputs=[{"name": "b", "parameters": {"binary_data": True}}]),
        None,
    )
    document, rest, _ = answer(request, outputs, specs)
    assert [entry["name"] for entry in document["outputs"]] == ["b"]
    assert rest == struct.pack("<I", 1) + b"x" + struct.pack("<I", 2) + b"yz"
    plain = kserve.parse_request(body(tensor(data=[0, 0]), outputs=[{"name": "b"}]), None)
    document, _, _ = answer(plain, outputs, specs)
    assert document["outputs"][0]["data"] == ["x", "yz"]
    unknown = kserve.parse_request(body(tensor(data=[0, 0]), outputs=[{"name": "c"}]), None)
    with pytest.raises(HTTPError) as raised:
        answer(unknown, outputs, specs)
    assert raised.value.status == 422
    assert raised.value.message == "unknown outputs ['c']; the model gives ['a', 'b']"


def test_outputs_that_cannot_be_sent_are_500_invalid_output() -> None:
    request = kserve.parse_request(body(tensor(data=[0, 0])), None)
    for outputs, specs, message in (
        ([{"a": 1}], [TensorSpec("a", "FP32", []), TensorSpec("b", "FP32", [])], "lacks 'b'"),
        ([[1, 2], [3]], [], "cannot form a tensor"),
        ([np.array([1j])], [], "outputs of dtype complex128 cannot be sent"),
    ):
        with pytest.raises(HTTPError) as raised:
            answer(request, outputs, specs)
        assert (raised.value.status, raised.value.type) == (500, "InvalidOutput")
        assert message in raised.value.message


def test_bytes_outputs_are_sent_as_they_are_or_refused() -> None:
    """BYTES elements travel exactly in binary; JSON takes the UTF-8 ones only (never a
    replacement character in place of a byte), and neither takes what is not str or bytes."""
    spec = [TensorSpec("y", "BYTES", [])]
    raw = [b"\xff\x00\xfe", "\u00e9\U0001f600\x00".encode(), "z"]
    binary = kserve.parse_request(
        body(tensor(data=[0, 0]), parameters={"binary_data_output": True}), None
    )
    _, rest, _ = answer(binary, raw, spec)
    assert rest == kserve.encode_bytes_elements(raw)
    plain = kserve.parse_request(body(tensor(data=[0, 0])), None)
    document, _, _ = answer(plain, raw[1:], spec)
    assert document["outputs"][0]["data"] == ["\u00e9\U0001f600\x00", "z"]
    for request, outputs, message in (
        (plain, raw, "output 'y' holds bytes that are not UTF-8"),
        (plain, [None], "output 'y' is BYTES, but holds NoneType values"),
        (binary, [3], "output 'y' is BYTES, but holds int values"),
    ):
        with pytest.raises(HTTPError) as raised:
            answer(request, outputs, spec)
        assert (raised.value.status, raised.value.type) == (500, "InvalidOutput")
        assert raised.value.message.startswith(message)


def test_tensor_metadata_has_a_batch_dimension() -> None:
    specs = [TensorSpec("x", "FP32", [3, 4])]
    assert kserve.tensor_metadata(specs) == [{"name": "x", "datatype": "FP32", "shape": [-1, 3, 4]}]


def test_a_shape_with_a_zero_and_dims_too_large_for_numpy_is_a_400() -> None:
    """No elements (a zero dim), but nonzero dims whose product numpy cannot size: a 400
    naming the input, not numpy's ValueError answered 500."""
    raw = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 0, 2**62], "data": []}]}
    )
    with pytest.raises(HTTPError) as refused:
        kserve.parse_request(raw, None)
    assert refused.value.status == 400 and "is too large" in refused.value.message
    within = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 0, 2**40], "data": []}]}
    )
    assert kserve.parse_request(within, None).inputs["x"].shape == (1, 0, 2**40)


def test_the_json_header_is_held_to_the_container_budget() -> None:
    tensor = {"name": "x", "datatype": "FP32", "shape": [2, 1], "data": [[1], [2]]}
    raw = orjson.dumps({"inputs": [tensor]})  # 7 arrays and objects
    assert kserve.parse_request(raw, None, max_containers=7).batch_size == 2
    with pytest.raises(HTTPError) as refused:
        kserve.parse_request(raw, None, max_containers=6)
    assert refused.value.status == 413


def test_a_bytes_shape_far_past_its_binary_data_is_refused_before_any_allocation() -> None:
    """Each BYTES element takes at least its 4-byte length: a shape claiming more elements
    than the binary data can hold is a 400 allocating nothing for them (a 150-byte request
    claiming 2**26 elements made the gateway allocate 512 MiB, 2**31 elements 16 GiB)."""
    import tracemalloc

    head = body(tensor("s", "BYTES", (2**24,), parameters={"binary_data_size": 4}))
    tracemalloc.start()
    try:
        status, said = refused(head + struct.pack("<I", 0), str(len(head)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (status, said) == (400, "input 's': binary BYTES data is truncated")
    assert peak < 2**20  # the old code's array of 2**24 pointers alone was 128 MiB


def test_an_output_requested_twice_is_a_400() -> None:
    """Each requested output was answered as often as it was named, its binary data with it:
    a 5 MB request naming one output 100,000 times got a 111 MB answer (the bigger a model's
    outputs, the more: past any memory, within the body limit)."""
    twice = [{"name": "y", "parameters": {"binary_data": True}}, {"name": "y"}]
    status, said = refused(body(tensor(data=[0, 0]), outputs=twice))
    assert (status, said) == (400, "output 'y' is requested twice")
    once = kserve.parse_request(body(tensor(data=[0, 0]), outputs=twice[:1]), None)
    assert once.outputs == [("y", True)]


def test_binary_output_flags_that_are_no_booleans_are_400() -> None:
    """``"binary_data_output": "false"`` (or an output's ``"binary_data": "no"``) was read by
    its truthiness: the string "false" asked for binary outputs. As Triton, a flag that is no
    JSON boolean is a 400 (null is no flag given)."""
    for value in ("false", "true", 0, 1, [], {}):
        status, said = refused(body(tensor(data=[0, 0]), parameters={"binary_data_output": value}))
        assert status == 400, value
        assert said == f"'binary_data_output' must be true or false, not {shown(value)}"
        wanted = [{"name": "y", "parameters": {"binary_data": value}}]
        status, said = refused(body(tensor(data=[0, 0]), outputs=wanted))
        assert status == 400, value
        assert said == f"output 'y': 'binary_data' must be true or false, not {shown(value)}"
    for flag in (True, False):
        outputs = [
            {"name": "y"},
            {"name": "z", "parameters": {"binary_data": not flag}},
            {"name": "w", "parameters": {"binary_data": None}},
        ]
        request = kserve.parse_request(
            body(tensor(data=[0, 0]), parameters={"binary_data_output": flag}, outputs=outputs),
            None,
        )
        assert request.outputs == [("y", flag), ("z", not flag), ("w", flag)]
    unset = kserve.parse_request(
        body(tensor(data=[0, 0]), parameters={"binary_data_output": None}, outputs=[{"name": "y"}]),
        None,
    )
    assert unset.outputs == [("y", False)]


def test_a_datatype_that_is_a_list_or_an_object_is_400_not_500() -> None:
    """A datatype JSON cannot hash (a list, an object) raised TypeError in the look-up of the
    known datatypes: the request was answered 500 InternalError, with an error line in the
    gateway's log each."""
    for datatype in ([], ["FP32"], {}, {"FP32": 1}):
        status, said = refused(body(tensor(datatype=datatype, data=[0, 0])))
        assert status == 400, datatype
        assert said == f"input 'x': unknown datatype {shown(datatype)}"


def test_extensions_the_gateway_does_not_serve_are_400_not_ignored() -> None:
    """An output asking for Triton's classification extension (tritonclient's
    ``class_count``) was answered with the whole tensor, not the top classes asked for, and an
    output asking for a shared-memory region was answered inline: a client then read an answer
    of another shape, or nothing, where a 400 says the extension is not served."""
    top3 = [{"name": "y", "parameters": {"classification": 3}}]
    status, said = refused(body(tensor(data=[0, 0]), outputs=top3))
    assert status == 400 and said.startswith("output 'y': Triton's classification extension")
    assert "binary_tensor_data" in said  # the extensions it has, as GET /v2 lists them
    region = {"shared_memory_region": "r", "shared_memory_byte_size": 8}
    status, said = refused(body(tensor(data=[0, 0]), outputs=[{"name": "y", "parameters": region}]))
    assert status == 400 and said.startswith("output 'y': Triton's shared-memory extension")
    status, said = refused(body(tensor(parameters=region)))
    assert status == 400 and said.startswith("input 'x': Triton's shared-memory extension")
    unset = {"classification": None, "shared_memory_region": None}
    request = kserve.parse_request(
        body(tensor(data=[0, 0]), outputs=[{"name": "y", "parameters": unset}]), None
    )
    assert request.outputs == [("y", False)]


def test_refused_values_are_quoted_as_json_not_as_python() -> None:
    """A refused value of the request's JSON was shown as Python's repr of what it parsed to
    (``True``, ``['FP32']``, ``{'FP32': 1}``, ``None``): words the client never wrote."""
    cases = (
        (body(tensor(data=[0, 0]), parameters={"binary_data_output": [True]}),
         "'binary_data_output' must be true or false, not [true]"),
        (body(tensor(data=[0, 0]), outputs=[{"name": "y", "parameters": {"binary_data": {}}}]),
         "output 'y': 'binary_data' must be true or false, not {}"),
        (body(tensor(datatype=["FP32"], data=[0, 0])),
         'input \'x\': unknown datatype ["FP32"]'),
        (body(tensor(datatype={"FP32": True}, data=[0, 0])),
         'input \'x\': unknown datatype {"FP32":true}'),
        (body(tensor(datatype=None, data=[0, 0])), "input 'x': unknown datatype null"),
        (body({"name": None, "parameters": {"shared_memory_region": "r"}}),
         "input null: Triton's shared-memory extension"),
        (body({"name": False, "parameters": {"shared_memory_region": "r"}}),
         "input false: Triton's shared-memory extension"),
    )  # fmt: skip
    for raw, said in cases:
        status, message = refused(raw)
        assert status == 400 and message.startswith(said), (said, message)
