"""The embedder feeding classifier heads, as pipelines: a chain and a fan-out.

- ``Sentiment`` (pipeline ``sentiment``): ``embedder -> classifier``. Text in; the answer is
  the sentiment head's ``{"label": "negative" | "positive", "scores": [p_neg, p_pos]}``.
- ``SentimentTopic`` (pipeline ``sentiment-topic``): ``embedder -> (sentiment, topic)``: one
  embedding feeds both heads, and the two answers are joined into one object::

      {"sentiment": "positive", "sentiment_scores": [p_neg, p_pos],
       "topic": "food", "topic_scores": [p_food, p_sport, p_technology, p_weather]}

Each stage is its own model with its own workers (``worker start --model
examples.pipelines:Sentiment --stage embedder``, ``... --stage classifier``); the embedder's
output (FP32 [384]) goes from its worker straight to the head's stream and is the head's input
as it is: no transform runs between the stages (the head checks and normalises the vector in
its own worker). The text is tokenized on the caller's side (the embedder's ``preprocess``).

One command runs either of them on this machine: ``python -m examples.pipeline_demo``.
"""

from __future__ import annotations

from typing import Any

from examples.embedder import Embedder
from examples.text_classifier import SentimentHead, TopicHead
from gpu_worker import TensorSpec
from gpu_worker.pipeline import Pipeline, Stage


class Sentiment(Pipeline):
    """Text -> sentence embedding -> ``{"label": ..., "scores": FP32 [2]}`` (negative, positive)."""

    name = "sentiment"
    stages = [Stage("embedder", Embedder), Stage("classifier", SentimentHead)]


class SentimentTopic(Pipeline):
    """Text -> sentence embedding -> sentiment and topic heads, joined into one answer."""

    name = "sentiment-topic"
    stages = [
        Stage("embedder", Embedder),
        Stage("sentiment", SentimentHead, after="embedder"),
        Stage("topic", TopicHead, after="embedder"),
    ]
    outputs = [
        TensorSpec("sentiment", "BYTES", []),
        TensorSpec("sentiment_scores", "FP32", [len(SentimentHead.labels)]),
        TensorSpec("topic", "BYTES", []),
        TensorSpec("topic_scores", "FP32", [len(TopicHead.labels)]),
    ]

    def postprocess(self, output: Any) -> Any:
        """The joined map ``{"sentiment": head output, "topic": head output}`` as one flat
        object, so that KServe v2 answers carry it as four tensors."""
        return {
            "sentiment": output["sentiment"]["label"],
            "sentiment_scores": output["sentiment"]["scores"],
            "topic": output["topic"]["label"],
            "topic_scores": output["topic"]["scores"],
        }
