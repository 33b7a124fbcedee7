"""An image classifier fed by uploads: ``curl -F file=@cat.jpg .../v1/models/classifier/predict``.

The point of this example is the image path, end to end:

- **Gateway** (``preprocess``, Pillow, no torch): the upload is decoded, checked and resized
  there, on the CPUs that scale out, so the worker only ever sees a small fixed-size array
  (``UINT8 [64, 64, 3]``, 12 KiB). Bad uploads are refused with 422 before anything is queued:
  bytes that are no image (or a format outside PNG, JPEG, GIF, BMP, WebP), a truncated file, and
  an image over :data:`MAX_PIXELS` pixels (a decompression bomb: a small file that claims huge
  dimensions is refused from its header, before any pixel is decoded).
- **Worker**: a small CNN runs once per batch and returns class probabilities.
- **Gateway** (``postprocess``): the top-k classes with their scores, as JSON.

**The weights are random** (seeded, so answers are reproducible): the test machines cannot
download pretrained ImageNet weights, and torchvision is not needed. Drop in your own: subclass
and set ``weights`` (a ``state_dict`` file saved with ``torch.save``, loaded with
``weights_only=True``) and ``labels``, or replace ``build_network`` with your architecture. The
environment variable ``MICROBATCH_CLASSIFIER_WEIGHTS`` points the stock class at a weights file.

JSON callers send the image base64-encoded: ``{"inputs": [{"b64": "..."}]}`` (or a plain base64
string). The answer of each image is ``{"classes": [...], "labels": [...], "scores": [...]}``,
best first; KServe v2 callers get the ``classes`` and ``scores`` tensors.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any, ClassVar

import numpy as np

from broker.errors import InvalidInput
from gpu_worker import ManagedModel, TensorSpec
from gpu_worker.staging import HostStaging, OutputCopy

SIZE = 64  # the network's input: SIZE x SIZE RGB
TOP_K = 3
MAX_PIXELS = 40_000_000  # width x height above which an upload is refused (422)
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP")
WEIGHTS_ENV = "MICROBATCH_CLASSIFIER_WEIGHTS"
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet's, as pretrained CNNs expect
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)

LABELS = [
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
]  # fmt: skip


def image_bytes(item: Any) -> bytes:
    """An upload's bytes: raw bytes, or base64 (a string, or ``{"b64": ...}`` from JSON)."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, dict) and set(item) == {"b64"}:
        item = item["b64"]
    if isinstance(item, str):
        try:
            return base64.b64decode(item, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidInput("the image is not valid base64") from None
    raise InvalidInput('send an image file, or JSON {"b64": "<base64 of the file>"}')


def decode_image(data: bytes, size: int = SIZE, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Decode an image file and fit it to ``size`` x ``size`` RGB (UINT8, height x width x 3).

    Raises InvalidInput for anything that is not a whole image of an allowed format and size.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            width, height = image.size  # from the header: nothing is decoded yet
            if width * height > max_pixels:
                raise InvalidInput(
                    f"image is {width}x{height} pixels; the most is {max_pixels} pixels"
                )
            image.draft("RGB", (size, size))  # JPEG: decode at a reduced scale, much faster
            image.load()
            rgb = ImageOps.exif_transpose(image).convert("RGB")
            fitted = ImageOps.fit(rgb, (size, size), method=Image.Resampling.BILINEAR)
    except InvalidInput:
        raise
    except UnidentifiedImageError:
        raise InvalidInput(f"not an image in a known format ({', '.join(FORMATS)})") from None
    except Image.DecompressionBombError as exc:
        raise InvalidInput(f"image is too large: {exc}") from None
    except Exception as exc:  # truncated or corrupt data: Pillow raises OSError, SyntaxError, ...
        raise InvalidInput(f"cannot decode the image: {type(exc).__name__}: {exc}") from None
    return np.asarray(fitted, dtype=np.uint8)


def build_network(torch: Any, num_classes: int) -> Any:
    """A small CNN: three strided 3x3 convolutions, global average pooling, a linear head."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, num_classes),
    )


class ImageClassifier(ManagedModel):
    """Image upload -> top-k classes with scores. Random (seeded) weights unless given some."""

    name = "classifier"
    labels: ClassVar[list[str]] = LABELS
    top_k: ClassVar[int] = TOP_K
    weights: ClassVar[str | None] = None  # path of a state_dict for build_network
    request_inputs = [TensorSpec("image", "BYTES", [])]  # the image file's bytes
    inputs = [TensorSpec("image", "UINT8", [SIZE, SIZE, 3])]
    outputs = [TensorSpec("classes", "INT32", [TOP_K]), TensorSpec("scores", "FP32", [TOP_K])]
    batch_size = 32

    # -- caller side: Pillow, no torch ---------------------------------------------------------
    def preprocess(self, item: Any) -> Any:
        return decode_image(image_bytes(item))

    def postprocess(self, output: Any) -> Any:
        probabilities = np.asarray(output, dtype=np.float32)
        best = np.argsort(-probabilities, kind="stable")[: self.top_k]
        return {
            "classes": [int(index) for index in best],
            "labels": [self.labels[index] for index in best],
            "scores": [float(probabilities[index]) for index in best],
        }

    # -- worker --------------------------------------------------------------------------------
    def init_model(self) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(0)
        self.net = build_network(torch, len(self.labels))
        weights = self.weights or os.environ.get(WEIGHTS_ENV)
        if weights:
            self.net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        self.net = self.net.to(self.device).eval()
        self.mean = torch.from_numpy(MEAN).view(1, 3, 1, 1).to(self.device)
        self.std = torch.from_numpy(STD).view(1, 3, 1, 1).to(self.device)
        self.staging = HostStaging(self.device)  # pinned host memory on a GPU

    def warmup(self) -> None:
        self.predict([np.zeros((SIZE, SIZE, 3), dtype=np.uint8)] * 2)

    def predict(self, batch: list[Any]) -> OutputCopy:
        torch = self.torch
        pixels = self.staging.stack(batch, np.uint8)  # N x 64 x 64 x 3, on the device
        pixels = pixels.permute(0, 3, 1, 2).float().div_(255.0)
        with torch.inference_mode():
            logits = self.net((pixels - self.mean) / self.std)
            probabilities = torch.softmax(logits, dim=1)
        return self.staging.to_host_later(probabilities)  # pending: the GPU may still compute
