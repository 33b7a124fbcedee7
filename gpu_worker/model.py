"""What a user writes: a ManagedModel subclass with TensorSpecs. Light: never imports torch."""

from __future__ import annotations

import importlib
import numbers
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from broker.errors import InvalidInput, MicrobatchError, ModelError
from broker.keys import check_name

from .outcomes import describe
from .tensors import DATATYPES, Unfit, to_datatype

if TYPE_CHECKING:
    from .outcomes import PendingOutputs

__all__ = [
    "DATATYPES",
    "ManagedModel",
    "ModelLoadError",
    "TensorSpec",
    "Unfit",
    "check_item",
    "load_model_class",
    "to_datatype",
    "use_app_dir",
]


@dataclass(frozen=True)
class TensorSpec:
    """One named input or output: a KServe datatype and a shape without the batch dimension.

    A ``-1`` in ``shape`` means any length along that axis.
    """

    name: str
    datatype: str
    shape: Sequence[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES:
            known = ", ".join(DATATYPES)
            raise ValueError(f"unknown datatype {self.datatype!r} for {self.name!r} ({known})")
        object.__setattr__(self, "shape", [int(dim) for dim in self.shape])
        name = DATATYPES[self.datatype]
        object.__setattr__(self, "_dtype", None if name is None else np.dtype(name))
        object.__setattr__(self, "_fixed_shape", None if -1 in self.shape else tuple(self.shape))

    @property
    def numpy_dtype(self) -> np.dtype[Any] | None:
        """The numpy dtype of this tensor (None for BYTES)."""
        dtype: np.dtype[Any] | None = self.__dict__["_dtype"]
        return dtype

    def takes_shape(self, shape: tuple[int, ...]) -> bool:
        """:meth:`shape_matches`, answered by one comparison for a spec of fixed shape."""
        return shape == self.__dict__["_fixed_shape"] or self.shape_matches(shape)

    def shape_matches(self, shape: Sequence[int]) -> bool:
        """True if ``shape`` (without the batch dimension) fits this spec."""
        return len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        )

    def coerce(self, value: Any) -> Any:
        """Convert one item's value to this spec's dtype and check its shape.

        Numeric datatypes take numbers only (never null, booleans or strings), integer ones
        whole numbers within range, FP16/FP32 values that stay finite; BOOL takes booleans
        (the rules of :mod:`gpu_worker.tensors`). Raises :class:`broker.errors.InvalidInput`
        naming the input, and the position of a value that does not fit.
        """
        dtype: np.dtype[Any] | None = self.__dict__["_dtype"]
        if dtype is None:
            if not isinstance(value, (str, bytes)):
                raise InvalidInput(f"input {self.name!r} takes a string or bytes")
            return value
        if not (isinstance(value, np.ndarray) and value.dtype == dtype):
            try:
                value = to_datatype(value, dtype, self.datatype)
            except Unfit as exc:
                raise InvalidInput(exc.describe(self.name)) from None
            except (TypeError, ValueError, OverflowError) as exc:
                raise InvalidInput(
                    f"input {self.name!r} is not a tensor of {self.datatype}: {exc}"
                ) from None
        if not self.takes_shape(value.shape):
            raise InvalidInput(
                f"input {self.name!r} has shape {list(value.shape)}, "
                f"the model takes {list(self.shape)}"
            )
        return value


def check_item(specs: Sequence[TensorSpec], item: Any) -> Any:
    """One (preprocessed) item checked against declared inputs, as the model will get it.

    One input: the item is that tensor. Several: an object ``{name: value}`` with exactly
    those names. No declared inputs: the item passes unchecked.
    """
    if not specs:
        return item
    if len(specs) == 1:
        return specs[0].coerce(item)
    if not isinstance(item, dict):
        names = [spec.name for spec in specs]
        raise InvalidInput(f"the model takes an object with the inputs {names}")
    unknown = set(item) - {spec.name for spec in specs}
    if unknown:
        raise InvalidInput(f"unknown inputs {sorted(unknown)}")
    out = {}
    for spec in specs:
        if spec.name not in item:
            raise InvalidInput(f"input {spec.name!r} is missing")
        out[spec.name] = spec.coerce(item[spec.name])
    return out


# The kinds of numpy data a numeric input converts from (never bools into numbers, never
# numbers into bools, never floats into integers).
_CONVERTS_FROM = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}


