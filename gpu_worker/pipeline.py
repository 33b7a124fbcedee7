"""Pipelines of models: what a user declares. Light, like :mod:`.model`: never imports torch.

A :class:`Pipeline` names its stages; each stage is its own model, served by its own workers
(``worker start --model <pipeline> --stage <name>``), with its own batch size and devices. An
item's output goes from a stage's worker straight onto the next stage's stream; the leaves'
outputs are the answer (several leaves: joined into a map by stage name). To callers (the
gateway, ``Streamer(model=...)``) a pipeline is a model: its name, inputs, pre- and
postprocessing. The wire: docs/pipelines.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from broker.keys import ModelKeys, check_name, stage_keys_name

from .model import ManagedModel, ModelLoadError, TensorSpec, import_object, load_model_class

__all__ = ["Pipeline", "Stage", "load_stage"]

Transform = Callable[[Any], Any]


@dataclass(frozen=True)
class Stage:
    """One stage of a pipeline.

    ``model``: a ManagedModel subclass, or its import path ``"module:Class"`` (imported only
    when needed). ``after``: the stage whose output this one takes (default: the stage listed
    before it; the first stage takes the caller's input). ``transform``: a callable (or its
    import path ``"module:function"``) run in this stage's worker on each item before
    ``predict``, never on the caller; an exception there fails that item with ModelError.
    """

    name: str
    model: type[ManagedModel] | str
    after: str | None = None
    transform: Transform | str | None = None

    def __post_init__(self) -> None:
        try:
            check_name(self.name)
        except ValueError:
            raise ValueError(
                f"invalid stage name {self.name!r}: use lower-case letters, digits, '_' or '-'"
            ) from None

    def model_class(self) -> type[ManagedModel]:
        """The stage's model class (imported if given by path)."""
        if isinstance(self.model, str):
            try:
                return load_model_class(self.model)
            except ModelLoadError as exc:
                raise ModelLoadError(f"stage {self.name!r}: {exc}") from exc
        if not (isinstance(self.model, type) and issubclass(self.model, ManagedModel)):
            raise ModelLoadError(f"stage {self.name!r}: model must be a ManagedModel subclass")
        return self.model

    def transform_fn(self) -> Transform | None:
        """The stage's transform (imported if given by path), or None."""
        fn: Any
        if isinstance(self.transform, str):
            what = f"stage {self.name!r}: transform"
            try:
                fn = import_object(self.transform, what, "name")
            except ModelLoadError as exc:
                if str(exc).startswith(what):
                    raise
                raise ModelLoadError(f"{what}: {exc}") from exc
        else:
            fn = self.transform
        if fn is not None and not callable(fn):
            raise ModelLoadError(f"stage {self.name!r}: transform is not callable")
        transform: Transform | None = fn
        return transform


