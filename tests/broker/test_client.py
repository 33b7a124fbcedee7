"""The Streamer's close: calls still waiting end at once and take their items back, and at
interpreter exit the calls of threads still to be joined get their results first."""

from __future__ import annotations

import asyncio
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from broker import BrokerUnavailable, DeadlineExceeded, Streamer
from broker.devserver import RedisServer
from broker.keys import ModelKeys
from tests.conftest import ROOT, worker_process


def queued(client: redis.Redis, keys: ModelKeys) -> tuple[int, int, int]:
    """(entries, queued bytes, packed items) of a model's stream."""
    return (
        client.xlen(keys.stream),
        int(client.get(keys.queued_bytes) or 0),
        int(client.get(keys.packed_items) or 0),
    )


def test_closing_fails_the_calls_still_waiting_and_withdraws_them(
    redis_server: RedisServer, prefix: str
) -> None:
    """A submit() future pending at close() was never settled (result() blocked forever), and
    a blocking predict() waited out its deadline: no worker answers a closed Streamer."""
    keys = ModelKeys("toy", prefix)
    streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
    futures = [streamer.submit([[1.0, 2.0], [3.0, 4.0]], timeout=60) for _ in range(5)]
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            streamer.predict([[5.0]], timeout=60)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    client = redis_server.client()
    deadline = time.monotonic() + 30
    while sum(queued(client, keys)[::2]) < 11:  # entries plus packed items: all queued
        assert time.monotonic() < deadline
        time.sleep(0.01)
    streamer.close()
    thread.join(10)
    for future in futures:
        error = future.exception(timeout=10)
        assert isinstance(error, BrokerUnavailable), error
        assert "closed while the call waited" in str(error)
    assert len(errors) == 1 and isinstance(errors[0], BrokerUnavailable)
    assert queued(client, keys) == (0, 0, 0)  # nothing left for a worker to compute


def test_a_cancel_just_before_close_still_withdraws(redis_server: RedisServer, prefix: str) -> None:
    """close() cancelled the withdrawals in flight: a worker computed what was cancelled, and
    the items counted against the queue bound."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    for _ in range(5):
        with Streamer("toy", redis_url=redis_server.url, prefix=prefix) as streamer:
            future = streamer.submit([[1.0], [2.0], [3.0]], timeout=60)
            deadline = time.monotonic() + 30
            while queued(client, keys)[0] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            assert future.cancel()
    assert queued(client, keys) == (0, 0, 0)


def test_asyncio_callers_waiting_at_aclose_fail_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    keys = ModelKeys("toy", prefix)

    async def scenario() -> BaseException:
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
        task = asyncio.ensure_future(streamer.apredict([[1.0]], timeout=60))
        client = redis_server.client()
        while client.xlen(keys.stream) == 0:
            await asyncio.sleep(0.01)
        await streamer.aclose()
        return await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)

    (error,) = asyncio.run(scenario())
    assert isinstance(error, BrokerUnavailable)
    assert queued(redis_server.client(), keys) == (0, 0, 0)


def test_apredict_tasks_cancelled_as_asyncio_run_ends_are_withdrawn(
    redis_server: RedisServer, prefix: str
) -> None:
    """asyncio.run() cancels the tasks left and closes the loop: the withdrawals those
    cancellations started were destroyed pending, and a worker computed the items later."""
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)

    async def leave_calls_waiting() -> None:
        waiting = [asyncio.ensure_future(streamer.apredict([[float(i)]], 60)) for i in range(5)]
        assert not any(task.done() for task in waiting)
        while sum(queued(client, keys)[::2]) < 5:  # entries plus packed items: all queued
            await asyncio.sleep(0.01)

    try:
        asyncio.run(leave_calls_waiting())
        assert queued(client, keys) == (0, 0, 0)
    finally:
        streamer.close()


def test_asyncio_run_per_call_leaves_no_connection_open(
    redis_server: RedisServer, prefix: str
) -> None:
    """A shared Streamer called through asyncio.run() (a new event loop each call) left each
    loop's connections open until the garbage collector found them: with the collector off,
    one more Redis connection and file descriptor per call, for good."""
    import gc

    client = redis_server.client()
    streamer = Streamer("runs", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)

    def connections() -> int:
        return len(client.client_list())

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before, fds_before = connections(), fds()
    gc.disable()
    try:
        for _ in range(10):  # no worker: each call ends by its deadline, its item withdrawn
            with pytest.raises(DeadlineExceeded):
                asyncio.run(streamer.apredict([[1.0]], timeout=0.05))
        assert fds() <= fds_before + 1, "each asyncio.run() left a connection open"
        deadline = time.monotonic() + 5
        while connections() > before:  # Redis sees the last ones go a moment later
            assert time.monotonic() < deadline, f"{connections() - before} connections stayed"
            time.sleep(0.02)
    finally:
        gc.enable()
        streamer.close()


AT_EXIT = """\
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from broker import Streamer

