"""Declaring pipelines, their keys, and what a stage's worker sends on (no Redis needed)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from broker import codec
from broker.keys import ModelKeys
from broker.protocol import Reply, decode_reply
from gpu_worker.forwarding import StageRoute, _joined, stage_error
from gpu_worker.model import ManagedModel, ModelLoadError
from gpu_worker.pipeline import Pipeline, Stage, load_stage
from tests.conftest import run_python
from tests.pipeline_models import Chain, Embed, Fan, Polarity, Topic


def test_a_chain_and_a_fan_out_declare_their_graph() -> None:
    assert Chain.first() == "embed" and Chain.next_stages("embed") == ["polarity"]
    assert Chain.leaves() == ["polarity"]
    assert Fan.next_stages("embed") == ["polarity", "topic"]
    assert Fan.leaves() == ["polarity", "topic"]
    # to callers a pipeline is a model: the first stage's inputs, the single leaf's outputs
    assert Chain.inputs == Embed.inputs and Chain.outputs == Polarity.outputs
    # no stage model preprocesses or postprocesses: neither does the pipeline (the gateway
    # then prepares small bodies inline)
    assert Chain.preprocess is ManagedModel.preprocess
    assert Fan.postprocess is ManagedModel.postprocess
    # several leaves: one output per leaf, named after it, as the joined answer's map is
    assert [(o.name, o.datatype, o.shape) for o in Fan.outputs] == [
        ("polarity", "FP32", [2]),
        ("topic", "FP32", [3]),
    ]


def test_a_pipeline_takes_its_first_stage_s_request_inputs_unless_it_prepares_its_own() -> None:
    """What a request sends (the v2 metadata's inputs): the first stage's, as its preprocess
    is; a pipeline with inputs or a preprocess of its own has no others."""
    from gpu_worker.model import TensorSpec

    text = [TensorSpec("text", "BYTES", [])]
    first = type("Texts", (Embed,), {"name": "texts", "request_inputs": text})
    stages = [Stage("embed", first), Stage("polarity", Polarity)]
    taken = type("Taken", (Pipeline,), {"name": "taken", "stages": stages})
    assert taken.request_inputs == text
    assert Chain.request_inputs is None  # its first stage declares none
    own_preprocess = {"name": "own", "stages": stages, "preprocess": lambda self, item: item}
    assert type("Own", (Pipeline,), own_preprocess).request_inputs is None
    own_inputs = {"name": "own-inputs", "stages": stages, "inputs": list(Embed.inputs)}
    assert type("OwnInputs", (Pipeline,), own_inputs).request_inputs is None
    declared = [TensorSpec("words", "BYTES", [])]
    own = {"name": "own-request", "stages": stages, "request_inputs": declared}
    assert type("OwnRequest", (Pipeline,), own).request_inputs == declared


def test_an_item_too_late_to_forward_is_answered_naming_its_stage() -> None:
    """As every error a stage answers: the stage before the message and in the error map."""
    import asyncio

    from broker.protocol import Request
    from gpu_worker.forwarding import StageTransport

    stage = StageTransport(None, StageRoute(Chain, "embed", "p"))  # type: ignore[arg-type]
    stage.now_ms = lambda: 2_000.0
    late = Request("1-0", "r1", Chain.keys("embed", "p").inbox("c"), 0, 1_000, b"")
    [(reply_key, reply)] = asyncio.run(stage._forward([(late, b"output")], {}))
    error = codec.decode(reply)["error"]
    assert reply_key == late.reply_key and error == {
        "type": "DeadlineExceeded",
        "message": "stage 'embed': deadline passed before the item was forwarded",
        "stage": "embed",
    }


def test_stage_keys_are_the_pipelines_own_then_their_own_with_the_pipelines_inboxes() -> None:
    first, later = Chain.keys("embed", "p"), Chain.keys("polarity", "p")
    assert first == ModelKeys("chain", "p")  # callers queue to the pipeline as to a model
    assert later.stream == "mb:{p:chain.polarity}:requests"  # a slot of its own
    assert later.dead_letters == "mb:{p:chain.polarity}:dead"
    assert later.reply_namespace == first.reply_namespace == "mb:{p:chain}:inbox:"
    assert later.may_reply_to("mb:{p:chain}:inbox:c1")
    assert not later.may_reply_to("mb:{p:chain.polarity}:inbox:c1")
    assert not later.may_reply_to("mb:{p:chainx}:inbox:c1")
    assert later.withdrawn == first.withdrawn == "mb:{p:chain}:withdrawn"
    assert later.join("c1", "r1") == "mb:{p:chain}:join:2:c1:r1"
    for bad in ("a.b.c", ".b", "a.", "A.b"):
        with pytest.raises(ValueError):
            ModelKeys(bad, "p")


def test_no_two_requests_share_a_join_hash_whatever_colons_they_hold() -> None:
    keys = ModelKeys("fan.topic", "p")
    assert keys.join("a", "b:r") == "mb:{p:fan}:join:1:a:b:r"
    pairs = [("a", "b:r"), ("a:b", "r"), ("a:", "b:r"), ("a", ":b:r"), ("", "a:b:r")]
    assert len({keys.join(client, request) for client, request in pairs}) == len(pairs)


def test_a_malformed_declaration_is_refused_when_the_class_is_defined() -> None:
    with pytest.raises(ValueError, match="not declared before it"):

        class Backwards(Pipeline):
            stages = [Stage("a", Embed), Stage("b", Polarity, after="c"), Stage("c", Topic)]

    with pytest.raises(ValueError, match="declared twice"):

        class Twice(Pipeline):
            stages = [Stage("a", Embed), Stage("a", Polarity)]

    with pytest.raises(ValueError, match="first stage follows no stage"):

        class Headless(Pipeline):
            stages = [Stage("a", Embed, after="b")]

    with pytest.raises(ValueError, match="declares no stages"):

        class Empty(Pipeline):
            stages = []

    with pytest.raises(ModelLoadError, match="cannot import module"):

        class Missing(Pipeline):
            stages = [Stage("a", "no_such_module:Model")]


def test_a_bad_stage_name_is_refused_as_a_stage_name() -> None:
    with pytest.raises(ValueError, match=r"^invalid stage name 'Head\.1': use lower-case"):
        Stage("Head.1", Polarity)


def test_a_wrong_model_path_fails_at_definition_whatever_the_stage() -> None:
    """Not only the first stage's and the leaves': a middle stage's path is imported too, so
    that a typo fails where the Pipeline is defined, naming the stage, not in its worker."""
    with pytest.raises(ModelLoadError, match=r"stage 'middle': .*has no attribute 'Nope'"):

        class Middle(Pipeline):
            stages = [
                Stage("embed", Embed),
                Stage("middle", "tests.pipeline_models:Nope"),
                Stage("head", Polarity),
            ]

    with pytest.raises(ModelLoadError, match="stage 'middle': model must be a ManagedModel"):

        class NotAModel(Pipeline):
            stages = [Stage("embed", Embed), Stage("middle", int), Stage("head", Polarity)]  # type: ignore[arg-type]


def test_a_worker_loads_the_model_of_its_stage() -> None:
    assert load_stage("tests.pipeline_models:Chain", "polarity") is Polarity
    assert load_stage("tests.pipeline_models:Embed", None) is Embed
    with pytest.raises(ModelLoadError, match=re.escape("give --stage <embed|polarity>")):
        load_stage("tests.pipeline_models:Chain", None)
    with pytest.raises(ModelLoadError, match="has no stage 'nope'"):
        load_stage("tests.pipeline_models:Chain", "nope")
    with pytest.raises(ModelLoadError, match="needs a Pipeline"):
        load_stage("tests.pipeline_models:Embed", "embed")


def test_a_worker_of_a_stage_with_a_wrong_transform_path_is_refused_at_start() -> None:
    """Not a worker that reports ready, then crashes on every restart."""
    with pytest.raises(
        ModelLoadError,
        match=r"^stage 'polarity': transform: module 'tests.pipeline_models' has no attribute",
    ):
        load_stage("tests.pipeline_models:MistypedTransform", "polarity")
    assert load_stage("tests.pipeline_models:MistypedTransform", "embed") is Embed


def test_routes_come_from_the_declaration() -> None:
    embed = StageRoute(Fan, "embed", "p")
    assert [k.stream for k in embed.next] == [
        "mb:{p:fan.polarity}:requests",
        "mb:{p:fan.topic}:requests",
    ]
    assert embed.leaves == [] and not embed.later
    topic = StageRoute(Fan, "topic", "p")
    assert topic.next == [] and topic.leaves == ["polarity", "topic"] and topic.later
    polarity = StageRoute(Chain, "polarity", "p")
    assert polarity.next == [] and polarity.leaves == []  # a chain's leaf answers as it is


def test_a_joined_answer_and_a_stage_error_are_replies_every_reader_takes() -> None:
    parts = {"topic": codec.encode(np.array([1.0, 2.0])), "polarity": codec.encode("neg")}
    reply = decode_reply(_joined("r-1", parts, ["polarity", "topic"]))
    assert reply.ok and reply.request_id == "r-1"
    assert reply.result["polarity"] == "neg"
    np.testing.assert_array_equal(reply.result["topic"], [1.0, 2.0])
    error = decode_reply(stage_error("topic", Reply("r-2", False, None, "ModelError", "E: x")))
    assert (error.error_type, error.error_message) == ("ModelError", "stage 'topic': E: x")
    assert (
        codec.decode(stage_error("topic", Reply("r", False, None, "T", "m")))["error"]["stage"]
        == "topic"
    )


def test_a_pipeline_class_comes_without_torch_or_the_batch_loop() -> None:
    """What a gateway or a caller imports: the declaration, its stage model classes."""
    done = run_python(
        "import sys\n"
        "from gpu_worker.model import load_model_class\n"
        "load_model_class('tests.pipeline_models:Fan')\n"
        "heavy = {'torch', 'gpu_worker.batching', 'gpu_worker.forwarding'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


class Shout(ManagedModel):
    """A stage model with caller-side processing."""

    def preprocess(self, item: str) -> str:
        return item.upper()

    def postprocess(self, output: str) -> str:
        return output + "!"


def test_a_pipeline_runs_its_stage_models_caller_side_processing() -> None:
    class Loud(Pipeline):
        stages = [Stage("a", Shout), Stage("b", Embed), Stage("c", Shout, after="a")]

    loud = Loud()
    assert loud.preprocess("hi") == "HI"  # the first stage's
    # leaves b and c: each leaf's postprocess on its entry of the joined map
    assert loud.postprocess({"b": "x", "c": "y"}) == {"b": "x", "c": "y!"}


class _Backlog:
    """A transport whose next stage holds what ``state`` says (the replies of the commands
    ``next_stage_full`` sends, in order)."""

    def __init__(self, **state: object) -> None:
        self.state = {
            "bound": [b"4", b"1000"],
            "live": [b"w1"],
            "length": 0,
            "high_length": 0,
            "size": None,
            "high_size": None,
            "packed": None,
            "high_packed": None,
            **state,
        }
        self.calls: list[str] = []

    async def run_in_slot(
        self, key: str, commands: list[tuple[object, ...]], atomic: bool = True
    ) -> list[object]:
        self.calls.append(key)
        assert not atomic and [c[0] for c in commands] == [
            "HMGET", "ZRANGEBYSCORE", "XLEN", "XLEN", "GET", "GET", "GET", "GET"
        ]  # fmt: skip
        return list(self.state.values())


@pytest.mark.parametrize(
    ("state", "full"),
    [
        ({}, None),
        ({"length": 3}, None),
        ({"length": 4}, "chain.polarity holds 4 items, its bound 4"),
        ({"length": 3, "packed": b"1"}, "chain.polarity holds 4 items, its bound 4"),
        ({"length": 7, "live": [b"w1", b"w2"]}, None),  # the bound is per live worker
        ({"length": 4, "live": []}, "chain.polarity holds 4 items, its bound 4"),  # at least one
        ({"high_length": 4}, "chain.polarity (high level) holds 4 items, its bound 4"),
        ({"size": b"1000"}, "chain.polarity holds 1000 bytes, its bound 1000"),
        ({"bound": [None, None], "length": 10**6}, None),  # no bound written: no backpressure
        ({"bound": [b"0", b"0"], "size": b"999999"}, None),
    ],
)
def test_a_stage_reads_nothing_new_while_its_next_stage_is_at_its_bound(
    state: dict[str, object], full: str | None
) -> None:
    """Backpressure: a slow later stage holds the stage before it back (and so, stream by
    stream, the first stage, whose bound refuses new calls), as mb_enqueue counts."""
    import asyncio

    from gpu_worker.forwarding import StageTransport

    inner = _Backlog(**state)
    stage = StageTransport(inner, StageRoute(Chain, "embed", "p"))  # type: ignore[arg-type]
    assert asyncio.run(stage.next_stage_full()) == full
    assert inner.calls == [Chain.keys("polarity", "p").stream]
    last = StageTransport(inner, StageRoute(Chain, "polarity", "p"))  # type: ignore[arg-type]
    assert asyncio.run(last.next_stage_full()) is None  # a leaf forwards nothing: no check
    assert len(inner.calls) == 1


def test_a_full_next_stage_means_an_empty_read_and_no_xreadgroup() -> None:
    import asyncio

    from gpu_worker import forwarding
    from gpu_worker.forwarding import StageTransport

    class Inner(_Backlog):
        async def read_batch(self, *args: object) -> list[object]:
            raise AssertionError("read while the next stage is full")

    stage = StageTransport(Inner(length=9), StageRoute(Chain, "embed", "p"))  # type: ignore[arg-type]
    forwarding.BACKPRESSURE_WAIT_S, saved = 0.001, forwarding.BACKPRESSURE_WAIT_S
    try:
        keys = Chain.keys("embed", "p")
        assert asyncio.run(stage.read_batch(keys, "c", 4, 1000)) == []
    finally:
        forwarding.BACKPRESSURE_WAIT_S = saved
