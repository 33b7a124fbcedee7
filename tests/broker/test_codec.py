"""The codec: msgpack + arrays/tensors, zero-copy, allow-listed, never pickle."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest

from broker import codec
from broker.errors import CodecError


@pytest.mark.parametrize(
    "dtype",
    [
        "bool",
        "int8",
        "uint8",
        "int16",
        "int32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
    ],
)
def test_arrays_round_trip_with_dtype_and_shape(dtype: str) -> None:
    array = (np.arange(24) % 5).astype(dtype).reshape(2, 3, 4)
    decoded = codec.decode(codec.encode({"x": array, "n": 3}))
    assert decoded["n"] == 3
    out = decoded["x"]
    assert out.dtype == np.dtype(dtype) and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, array)


def test_decoded_arrays_are_read_only_views_of_the_message() -> None:
    data = codec.encode(np.ones((1000,), dtype=np.float32))
    out = codec.decode(data)
    assert not out.flags.writeable
    assert out.base is not None  # a view over the received bytes, not a copy


def test_non_contiguous_big_endian_and_scalars() -> None:
    array = np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(codec.decode(codec.encode(array)), array)
    assert codec.decode(codec.encode([np.float32(1.5), np.int64(2)])) == [1.5, 2]
    assert codec.decode(codec.encode(np.zeros((0, 3)))).shape == (0, 3)


def test_torch_tensors_travel_as_arrays() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = codec.decode(codec.encode(tensor))
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, tensor.numpy())
    bf16 = codec.decode(codec.encode(torch.ones(2, dtype=torch.bfloat16)))
    assert bf16.dtype == np.float32


def test_disallowed_values_are_refused() -> None:
    for value in (object(), np.array(["a", "b"]), np.array([object()], dtype=object)):
        with pytest.raises(CodecError):
            codec.encode(value)


def test_refusals_say_what_the_value_is() -> None:
    """An int past msgpack's 64 bits is no bad type, and a tuple map key (encoded as an
    array) is no malformed payload: each refusal says which it is."""
    for number in (2**64, -(2**63) - 1, 10**5000):
        with pytest.raises(CodecError, match=r"integers below -2\*\*63 or above 2\*\*64-1"):
            codec.encode([number])
    for value in ({(1, 2): "a"}, [{"k": {(0,): 1}}]):
        with pytest.raises(CodecError, match="a map key is an array or a map"):
            codec.decode(codec.encode(value))
    # bytes packed as a str (Ruby's msgpack packs a String tagged UTF-8 so, bytes or not)
    for data in (b"\xa2\xc7\x15", b"\x81\xa1k\xa1\xff", b"\x81\xa1\xff\x01"):
        with pytest.raises(CodecError, match="str holds bytes that are not UTF-8"):
            codec.decode(data)


def test_malformed_payloads_raise_codec_error() -> None:
    header = bytes([3]) + b"<f4" + bytes([1]) + (10).to_bytes(8, "little")
    cases = [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2])[:-1],  # truncated
        pickle.dumps({"a": 1}),  # a pickle is not msgpack
        msgpack.packb(msgpack.ExtType(1, header + b"\x00" * 8)),  # data shorter than shape
        msgpack.packb(msgpack.ExtType(1, bytes([3]) + b"|O8" + bytes([0]))),  # object dtype
        msgpack.packb(msgpack.ExtType(1, b"")),  # empty header
        msgpack.packb(msgpack.ExtType(9, b"x")),  # unknown extension
    ]
    for data in cases:
        with pytest.raises(CodecError):
            codec.decode(data)


def test_msgpack_timestamps_are_an_unknown_extension_too() -> None:
    """msgpack decodes extension type -1 itself, around the hook that refuses the others."""
    stamps = [msgpack.Timestamp(1), msgpack.Timestamp(1, 5), msgpack.Timestamp(2**40, 1)]
    for stamp in stamps:  # its 4-, 8- and 12-byte forms, anywhere in the payload
        for value in (stamp, [1, {"t": stamp}], {stamp: 1}):
            with pytest.raises(CodecError, match="unknown extension type -1"):
                codec.decode(msgpack.packb(value))
    # the same bytes inside binary data, or a 255, are data
    lookalike = [255, b"\xd6\xff\x00\x00\x00\x01", "\xff"]
    assert codec.decode(msgpack.packb(lookalike)) == lookalike


def test_size_limit() -> None:
    data = codec.encode(b"x" * 1000)
    with pytest.raises(CodecError, match="limit"):
        codec.decode(data, max_bytes=100)
    with pytest.raises(CodecError, match="limit"):
        codec.encode(b"x" * 1000, max_bytes=100)


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(0, dtype=np.float32),
        np.arange(3, dtype=np.uint8),  # a 16-byte body: msgpack's fixext 16
        np.arange(4, dtype=np.uint8),
        np.arange(256, dtype=np.float32),  # ext 16, the common request
        np.arange(60, dtype=np.uint8),  # ext 8
        np.arange(70_000, dtype=np.uint8),  # ext 32
        np.arange(12, dtype=">i4").reshape(3, 4)[:, ::2],  # big-endian, not contiguous
        np.zeros((2, 0, 3), dtype=np.float16),
    ],
    ids=lambda a: f"{a.dtype}{a.shape}",
)
def test_the_array_fast_path_packs_exactly_what_msgpack_packs(array: np.ndarray) -> None:
    generic = msgpack.packb(array, default=codec._default, use_bin_type=True)
    assert codec.encode(array) == generic
    decoded = codec.decode(generic)
    assert decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)


def test_messages_of_more_containers_than_the_budget_are_refused_as_they_decode() -> None:
    """Each empty array or map is one byte of msgpack and a Python list or dict of 64 bytes or
    more: a 16 MiB payload of them grew a worker by 1.7 GB. The decode counts them and stops
    one past the budget, with CodecError naming it."""
    nested = codec.encode({"rows": [[1.0, 2.0]] * 10, "meta": {"k": [1]}})  # 14 containers
    assert codec.decode(nested, max_containers=14)["rows"][9] == [1.0, 2.0]
    with pytest.raises(CodecError, match="more than 13 arrays and maps"):
        codec.decode(nested, max_containers=13)
    # a message of no more bytes than the budget cannot exceed it: decoded without counting
    assert codec.decode(msgpack.packb([[]] * 3), max_containers=4) == [[], [], []]
    # the default budget, against 2 Mi empty arrays (2 MiB): refused, not built
    flood = b"\xdd" + (2 * codec.DEFAULT_MAX_CONTAINERS).to_bytes(4, "big")
    flood += b"\x90" * (2 * codec.DEFAULT_MAX_CONTAINERS)
    with pytest.raises(CodecError, match=f"more than {codec.DEFAULT_MAX_CONTAINERS} arrays"):
        codec.decode(flood)
    maps = b"\xdd" + (2 * codec.DEFAULT_MAX_CONTAINERS).to_bytes(4, "big")
    maps += b"\x80" * (2 * codec.DEFAULT_MAX_CONTAINERS)
    with pytest.raises(CodecError, match="arrays and maps"):
        codec.decode(maps)
    # arrays (extension type 1) are not containers: any number of them in budget
    arrays = codec.encode([np.zeros(2, np.float32)] * 100)
    assert len(codec.decode(arrays, max_containers=1)) == 100
