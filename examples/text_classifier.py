"""Small classifier heads on all-MiniLM-L6-v2 sentence embeddings: sentiment and topic.

Each head is a multinomial logistic regression (one linear layer, 384 -> number of labels,
softmax) trained when its worker starts, on the labelled sentences shipped with it
(``examples/data/sentiment.json``, ``examples/data/topic.json``): ``init_model`` embeds those
sentences with the real embedder (:class:`examples.embedder.Embedder`, on the CPU, in the
worker process) and fits the layer with L-BFGS in float64 from zero weights. Nothing is random:
the same sentences give the same weights, on any start.

- **Input**: one sentence embedding, ``FP32 [384]`` (what the embedder answers). The head
  L2-normalises it first (the embedder's vectors are unit vectors already); a vector that is
  all zeros, or not finite, is refused (``InvalidInput`` on the caller's side, ``ModelError``
  in the worker, where pipeline items arrive).
- **Output**: an object ``{"label": str, "scores": FP32 [n]}``: ``scores`` are the softmax
  probabilities of the head's ``labels``, in that order (they sum to 1), and ``label`` is the
  label of the highest score. KServe v2 answers carry the tensors ``label`` (BYTES, ``[n]``
  for n items) and ``scores`` (FP32, ``[n, labels]``).

  - ``SentimentHead`` (model ``sentiment-head``): labels ``["negative", "positive"]``;
  - ``TopicHead`` (model ``topic-head``): labels ``["food", "sport", "technology", "weather"]``.

Behind the embedder as a pipeline (docs/examples.md, "A pipeline"), or alone on embeddings::

    worker start --model examples.text_classifier:SentimentHead
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from broker.errors import InvalidInput
from gpu_worker import ManagedModel, TensorSpec
from gpu_worker.staging import HostStaging

DIM = 384  # all-MiniLM-L6-v2's embedding size
DATA = Path(__file__).resolve().parent / "data"
WEIGHT_DECAY = 1e-3  # L2 penalty on the weights: keeps the scores from saturating at 0 and 1


def load_examples(path: Path, labels: list[str]) -> tuple[list[str], np.ndarray]:
    """The texts of a training file and their label indices; checks its labels are ``labels``.

    The file is JSON: ``{"labels": [...], "examples": [[text, label], ...]}``.
    """
    document = json.loads(path.read_text(encoding="utf-8"))
    if document.get("labels") != labels:
        raise ValueError(f"{path.name} has labels {document.get('labels')}, expected {labels}")
    texts = [str(text) for text, _ in document["examples"]]
    targets = np.array([labels.index(label) for _, label in document["examples"]], np.int64)
    missing = set(range(len(labels))) - set(targets.tolist())
    if missing:
        raise ValueError(f"{path.name} has no example of {[labels[i] for i in missing]}")
    return texts, targets


def embed_texts(texts: list[str], embedder: Any = None) -> np.ndarray:
    """The texts' embeddings (one batch) by the real embedder: ``embedder``, else one loaded
    in this process on the CPU."""
    if embedder is None:
        from examples.embedder import Embedder

        embedder = Embedder("cpu")
        embedder.init_model()
    return np.stack(embedder.predict([embedder.preprocess(text) for text in texts]))


def unit_vector(item: Any) -> np.ndarray:
    """One embedding as a float32 unit vector; ValueError if it is not ``[384]`` finite numbers
    with some length."""
    try:
        vector = np.asarray(item, dtype=np.float32)
    except (TypeError, ValueError):
        raise ValueError(f"expected an embedding of {DIM} floats") from None
    if vector.shape != (DIM,):
        raise ValueError(f"expected an embedding of {DIM} floats, got shape {list(vector.shape)}")
    if not np.isfinite(vector).all():
        raise ValueError("the embedding is not finite (NaN or infinity)")
    norm = float(np.linalg.norm(vector))
    if not norm > 0 or not np.isfinite(norm):
        raise ValueError("the embedding is all zeros (or too large to normalise)")
    unit: np.ndarray = vector / np.float32(norm)
    return unit


class TextClassifierHead(ManagedModel):
    """A logistic-regression head on a sentence embedding; subclasses name the data and labels."""

    labels: ClassVar[list[str]] = []
    data: ClassVar[str] = ""  # the training file's name in examples/data/
    batch_size = 256  # a batch costs one small matrix product

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.inputs = [TensorSpec("embedding", "FP32", [DIM])]
        cls.outputs = [
            TensorSpec("label", "BYTES", []),
            TensorSpec("scores", "FP32", [len(cls.labels)]),
        ]

    # -- caller side (a direct call with embeddings): no torch -------------------------------
    def preprocess(self, item: Any) -> Any:
        try:
            return unit_vector(item)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(str(exc)) from None

    # -- worker ------------------------------------------------------------------------------
    def init_model(self) -> None:
        texts, _ = self.training_set()
        self.fit(embed_texts(texts))

    def training_set(self) -> tuple[list[str], np.ndarray]:
        """The shipped training sentences and their label indices."""
        return load_examples(DATA / self.data, self.labels)

    def fit(self, embeddings: np.ndarray) -> None:
        """Train the head on the embeddings of :meth:`training_set`'s texts, in that order.

        Full-batch L-BFGS on the cross-entropy plus ``WEIGHT_DECAY`` times the squared weights,
        in float64 on the CPU from zero weights: deterministic. The weights then go to
        ``self.device`` as float32.
        """
        torch: Any = importlib.import_module("torch")  # typed as Any: torch's API is untyped
        _, targets = self.training_set()
        vectors = np.stack([unit_vector(vector) for vector in embeddings]).astype(np.float64)
        if len(vectors) != len(targets):
            raise ValueError(f"{len(vectors)} embeddings for {len(targets)} training texts")
        x, y = torch.from_numpy(vectors), torch.from_numpy(targets)
        weight = torch.zeros(len(self.labels), DIM, dtype=torch.float64, requires_grad=True)
        bias = torch.zeros(len(self.labels), dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.LBFGS(
            [weight, bias],
            max_iter=500,
            tolerance_grad=1e-10,
            tolerance_change=1e-12,
            line_search_fn="strong_wolfe",
        )

        def loss() -> Any:
            optimizer.zero_grad()
            logits = x @ weight.T + bias
            value = (
                torch.nn.functional.cross_entropy(logits, y) + WEIGHT_DECAY * weight.pow(2).sum()
            )
            value.backward()
            return value

        optimizer.step(loss)
        self.torch = torch
        self.weight = weight.detach().to(torch.float32).to(self.device)
        self.bias = bias.detach().to(torch.float32).to(self.device)
        self.staging = HostStaging(self.device)  # pinned host memory on a GPU

    def warmup(self) -> None:
        self.predict([np.full(DIM, 1.0, dtype=np.float32)])

    def predict(self, batch: list[Any]) -> list[Any]:
        torch = self.torch
        vectors = self.staging.stack([unit_vector(item) for item in batch], np.float32)
        with torch.inference_mode():
            logits = vectors @ self.weight.T + self.bias
            scores = self.staging.to_host(torch.softmax(logits, dim=1))
        labels = self.labels
        return [{"label": labels[int(row.argmax())], "scores": row} for row in scores]


class SentimentHead(TextClassifierHead):
    """Sentence embedding -> ``{"label": "negative" | "positive", "scores": [p_neg, p_pos]}``."""

    name = "sentiment-head"
    labels = ["negative", "positive"]
    data = "sentiment.json"


class TopicHead(TextClassifierHead):
    """Sentence embedding -> ``{"label": topic, "scores": FP32 [4]}`` over the labels
    food, sport, technology, weather (in that order)."""

    name = "topic-head"
    labels = ["food", "sport", "technology", "weather"]
    data = "topic.json"
