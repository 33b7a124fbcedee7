"""The processes that own a device. Importing this package never imports torch, nor the batch
loop: a gateway that imports a model class (``gpu_worker.model``) loads neither."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .model import ManagedModel, ModelLoadError, TensorSpec, load_model_class

if TYPE_CHECKING:
    from .local import LocalStreamer

__all__ = ["LocalStreamer", "ManagedModel", "ModelLoadError", "TensorSpec", "load_model_class"]


def __getattr__(name: str) -> Any:
    if name == "LocalStreamer":  # the batch loop and the in-memory transport, on first use
        from .local import LocalStreamer

        return LocalStreamer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
