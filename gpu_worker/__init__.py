"""The processes that own a device. Importing this package never imports torch.

``LocalStreamer`` (and with it the batch loop) is loaded on first use, so a gateway that imports
``gpu_worker`` for a model class never loads the batch loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .model import ManagedModel, ModelLoadError, TensorSpec, load_model_class

if TYPE_CHECKING:
    from .local import LocalStreamer

__all__ = ["LocalStreamer", "ManagedModel", "ModelLoadError", "TensorSpec", "load_model_class"]


def __getattr__(name: str) -> Any:
    if name == "LocalStreamer":
        from .local import LocalStreamer

        return LocalStreamer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
