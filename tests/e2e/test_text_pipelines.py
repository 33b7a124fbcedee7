"""examples.pipelines through real workers: the MiniLM embedder feeding the classifier heads,
one `worker start --stage` process per stage and a gateway, against the embedder and then the
heads called one after the other in this process.

Every test here loads the real models in several processes: all are marked slow.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import numpy as np
import pytest

from broker import Streamer
from broker.devserver import RedisServer
from examples.embedder import Embedder
from examples.pipeline_demo import in_process, stage_names, v2_items
from examples.pipelines import Sentiment, SentimentTopic
from gpu_worker.pipeline import Pipeline
from tests.conftest import wait_for_consumers, worker_process
from tests.e2e.test_gateway import check_error, gateway_process

if not importlib.util.find_spec("sentence_transformers"):
    pytest.skip("pip install 'microbatch[examples]'", allow_module_level=True)

pytestmark = pytest.mark.slow  # the real embedder and heads in five worker processes

PIPELINES: list[type[Pipeline]] = [Sentiment, SentimentTopic]
TEXTS = [
    "The soup was delicious and the staff were lovely.",
    "My new laptop crashed twice today, what a waste of money.",
    "What a brilliant match, our striker scored a wonderful goal.",
    "Heavy rain is expected all weekend, which ruins our picnic.",
    "I love this phone, it is fast and the battery lasts all day.",
    "ok",
    " ".join(["A long review of a film that goes on and on about nothing much."] * 8),
]


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer) -> Iterator[dict[str, Any]]:
    """A worker per stage of both pipelines and one gateway serving both; the reference
    answers are computed in this process meanwhile."""
    prefix = f"p{uuid.uuid4().hex[:10]}"
    url = redis_server.url
    with ExitStack() as stack:
        for pipeline in PIPELINES:
            path = f"examples.pipelines:{pipeline.__name__}"
            for stage in stage_names(pipeline):
                stack.enter_context(
                    worker_process(url, path, prefix, "--stage", stage, expect_consumers=None)
                )
        paths = [f"examples.pipelines:{pipeline.__name__}" for pipeline in PIPELINES]
        base, _ = stack.enter_context(gateway_process(url, paths, prefix))
        expected = {pipeline.name: in_process(pipeline, TEXTS) for pipeline in PIPELINES}
        for pipeline in PIPELINES:
            for stage in stage_names(pipeline):
                wait_for_consumers(url, pipeline.keys(stage, prefix), 1, timeout=180)
        yield {"url": url, "prefix": prefix, "base": base, "expected": expected}


def assert_same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """The same labels, and scores within 1e-4 (each process pads its batch differently)."""
    assert len(got) == len(want)
    for index, (answer, reference) in enumerate(zip(got, want, strict=True)):
        assert set(answer) == set(reference), index
        for key, value in reference.items():
            if isinstance(value, str):
                assert answer[key] == value, (index, key)
            else:
                scores = np.asarray(answer[key], dtype=np.float32)
                np.testing.assert_allclose(scores, value, atol=1e-4, err_msg=f"{index} {key}")


def test_the_reference_is_what_a_reader_expects(stack: dict[str, Any]) -> None:
    """The in-process reference itself: sentiment and topic of the clear sentences."""
    chain, fan = stack["expected"]["sentiment"], stack["expected"]["sentiment-topic"]
    assert [answer["label"] for answer in chain[:5]] == [
        "positive", "negative", "positive", "negative", "positive"
    ]  # fmt: skip
    assert [answer["topic"] for answer in fan[:4]] == ["food", "technology", "sport", "weather"]
    assert [answer["sentiment"] for answer in fan] == [answer["label"] for answer in chain]


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda pipeline: pipeline.name)
def test_the_pipeline_answers_as_the_models_called_in_sequence(
    stack: dict[str, Any], pipeline: type[Pipeline]
) -> None:
    want = stack["expected"][pipeline.name]
    # the Python client, tokenizing on the caller's side and flattening the fan-out there
    with Streamer(
        pipeline.name, redis_url=stack["url"], prefix=stack["prefix"], model=pipeline
    ) as streamer:
        assert_same(streamer.predict(TEXTS, timeout=120), want)
    # without the pipeline's class: token ids in, the leaves' answers as the workers give them
    # (a fan-out's joined map, {leaf: its answer}), which the class's postprocess flattens
    tokens = [Embedder().preprocess(text) for text in TEXTS]
    with Streamer(pipeline.name, redis_url=stack["url"], prefix=stack["prefix"]) as raw:
        outputs = raw.predict(tokens, timeout=120)
    if len(pipeline.leaves()) > 1:
        assert all(set(output) == set(pipeline.leaves()) for output in outputs)
    assert_same([pipeline().postprocess(output) for output in outputs], want)

    with httpx.Client(base_url=stack["base"], timeout=120) as http:
        # HTTP v1
        response = http.post(f"/v1/models/{pipeline.name}/predict", json={"inputs": TEXTS})
        assert response.status_code == 200, response.text
        assert_same(response.json()["outputs"], want)

        # HTTP v2: one tensor per output, as the pipeline's metadata declares them
        tensor = {"name": "text", "datatype": "BYTES", "shape": [len(TEXTS)], "data": TEXTS}
        response = http.post(f"/v2/models/{pipeline.name}/infer", json={"inputs": [tensor]})
        assert response.status_code == 200, response.text
        document = response.json()
        declared = http.get(f"/v2/models/{pipeline.name}").json()["outputs"]
        assert [t["name"] for t in document["outputs"]] == [t["name"] for t in declared]
        for got, spec in zip(document["outputs"], declared, strict=True):
            assert got["datatype"] == spec["datatype"]
            assert got["shape"] == [len(TEXTS), *spec["shape"][1:]]  # [-1, ...] declared
        assert_same(v2_items(document), want)


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda pipeline: pipeline.name)
def test_a_text_the_embedder_refuses_is_refused_with_422(
    stack: dict[str, Any], pipeline: type[Pipeline]
) -> None:
    with httpx.Client(base_url=stack["base"], timeout=60) as http:
        response = http.post(f"/v1/models/{pipeline.name}/predict", json={"inputs": ["ok", " "]})
    error = check_error(response, 422, "InvalidInput")
    assert "item 1" in error["message"] and "empty" in error["message"]
