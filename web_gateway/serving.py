"""One served model: its class (metadata, preprocess, postprocess) and its Streamer.

The gateway passes ``model=None`` to its Streamer and runs the model's caller-side prepare
(``preprocess`` and the check against the declared inputs) and ``postprocess`` itself, in a
thread pool, so that a CPU-heavy preprocess never stalls the event loop and an input that does
not fit is refused (422) before anything is queued. ``init_model`` is never called here: the
class is only instantiated (on the CPU) to reach its caller-side methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from broker import Streamer
from broker.errors import InvalidInput, ModelError
from broker.keys import ModelKeys
from broker.stage_check import stage_names
from gpu_worker.model import ManagedModel, TensorSpec, load_model_class
from gpu_worker.pipeline import Pipeline

from .errors import from_microbatch, invalid_input
from .metrics import ModelMetrics
from .settings import GatewaySettings


def _overrides(cls: type[ManagedModel], method: str) -> bool:
    return getattr(cls, method) is not getattr(ManagedModel, method)


def _stage_keys(cls: type[ManagedModel], keys: ModelKeys) -> list[ModelKeys]:
    """The keys of each stage of a pipeline (the first stage's are the pipeline's own), or
    ``[keys]`` for a model."""
    if not issubclass(cls, Pipeline):
        return [keys]
    return [cls.keys(stage, keys.prefix) for stage in cls.stage_names()]


class ServedModel:
    """A model this gateway serves."""

    def __init__(self, cls: type[ManagedModel], settings: GatewaySettings) -> None:
        self.cls = cls
        self.name = cls.name
        self.instance = cls()
        self.inputs: list[TensorSpec] = list(cls.inputs)
        # what a request sends (v2 metadata, the names a v2 request's tensors take)
        declared = cls.request_inputs
        self.request_inputs = self.inputs if declared is None else list(declared)
        self.outputs: list[TensorSpec] = list(cls.outputs)
        self.has_preprocess = _overrides(cls, "preprocess")
        self.has_postprocess = _overrides(cls, "postprocess")
        # items are this one float tensor as sent (the v1 route may pre-convert JSON numbers)
        self.float_input = (
            not self.has_preprocess
            and len(self.inputs) == 1
            and self.inputs[0].datatype in ("FP16", "FP32", "FP64")
        )
        self.metrics = ModelMetrics(self.name)
        self.streamer = Streamer(
            self.name,
            redis_url=settings.redis_url,
            prefix=settings.prefix,
            model=None,
            timeout=settings.default_timeout,
            max_queue_items=settings.max_queue_items,
            max_queue_bytes=settings.max_queue_bytes,
            wait_for_workers=settings.wait_for_workers,
            workers_grace=settings.workers_grace,
            entry_items=settings.entry_items,
            stages=stage_names(cls),  # a pipeline's errors name a later stage without workers
        )
        # whose workers model readiness counts: the model's; a pipeline's, every stage's
        self.stage_keys = _stage_keys(cls, self.streamer.keys)

    @classmethod
    def load(cls, path: str, settings: GatewaySettings) -> ServedModel:
        return cls(load_model_class(path), settings)

    # -- runs in the thread pool --------------------------------------------------------------
    def prepare(self, raw_items: Sequence[Any]) -> list[Any]:
        """The model's caller-side prepare (preprocess, then the check against its declared
        inputs: ``ManagedModel.prepare_items``, as ``Streamer(model=...)`` runs it); 422 if
        an item does not fit."""
        try:
            return self.instance.prepare_items(raw_items)
        except InvalidInput as exc:
            raise invalid_input(str(exc)) from None

    def finish(self, outputs: list[Any]) -> list[Any]:
        """postprocess each output (in the thread pool only when the model defines one); 500
        ModelError naming the item if it raises."""
        if not self.has_postprocess:
            return outputs
        try:
            return self.instance.finish_outputs(outputs)
        except ModelError as exc:
            raise from_microbatch(exc, 0) from None

    def metadata(self) -> dict[str, Any]:
        from .kserve import VERSIONS, tensor_metadata

        return {
            "name": self.name,
            "versions": list(VERSIONS),
            "platform": "microbatch",
            "inputs": tensor_metadata(self.request_inputs),
            "outputs": tensor_metadata(self.outputs),
        }


def to_json(value: Any) -> Any:
    """orjson ``default``: whatever orjson cannot write natively (numpy views, bytes, ...)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            import base64

            return {"b64": base64.b64encode(raw).decode("ascii")}
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
