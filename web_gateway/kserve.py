"""The Open Inference Protocol (KServe v2) request/response bodies, with Triton's binary tensors.

A request body is JSON, optionally followed by raw tensor bytes: the header
``Inference-Header-Content-Length`` gives the JSON's length, and each input whose
``parameters.binary_data_size`` is set takes that many bytes from what follows, in input order.
BYTES elements travel as a 4-byte little-endian length then the bytes. A response puts an output
in binary when the request asked for it (``parameters.binary_data_output`` for all outputs, or an
output's ``parameters.binary_data``), and then sets the same header.

Everything here raises :class:`web_gateway.errors.HTTPError` (400 for a malformed body, 422 for
one that does not fit the model) and never touches the network.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import orjson

from broker.codec import MAX_NDIM
from gpu_worker.model import DATATYPES, TensorSpec, Unfit, to_datatype

from .errors import HTTPError, bad_request, invalid_input, shown
from .reading import DEFAULT_MAX_JSON_CONTAINERS, json_document

HEADER_LENGTH = "inference-header-content-length"
VERSIONS = ("1",)  # a model's versions in the protocol's sense: each served model has one
EXTENSIONS = ("binary_tensor_data",)  # the protocol extensions served (GET /v2 lists them)
# Parameters that ask for an extension not served, and its name: answered 400, as ignoring
# them would answer something else than what was asked (the whole tensor for the top classes)
UNSERVED_EXTENSIONS = {
    "classification": "classification",
    "shared_memory_region": "shared-memory",
}
_U32 = struct.Struct("<I")

NUMPY_TO_DATATYPE = {
    np.dtype(dtype): datatype for datatype, dtype in DATATYPES.items() if dtype is not None
}


@dataclass
class InferRequest:
    """A parsed v2 inference request: its id, parameters, input tensors and requested outputs."""

    id: str | None
    parameters: dict[str, Any]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    datatypes: dict[str, str] = field(default_factory=dict)
    outputs: list[tuple[str, bool]] | None = None  # (name, binary) as requested
    all_binary: bool = False  # binary_data_output: every output not named in binary

    @property
    def batch_size(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    def items(self) -> list[Any]:
        """One item per row: the row itself for one input, else ``{name: row}``."""
        rows = range(self.batch_size)
        if len(self.inputs) == 1:
            (array,) = self.inputs.values()
            return _rows(array, rows)
        columns = {name: _rows(array, rows) for name, array in self.inputs.items()}
        return [{name: column[i] for name, column in columns.items()} for i in rows]


def _rows(array: np.ndarray, rows: range) -> list[Any]:
    """An array's rows. Those of a numeric 1-d array as 0-d arrays, not numpy scalars: the
    codec sends a scalar as a Python number, so an FP32 row would reach the model as a
    float64 one (BYTES rows stay str or bytes)."""
    if array.ndim == 1 and array.dtype != object:
        return [array[i, ...] for i in rows]
    return [array[i] for i in rows]


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"{what} must be a JSON object")
    return value


def _parameters(holder: dict[str, Any], what: str) -> dict[str, Any]:
    """``holder``'s ``parameters``: an object, or none (absent or null: no parameters)."""
    value = holder.get("parameters")
    return {} if value is None else _object(value, what)


def _check_served(params: dict[str, Any], where: str) -> None:
    """400 for a tensor's parameter asking for an extension this server does not have."""
    for parameter, extension in UNSERVED_EXTENSIONS.items():
        if params.get(parameter) is not None:
            raise bad_request(
                f"{where}: Triton's {extension} extension ({parameter!r}) is not served; "
                f"this server's extensions: {', '.join(EXTENSIONS)}"
            )


