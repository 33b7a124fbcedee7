"""Every gateway route in-process (starlette's TestClient over ``create_app``): auth, errors in
each protocol's shape, limits, health and readiness, metrics, and results from a real worker."""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from starlette.testclient import TestClient

from broker.devserver import RedisServer
from tests.conftest import worker_process
from web_gateway import kserve
from web_gateway.app import create_app
from web_gateway.settings import GatewaySettings
from web_gateway.v2 import _timeout_parameter

DOUBLER = "tests.gateway_models:Doubler"
TOKEN = "route-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def settings(redis_url: str, prefix: str, **extra: object) -> GatewaySettings:
    return GatewaySettings(model=[DOUBLER], redis_url=redis_url, prefix=prefix, **extra)


@pytest.fixture
def guarded(redis_server: RedisServer, prefix: str) -> Iterator[TestClient]:
    """Bearer auth on, small limits, no lifespan (nothing reaches Redis)."""
    app = create_app(
        settings(redis_server.url, prefix, auth_tokens=[TOKEN], max_items=2, max_body_bytes=256)
    )
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


@pytest.fixture
def live(redis_server: RedisServer, prefix: str) -> Iterator[TestClient]:
    """The app with its lifespan and a real worker."""
    with (
        worker_process(redis_server.url, DOUBLER, prefix),
        TestClient(create_app(settings(redis_server.url, prefix))) as http,
    ):
        yield http