streamer = Streamer("toy", redis_url=sys.argv[1], prefix=sys.argv[2], timeout=20)
printing = threading.Lock()


def say(label, output):
    with printing:
        print(label, output[0]["item"]["label"], flush=True)


def call(label):
    say(label, streamer.predict([{"sleep": 1.0, "label": label}]))


threading.Thread(target=call, args=("thread",)).start()
ThreadPoolExecutor(1).submit(call, "pool")
future = streamer.submit([{"sleep": 1.0, "label": "future"}])
threading.Thread(target=lambda: say("future", future.result())).start()
# the main thread ends here: the threads above are joined as the interpreter exits
"""


def test_threads_still_calling_at_exit_get_their_results(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """The Streamer closed as the interpreter began to exit, before the threads still waiting
    on it were joined: their calls failed after their deadline (or, a submit() future's, never
    ended, and neither did the process)."""
    program = tmp_path / "at_exit.py"
    program.write_text(AT_EXIT)
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        done = subprocess.run(
            [sys.executable, str(program), redis_server.url, prefix],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == sorted(
        ["thread", "thread", "pool", "pool", "future", "future"]
    ), done.stderr


def test_a_call_s_timeout_is_checked_before_anything_is_sent() -> None:
    """inf or 1e10 s raised OverflowError deep in a thread wait (after the Streamer accepted
    them as its default), and "5" a TypeError naming an internal comparison."""
    streamer = Streamer("toy", redis_url="redis://127.0.0.1:1/0")  # never reached
    try:
        for bad in (math.inf, 1e10, 0, -1, math.nan):
            with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
                streamer.submit([[1.0]], timeout=bad)
            with pytest.raises(ValueError, match=re.escape("(at most 3.1536e+07: a year)")):
                Streamer("toy", timeout=bad)
        for wrong in ("5", True, [1]):
            with pytest.raises(TypeError, match="timeout must be a number of seconds"):
                streamer.predict([[1.0]], timeout=wrong)  # type: ignore[arg-type]
        assert Streamer("toy", timeout=np.int64(3)).timeout == 3.0
    finally:
        streamer.close()


def test_a_traceparent_that_is_no_string_is_a_type_error_saying_so() -> None:
    """123 raised "expected string or bytes-like object, got 'int'", and b"00" "cannot use a
    string pattern on a bytes-like object": internals of a regular expression."""
    streamer = Streamer("toy", redis_url="redis://127.0.0.1:1/0")  # never reached
    try:
        for wrong in (123, b"00-ab", ["00"]):
            for call in (streamer.predict, streamer.submit):
                with pytest.raises(TypeError, match="traceparent must be a str"):
                    call([[1.0]], traceparent=wrong)  # type: ignore[operator]
            with pytest.raises(TypeError, match="traceparent must be a str"):
                asyncio.run(streamer.apredict([[1.0]], traceparent=wrong))  # type: ignore[arg-type]
    finally:
        streamer.close()


def test_pickling_a_streamer_says_to_make_one_in_that_process() -> None:
    """Handed to a spawned process (a spawn Pool's arguments, macOS' default start method), a
    Streamer raised "cannot pickle '_thread.lock' object"."""
    import pickle

    with (
        Streamer("toy", redis_url="redis://127.0.0.1:1/0") as streamer,
        pytest.raises(TypeError, match="make one in the process that uses it"),
    ):
        pickle.dumps(streamer)


def test_a_batch_that_is_no_list_or_tuple_is_a_type_error_naming_what_it_got() -> None:
    streamer = Streamer("toy", redis_url="redis://127.0.0.1:1/0")  # never reached
    bad: list[Any] = ["text", b"bytes", np.zeros(3), (item for item in [1]), {1: 2}, 5, None]
    try:
        for batch in bad:
            said = f"take a list (or tuple) of items, not {type(batch).__name__}"
            for call in (streamer.predict, streamer.submit):
                with pytest.raises(TypeError, match=re.escape(said)):
                    call(batch)
        assert streamer.predict([]) == [] and streamer.predict(()) == []
        # a batch in one array, as a model's own predict takes it: say how to send it
        with pytest.raises(TypeError, match=re.escape("pass list(array): one item per row")):
            streamer.predict(np.zeros((2, 3)))
    finally:
        streamer.close()