def _shape(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in value
    ):
        raise bad_request(f"input {name!r}: shape must be a list of non-negative integers")
    if not value:
        raise bad_request(f"input {name!r}: shape needs a batch dimension")
    if len(value) > MAX_NDIM + 1:
        raise bad_request(
            f"input {name!r}: shape has {len(value)} dimensions, at most {MAX_NDIM + 1} "
            f"(the batch dimension and {MAX_NDIM} of each item)"
        )
    return value


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    # Whole levels of lists at once (the common shapes: flat, or rows of equal depth); a level
    # that mixes lists and values goes the slow way below, the leaves in the same order.
    level: list[Any] = data
    while True:
        kinds = set(map(type, level))
        if not any(issubclass(kind, list) for kind in kinds):
            return level
        if kinds != {list}:
            break
        level = list(chain.from_iterable(level))
    out: list[Any] = []
    stack = [iter(level)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            out.append(value)
        else:
            stack.pop()
    return out


def _decode_bytes_elements(blob: bytes, count: int, name: str) -> list[bytes]:
    if count * _U32.size > len(blob):  # each element has its length: checked before any work
        raise bad_request(f"input {name!r}: binary BYTES data is truncated")
    out: list[bytes] = []
    pos = 0
    for _ in range(count):
        if pos + 4 > len(blob):
            raise bad_request(f"input {name!r}: binary BYTES data is truncated")
        (size,) = _U32.unpack_from(blob, pos)
        pos += 4
        if pos + size > len(blob):
            raise bad_request(f"input {name!r}: binary BYTES data is truncated")
        out.append(blob[pos : pos + size])
        pos += size
    if pos != len(blob):
        raise bad_request(f"input {name!r}: binary BYTES data has trailing bytes")
    return out


def encode_bytes_elements(values: Sequence[Any]) -> bytes:
    parts = []
    for value in values:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def _header(spec: dict[str, Any]) -> tuple[str, str, list[int], int]:
    """An input's name, datatype, shape and element count, checked."""
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("every input needs a 'name'")
    datatype = spec.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:  # (a list is unhashable)
        raise bad_request(f"input {name!r}: unknown datatype {shown(datatype)}")
    shape = _shape(spec.get("shape"), name)
    count = 1
    for dim in shape:
        count *= dim
    if count > 1 << 31:
        raise bad_request(f"input {name!r}: shape {shape} is too large")
    return name, datatype, shape, count


def _from_binary(blob: bytes, name: str, datatype: str, shape: list[int], count: int) -> Any:
    dtype_name = DATATYPES[datatype]
    if dtype_name is None:
        # decoded before the array is made: a shape the blob cannot hold allocates nothing
        elements = _decode_bytes_elements(blob, count, name)
        array = np.empty(count, dtype=object)
        array[:] = elements
        return array
    dtype = np.dtype(dtype_name).newbyteorder("<")
    if len(blob) != count * dtype.itemsize:
        raise bad_request(
            f"input {name!r}: {len(blob)} binary bytes do not match shape {shape} of {datatype}"
        )
    return np.frombuffer(blob, dtype=dtype)


def _from_json(spec: dict[str, Any], name: str, datatype: str, shape: list[int], count: int) -> Any:
    if "data" not in spec:
        raise bad_request(f"input {name!r} has neither 'data' nor binary data")
    flat = _flatten(spec["data"])
    if len(flat) != count:
        raise bad_request(f"input {name!r}: {len(flat)} data elements do not match shape {shape}")
    dtype_name = DATATYPES[datatype]
    if dtype_name is None:
        if not all(isinstance(value, str) for value in flat):
            raise bad_request(f"input {name!r}: BYTES data must be strings")
        array = np.empty(count, dtype=object)
        array[:] = flat
        return array
    try:
        return to_datatype(flat, np.dtype(dtype_name), datatype)
    except Unfit as exc:  # 422 naming the item (row) and the position within it
        item, *position = (int(i) for i in np.unravel_index(exc.position[0], shape))
        raise invalid_input(f"item {item}: {exc.describe(name, position)}") from None
    except (OverflowError, ValueError, TypeError) as exc:
        raise bad_request(f"input {name!r}: data does not fit {datatype}: {exc}") from exc


def _tensor(spec: dict[str, Any], blob: bytes | None) -> tuple[str, str, np.ndarray]:
    name, datatype, shape, count = _header(spec)
    if blob is not None:
        if "data" in spec:  # which would win is nowhere said: neither does
            raise bad_request(f"input {name!r} has both 'data' and binary data (binary_data_size)")
        array = _from_binary(blob, name, datatype, shape, count)
    else:
        array = _from_json(spec, name, datatype, shape, count)
    try:
        return name, datatype, array.reshape(shape)
    except ValueError:  # no elements, but nonzero dims whose product numpy cannot size
        raise bad_request(f"input {name!r}: shape {shape} is too large") from None


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON part of a body and the binary data after it."""
    if header_length is None:
        return body, memoryview(b"")
    if not header_length.strip(" \t").isascii() or not header_length.strip(" \t").isdigit():
        # (int() also takes '1_0', '+1' and '-0')
        raise bad_request("Inference-Header-Content-Length must be an integer")
    json_size = int(header_length)
    if not 0 < json_size <= len(body):
        raise bad_request("Inference-Header-Content-Length is outside the body")
    return body[:json_size], memoryview(body)[json_size:]


def _document(head: bytes, max_containers: int) -> dict[str, Any]:
    return _object(json_document(head, max_containers), "the request body")


class _Binary:
    """The binary data after a body's JSON, taken by the inputs in order."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def take(self, params: dict[str, Any]) -> bytes | None:
        """An input's bytes, if its parameters say it has ``binary_data_size`` of them."""
        size = params.get("binary_data_size")
        if size is None:
            return None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise bad_request("binary_data_size must be a non-negative integer")
        if self.pos + size > len(self.data):
            if not self.data:  # a body without Inference-Header-Content-Length is all JSON
                raise bad_request(
                    f"an input has binary_data_size {size}, but the body has no binary data: "
                    "send Inference-Header-Content-Length (the size of its JSON in bytes)"
                )
            raise bad_request("binary tensor data is shorter than binary_data_size says")
        blob = bytes(self.data[self.pos : self.pos + size])
        self.pos += size
        return blob

    def check_all_taken(self) -> None:
        if self.pos != len(self.data):
            raise bad_request("the body has binary data that no input claims")


def _read_inputs(request: InferRequest, inputs: Any, binary: _Binary) -> None:
    if not isinstance(inputs, list) or not inputs:
        raise bad_request("'inputs' must be a non-empty list of tensors")
    for raw in inputs:
        spec = _object(raw, "each input")
        params = _parameters(spec, "input 'parameters'")
        _check_served(params, f"input {shown(spec.get('name'))}")
        name, datatype, array = _tensor(spec, binary.take(params))
        if name in request.inputs:
            raise bad_request(f"input {name!r} appears twice")
        request.inputs[name] = array
        request.datatypes[name] = datatype
    binary.check_all_taken()
    sizes = {array.shape[0] for array in request.inputs.values()}
    if len(sizes) != 1:
        raise bad_request("all inputs must have the same batch size (first dimension)")


def _requested_outputs(wanted: Any, all_binary: bool) -> list[tuple[str, bool]] | None:
    """The outputs a request names, each with whether it wants it in binary."""
    if wanted is None:
        return None
    if not isinstance(wanted, list):
        raise bad_request("'outputs' must be a list")
    outputs = []
    named: set[str] = set()
    for raw in wanted:
        out = _object(raw, "each requested output")
        out_name = out.get("name")
        if not isinstance(out_name, str):
            raise bad_request("every requested output needs a 'name'")
        if out_name in named:  # each one named would be answered, its data with it
            raise bad_request(f"output {out_name!r} is requested twice")
        named.add(out_name)
        out_params = _parameters(out, "output 'parameters'")
        _check_served(out_params, f"output {out_name!r}")
        binary = _flag(out_params, "binary_data", f"output {out_name!r}: ")
        outputs.append((out_name, all_binary if binary is None else binary))
    return outputs


def _flag(parameters: dict[str, Any], name: str, where: str = "") -> bool | None:
    """A boolean parameter (``binary_data_output``, ``binary_data``); None where it is absent
    or null; 400 for any other value (the string "false" was read as true)."""
    value = parameters.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise bad_request(f"{where}{name!r} must be true or false, not {shown(value)}")


def parse_request(
    body: bytes, header_length: str | None, max_containers: int = DEFAULT_MAX_JSON_CONTAINERS
) -> InferRequest:
    """Parse a v2 infer body (JSON, or JSON + binary tensors); 400 when malformed, 413 when
    its JSON holds more than ``max_containers`` arrays and objects."""
    head, binary = _split_body(body, header_length)
    document = _document(head, max_containers)
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request("'id' must be a string")
    parameters = _parameters(document, "'parameters'")
    request = InferRequest(request_id, parameters)
    _read_inputs(request, document.get("inputs"), _Binary(binary))
    request.all_binary = bool(_flag(parameters, "binary_data_output"))
    request.outputs = _requested_outputs(document.get("outputs"), request.all_binary)
    return request


def check_inputs(
    request: InferRequest, specs: Sequence[TensorSpec], strict_datatypes: bool
) -> None:
    """422 unless the request's tensors are the model's declared inputs (names, rank, type)."""
    if not specs:
        return
    declared = {spec.name: spec for spec in specs}
    if set(request.inputs) != set(declared):
        raise invalid_input(
            f"inputs are {sorted(request.inputs)}, the model takes {sorted(declared)}"
        )
    if not strict_datatypes:
        return
    for name, array in request.inputs.items():
        spec = declared[name]
        if request.datatypes[name] != spec.datatype:
            raise invalid_input(
                f"input {name!r} is {request.datatypes[name]}, the model takes {spec.datatype}"
            )
        if not spec.shape_matches(array.shape[1:]):
            raise invalid_input(
                f"input {name!r} has shape {list(array.shape)}, the model takes {[-1, *spec.shape]}"
            )


def _datatype_of(array: np.ndarray) -> str:
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    datatype = NUMPY_TO_DATATYPE.get(array.dtype.newbyteorder("="))
    if datatype is None:
        raise HTTPError(500, "InvalidOutput", f"outputs of dtype {array.dtype} cannot be sent")
    return datatype


def _stack(values: list[Any], spec: TensorSpec | None) -> np.ndarray:
    if spec is not None and spec.datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array
    try:
        array = np.stack([np.asarray(value) for value in values])
        if spec is not None and spec.numpy_dtype is not None:
            array = array.astype(spec.numpy_dtype, copy=False)
    except (ValueError, TypeError) as exc:
        raise HTTPError(500, "InvalidOutput", f"model outputs cannot form a tensor: {exc}") from exc
    return array


def _output_tensors(outputs: list[Any], specs: Sequence[TensorSpec]) -> dict[str, np.ndarray]:
    """The items' outputs stacked into one tensor per output name."""
    if len(specs) > 1 or (not specs and outputs and isinstance(outputs[0], dict)):
        names = [spec.name for spec in specs] or list(outputs[0])
        by_name = {spec.name: spec for spec in specs}
        try:
            columns = {name: [output[name] for output in outputs] for name in names}
        except (KeyError, TypeError) as exc:
            raise HTTPError(500, "InvalidOutput", f"model output lacks {exc}") from exc
        return {name: _stack(values, by_name.get(name)) for name, values in columns.items()}
    spec = specs[0] if specs else None
    return {spec.name if spec else "output": _stack(outputs, spec)}


def check_outputs(request: InferRequest, specs: Sequence[TensorSpec]) -> None:
    """422 for a requested output the model does not declare, before its items are queued (a
    model declaring no outputs has its names known only from its results: see ``_wanted``)."""
    if request.outputs is not None and specs:
        _check_known(request.outputs, [spec.name for spec in specs])


def _check_known(requested: list[tuple[str, bool]], names: Iterable[str]) -> None:
    known = set(names)
    unknown = [name for name, _ in requested if name not in known]
    if unknown:
        raise invalid_input(f"unknown outputs {unknown}; the model gives {sorted(known)}")


def _wanted(request: InferRequest, tensors: dict[str, np.ndarray]) -> list[tuple[str, bool]]:
    if request.outputs is None:
        return [(name, request.all_binary) for name in tensors]
    _check_known(request.outputs, tensors)
    return request.outputs


def _bytes_elements(name: str, array: np.ndarray) -> list[str | bytes]:
    """A BYTES output's elements; 500 InvalidOutput for one that is neither str nor bytes
    (``str()`` or ``bytes()`` of it would be no value the model gave: ``bytes(3)`` is three
    zero bytes)."""
    values: list[Any] = array.reshape(-1).tolist()
    for value in values:
        if not isinstance(value, (str, bytes)):
            raise HTTPError(
                500,
                "InvalidOutput",
                f"output {name!r} is BYTES, but holds {type(value).__name__} values "
                "(a BYTES output takes str or bytes)",
            )
    return values


def _as_text(name: str, value: str | bytes) -> str:
    """One BYTES element as a JSON string: 500 InvalidOutput for bytes that are not UTF-8,
    which JSON cannot carry as they are (binary outputs can)."""
    if isinstance(value, str):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise HTTPError(
            500,
            "InvalidOutput",
            f"output {name!r} holds bytes that are not UTF-8, which JSON cannot carry: "
            "ask for it in binary (parameters.binary_data or binary_data_output)",
        ) from None


def _describe(name: str, array: np.ndarray, binary: bool) -> tuple[dict[str, Any], bytes | None]:
    """One output's JSON entry, and its binary data when it travels in binary."""
    datatype = _datatype_of(array)
    entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if binary:
        if datatype == "BYTES":
            blob = encode_bytes_elements(_bytes_elements(name, array))
        else:
            blob = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        entry["parameters"] = {"binary_data_size": len(blob)}
        return entry, blob
    if datatype == "BYTES":
        entry["data"] = [_as_text(name, value) for value in _bytes_elements(name, array)]
    else:
        # serialized by orjson as it is (float32 values in their shortest form, as v1 writes
        # them, not as the float64 values tolist() would make of them)
        entry["data"] = np.ascontiguousarray(array.reshape(-1), array.dtype.newbyteorder("="))
    return entry, None


def build_response(
    model_name: str,
    request: InferRequest,
    outputs: list[Any],
    specs: Sequence[TensorSpec],
) -> tuple[bytes, dict[str, str]]:
    """The response body and its extra headers for the items' ``outputs``."""
    tensors = _output_tensors(outputs, specs)
    described = []
    blobs: list[bytes] = []
    for name, binary in _wanted(request, tensors):
        entry, blob = _describe(name, tensors[name], binary)
        described.append(entry)
        if blob is not None:
            blobs.append(blob)
    document: dict[str, Any] = {"model_name": model_name, "model_version": VERSIONS[0]}
    if request.id is not None:
        document["id"] = request.id
    document["outputs"] = described
    head = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return head, {}
    return head + b"".join(blobs), {"Inference-Header-Content-Length": str(len(head))}


def tensor_metadata(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    """v2 metadata of declared tensors, with the batch dimension as -1."""
    return [
        {"name": spec.name, "datatype": spec.datatype, "shape": [-1, *spec.shape]} for spec in specs
    ]