class ItemCheck:
    """What a worker checks each decoded item against: a model's one numeric input.

    An array of the input's dtype and shape passes as it is (one dtype and one tuple compare);
    a list or number, or an array of another dtype, is converted to the input's dtype when
    its kind allows (integers and floats into floats, integers into integers, within range),
    and then checked. Anything else raises :class:`broker.errors.InvalidInput`.
    """

    def __init__(self, spec: TensorSpec) -> None:
        dtype = spec.numpy_dtype
        if dtype is None:
            raise ValueError("BYTES inputs are not checked by workers")
        self.spec = spec
        self.dtype = dtype
        self.shape = tuple(spec.shape)
        self.wildcards = -1 in self.shape
        self.fixed = tuple((axis, dim) for axis, dim in enumerate(self.shape) if dim != -1)
        self.kinds = _CONVERTS_FROM[dtype.kind]

    def __call__(self, item: Any) -> Any:
        """``item``, or it converted to the input's dtype; InvalidInput if it does not fit."""
        if type(item) is np.ndarray and item.dtype is self.dtype and item.shape == self.shape:
            return item  # the common case
        if type(item) is not np.ndarray or item.dtype != self.dtype:
            item = self._convert(item)
        if self.wildcards and self._shape_fits(item.shape):
            return item
        if item.shape != self.shape:
            raise InvalidInput(
                f"input {self.spec.name!r} has shape {list(item.shape)}, "
                f"the model takes {list(self.shape)}"
            )
        return item

    def _shape_fits(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(shape[axis] == dim for axis, dim in self.fixed)

    def _convert(self, item: Any) -> np.ndarray:
        name, datatype = self.spec.name, self.spec.datatype
        try:
            array = np.asarray(item)
        except Exception:  # ragged nesting, or something numpy cannot hold
            array = None
        if array is None or array.dtype.kind not in self.kinds:
            what = "not numeric data" if array is None else _KIND_WORDS.get(array.dtype.kind)
            raise InvalidInput(
                f"input {name!r} is {what or 'not numeric data'}, the model takes {datatype}"
            )
        if self.dtype.kind in "iu" and not np.can_cast(array.dtype, self.dtype) and array.size:
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise InvalidInput(f"input {name!r} has values out of range for {datatype}")
        with np.errstate(all="ignore"):
            converted = array.astype(self.dtype)
        if self.dtype.kind == "f":
            infinite = np.isinf(converted)
            if infinite.any() and (infinite & np.isfinite(array)).any():
                # finite values past the input's range (inf and nan given as such pass)
                raise InvalidInput(f"input {name!r} has values out of range for {datatype}")
        return converted


# What an item that numpy made into an array of each kind holds, in a caller's words ("O":
# mixed values, maps or nulls, is "not numeric data").
_KIND_WORDS = {
    "b": "booleans",
    "i": "integers",
    "u": "integers",
    "f": "floating-point numbers",
    "c": "complex numbers",
    "U": "text",
    "S": "bytes",
    "M": "dates",
    "m": "time spans",
}


def input_check(inputs: Sequence[TensorSpec]) -> ItemCheck | None:
    """The check a worker runs on each decoded item: for a model with exactly one declared
    input of a numeric datatype; None (items pass unchecked) for anything else."""
    if len(inputs) != 1 or inputs[0].numpy_dtype is None:
        return None
    return ItemCheck(inputs[0])


class ManagedModel:
    """Base class of a model served by microbatch.

    Subclasses set ``name``, ``inputs`` and ``outputs`` and implement ``init_model`` and
    ``predict``. Heavy imports (torch, ...) belong inside ``init_model``, so that gateways can
    import the class without them. ``batch_size``, ``max_latency`` (seconds) and
    ``max_batch_cost`` are defaults that the worker's command-line flags override.

    A model whose items differ in cost (texts padded to the longest of a batch) declares
    ``item_cost`` and a budget per batch, ``max_batch_cost``: workers then form batches whose
    items cost at most that together, of items of similar cost (docs/protocol.md, 10.3).

    ``inputs`` are what ``predict`` gets, after ``preprocess``. A model whose ``preprocess``
    takes something else (texts, image bytes) declares what a caller sends as
    ``request_inputs``: the gateway's v2 metadata reports them (None: ``inputs``).
    """

    name: ClassVar[str] = ""
    request_inputs: ClassVar[list[TensorSpec] | None] = None
    inputs: ClassVar[list[TensorSpec]] = []
    outputs: ClassVar[list[TensorSpec]] = []
    batch_size: ClassVar[int] = 32
    max_latency: ClassVar[float] = 0.0
    max_batch_cost: ClassVar[int | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = check_name(cls.__dict__.get("name") or cls.__name__.lower())
        _check_attributes(cls)

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def init_model(self) -> None:
        """Load weights onto ``self.device``. Runs in the worker process, after pinning."""

    def warmup(self) -> None:
        """Optional: run before the worker starts consuming (compile kernels, fill caches)."""

    def predict(self, batch: list[Any]) -> Sequence[Any] | PendingOutputs:
        """Compute one batch; return exactly one output per item, in order.

        Or return them pending: an object with ``done()`` and ``result()`` (a
        ``concurrent.futures.Future`` of the outputs, or
        :meth:`gpu_worker.staging.HostStaging.to_host_later` of a GPU's output tensor). The
        worker then answers the batch before and prepares the next while this one computes
        (docs/gpu.md, section 6)."""
        raise NotImplementedError(f"{type(self).__name__} must implement predict()")

    def item_cost(self, item: Any) -> int:
        """What one item costs against ``max_batch_cost``: a non-negative int, e.g. its
        length in tokens. Runs in the worker on each item as ``predict`` will get it, before
        its batch is formed (keep it cheap); used only when a budget is set. An exception
        fails that item alone with ModelError. Default: 1."""
        return 1

    def preprocess(self, item: Any) -> Any:
        """Caller side (gateway or Streamer(model=...)), on the CPU: raw input -> model input."""
        return item

    def postprocess(self, output: Any) -> Any:
        """Caller side: model output -> what the caller receives."""
        return output

    def prepare_items(self, raw_items: Sequence[Any]) -> list[Any]:
        """Caller side: ``preprocess`` each raw item, then check it against ``inputs``.

        What the gateway (v1 and v2) and ``Streamer(model=...)`` send: each item converted to
        its declared datatype and shape. Raises :class:`broker.errors.InvalidInput` naming the
        item (its index) and, for a value that does not fit, the input and the position.
        An exception from ``preprocess`` is the input's fault too.
        """
        preprocess = None if type(self).preprocess is ManagedModel.preprocess else self.preprocess
        specs = self.inputs
        items = []
        for index, raw in enumerate(raw_items):
            try:
                item = raw if preprocess is None else preprocess(raw)
            except MicrobatchError as exc:
                raise InvalidInput(exc.message, index=index) from exc
            except Exception as exc:  # the model's preprocess refused this input
                raise InvalidInput(
                    f"preprocess failed: {type(exc).__name__}: {exc}", index=index
                ) from exc
            try:
                items.append(check_item(specs, item))
            except MicrobatchError as exc:
                raise InvalidInput(exc.message, index=index) from exc
            except RecursionError as exc:  # lists nested ~1000 deep: no tensor has that many axes
                raise InvalidInput("nested too deep to be a tensor", index=index) from exc
        return items

    def finish_outputs(self, outputs: Sequence[Any]) -> list[Any]:
        """Caller side: ``postprocess`` each output. An exception from it is the model's
        fault: :class:`broker.errors.ModelError` naming the item, and what was raised."""
        postprocess = self.postprocess
        finished = []
        for index, output in enumerate(outputs):
            try:
                finished.append(postprocess(output))
            except MicrobatchError as exc:
                raise exc.with_index(index) from exc
            except Exception as exc:
                raise ModelError(f"postprocess failed: {describe(exc)}", index=index) from exc
        return finished


def is_integer(value: object) -> bool:
    """An int, numpy's included, never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_batching(batch_size: Any, max_latency: Any, where: str = "") -> None:
    """ValueError naming a ``batch_size`` that is no positive int, or a ``max_latency`` that
    is no finite number of seconds >= 0 (numpy's numbers are taken; ``where``: a prefix of
    their names in the message, such as the class's)."""
    if not is_integer(batch_size) or batch_size < 1:
        raise ValueError(f"{where}batch_size must be a positive int, not {batch_size!r}")
    if not _is_real(max_latency) or not 0 <= max_latency < float("inf"):
        raise ValueError(
            f"{where}max_latency must be a number of seconds >= 0, not {max_latency!r}"
        )


def _check_attributes(cls: type[ManagedModel]) -> None:
    """ValueError naming the class attribute a model declares wrong: found as the class is
    defined, rather than by its workers failing (and being restarted) one after another."""
    where = cls.__name__
    size, latency = cls.batch_size, cls.max_latency
    check_batching(size, latency, f"{where}.")
    budget = cls.max_batch_cost
    if budget is not None and (not is_integer(budget) or budget < 1):
        raise ValueError(f"{where}.max_batch_cost must be a positive int or None, not {budget!r}")
    # numpy's scalars (np.int64(32), np.float32(0.005)) are taken, as the plain numbers they are
    cls.batch_size, cls.max_latency = int(size), float(latency)
    cls.max_batch_cost = None if budget is None else int(budget)
    for attribute in ("inputs", "outputs", "request_inputs"):
        specs = getattr(cls, attribute)
        if specs is None and attribute == "request_inputs":
            continue
        if not isinstance(specs, (list, tuple)) or not all(
            isinstance(spec, TensorSpec) for spec in specs
        ):
            raise ValueError(f"{where}.{attribute} must be a list of TensorSpec, not {specs!r}")
        names = [spec.name for spec in specs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"{where}.{attribute} declares {twice[0]!r} more than once")
    for attribute in ("inputs", "request_inputs"):
        for spec in getattr(cls, attribute) or ():
            if spec.datatype == "BYTES" and spec.shape:
                raise ValueError(
                    f"{where}.{attribute}: the BYTES input {spec.name!r} takes one string or "
                    f"bytes per item: declare it with shape [], not {spec.shape}"
                )


class ModelLoadError(ValueError):
    """A ``module:Class`` path that does not name a ManagedModel subclass."""


_app_dir: str | None = None  # where use_app_dir() said models are imported from


def use_app_dir(app_dir: str | os.PathLike[str] = ".") -> str:
    """Import models from ``app_dir`` (default: the current directory) first, as uvicorn's
    ``--app-dir`` does, so that ``--model examples.mlp:MLP`` works from a project directory
    that is not installed. The directory goes first on ``sys.path`` here and on ``PYTHONPATH``
    for the processes this one starts (workers, gunicorn's); returns it as an absolute path."""
    global _app_dir
    path = _app_dir = os.path.abspath(app_dir)
    if path not in sys.path:
        sys.path.insert(0, path)
    entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if path not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *entries])
    return path


# The packages' own directories, left out of where an import failed.
_OUR_DIRS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), package, "")
    for package in ("gpu_worker", "broker")
)