def test_bearer_auth_guards_models_but_not_health(guarded: TestClient) -> None:
    for method, path in (
        ("GET", "/v1/models"),
        ("POST", "/v1/models/doubler/predict"),
        ("GET", "/v2/models/doubler"),
        ("POST", "/v2/models/doubler/infer"),
    ):
        refused = guarded.request(method, path, json={"inputs": [[1, 2, 3, 4]]})
        assert refused.status_code == 401, path
        assert refused.headers["www-authenticate"] == 'Bearer realm="microbatch"'
        wrong = guarded.request(method, path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, path
    assert guarded.get("/v1/models", headers=AUTH).json() == {"models": ["doubler"]}
    for path in ("/healthz", "/v2/health/live", "/v2"):
        assert guarded.get(path).status_code == 200, path


def test_a_non_ascii_token_is_taken_as_its_utf8_bytes(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """A token is compared as the UTF-8 bytes a client sends: the header's bytes, not their
    Latin-1 reading encoded again (no non-ASCII token ever matched). Non-breaking spaces
    (whose byte 0xa0 ends 'à' in UTF-8) are part of a token, not spaces around it."""
    tokens = tmp_path / "tokens"
    tokens.write_text("# one per line\nclé-secrète-voilà\n", encoding="utf-8")
    app = create_app(settings(redis_server.url, prefix, auth_tokens_file=tokens))
    with TestClient(app) as http:
        for token, status in (
            ("clé-secrète-voilà", 200),
            ("clé-secrète-voil", 401),
            ("clé-secrète-voilà\u00a0", 401),
        ):
            header = f"Bearer {token}".encode()
            assert http.get("/v1/models", headers={"Authorization": header}).status_code == status


def test_errors_take_the_shape_of_their_protocol(guarded: TestClient) -> None:
    v1 = guarded.post("/v1/models/nope/predict", headers=AUTH, json={"inputs": [1]})
    assert v1.status_code == 404
    assert v1.json() == {
        "error": {"type": "ModelNotFound", "message": "no model named 'nope' is served here"}
    }
    v2 = guarded.post("/v2/models/nope/infer", headers=AUTH, json={"inputs": []})
    assert v2.status_code == 404
    assert v2.json() == {
        "error": "ModelNotFound: no model named 'nope' is served here",
        "type": "ModelNotFound",
    }
    route = guarded.get("/v2/nowhere")
    assert route.status_code == 404 and route.json()["error"] == "NotFound: Not Found"
    route = guarded.get("/v1/nowhere")
    assert route.json() == {"error": {"type": "NotFound", "message": "Not Found"}}
    method = guarded.get("/v1/models/doubler/predict")
    assert method.status_code == 405 and method.json()["error"]["type"] == "MethodNotAllowed"


def test_a_path_with_a_trailing_slash_is_an_unknown_route(guarded: TestClient) -> None:
    """No redirect (FastAPI's default was a bodiless 307 to ``http://<Host header>/...``:
    a scheme and host a client behind a proxy cannot reach, and a client that follows it
    sends its body again): the documented 404 ``NotFound``, in the route's format."""
    for method, path in (
        ("GET", "/healthz/"),
        ("GET", "/v1/models/"),
        ("GET", "/v2/models/doubler/"),
        ("GET", "/v2/models/doubler/versions/1/ready/"),
        ("POST", "/v1/models/doubler/predict/"),
        ("POST", "/v2/models/doubler/infer/"),
    ):
        answer = guarded.request(
            method, path, headers={**AUTH, "Host": "elsewhere.example"}, follow_redirects=False
        )
        assert answer.status_code == 404, path
        assert "location" not in answer.headers, path
        body = answer.json()
        if path.startswith("/v2"):
            assert body == {"error": "NotFound: Not Found", "type": "NotFound"}, path
        else:
            assert body == {"error": {"type": "NotFound", "message": "Not Found"}}, path


def test_head_is_get_without_the_body(guarded: TestClient) -> None:
    """Load balancers and uptime checks probe with HEAD; FastAPI's routes answered it 405."""
    health = guarded.head("/healthz")
    assert health.status_code == 200 and health.content == b""
    assert health.headers["content-length"] == str(len(guarded.get("/healthz").content))
    assert guarded.head("/v2/health/live").status_code == 200
    assert guarded.head("/v1/models", headers=AUTH).status_code == 200
    assert guarded.head("/v1/models").status_code == 401  # the same guard as GET
    assert guarded.head("/v1/models/doubler/predict", headers=AUTH).status_code == 405
    # a 405's Allow lists HEAD wherever GET is (RFC 9110, 15.5.6: the methods served)
    for method, path in (("DELETE", "/v1/models"), ("POST", "/healthz"), ("PUT", "/v2")):
        refused = guarded.request(method, path, headers=AUTH)
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD", path
    assert guarded.get("/v1/models/doubler/predict").headers["allow"] == "POST"


def test_a_compressed_body_is_inflated_off_the_event_loop(
    guarded: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 KB of gzip inflating to 16 MiB took ~70 ms of CPU on the event loop, which every
    other request of the process waited out."""
    from web_gateway import reading

    inflated_on_loop: list[bool] = []
    decompress = reading._decompress

    def recording(data: bytes, encoding: str, limit: int) -> bytes:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            inflated_on_loop.append(False)
        else:
            inflated_on_loop.append(True)
        return decompress(data, encoding, limit)

    monkeypatch.setattr(reading, "_decompress", recording)
    body = gzip.compress(b'{"inputs": [[1, 2, 3, 4]]}')
    response = guarded.post(
        "/v1/models/doubler/predict",
        content=body,
        headers={**AUTH, "Content-Encoding": "gzip", "X-Request-Timeout": "0.5"},
    )
    assert response.status_code != 400, response.text  # read whole, whatever came after
    assert inflated_on_loop == [False]


def test_limits_and_malformed_requests(guarded: TestClient) -> None:
    def v1(content: bytes, **headers: str) -> tuple[int, str]:
        response = guarded.post(
            "/v1/models/doubler/predict", content=content, headers={**AUTH, **headers}
        )
        return response.status_code, response.json()["error"]["type"]

    assert v1(b'{"inputs": [[1,2,3,4],[1,2,3,4],[1,2,3,4]]}') == (413, "PayloadTooLarge")
    assert v1(b'{"inputs": []}') == (400, "BadRequest")
    assert v1(b"[" * 300) == (413, "PayloadTooLarge")
    assert v1(b"{}", **{"X-Request-Timeout": "soon"}) == (400, "BadRequest")
    for lax in ("1_0", "inf", "nan", "0x10", "1e"):  # float() took the first three
        assert v1(b"{}", **{"X-Request-Timeout": lax}) == (400, "BadRequest"), lax
    assert v1(b"{}", **{"X-Request-Timeout": "-1"}) == (400, "BadRequest")
    assert v1(b"{}", **{"Content-Encoding": "br"}) == (415, "UnsupportedMediaType")
    assert v1(b"not gzip", **{"Content-Encoding": "gzip"}) == (400, "BadRequest")
    whole = gzip.compress(b'{"inputs": [[1, 2, 3, 4]]}')
    for damaged in (whole[:-8], whole + b"junk", zlib.compress(b"{}") + b"x"):  # cut, or followed
        encoding = "gzip" if damaged.startswith(b"\x1f") else "deflate"
        assert v1(damaged, **{"Content-Encoding": encoding}) == (400, "BadRequest")
    bomb = gzip.compress(b" " * 10_000)
    assert v1(bomb, **{"Content-Encoding": "gzip"}) == (413, "PayloadTooLarge")
    assert v1(b"{", **{"Content-Type": "multipart/form-data; boundary=x"}) == (400, "BadRequest")

    def v2_timeout(micros: object) -> tuple[int, str]:
        tensor = {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}
        body = {"parameters": {"timeout": micros}, "inputs": [tensor]}
        response = guarded.post("/v2/models/doubler/infer", headers=AUTH, json=body)
        return response.status_code, response.json()["error"]

    # Triton's timeout parameter is whole microseconds: anything else is refused, as a bad
    # X-Request-Timeout is, not silently replaced by the default
    for bad in (-1, 1.5, -1e3, "5000", True, [1], {"us": 1}):
        status, error = v2_timeout(bad)
        assert status == 400 and "'timeout' parameter" in error, bad

    # a whole number however written (1e3, 1000.0), and one past 64 bits, which JSON parsing
    # gives as a float (it was refused as 'not 1e+29' though the docs say it is capped)
    def seconds(raw: bytes) -> float | None:
        return _timeout_parameter(kserve.parse_request(raw, None))

    tensor = b'"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]'
    for micros, expected in ((b"1e3", 0.001), (b"1000.0", 0.001), (b"10" + b"0" * 28, 1e9)):
        raw = b'{"parameters": {"timeout": %s}, %s}' % (micros, tensor)
        assert seconds(raw) == expected, micros


def test_a_header_given_twice_is_read_as_its_list(guarded: TestClient) -> None:
    """Two lines of a header mean their comma-separated list (RFC 9110, 5.3), which these
    headers refuse as they refuse it on one line: the first line alone was obeyed, so an
    ``X-Priority`` or ``X-Request-Timeout`` a proxy added after the client's was ignored
    without a word, and a binary body was framed by one of two disagreeing lengths."""
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}
    v1_body, v2_body = b'{"inputs": [[1, 2, 3, 4]]}', orjson.dumps({"inputs": [tensor]})
    cases = (
        ("X-Priority", ("high", "normal"), 400, "BadRequest"),
        ("X-Priority", ("high", "high"), 400, "BadRequest"),
        ("X-Request-Timeout", ("2", "3"), 400, "BadRequest"),
        ("Content-Encoding", ("identity", "identity"), 415, "UnsupportedMediaType"),
    )
    for name, values, status, kind in cases:
        headers = [*AUTH.items(), *((name, value) for value in values)]
        v1 = guarded.post("/v1/models/doubler/predict", content=v1_body, headers=headers)
        assert (v1.status_code, v1.json()["error"]["type"]) == (status, kind), (name, values)
        v2 = guarded.post("/v2/models/doubler/infer", content=v2_body, headers=headers)
        assert (v2.status_code, v2.json()["type"]) == (status, kind), (name, values)
    length = str(len(v2_body))
    framed = [*AUTH.items(), ("Inference-Header-Content-Length", length)] * 2
    v2 = guarded.post("/v2/models/doubler/infer", content=v2_body, headers=framed[1:])
    assert (v2.status_code, v2.json()["type"]) == (400, "BadRequest")
    assert "Inference-Header-Content-Length" in v2.json()["error"]


def test_two_authorization_lines_are_refused_whichever_comes_first(guarded: TestClient) -> None:
    """A request may carry one Authorization line (RFC 9110, 11.6.2): with a valid token on one
    of two lines it is 401 whichever comes first (the first line alone was read, so a valid
    token first let a request through that a proxy had marked with another)."""
    body = b'{"inputs": [[1, 2, 3, 4]]}'
    wrong = ("Authorization", "Bearer not-a-token")
    for lines in ([*AUTH.items(), wrong], [wrong, *AUTH.items()]):
        response = guarded.post("/v1/models/doubler/predict", content=body, headers=lines)
        assert response.status_code == 401, lines
        assert response.json()["error"]["type"] == "Unauthorized"


def test_an_unknown_requested_output_is_refused_before_anything_is_queued(
    guarded: TestClient,
) -> None:
    """A v2 request naming an output the model does not declare is 422 at once: it was found
    only once the workers had computed the items (here: no worker, so after the 10 s grace, a
    503 ``NoWorkers`` in place of the 422)."""
    tensor = {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}
    body = {"inputs": [tensor], "outputs": [{"name": "output"}, {"name": "outptu"}]}
    started = time.monotonic()
    refused = guarded.post("/v2/models/doubler/infer", headers=AUTH, json=body)
    assert time.monotonic() - started < 2
    assert refused.status_code == 422
    assert refused.json() == {
        "error": "InvalidInput: unknown outputs ['outptu']; the model gives ['output']",
        "type": "InvalidInput",
    }


def test_results_health_readiness_and_metrics(live: TestClient) -> None:
    assert live.get("/v2/health/ready").json() == {"ready": True}
    ready = live.get("/v2/models/doubler/ready")
    assert ready.status_code == 200 and ready.json()["workers"] == 1
    # two gzip members, one after the other, are one body (RFC 1952; `gzip -c a b` writes it)
    gzipped = gzip.compress(b'{"inputs": [[1, 2,') + gzip.compress(b" 3, 4]]}")
    result = live.post(
        "/v1/models/doubler/predict",
        content=gzipped,
        headers={"Content-Encoding": "gzip", "X-Request-Timeout": "10"},
    )
    assert result.status_code == 200 and result.json() == {"outputs": [[2.0, 4.0, 6.0, 8.0]]}
    # a UTF-8 byte order mark before the JSON (some Windows tools write one) is ignored
    marked = live.post(
        "/v1/models/doubler/predict", content=b'\xef\xbb\xbf{"inputs": [[1, 2, 3, 4]]}'
    )
    assert marked.status_code == 200 and marked.json() == {"outputs": [[2.0, 4.0, 6.0, 8.0]]}
    v2 = live.post(
        "/v2/models/doubler/infer",
        json={
            "id": "a",
            "parameters": {"timeout": 10_000_000},
            "inputs": [
                {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}
            ],
        },
    )
    assert v2.status_code == 200 and v2.json()["id"] == "a"
    assert v2.headers["content-type"] == "application/json"
    assert v2.json()["outputs"][0]["data"] == [2.0, 2.0, 2.0, 2.0]
    no_own_timeout = live.post(  # Triton's 0: the gateway's default timeout
        "/v2/models/doubler/infer",
        json={
            "parameters": {"timeout": 0},
            "inputs": [
                {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}
            ],
        },
    )
    assert no_own_timeout.status_code == 200
    metadata = live.get("/v2/models/doubler").json()
    assert metadata["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    text = live.get("/metrics").text
    assert any(
        line.startswith("microbatch_gateway_requests_total{")
        and 'model="doubler"' in line
        and 'outcome="ok"' in line
        for line in text.splitlines()
    )


def test_a_redis_url_of_a_cluster_node_leaves_the_gateway_unready(prefix: str) -> None:
    """Redis answers PING, yet a Cluster node named by a redis:// URL answers MOVED for most
    of the model's keys: the gateway must not join a load balancer's pool as if all was
    well."""
    from broker.devserver import free_port

    node = RedisServer({"cluster-enabled": "yes", "cluster-port": str(free_port())}).start()
    try:
        with TestClient(create_app(settings(node.url, prefix))) as http:
            for _ in range(2):  # the verdict is remembered, and still refuses
                ready = http.get("/v2/health/ready")
                assert ready.status_code == 503, ready.text
                assert ready.json()["ready"] is False
                assert "give a redis+cluster:// URL" in ready.json()["error"]
                # an open route: it names no address of the gateway's Redis
                assert f":{node.port}" not in ready.text and "127.0.0.1" not in ready.text
    finally:
        node.stop()


def test_requests_failing_while_redis_is_away_are_logged_once_a_while(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway answered 503 to every request during an outage and logged nothing (the
    workers logged theirs)."""
    import logging

    from broker.devserver import free_port

    body = {"inputs": [[1.0, 2.0, 3.0, 4.0]]}
    port = free_port()
    with (
        caplog.at_level(logging.WARNING, logger="microbatch.gateway"),
        TestClient(create_app(settings(f"redis://127.0.0.1:{port}/0", prefix))) as http,
    ):
        for _ in range(3):
            answer = http.post("/v1/models/doubler/predict", json=body)
            assert answer.status_code == 503 and answer.json()["error"]["type"] == (
                "BrokerUnavailable"
            )
            # the client is told to retry, not where the gateway's Redis is nor why it failed
            assert f":{port}" not in answer.text and "127.0.0.1" not in answer.text
            assert "Errno" not in answer.text and "Redis" in answer.json()["error"]["message"]
    lines = [r.getMessage() for r in caplog.records if "answered 503" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("1 request(s) answered 503 BrokerUnavailable")
    assert f"cannot connect to Redis at 127.0.0.1:{port}" in lines[0]  # the log says why


def test_the_schema_names_the_served_models(guarded: TestClient) -> None:
    schema = guarded.get("/openapi.json").json()
    operation = schema["paths"]["/v1/models/{name}/predict"]["post"]
    (name,) = [p for p in operation["parameters"] if p["name"] == "name"]
    assert name["schema"]["enum"] == ["doubler"]
    assert {"Error", "V2Error"} <= set(schema["components"]["schemas"])
    infer = schema["paths"]["/v2/models/{name}/infer"]["post"]
    assert infer["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/V2Error"
    }
    # each route declares the statuses it answers (FastAPI's 422 for its parameter
    # validation never is: the gateway answers that 400)
    inference = {"200", "400", "401", "404", "413", "415", "422", "500", "503", "504"}
    declared = {
        "/v1/models": {"200", "401"},
        "/v1/models/{name}/predict": inference,
        "/v2/health/ready": {"200", "503"},
        "/v2/models/{name}": {"200", "401", "404"},
        "/v2/models/{name}/versions/{version}": {"200", "401", "404"},
        "/v2/models/{name}/ready": {"200", "404", "503"},
        "/v2/models/{name}/versions/{version}/ready": {"200", "404", "503"},
        "/v2/models/{name}/infer": inference,
        "/v2/models/{name}/versions/{version}/infer": inference,
    }
    for path, statuses in declared.items():
        (operation,) = schema["paths"][path].values()
        assert set(operation["responses"]) == statuses, path
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_the_schema_describes_binary_tensors_and_the_infer_answer(guarded: TestClient) -> None:
    """A client made from /openapi.json learns the binary tensor extension (its header and
    octet-stream bodies) and the answer's fields, which the schema left out."""
    schema = guarded.get("/openapi.json").json()
    for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"):
        infer = schema["paths"][path]["post"]
        headers = {p["name"] for p in infer["parameters"] if p["in"] == "header"}
        assert "Inference-Header-Content-Length" in headers, path
        assert "application/octet-stream" in infer["requestBody"]["content"], path
        answer = infer["responses"]["200"]["content"]
        assert "application/octet-stream" in answer, path
        fields = answer["application/json"]["schema"]["properties"]
        assert {"model_name", "model_version", "id", "outputs"} <= set(fields), path


def test_multipart_bodies_over_the_limits_say_so(redis_server: RedisServer, prefix: str) -> None:
    app = create_app(settings(redis_server.url, prefix, max_items=2))
    file_part = b'name="file"; filename="a"'

    def post(parts: list[bytes]) -> tuple[int, str]:
        body = b"".join(
            b"--b\r\nContent-Disposition: form-data; %s\r\n\r\nx\r\n" % part for part in parts
        )
        response = http.post(
            "/v1/models/doubler/predict",
            content=body + b"--b--\r\n",
            headers={"Content-Type": "multipart/form-data; boundary=b"},
        )
        return response.status_code, response.json()["error"]["message"]

    with TestClient(app, raise_server_exceptions=False) as http:
        # one more file than the limit is counted; more than that, starlette stops reading
        assert post([file_part] * 3) == (413, "3 items is over the limit of 2")
        assert post([file_part] * 4) == (413, "more than 3 items is over the limit of 2")
        status, message = post([b'name="text"'] * 4)  # fields, not files
        assert status == 400 and message == (
            "malformed multipart body: Too many fields. Maximum number of fields is 3."
        )
        # a 'file' field that is no upload (no filename: curl -F file=text, a form's text input)
        status, message = post([b'name="file"'])
        assert status == 400 and "no filename" in message and "@" in message, message


def test_multipart_bodies_that_cannot_be_parsed_write_no_log_line_each(
    guarded: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """python-multipart logged a warning for every body it could not parse: a client (any,
    with auth off) sending such bodies wrote a line a request to the gateway's log. The 400
    says what was wrong; the log stays quiet."""
    caplog.set_level(logging.DEBUG)
    for body in (b"{}", b"--b\r\nno headers end", b"--b\rX", b"--bX\r\n"):
        response = guarded.post(
            "/v1/models/doubler/predict",
            content=body,
            headers={**AUTH, "Content-Type": "multipart/form-data; boundary=b"},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith("malformed multipart body")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("python_multipart")] == []


def test_json_bodies_over_the_container_budget_get_413(
    redis_server: RedisServer, prefix: str
) -> None:
    """--max-json-containers bounds the arrays and objects a JSON body may hold, counted before
    it is parsed (each costs the parse ~90 bytes for as little as 2 bytes of JSON), on v1 and
    v2 alike, gzip-compressed or not; a body within it is parsed as before."""
    app = create_app(settings(redis_server.url, prefix, max_json_containers=8))
    hostile = b'{"inputs": [[1, 2, 3, 4]], "x": [' + b"[]," * 20 + b"[]]}"
    tensor = b'{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}'
    v2_hostile = b'{"inputs": [' + tensor + b'], "x": [' + b"{}," * 20 + b"{}]}"
    with TestClient(app, raise_server_exceptions=False) as http:
        for path, body, shape in (
            ("/v1/models/doubler/predict", hostile, "v1"),
            ("/v2/models/doubler/infer", v2_hostile, "v2"),
        ):
            for encoding, content in (("identity", body), ("gzip", gzip.compress(body))):
                response = http.post(path, content=content, headers={"Content-Encoding": encoding})
                assert response.status_code == 413, (path, encoding)
                error = response.json()["error"]
                message = error if shape == "v2" else error["message"]
                assert "more than 8 arrays and objects (--max-json-containers)" in message
        # within the budget (brackets within strings do not count): parsed, checked (422:
        # no worker is needed to refuse it)
        within = b'{"inputs": [[1, 2, 3]], "x": "' + b"[]" * 40 + b'"}'
        response = http.post("/v1/models/doubler/predict", content=within)
        assert response.status_code == 422, response.text


def test_a_bad_timeout_parameter_is_quoted_as_the_client_wrote_it() -> None:
    """It was Python's repr of what the JSON parsed to (``True``, ``{'us': 1}``), and a
    negative ``-1e3`` was shown as the ``-1`` it had been turned into."""
    from web_gateway.errors import HTTPError

    tensor = b'"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]'
    for micros, shown in (
        (b"true", "true"),
        (b'{"us": 1}', '{"us":1}'),
        (b"[1]", "[1]"),
        (b'"5000"', "'5000'"),
        (b"-1e3", "-1000.0"),
        (b"1.5", "1.5"),
    ):
        raw = b'{"parameters": {"timeout": %s}, %s}' % (micros, tensor)
        with pytest.raises(HTTPError) as refused:
            _timeout_parameter(kserve.parse_request(raw, None))
        assert refused.value.message == (
            f"the 'timeout' parameter must be a whole number of microseconds, not {shown}"
        ), micros
