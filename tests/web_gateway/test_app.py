"""The gateway's ASGI app in-process (starlette's TestClient over ``create_app``).

Parsing and input checks need neither Redis nor a worker: those requests are refused before
anything is queued. Results come from a real `worker start` over the session's redis-server.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
from starlette.testclient import TestClient

from broker import Streamer
from broker.devserver import RedisServer
from broker.errors import InvalidInput
from broker.keys import ModelKeys
from tests.conftest import worker_process
from tests.gateway_models import Doubler, Tally
from web_gateway.app import create_app
from web_gateway.settings import GatewaySettings

DOUBLER = "tests.gateway_models:Doubler"
TALLY = "tests.gateway_models:Tally"


def make_app(redis_url: str, prefix: str) -> Any:
    return create_app(GatewaySettings(model=[DOUBLER, TALLY], redis_url=redis_url, prefix=prefix))


@pytest.fixture
def client(redis_server: RedisServer, prefix: str) -> Iterator[TestClient]:
    """The app without its lifespan: nothing connects to Redis, nothing can be queued."""
    with TestClient(make_app(redis_server.url, prefix), raise_server_exceptions=False) as http:
        yield http


@pytest.fixture
def served(redis_server: RedisServer, prefix: str) -> Iterator[TestClient]:
    """The app with its lifespan (Redis connected) and a real worker for each model."""
    url = redis_server.url
    with (
        worker_process(url, DOUBLER, prefix),
        worker_process(url, TALLY, prefix),
        TestClient(make_app(url, prefix)) as http,
    ):
        yield http


def v2_body(name: str, datatype: str, shape: list[int], data: Any) -> dict[str, Any]:
    return {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}]}


def refusals(
    client: TestClient, redis_url: str, prefix: str, model: Any, items: list[Any], v2: Any
) -> tuple[str, str, str]:
    """The 422 messages of v1, v2 JSON and Streamer(model=...) for the same bad items."""
    v1 = client.post(f"/v1/models/{model.name}/predict", json={"inputs": items})
    assert v1.status_code == 422, v1.text
    assert v1.json()["error"]["type"] == "InvalidInput"
    over_v2 = client.post(f"/v2/models/{model.name}/infer", json=v2)
    assert over_v2.status_code == 422, over_v2.text
    assert over_v2.json()["type"] == "InvalidInput"
    v2_message = over_v2.json()["error"].removeprefix("InvalidInput: ")
    with (
        Streamer(model.name, redis_url=redis_url, prefix=prefix, model=model) as streamer,
        pytest.raises(InvalidInput) as raised,
    ):
        streamer.predict(items, timeout=5)
    return v1.json()["error"]["message"], v2_message, str(raised.value)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (None, "null is not a number (FP32)"),
        (True, "a boolean (true) is not a number (FP32)"),
        (False, "a boolean (false) is not a number (FP32)"),
        ("1", "a string is not a number (FP32)"),
    ],
)
def test_fp32_takes_numbers_only_the_same_over_v1_v2_and_the_python_client(
    client: TestClient, redis_server: RedisServer, prefix: str, value: Any, said: str
) -> None:
    items = [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, value, 4.0]]
    v2 = v2_body("input", "FP32", [2, 4], [x for item in items for x in item])
    messages = refusals(client, redis_server.url, prefix, Doubler, items, v2)
    assert set(messages) == {f"item 1: input 'input' at [2]: {said}"}
    # nothing reached Redis: the Streamer refused before sending
    assert not redis.Redis.from_url(redis_server.url).exists(ModelKeys("doubler", prefix).stream)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (1.5, "1.5 is not a whole number (INT32)"),
        (2**40, f"{2**40} is out of range for INT32"),
        (None, "null is not a number (INT32)"),
        (True, "a boolean (true) is not a number (INT32)"),
        ("7", "a string is not a number (INT32)"),
    ],
)
def test_integer_inputs_take_whole_numbers_in_range_the_same_everywhere(
    client: TestClient, redis_server: RedisServer, prefix: str, value: Any, said: str
) -> None:
    items = [[1, 2, value]]
    v2 = v2_body("counts", "INT32", [1, 3], items[0])
    messages = refusals(client, redis_server.url, prefix, Tally, items, v2)
    assert set(messages) == {f"item 0: input 'counts' at [2]: {said}"}


def test_nested_lists_of_the_wrong_shape_are_refused_everywhere(
    client: TestClient, redis_server: RedisServer, prefix: str
) -> None:
    for items, v2_shape in (([[[1.0, 2.0], [3.0, 4.0]]], [1, 2, 2]), ([[1.0, 2.0, 3.0]], [1, 3])):
        v2 = v2_body("input", "FP32", v2_shape, items[0])
        v1_message, v2_message, python_message = refusals(
            client, redis_server.url, prefix, Doubler, items, v2
        )
        assert v1_message == python_message
        assert re.fullmatch(
            r"item 0: input 'input' has shape \[.*\], the model takes \[4\]", v1_message
        )
        assert "input 'input' has shape" in v2_message
    ragged = [[[1.0, 2.0], [3.0]]]
    response = client.post("/v1/models/doubler/predict", json={"inputs": ragged})
    assert response.status_code == 422
    message = response.json()["error"]["message"]
    assert message.startswith("item 0: input 'input' is not a tensor of FP32")
    with pytest.raises(InvalidInput) as raised:
        Doubler().prepare_items(ragged)
    assert str(raised.value) == message


def test_nan_and_1e999_are_malformed_json_while_python_floats_may_be_nan(
    client: TestClient,
) -> None:
    for literal in (b"NaN", b"1e999", b"Infinity"):
        body = b'{"inputs": [[1.0, 2.0, 3.0, ' + literal + b"]]}"
        v1 = client.post("/v1/models/doubler/predict", content=body)
        assert v1.status_code == 400 and v1.json()["error"]["type"] == "BadRequest"
        v2 = client.post(
            "/v2/models/doubler/infer",
            content=b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], '
            b'"data": [1, 2, 3, ' + literal + b"]}]}",
        )
        assert v2.status_code == 400 and v2.json()["type"] == "BadRequest"
    # Python's own IEEE values are numbers; a finite value too large for FP32 is not
    prepared = Doubler().prepare_items([[float("nan"), float("inf"), 1.0, 2.0]])
    assert prepared[0].dtype == np.float32 and np.isnan(prepared[0][0])
    with pytest.raises(InvalidInput, match=r"item 0: input 'input' at \[1\]: 1e\+39 is out"):
        Doubler().prepare_items([[1.0, 1e39, 1.0, 2.0]])
    response = client.post("/v1/models/doubler/predict", json={"inputs": [[1.0, 1e39, 1.0, 2.0]]})
    assert response.status_code == 422
    assert response.json()["error"]["message"].startswith("item 0: input 'input' at [1]: 1e+39")


def test_a_failing_preprocess_is_invalid_input_from_the_python_client_too(
    redis_server: RedisServer, prefix: str
) -> None:
    from tests.gateway_models import ByteStats

    said = "item 1: preprocess failed: TypeError: bytestats takes a file or a string"
    with (
        Streamer("bytestats", redis_url=redis_server.url, prefix=prefix, model=ByteStats) as s,
        pytest.raises(InvalidInput) as raised,
    ):
        s.predict([b"ok", 42], timeout=5)
    assert str(raised.value) == said
    assert raised.value.index == 1
    # the gateway refuses the same item the same way (one caller-side prepare for both)
    settings = GatewaySettings(
        model=["tests.gateway_models:ByteStats"], redis_url=redis_server.url, prefix=prefix
    )
    with TestClient(create_app(settings)) as http:
        v1 = http.post("/v1/models/bytestats/predict", json={"inputs": ["ok", 42]})
    assert v1.status_code == 422
    assert v1.json() == {"error": {"type": "InvalidInput", "message": said}}
    assert not redis.Redis.from_url(redis_server.url).exists(ModelKeys("bytestats", prefix).stream)


def test_a_failing_postprocess_is_a_model_error_naming_the_item_everywhere(
    redis_server: RedisServer, prefix: str
) -> None:
    """The model's own caller-side code failed: ModelError (500), not the raw exception
    from the Python client or an opaque InternalError from the gateway."""
    from broker.errors import ModelError
    from tests.gateway_models import Labeller

    said = "item 1: postprocess failed: KeyError: 2.0"
    settings = GatewaySettings(
        model=["tests.gateway_models:Labeller"], redis_url=redis_server.url, prefix=prefix
    )
    with worker_process(redis_server.url, "tests.gateway_models:Labeller", prefix):
        with (
            Streamer("labeller", redis_url=redis_server.url, prefix=prefix, model=Labeller) as s,
            pytest.raises(ModelError) as raised,
        ):
            s.predict([[1.0], [2.0]], timeout=10)
        assert (str(raised.value), raised.value.index) == (said, 1)
        with TestClient(create_app(settings)) as http:
            v1 = http.post("/v1/models/labeller/predict", json={"inputs": [[0.0], [2.0]]})
    assert v1.status_code == 500
    assert v1.json() == {"error": {"type": "ModelError", "message": said}}


def test_versioned_paths_answer_like_the_unversioned_ones(client: TestClient) -> None:
    metadata = client.get("/v2/models/doubler/versions/1")
    assert metadata.status_code == 200
    assert metadata.json() == client.get("/v2/models/doubler").json()
    assert metadata.json()["versions"] == ["1"]
    for response in (
        client.get("/v2/models/doubler/versions/2"),
        client.get("/v2/models/doubler/versions/2/ready"),
        client.post("/v2/models/doubler/versions/2/infer", json={"inputs": []}),
    ):
        assert response.status_code == 404
        body = response.json()
        assert body["type"] == "ModelNotFound"
        assert body["error"] == (
            "ModelNotFound: model 'doubler' has no version '2' (its versions: '1')"
        )
    assert client.get("/v2/models/nope/versions/1").status_code == 404
    # no worker and no Redis here: not ready, through either path
    assert client.get("/v2/models/doubler/versions/1/ready").status_code == 503
    bad = v2_body("input", "FP32", [1, 4], [1, 2, 3, None])
    response = client.post("/v2/models/doubler/versions/1/infer", json=bad)
    assert response.status_code == 422
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/v2/models/{name}/versions/{version}",
        "/v2/models/{name}/versions/{version}/ready",
        "/v2/models/{name}/versions/{version}/infer",
    ):
        assert path in paths


def test_docs_reference_no_external_host(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "swagger-ui-bundle.js" in page.text
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", page.text, re.IGNORECASE)
    referenced = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert len(referenced) >= 3  # the script, the style sheet and the icon
    for url in referenced:
        assert url.startswith("/docs/static/"), url
        asset = client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 100, url
    assert "url: '/openapi.json'" in page.text
    assert client.get("/redoc").status_code == 404  # ReDoc would need a CDN: not served


def test_results_over_v1_and_the_versioned_v2_path(served: TestClient) -> None:
    v1 = served.post("/v1/models/doubler/predict", json={"inputs": [[1, 2, 3, 4]]})
    assert v1.status_code == 200 and v1.json() == {"outputs": [[2.0, 4.0, 6.0, 8.0]]}
    v2 = served.post(
        "/v2/models/tally/versions/1/infer", json=v2_body("counts", "INT32", [2, 2], [1, 2, 3, 4])
    )
    assert v2.status_code == 200, v2.text
    body = v2.json()
    assert body["model_name"] == "tally" and body["model_version"] == "1"
    assert body["outputs"] == [
        {"name": "total", "datatype": "INT64", "shape": [2, 1], "data": [3, 7]}
    ]
    ready = served.get("/v2/models/tally/versions/1/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_the_v1_shortcut_for_plain_numbers_changes_no_result_and_no_error() -> None:
    """Bodies of plain JSON numbers skip the per-value scan; what comes out must not change."""
    from web_gateway.errors import HTTPError
    from web_gateway.serving import ServedModel
    from web_gateway.v1 import only_numbers as _only_numbers
    from web_gateway.v1 import parse_and_prepare

    served = ServedModel.load(DOUBLER, GatewaySettings(model=[DOUBLER]))
    assert served.float_input

    bodies = [
        b'{"inputs": [[1, 2.5, -3e2, 4E-1], [0, 0, 0, 1e38]]}',
        b'{"inputs": [[1, 2, 3, 1e39]]}',
        b'{"inputs": [[1, 2, 3, 3.4028234663852886e+38]]}',  # FP32's largest
        b'{"inputs": [[1, 2, 3, -3.402823466385289e+38]]}',  # the next double past it
        b'{"inputs": [[1, 2, 3, 4], [1, 2, 3, 1e200]]}',
        b'{"inputs": [[1, 2, 3, 4], [1, 2, 3]]}',
        b'{"inputs": [[1, 2, 3, ' + str(10**400).encode() + b"]]}",
        b'{"inputs": [[[1, 2], [3, 4]]]}',
        b'{"inputs": [[[1, 2], [3]]]}',
        b'{"inputs": [[1, 2, 3]]}',
        b'{"inputs": [5]}',
        b'{"inputs": [[1, 2, 3, null]]}',
        b'{"inputs": [[1, 2, 3, true]]}',
        b'{"inputs": [[1, 2, 3, "4"]]}',
        # objects without keys hold no string: such a body passed for plain numbers, and
        # numpy's TypeError on them was a 500 InternalError
        b'{"inputs": [{}]}',
        b'{"inputs": [[1, 2, 3, {}]]}',
        b'{"inputs": [[1, 2, 3, 4], {}]}',
        b'{"inputs": [[{}, {}], [1, 2]]}',
    ]
    for body in bodies:
        outcomes = []
        for shortcut in (True, False):
            served.float_input = shortcut
            try:
                items = parse_and_prepare(served, body, 256)
                outcomes.append(("ok", [(item.dtype, item.tolist()) for item in items]))
            except HTTPError as exc:
                outcomes.append((exc.status, exc.message))
        assert outcomes[0] == outcomes[1], body
    assert _only_numbers(bodies[0]) and not _only_numbers(bodies[11])
    assert not _only_numbers(bodies[12]) and not _only_numbers(bodies[13])
    assert _only_numbers(bodies[14])  # taken the short way, and refused as the long way does


def test_v1_outputs_that_json_cannot_hold_are_invalid_output() -> None:
    """Map keys that are not strings are written as strings, as JSON has only those; what
    JSON cannot write at all is 500 InvalidOutput saying what, never an InternalError."""
    import orjson

    from web_gateway.errors import HTTPError
    from web_gateway.v1 import outputs_response

    answer = outputs_response([{1: "a", None: [np.float32(0.5)]}, {"k": b"v"}])
    assert orjson.loads(answer.body) == {"outputs": [{"1": "a", "null": [0.5]}, {"k": "v"}]}
    for outputs, what in (
        ([np.array([1 + 2j], np.complex64)], "complex"),
        ([{b"k": 1}], "Dict key"),
    ):
        with pytest.raises(HTTPError) as raised:
            outputs_response(outputs)
        assert (raised.value.status, raised.value.type) == (500, "InvalidOutput")
        assert raised.value.message.startswith("model outputs cannot be written as JSON")
        assert what in raised.value.message


def asgi_request(app: Any, method: str, target: str) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request straight through the ASGI app, as uvicorn hands over a ``target``."""
    import asyncio

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": target, "raw_path": target.encode(),
             "query_string": b"", "root_path": "", "headers": [(b"host", b"x")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body


def test_options_asterisk_asks_the_server_and_other_methods_may_not_use_it(
    redis_server: RedisServer, prefix: str
) -> None:
    """`OPTIONS *` (RFC 9110, 9.3.7: the server's own options, as a ping) was a 404 NotFound;
    the asterisk is a target for OPTIONS alone (RFC 9112, 3.2.4), and was a 404 for others."""
    app = make_app(redis_server.url, prefix)
    status, headers, body = asgi_request(app, "OPTIONS", "*")
    assert (status, headers[b"allow"], headers[b"content-length"], body) == (
        200,
        b"GET, HEAD, POST",
        b"0",
        b"",
    )
    status, _, body = asgi_request(app, "GET", "*")
    assert status == 400 and b"'*' is the target of OPTIONS alone" in body


def test_v2_metadata_declares_what_a_request_sends_where_a_preprocess_takes_it(
    redis_server: RedisServer, prefix: str
) -> None:
    """A model with its own preprocess (texts -> token ids) was described by the tensors its
    worker gets (INT32 ids): tools that build requests from the metadata (tritonclient,
    perf_analyzer) sent ids, which the preprocess refused. Its ``request_inputs`` are what a
    request sends; a model without them keeps its ``inputs``."""
    models = ["tests.gateway_models:ByteStats", "tests.gateway_models:Codes", DOUBLER]
    settings = GatewaySettings(model=models, redis_url=redis_server.url, prefix=prefix)
    with TestClient(create_app(settings), raise_server_exceptions=False) as http:
        bytestats = http.get("/v2/models/bytestats").json()
        codes = http.get("/v2/models/codes/versions/1").json()
        doubler = http.get("/v2/models/doubler").json()
        # a request's tensors are named as the request inputs are
        wrong = http.post("/v2/models/codes/infer", json=v2_body("codes", "INT32", [1], [65]))
        right = http.post("/v2/models/codes/infer", json=v2_body("text", "INT32", [1], [65]))
    assert bytestats["inputs"] == [{"name": "stats", "datatype": "BYTES", "shape": [-1]}]
    assert bytestats["outputs"] == [{"name": "stats", "datatype": "FP64", "shape": [-1, 2]}]
    assert codes["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert doubler["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
    assert wrong.status_code == 422
    assert wrong.json()["error"] == "InvalidInput: inputs are ['codes'], the model takes ['text']"
    assert right.status_code == 422  # named right, refused by the preprocess (not a text)
    assert "preprocess failed: TypeError: codes takes a text" in right.json()["error"]
    assert not redis.Redis.from_url(redis_server.url).exists(ModelKeys("codes", prefix).stream)