class Pipeline(ManagedModel):
    """Base class of a declared pipeline of models (a chain, or a tree that fans out).

    Subclasses set ``name`` and ``stages``. ``inputs``, ``preprocess`` (and
    ``request_inputs``, where the pipeline declares neither of those) default to the first
    stage's model's; ``outputs`` and ``postprocess`` to the single leaf's (several leaves: one
    output per leaf, named after it, where each declares one; ``postprocess`` applies each
    leaf's to its entry of the joined map). Override any of them.
    A pipeline computes nothing itself: each stage runs in its own workers.
    """

    stages: ClassVar[Sequence[Stage | str]] = ()
    _graph: ClassVar[dict[str, Stage]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._graph = _graph(cls.name, cls.stages)
        if not cls._graph:
            raise ValueError(f"pipeline {cls.name!r} declares no stages")
        # Stage models named by path are imported now (model classes are light): the pipeline's
        # inputs and outputs are theirs, and a wrong path (any stage's) fails here, not in a
        # worker.
        for stage in cls._graph.values():
            stage.model_class()
        first = cls.first_model()
        if not {"request_inputs", "inputs", "preprocess"} & cls.__dict__.keys():
            cls.request_inputs = first.request_inputs  # a request sends what the first takes
        if "inputs" not in cls.__dict__:
            cls.inputs = list(first.inputs)
        if "outputs" not in cls.__dict__:
            cls.outputs = cls._leaf_outputs()
        # No stage model to delegate to: the base's own (callers then know there is nothing to
        # run, and the gateway prepares small bodies inline).
        if "preprocess" not in cls.__dict__ and not _overrides(cls.first_model(), "preprocess"):
            cls.preprocess = ManagedModel.preprocess  # type: ignore[method-assign]
        leaf_models = [cls.stage(leaf).model_class() for leaf in cls.leaves()]
        if "postprocess" not in cls.__dict__ and not any(
            _overrides(model, "postprocess") for model in leaf_models
        ):
            cls.postprocess = ManagedModel.postprocess  # type: ignore[method-assign]

    @classmethod
    def first_model(cls) -> type[ManagedModel]:
        """The model class of the stage that takes the caller's input."""
        return cls.stage(cls.first()).model_class()

    @classmethod
    def _leaf_outputs(cls) -> list[TensorSpec]:
        """The single leaf's outputs; with several leaves, one output per leaf named after it
        (as the joined answer's map is), where each leaf declares exactly one."""
        leaves = cls.leaves()
        specs = {leaf: cls.stage(leaf).model_class().outputs for leaf in leaves}
        if len(leaves) == 1:
            return list(specs[leaves[0]])
        if all(len(outputs) == 1 for outputs in specs.values()):
            return [TensorSpec(leaf, out[0].datatype, out[0].shape) for leaf, out in specs.items()]
        return []

    # -- the graph --------------------------------------------------------------------------
    @classmethod
    def stage(cls, name: str) -> Stage:
        """The stage called ``name`` (ValueError naming the stages if there is none)."""
        stage = cls._graph.get(name)
        if stage is None:
            known = ", ".join(cls._graph) or "none"
            raise ValueError(f"pipeline {cls.name!r} has no stage {name!r} (stages: {known})")
        return stage

    @classmethod
    def stage_names(cls) -> list[str]:
        """Every stage's name, in declaration order (the first stage first)."""
        return list(cls._graph)

    @classmethod
    def first(cls) -> str:
        """The stage that takes the caller's input."""
        return next(iter(cls._graph))

    @classmethod
    def next_stages(cls, name: str) -> list[str]:
        """The stages that take ``name``'s output, in declaration order."""
        return [stage.name for stage in cls._graph.values() if stage.after == name]

    @classmethod
    def leaves(cls) -> list[str]:
        """The stages whose outputs make the answer, in declaration order."""
        return [name for name in cls._graph if not cls.next_stages(name)]

    @classmethod
    def keys(cls, stage: str, prefix: str) -> ModelKeys:
        """The keys stage ``stage`` consumes (the first stage: the pipeline's own)."""
        cls.stage(stage)
        return ModelKeys(stage_keys_name(cls.name, stage, stage == cls.first()), prefix)

    # -- to callers, a model ----------------------------------------------------------------
    def init_model(self) -> None:
        raise RuntimeError(
            f"pipeline {self.name!r} runs in one worker per stage: "
            f"worker start --model <this pipeline> --stage <{'|'.join(self._graph)}>"
        )

    def predict(self, batch: list[Any]) -> Sequence[Any]:
        raise RuntimeError(f"pipeline {self.name!r} computes nothing itself")

    def _model(self, stage: str) -> ManagedModel:
        """An instance of a stage's model, for its caller-side pre- or postprocess (never
        initialised: init_model runs only in the stage's workers)."""
        models: dict[str, ManagedModel] = self.__dict__.setdefault("_models", {})
        if stage not in models:
            models[stage] = self.stage(stage).model_class()(self.device)
        return models[stage]

    def preprocess(self, item: Any) -> Any:
        """The first stage's model's preprocess."""
        return self._model(self.first()).preprocess(item)

    def postprocess(self, output: Any) -> Any:
        """The leaf's postprocess; with several leaves, each one's on its entry of the map."""
        leaves = self.leaves()
        if len(leaves) == 1:
            return self._model(leaves[0]).postprocess(output)
        if not isinstance(output, dict):
            return output
        return {
            leaf: self._model(leaf).postprocess(value) if leaf in leaves else value
            for leaf, value in output.items()
        }


def _overrides(model: type[ManagedModel], method: str) -> bool:
    return getattr(model, method) is not getattr(ManagedModel, method)


def _graph(pipeline: str, stages: Sequence[Stage | str]) -> dict[str, Stage]:
    """The stages by name, in order, each with its ``after`` filled in; ValueError if they do
    not form a tree rooted at the first stage."""
    graph: dict[str, Stage] = {}
    for index, stage in enumerate(stages):
        if isinstance(stage, str):
            raise ValueError(f"pipeline {pipeline!r}: give Stage(name, model), not {stage!r}")
        if stage.name in graph:
            raise ValueError(f"pipeline {pipeline!r}: stage {stage.name!r} declared twice")
        after = stage.after
        if index == 0:
            if after is not None:
                raise ValueError(f"pipeline {pipeline!r}: the first stage follows no stage")
        elif after is None:
            after = stages[index - 1].name  # type: ignore[union-attr]
        elif after not in graph:
            raise ValueError(
                f"pipeline {pipeline!r}: stage {stage.name!r} follows {after!r}, "
                "which is not declared before it"
            )
        graph[stage.name] = Stage(stage.name, stage.model, after, stage.transform)
    return graph


def load_stage(path: str, stage: str | None) -> type[ManagedModel]:
    """The model class a worker of ``--model path [--stage stage]`` runs."""
    model = load_model_class(path)
    if stage is None:
        if issubclass(model, Pipeline):
            stages = "|".join(model._graph)
            raise ModelLoadError(f"{path!r} is a pipeline: give --stage <{stages}>")
        return model
    if not issubclass(model, Pipeline):
        raise ModelLoadError(f"--stage {stage!r} needs a Pipeline for --model, not {path!r}")
    try:
        declared = model.stage(stage)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    declared.transform_fn()  # a wrong transform path refuses the worker at start
    return declared.model_class()


def load_pipeline(path: str) -> type[Pipeline]:
    """The Pipeline class at ``path``."""
    model = load_model_class(path)
    if not issubclass(model, Pipeline):
        raise ModelLoadError(f"{path!r} is not a Pipeline")
    return model
