"""IndexedHeaders (the hot routes' request headers) answer as starlette's Headers do."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from web_gateway.reading import GatewayRequest, IndexedHeaders

RAW = [
    (b"host", b"gateway"),
    (b"content-type", b"application/json"),
    (b"x-priority", b"high"),
    (b"x-priority", b"low"),  # a repeated name: the first value is the one read
    (b"x-request-timeout", b""),  # present, and empty
    (b"x-latin", "caf\u00e9".encode("latin-1")),
]
NAMES = ["host", "Content-Type", "X-PRIORITY", "x-request-timeout", "x-latin", "traceparent", ""]


def test_indexed_headers_answer_every_lookup_as_starlettes_do() -> None:
    indexed, plain = IndexedHeaders({"headers": list(RAW)}), Headers(scope={"headers": list(RAW)})
    for name in NAMES:
        assert indexed.get(name) == plain.get(name), name
        assert indexed.get(name, "fallback") == plain.get(name, "fallback"), name
        assert (name in indexed) == (name in plain), name
        if name in plain:
            assert indexed[name] == plain[name]
        else:
            with pytest.raises(KeyError):
                indexed[name]
    assert indexed.getlist("x-priority") == ["high", "low"]
    assert indexed.raw == plain.raw and dict(indexed.items()) == dict(plain.items())
    assert indexed == plain


def test_a_gateway_request_reads_its_headers_once_indexed() -> None:
    request = GatewayRequest({"type": "http", "headers": list(RAW)})
    assert isinstance(request.headers, IndexedHeaders)
    assert request.headers is request.headers
    assert request.headers.get("x-priority") == "high"
