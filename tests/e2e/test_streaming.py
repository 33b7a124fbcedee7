"""The client contract, run over both transports: Redis (real worker processes) and in-memory."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from broker import DeadlineExceeded, ModelError, QueueFull, Streamer
from broker import client as client_module
from broker.devserver import RedisServer
from examples.mlp import MLP
from gpu_worker import LocalStreamer, ManagedModel
from tests.conftest import worker_process
from tests.models import Toy

MakeStreamer = Callable[..., Streamer]


@pytest.fixture(params=["redis", "memory"])
def make_streamer(
    request: pytest.FixtureRequest, redis_server: RedisServer, prefix: str
) -> Iterator[MakeStreamer]:
    """Build a Streamer for a model class, served over the transport named by the param."""
    with contextlib.ExitStack() as stack:

        def make(
            model: type[ManagedModel],
            batch_size: int = 8,
            max_latency: float = 0.0,
            max_queue_items: int = 0,
            model_thread: str = "auto",
        ) -> Streamer:
            if request.param == "memory":
                streamer = LocalStreamer(
                    model,
                    batch_size=batch_size,
                    max_latency=max_latency,
                    max_queue_items=max_queue_items,
                    model_thread=model_thread,
                )
            else:
                path = f"{model.__module__}:{model.__name__}"
                stack.enter_context(
                    worker_process(
                        redis_server.url,
                        path,
                        prefix,
                        "--batch-size",
                        str(batch_size),
                        "--max-latency",
                        str(max_latency),
                        "--model-thread",
                        model_thread,
                        name=model.name,
                    )
                )
                streamer = Streamer(
                    model.name,
                    redis_url=redis_server.url,
                    prefix=prefix,
                    max_queue_items=max_queue_items,
                )
            stack.callback(streamer.close)
            return streamer

        yield make


def test_results_equal_the_model_called_directly(make_streamer: MakeStreamer) -> None:
    streamer = make_streamer(MLP, batch_size=16)
    inputs = list(np.random.default_rng(1).standard_normal((40, 256), dtype=np.float32))
    model = MLP()
    model.init_model()
    expected = model.predict(inputs)

    outputs = streamer.predict(inputs, timeout=30)

    assert len(outputs) == len(inputs)
    for got, want in zip(outputs, expected, strict=True):
        assert got.shape == (16,) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # lists of floats are accepted as well as arrays
    np.testing.assert_allclose(streamer.predict([inputs[0].tolist()])[0], expected[0], rtol=1e-5)


def test_order_is_kept_inside_a_call(make_streamer: MakeStreamer) -> None:
    streamer = make_streamer(Toy, batch_size=4)
    items = [f"item-{i}" for i in range(25)]
    outputs = streamer.predict(items)
    assert [out["item"] for out in outputs] == items
    assert max(out["batch"] for out in outputs) <= 4


def test_calls_are_served_first_in_first_out(make_streamer: MakeStreamer) -> None:
    streamer = make_streamer(Toy, batch_size=3)
    # 4 calls of 5 items: within the default bound of 8 batches of 3 for one worker
    futures = [streamer.submit([f"{call}-{i}" for i in range(5)]) for call in range(4)]
    sequences = [[out["seq"] for out in future.result(timeout=30)] for future in futures]
    for earlier, later in itertools.pairwise(sequences):
        assert max(earlier) < min(later)


def test_async_predict(make_streamer: MakeStreamer) -> None:
    streamer = make_streamer(Toy)

    async def main() -> list[list[dict[str, object]]]:
        calls = [streamer.apredict([f"a{i}", f"b{i}"], timeout=30) for i in range(20)]
        return await asyncio.gather(*calls)

    results = asyncio.run(main())
    assert [[out["item"] for out in result] for result in results] == [
        [f"a{i}", f"b{i}"] for i in range(20)
    ]


def test_a_caller_whose_deadline_passes_gets_deadline_exceeded(
    make_streamer: MakeStreamer,
) -> None:
    # On the model thread, so that the in-process streamer's loop stays free to start the late
    # call's timer while the slow batch runs (inline, a call made while predict holds that loop
    # starts its timeout only when predict returns).
    streamer = make_streamer(Toy, batch_size=1, model_thread="on")
    slow = streamer.submit([{"sleep": 1.5}], timeout=10)
    with pytest.raises(DeadlineExceeded) as caught:
        streamer.predict(["late"], timeout=0.3)
    assert caught.value.index == 0
    assert slow.result(timeout=10)[0]["item"] == {"sleep": 1.5}


def test_a_failing_item_raises_its_typed_error_with_its_index(
    make_streamer: MakeStreamer,
) -> None:
    streamer = make_streamer(Toy, batch_size=8)
    batch = ["ok-0", "ok-1", {"fail": "bad input"}, "ok-3"]
    with pytest.raises(ModelError) as caught:
        streamer.predict(batch)
    assert caught.value.index == 2
    assert "ValueError: bad input" in str(caught.value)
    # the other items of the batch were computed, and the model keeps serving
    assert [out["item"] for out in streamer.predict(["ok-4", "ok-5"])] == ["ok-4", "ok-5"]


def test_empty_batch_and_bad_arguments(make_streamer: MakeStreamer) -> None:
    streamer = make_streamer(Toy)
    assert streamer.predict([]) == []
    with pytest.raises(TypeError):
        streamer.predict("not a list")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        streamer.predict(["x"], timeout=0)


def test_a_call_over_the_queue_bound_is_refused_at_once(make_streamer: MakeStreamer) -> None:
    streamer = make_streamer(Toy, batch_size=1, max_queue_items=3)
    slow = streamer.submit([{"sleep": 0.5}, "q1", "q2"])  # fills the queue: 3 of 3
    with pytest.raises(QueueFull) as caught:
        streamer.predict(["one too many"], timeout=5)
    assert caught.value.index == 0
    assert len(slow.result(timeout=10)) == 3
    assert streamer.predict(["fits again"])[0]["item"] == "fits again"


def test_cancelled_calls_are_never_computed(make_streamer: MakeStreamer) -> None:
    streamer = make_streamer(Toy, batch_size=1)
    blocker = streamer.submit([{"sleep": 1.0}])
    abandoned = streamer.submit(["abandoned-1", "abandoned-2"])
    time.sleep(0.3)  # both calls are queued behind the slow batch

    async def give_up() -> None:
        task = asyncio.ensure_future(streamer.apredict(["abandoned-async"]))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.sleep(0.2)  # this loop ends with asyncio.run: let the withdrawal go out

    asyncio.run(give_up())
    assert abandoned.cancel()
    time.sleep(0.2)
    after = streamer.predict(["after"], timeout=10)
    assert blocker.result(timeout=10)[0]["item"] == {"sleep": 1.0}
    # "after" was computed right behind the slow batch: the abandoned items were skipped
    assert after[0]["seq"] == blocker.result()[0]["seq"] + 1
    if not isinstance(streamer, LocalStreamer):  # withdrawn bytes left the byte counter too
        client = redis.Redis.from_url(streamer.redis_url)
        assert int(client.get(streamer.keys.queued_bytes) or 0) == 0
        assert client.xlen(streamer.keys.stream) == 0
        client.close()


def test_many_threads_calling_at_once_each_get_their_own_outputs(
    make_streamer: MakeStreamer,
) -> None:
    streamer = make_streamer(Toy, batch_size=16)
    wrong: list[tuple[list[str], list[object]]] = []

    def caller(thread: int) -> None:
        for call in range(15):
            items = [f"{thread}-{call}-{i}" for i in range(1 + (thread + call) % 3)]
            if call % 5 == 4:
                outputs = streamer.submit(items, timeout=30).result(timeout=30)
            else:
                outputs = streamer.predict(items, timeout=30)
            if [out["item"] for out in outputs] != items:
                wrong.append((items, outputs))

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert wrong == []


@pytest.mark.usefixtures("ctrl_c")
def test_a_blocking_call_interrupted_by_ctrl_c_is_withdrawn(make_streamer: MakeStreamer) -> None:
    streamer = make_streamer(Toy, batch_size=1)
    blocker = streamer.submit([{"sleep": 1.0}])
    time.sleep(0.2)  # the slow batch runs: the next call waits in the queue behind it
    interrupt = threading.Timer(0.3, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    interrupt.start()
    with pytest.raises(KeyboardInterrupt):
        streamer.predict(["interrupted-1", "interrupted-2"], timeout=10)
    interrupt.join()
    time.sleep(0.2)  # the withdrawal goes out
    after = streamer.predict(["after"], timeout=10)
    # "after" was computed right behind the slow batch: the interrupted items were skipped
    assert after[0]["seq"] == blocker.result(timeout=10)[0]["seq"] + 1
    if not isinstance(streamer, LocalStreamer):
        client = redis.Redis.from_url(streamer.redis_url)
        assert int(client.get(streamer.keys.queued_bytes) or 0) == 0
        assert client.xlen(streamer.keys.stream) == 0
        client.close()


def test_a_blocking_caller_is_not_held_past_its_deadline_by_a_stuck_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The model inline on the in-process streamer's loop: a slow batch holds that loop, so
    # nothing there can expire the late call; the caller's own wait gives up instead.
    monkeypatch.setattr(client_module, "STUCK_S", 0.1)
    streamer = LocalStreamer(Toy, batch_size=1, model_thread="off")
    try:
        slow = streamer.submit([{"sleep": 2.0}], timeout=10)
        time.sleep(0.2)
        with pytest.raises(DeadlineExceeded) as caught:
            streamer.predict(["late"], timeout=0.2)
        assert caught.value.index == 0
        assert not slow.done()  # it gave up while the loop was still stuck
        assert slow.result(timeout=10)[0]["item"] == {"sleep": 2.0}
        # the late call was forgotten before it went out: the next item follows the slow one
        after = streamer.predict(["after"], timeout=10)
        assert after[0]["seq"] == slow.result()[0]["seq"] + 1
    finally:
        streamer.close()


class Checked(Toy):
    """Toy whose caller-side postprocess refuses one output."""

    def postprocess(self, output: Any) -> Any:
        if output["item"] == "refused":
            raise ValueError("postprocess refused it")
        return {**output, "post": True}


def test_submit_and_predict_run_postprocess_and_name_its_error() -> None:
    streamer = LocalStreamer(Checked, batch_size=4)
    try:
        assert streamer.submit(["a", "b"]).result(timeout=10)[1]["post"] is True
        assert streamer.predict(["c"])[0]["post"] is True
        # the model's error, named as its postprocess's, for the item it failed on
        with pytest.raises(ModelError, match=r"item 1: postprocess failed: ValueError: .*refused"):
            streamer.submit(["ok", "refused"]).result(timeout=10)
        with pytest.raises(ModelError, match="item 0: postprocess failed") as raised:
            streamer.predict(["refused"])
        assert isinstance(raised.value.__cause__, ValueError)
        assert streamer.submit([]).result(timeout=10) == []
    finally:
        streamer.close()
