"""The processes that own a device. Importing this package never imports torch."""

from .local import LocalStreamer
from .model import ManagedModel, ModelLoadError, TensorSpec, load_model_class

__all__ = ["LocalStreamer", "ManagedModel", "ModelLoadError", "TensorSpec", "load_model_class"]