def test_a_streamer_takes_only_a_model_s_name() -> None:
    """A pipeline's later stage (``chain.head``) was taken, and calls went straight into that
    stage's stream, skipping the stages before it; the README says a name is lower-case
    letters, digits, '_' and '-'."""
    for bad in ("chain.head", "Mlp", "a b", ""):
        with pytest.raises(ValueError, match="invalid model name"):
            Streamer(bad, redis_url="redis://127.0.0.1:1/0")


def test_a_model_argument_that_is_no_model_is_a_type_error_at_once() -> None:
    """An import path or another object was taken, and every call then failed with an
    AttributeError about ``preprocess``."""
    for wrong in ("tests.models:Toy", 42, object(), dict):
        with pytest.raises(TypeError, match="model= takes a ManagedModel"):
            Streamer("toy", redis_url="redis://127.0.0.1:1/0", model=wrong)


@pytest.mark.slow  # waits out the 10 s reply timeout once
def test_a_redis_that_never_answers_fails_a_call_after_one_reply_timeout() -> None:
    """The first call read the model's partition count, waited 10 s for it, then sent its
    enqueue anyway and waited 10 s more: 20 s to the BrokerUnavailable documented at 10."""
    import socket

    from broker.resp_lane import REPLY_TIMEOUT_S

    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            held.append(connection)
            threading.Thread(target=lambda c=connection: read_all(c), daemon=True).start()

    def read_all(connection: socket.socket) -> None:
        while data := connection.recv(65536):
            received.append(data)

    threading.Thread(target=accept, daemon=True).start()
    url = f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    streamer = Streamer("toy", redis_url=url, timeout=60)
    try:
        with pytest.raises(
            BrokerUnavailable, match=f"no reply from Redis in {REPLY_TIMEOUT_S:g} s"
        ):
            streamer.predict([[1.0]])
        assert b"mb_enqueue" not in b"".join(received)  # it never waited a second time
    finally:
        streamer.close()
        server.close()
        for connection in held:
            connection.close()


def test_a_streamer_dropped_without_close_ends_its_thread_and_connections(
    redis_server: RedisServer, prefix: str
) -> None:
    """A Streamer made per request and never closed left a loop thread and its Redis
    connections behind each time: a web app doing so ran out of threads or connections."""
    import gc
    import warnings

    client = redis_server.client()

    def connections() -> int:
        return len(client.client_list())

    before = connections()
    streamer = Streamer("dropped", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
    future = streamer.submit([[1.0]], timeout=60)  # waits: no worker serves it
    keys = ModelKeys("dropped", prefix)
    deadline = time.monotonic() + 10
    while queued(client, keys)[0] < 1:  # sent (on the Streamer's own thread)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    threads = [t for t in threading.enumerate() if t.name == f"microbatch-{streamer.name}"]
    assert len(threads) == 1 and connections() > before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del streamer
        gc.collect()
    assert [w for w in caught if "Streamer was dropped" in str(w.message)], caught
    threads[0].join(15)
    assert not threads[0].is_alive()
    with pytest.raises(BrokerUnavailable):  # the call waiting was failed, not left hanging
        future.result(timeout=5)
    deadline = time.monotonic() + 10
    while connections() > before:
        assert time.monotonic() < deadline, "the dropped Streamer's connections stayed open"
        time.sleep(0.05)
    assert queued(client, keys) == (0, 0, 0)  # and its item withdrawn


def test_a_closed_streamer_is_not_closed_again_when_dropped(
    redis_server: RedisServer, prefix: str
) -> None:
    import gc
    import warnings

    streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
    streamer.submit([[1.0]], timeout=60)
    streamer.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del streamer
        gc.collect()
    assert not [w for w in caught if "Streamer was dropped" in str(w.message)]


def test_a_user_refused_the_read_of_its_replies_fails_its_calls_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """An ACL user that may queue calls but not read their replies (BLMPOP refused): its calls
    waited out their whole timeout, though the model had answered them, with a single
    throttled warning as the only sign. They fail at once, as BrokerUnavailable naming the
    refusal, and are withdrawn."""
    from tests.conftest import worker_process

    admin = redis_server.client()
    user = f"noreplies-{prefix}"
    admin.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-blmpop")
    url = redis_server.url.replace("redis://", f"redis://{user}:pw@")
    try:
        with (
            worker_process(redis_server.url, "tests.models:Toy", prefix),
            Streamer("toy", redis_url=url, prefix=prefix, timeout=60) as streamer,
        ):
            started = time.monotonic()
            with pytest.raises(BrokerUnavailable) as raised:
                streamer.predict([{"x": 1}, {"x": 2}])
            assert time.monotonic() - started < 30  # not the 60 s timeout
            assert raised.value.type == "BrokerUnavailable"
            assert "refused this user the read of its replies" in str(raised.value)
            assert "NOPERM" in str(raised.value) or "permission" in str(raised.value)
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()
