"""The processes that own a device. Importing this package never imports torch, nor the batch
loop: a gateway that imports a model class (``gpu_worker.model``) loads neither. Its names are
loaded on first use (the package itself imports nothing: ``worker``'s entry point starts with
it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .local import LocalStreamer
    from .model import ManagedModel, ModelLoadError, TensorSpec, load_model_class

__all__ = ["LocalStreamer", "ManagedModel", "ModelLoadError", "TensorSpec", "load_model_class"]


MODEL_NAMES = ("ManagedModel", "ModelLoadError", "TensorSpec", "load_model_class")


def __getattr__(name: str) -> Any:
    if name == "LocalStreamer":  # the batch loop and the in-memory transport, on first use
        from .local import LocalStreamer

        return LocalStreamer
    if name in MODEL_NAMES:  # numpy with them
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
