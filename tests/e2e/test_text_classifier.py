"""examples.text_classifier: the sentiment and topic heads trained at start-up on the shipped
sentences, embedded by the real all-MiniLM-L6-v2 embedder (in this process).

The tests that load the embedder (sentence-transformers, seconds) are marked slow; the others
train the heads on seeded random vectors.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.errors import InvalidInput
from examples.text_classifier import (
    DIM,
    SentimentHead,
    TextClassifierHead,
    TopicHead,
    embed_texts,
    load_examples,
)
from tests.conftest import run_python

if not importlib.util.find_spec("sentence_transformers"):
    pytest.skip("pip install 'microbatch[examples]'", allow_module_level=True)

HEADS = [SentimentHead, TopicHead]
# Sentences that are not in the training files, each with the label a reader gives it.
HELD_OUT = {
    "sentiment-head": [
        ("The pizza was amazing and the waiter was lovely.", "positive"),
        ("Terrible experience, I want my money back.", "negative"),
        ("The plot was predictable and far too long.", "negative"),
        ("Works great, I'm really pleased.", "positive"),
    ],
    "topic-head": [
        ("The striker scored a goal.", "sport"),
        ("Bake the bread for forty minutes.", "food"),
        ("The server needs more RAM.", "technology"),
        ("Expect showers and strong winds.", "weather"),
    ],
}


@pytest.fixture(scope="module")
def embeddings() -> dict[str, np.ndarray]:
    """Each head's training sentences and held-out sentences, embedded once."""
    texts = {head.name: head().training_set()[0] for head in HEADS}
    held = {name: [text for text, _ in pairs] for name, pairs in HELD_OUT.items()}
    everything = [t for head in HEADS for t in texts[head.name] + held[head.name]]
    vectors = iter(embed_texts(everything))
    found = {}
    for head in HEADS:
        found[head.name] = np.stack([next(vectors) for _ in texts[head.name]])
        found[f"{head.name}-held"] = np.stack([next(vectors) for _ in held[head.name]])
    return found


def trained(head: type[TextClassifierHead], embeddings: dict[str, np.ndarray]) -> Any:
    model = head()
    model.fit(embeddings[head.name])
    return model


def random_vectors(head: type[TextClassifierHead]) -> dict[str, np.ndarray]:
    """Seeded random unit vectors, one per training sentence of ``head``: stand-ins for the
    embeddings where the embedder's own are not needed."""
    count = len(head().training_set()[0])
    vectors = np.random.default_rng(0).standard_normal((count, DIM)).astype(np.float32)
    return {head.name: vectors / np.linalg.norm(vectors, axis=1, keepdims=True)}


@pytest.mark.slow  # the real embedder, in this process
@pytest.mark.parametrize("head", HEADS, ids=lambda head: head.name)
def test_the_head_predicts_its_training_labels(
    head: type[TextClassifierHead], embeddings: dict[str, np.ndarray]
) -> None:
    model = trained(head, embeddings)
    _, targets = model.training_set()
    outputs = model.predict(list(embeddings[head.name]))
    assert [output["label"] for output in outputs] == [head.labels[i] for i in targets]
    for output in outputs:
        scores = output["scores"]
        assert scores.dtype == np.float32 and scores.shape == (len(head.labels),)
        assert abs(float(scores.sum()) - 1) < 1e-5
        assert output["label"] == head.labels[int(scores.argmax())]
        assert 0.5 < float(scores.max()) < 1  # regularised: confident, never saturated
    held = model.predict(list(embeddings[f"{head.name}-held"]))
    assert [output["label"] for output in held] == [label for _, label in HELD_OUT[head.name]]


@pytest.mark.parametrize("head", HEADS, ids=lambda head: head.name)
def test_training_is_deterministic(head: type[TextClassifierHead]) -> None:
    embeddings = random_vectors(head)
    first, second = trained(head, embeddings), trained(head, embeddings)
    assert np.array_equal(first.weight.numpy(), second.weight.numpy())
    assert np.array_equal(first.bias.numpy(), second.bias.numpy())
    # in another order the batch gives each item the same answer
    vectors = list(embeddings[head.name])
    forward = first.predict(vectors)
    backward = second.predict(vectors[::-1])[::-1]
    for a, b in zip(forward, backward, strict=True):
        assert a["label"] == b["label"]
        np.testing.assert_allclose(a["scores"], b["scores"], atol=1e-6)


@pytest.mark.slow  # the real embedder, in this process
def test_init_model_trains_on_the_real_embeddings_of_the_shipped_sentences(
    embeddings: dict[str, np.ndarray],
) -> None:
    """What a worker runs (init_model: load the embedder, embed, fit) gives the weights that
    fitting on the embeddings made here gives."""
    model = SentimentHead()
    model.init_model()
    model.warmup()
    reference = trained(SentimentHead, embeddings)
    np.testing.assert_allclose(model.weight.numpy(), reference.weight.numpy(), atol=1e-4)
    (output,) = model.predict([embeddings["sentiment-head-held"][0]])
    assert output["label"] == "positive"


def test_the_head_refuses_what_is_not_an_embedding() -> None:
    embeddings = random_vectors(SentimentHead)
    model = trained(SentimentHead, embeddings)
    good = embeddings["sentiment-head"][0]
    bad: list[tuple[Any, str]] = [
        (np.zeros(DIM, np.float32), "all zeros"),
        (np.full(DIM, np.nan, np.float32), "not finite"),
        (np.ones(DIM + 1, np.float32), "384 floats"),
        (np.ones((2, DIM), np.float32), "384 floats"),
        ("a sentence", "384 floats"),
    ]
    for item, message in bad:
        # caller side (a direct call of the head): 422 InvalidInput naming the item
        with pytest.raises(InvalidInput, match=message) as caught:
            model.prepare_items([good, item])
        assert caught.value.index == 1
        # worker side: predict refuses the item (the worker then fails that item alone)
        with pytest.raises(ValueError, match=message):
            model.predict([item])
    # scale does not matter: the head takes the direction of the vector
    (a,), (b,) = model.predict([good]), model.predict([good * 7])
    np.testing.assert_allclose(a["scores"], b["scores"], atol=1e-6)


def test_a_training_file_with_other_labels_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"labels": ["b", "a"], "examples": [["x", "a"], ["y", "b"]]}))
    with pytest.raises(ValueError, match="expected"):
        load_examples(path, ["a", "b"])
    path.write_text(json.dumps({"labels": ["a", "b"], "examples": [["x", "a"]]}))
    with pytest.raises(ValueError, match="no example of"):
        load_examples(path, ["a", "b"])


def test_the_heads_import_without_torch() -> None:
    """A gateway imports the heads (metadata, preprocess) without torch."""
    code = (
        "import sys, numpy as np\n"
        "from examples.text_classifier import SentimentHead, TopicHead\n"
        "assert [s.name for s in SentimentHead.outputs] == ['label', 'scores']\n"
        "assert list(TopicHead.outputs[1].shape) == [4]\n"
        "assert np.isclose(SentimentHead().preprocess([2.0] * 384)[0], 384 ** -0.5)\n"
        "heavy = [m for m in ('torch', 'sentence_transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('light')\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "light"