def import_object(path: str, what: str, example: str = "ClassName") -> Any:
    """The object at ``module:attribute`` (``what`` names the option, for the errors)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        module, dot, name = path.rpartition(".")
        guess = f" (did you mean '{module}:{name}'?)" if not sep and module and dot and name else ""
        raise ModelLoadError(f"{what} {path!r} must look like 'package.module:{example}'{guess}")
    if "/" in module_name or module_name.endswith(".py"):
        raise ModelLoadError(f"{what} {path!r} names a file: {_module_of_file(module_name, attr)}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]:
            searched = _app_dir or os.path.abspath(os.curdir)
            hint = (
                f" (neither installed nor in {searched}: run from the directory that holds "
                "it, or name that directory with --app-dir)"
            )
        raise ModelLoadError(f"cannot import module {module_name!r}: {exc}{hint}") from exc
    except Exception as exc:  # the module's own code raised (a SyntaxError, a bad class...)
        frames = [
            frame
            for frame in traceback.extract_tb(exc.__traceback__)
            if not frame.filename.startswith(("<", *_OUR_DIRS))
        ]
        where = ""  # the model's line that raised (a SyntaxError's message says where)
        if frames and not isinstance(exc, SyntaxError):
            where = f" (at {frames[-1].filename}:{frames[-1].lineno})"
        raise ModelLoadError(
            f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}{where}"
        ) from exc
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ModelLoadError(f"module {module_name!r} has no attribute {attr!r}")
    return obj


def _module_of_file(file: str, attr: str) -> str:
    """How to name the module of ``file`` (a path, as a newcomer may give) instead."""
    stem = PurePosixPath(file.removesuffix(".py"))
    if stem.is_absolute():
        return (
            f"give its module, as Python imports it: '{stem.name}:{attr}' with --app-dir "
            f"{stem.parent}"
        )
    module = ".".join(part for part in stem.parts if part != ".")
    return (
        f"give its module, as Python imports it: '{module}:{attr}' (from the directory that "
        "holds it, or name that directory with --app-dir)"
    )


def load_model_class(path: str) -> type[ManagedModel]:
    """Import ``module:Class`` and check that it is a ManagedModel subclass."""
    obj = import_object(path, "--model")
    if not (isinstance(obj, type) and issubclass(obj, ManagedModel)):
        raise ModelLoadError(f"{path!r} is not a ManagedModel subclass")
    # the bases themselves (Pipeline's module is loaded where obj is Pipeline: no import here)
    pipeline = sys.modules.get(f"{__package__}.pipeline")
    if obj in (ManagedModel, getattr(pipeline, "Pipeline", None)):
        raise ModelLoadError(f"{path!r} is {obj.__name__} itself: name a subclass of it")
    return obj
