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


# --- the JSON container budget (--max-json-containers) ---------------------------------------


def test_json_containers_counts_brackets_outside_strings_once_past_the_limit() -> None:
    from web_gateway.reading import json_containers

    body = b'{"inputs": [[1, 2], [3, 4]], "x": [' + b"[]," * 50 + b"{}]}"
    assert json_containers(body, 10) == 1 + 1 + 2 + 1 + 51
    # brackets within strings (escaped quotes included) are not containers
    quoted = b'{"a": "[[[{{{", "b\\"[[": ["\\\\", "[", {"c": "]"}], "d": ' + b"[]," * 10 + b"[]}"
    assert json_containers(quoted, 5) == 1 + 1 + 1 + 1 + 10
    # under twice the limit in bytes, a body cannot hold more: nothing is counted
    assert json_containers(b"[[[[]]]]", 4) == 0
    # a string that never ends (malformed JSON) hides the rest, in linear time
    assert json_containers(b'[[[[[[[["' + b'\\"[' * 100_000, 4) == 8


@pytest.mark.timeout(60)  # linear: a fraction of a second; quadratic: days
def test_an_unterminated_string_of_escaped_quotes_is_counted_in_linear_time() -> None:
    """The exact count strips strings with a possessive pattern: one that never closes is
    taken whole, never tried again from each quote within it (which would be quadratic)."""
    from web_gateway.reading import json_containers

    text = b"[" * 100 + b'"' + b'\\"' * (4 * 2**20)  # 8 MiB, 4 Mi escaped quotes
    assert json_containers(text, 10) == 100


def test_json_document_refuses_a_body_over_the_budget_before_parsing() -> None:
    from web_gateway.errors import HTTPError
    from web_gateway.reading import json_document

    assert json_document(b'{"inputs": [[1], [2]]}', 4) == {"inputs": [[1], [2]]}
    with pytest.raises(HTTPError) as refused:
        json_document(b'{"inputs": [[1], [2]], "x": [[], []]}', 4)
    assert refused.value.status == 413
    assert "more than 4 arrays and objects" in refused.value.message
    # a body within the budget whose strings hold brackets parses as before
    assert json_document(b'{"t": "' + b"[{" * 50 + b'"}', 4) == {"t": "[{" * 50}


def test_a_body_that_is_not_utf8_is_400_saying_so() -> None:
    """orjson's words were "str is not valid UTF-8: surrogates not allowed", whatever the byte."""
    from web_gateway.errors import HTTPError
    from web_gateway.reading import json_document

    for text in (b'{"inputs": ["\xff"]}', b"\xfe[1]", b'["\xed\xa0\x80"]'):
        with pytest.raises(HTTPError) as refused:
            json_document(text)
        assert refused.value.status == 400
        assert refused.value.message == "request body is not valid JSON: it is not UTF-8 text"


def test_a_gzip_body_of_more_members_than_the_bound_is_400() -> None:
    """Each gzip member cost a copy of the whole body after it (zlib's unused_data): 100,000
    empty members (2 MB) held the event loop 2.4 s, a 16 MiB body of them minutes, past
    gunicorn's worker timeout. At most MAX_GZIP_MEMBERS are read, each end copying at most
    one step of input."""
    import gzip
    import random

    from web_gateway.errors import HTTPError
    from web_gateway.reading import MAX_GZIP_MEMBERS, _decompress

    empty = gzip.compress(b"", mtime=0)
    whole = gzip.compress(b"[1]", mtime=0)
    assert _decompress(whole + empty * (MAX_GZIP_MEMBERS - 1), "gzip", 100) == b"[1]"
    with pytest.raises(HTTPError) as refused:
        _decompress(whole + empty * MAX_GZIP_MEMBERS, "gzip", 100)
    assert refused.value.status == 400
    assert refused.value.message == (
        f"body is not valid gzip: it has more than {MAX_GZIP_MEMBERS} members"
    )
    # members far larger than one step of input, incompressible, still one body
    noise = random.Random(7).randbytes(300_000)
    assert _decompress(gzip.compress(noise) + gzip.compress(noise), "gzip", 2**20) == noise * 2
    with pytest.raises(HTTPError) as over:
        _decompress(gzip.compress(noise) + gzip.compress(noise), "gzip", 500_000)
    assert over.value.status == 413


def _request(body: bytes, *headers: tuple[bytes, bytes]) -> GatewayRequest:
    """A request with ``body`` (in one message) and ``headers``, outside any server."""
    sent = False

    async def receive() -> dict[str, object]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": list(headers)}
    return GatewayRequest(scope, receive)


def test_x_gzip_is_read_as_gzip() -> None:
    """RFC 9110, 8.4.1.3: a recipient should take ``x-gzip`` as ``gzip`` (older clients and
    proxies still send it); it was refused 415. Any case, as every coding name."""
    import asyncio
    import gzip

    from web_gateway.reading import body

    compressed = gzip.compress(b'{"inputs": [1]}')
    for name in (b"x-gzip", b"X-GZIP", b"gzip"):
        request = _request(compressed, (b"content-encoding", name))
        assert asyncio.run(body(request, 1000)) == b'{"inputs": [1]}', name


def test_a_coding_not_served_is_415_naming_it_and_those_served() -> None:
    import asyncio

    from web_gateway.errors import HTTPError
    from web_gateway.reading import body

    for name in (b"br", b"x-deflate", b"compress", b"x-compress"):
        with pytest.raises(HTTPError) as refused:
            asyncio.run(body(_request(b"{}", (b"content-encoding", name)), 1000))
        assert refused.value.status == 415, name
        assert name.decode() in refused.value.message
        # RFC 9110, 15.5.16: the 415 says which codings would have been taken
        assert refused.value.headers == {"Accept-Encoding": "gzip, deflate"}


def _refused_priority(parameter: object = None, *headers: tuple[bytes, bytes]) -> str:
    from web_gateway.errors import HTTPError
    from web_gateway.reading import priority

    with pytest.raises(HTTPError) as refused:
        priority(_request(b"", *headers), parameter)
    assert refused.value.status == 400
    return refused.value.message


def test_a_bad_priority_is_quoted_as_the_client_wrote_it() -> None:
    """A v2 ``priority`` parameter is JSON: it was shown as Python's repr of what the body
    parsed to (``False``, ``['a', 'b']``, ``{'x': 1}``), words the client never wrote."""
    use = ": use 'high' or 'normal' (the default), or 1 or 0"
    for value, shown in (
        (False, "false"),
        (True, "true"),
        (["a", "b"], '["a","b"]'),
        ({"x": 1}, '{"x":1}'),
        (2, "2"),
        (1.5, "1.5"),
        ("urgent", "'urgent'"),
        ("it's", "'it's'"),
    ):
        message = _refused_priority(value)
        assert message == f"the 'priority' parameter: invalid priority {shown}{use}", value
    # a long one is shortened, never echoed whole
    message = _refused_priority(["high"] * 1000)
    assert message.startswith('the \'priority\' parameter: invalid priority ["high","high",')
    assert len(message) < 200
    # a header is text: quoted as sent, its UTF-8 read as UTF-8 (headers arrive as bytes)
    for raw, shown in ((b"urgent", "'urgent'"), ("tr\u00e8s".encode(), "'tr\u00e8s'")):
        message = _refused_priority(None, (b"x-priority", raw))
        assert message == f"X-Priority: invalid priority {shown}{use}", raw
