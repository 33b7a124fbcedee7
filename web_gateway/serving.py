"""One served model: its class (metadata, preprocess, postprocess) and its Streamer.

The gateway passes ``model=None`` to its Streamer and runs ``preprocess``, the check against the
declared inputs and ``postprocess`` itself, in a thread pool, so that a CPU-heavy preprocess
never stalls the event loop and an input that does not fit is refused (422) before anything is
queued. ``init_model`` is never called here: the class is only instantiated (on the CPU) to
reach its caller-side methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from broker import Streamer
from broker.errors import InvalidInput, MicrobatchError
from gpu_worker.model import ManagedModel, TensorSpec, load_model_class

from .errors import invalid_input
from .metrics import ModelMetrics
from .settings import GatewaySettings


def _overrides(cls: type[ManagedModel], method: str) -> bool:
    return getattr(cls, method) is not getattr(ManagedModel, method)


class ServedModel:
    """A model this gateway serves."""

    def __init__(self, cls: type[ManagedModel], settings: GatewaySettings) -> None:
        self.cls = cls
        self.name = cls.name
        self.instance = cls()
        self.inputs: list[TensorSpec] = list(cls.inputs)
        self.outputs: list[TensorSpec] = list(cls.outputs)
        self.has_preprocess = _overrides(cls, "preprocess")
        self.has_postprocess = _overrides(cls, "postprocess")
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
        )

    @classmethod
    def load(cls, path: str, settings: GatewaySettings) -> ServedModel:
        return cls(load_model_class(path), settings)

    # -- runs in the thread pool --------------------------------------------------------------
    def prepare(self, raw_items: Sequence[Any]) -> list[Any]:
        """preprocess each item and check it against the declared inputs (422 if it fails)."""
        items = []
        for index, raw in enumerate(raw_items):
            item = raw
            if self.has_preprocess:
                try:
                    item = self.instance.preprocess(raw)
                except MicrobatchError as exc:
                    raise invalid_input(str(exc.with_index(index))) from None
                except Exception as exc:  # the model's preprocess rejected this input
                    raise invalid_input(
                        f"item {index}: preprocess failed: {type(exc).__name__}: {exc}"
                    ) from None
            try:
                items.append(self._coerce(item))
            except InvalidInput as exc:
                raise invalid_input(str(exc.with_index(index))) from None
        return items

    def _coerce(self, item: Any) -> Any:
        if not self.inputs:
            return item
        if len(self.inputs) == 1:
            return self.inputs[0].coerce(item)
        if not isinstance(item, dict):
            names = [spec.name for spec in self.inputs]
            raise InvalidInput(f"the model takes an object with the inputs {names}")
        unknown = set(item) - {spec.name for spec in self.inputs}
        if unknown:
            raise InvalidInput(f"unknown inputs {sorted(unknown)}")
        out = {}
        for spec in self.inputs:
            if spec.name not in item:
                raise InvalidInput(f"input {spec.name!r} is missing")
            out[spec.name] = spec.coerce(item[spec.name])
        return out

    def finish(self, outputs: list[Any]) -> list[Any]:
        """postprocess each output (in the thread pool only when the model defines one)."""
        if not self.has_postprocess:
            return outputs
        return [self.instance.postprocess(output) for output in outputs]

    def metadata(self) -> dict[str, Any]:
        from .kserve import tensor_metadata

        return {
            "name": self.name,
            "versions": ["1"],
            "platform": "microbatch",
            "inputs": tensor_metadata(self.inputs),
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
