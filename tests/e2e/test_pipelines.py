"""Pipelines with real workers, one `worker start --stage` per stage, over a real Redis."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import redis

from broker import DeadlineExceeded, MicrobatchError, ModelError, Streamer, acl, admin, functions
from broker.devserver import RedisServer
from broker.keys import HIGH, ModelKeys
from broker.protocol import decode_reply, entry_time_ms, request_fields
from broker.redis_transport import RedisTransport
from tests.cluster_local import LocalCluster
from tests.conftest import ROOT, wait_for_consumers, wait_until, worker_process
from tests.e2e.test_gateway import gateway_process
from tests.models import DELAY_ENV, RECORD_ENV
from tests.pipeline_models import Chain, Embed, Half, Polarity, Topic, double

MODULE = "tests.pipeline_models"
FIRST = "embed"  # the first stage of every test pipeline


def keys_name(pipeline: str, stage: str) -> str:
    return pipeline if stage == FIRST else f"{pipeline}.{stage}"


@contextmanager
def stages(
    url: str, prefix: str, pipeline: str, names: list[str], *args: str, **options: Any
) -> Iterator[None]:
    """One `worker start --stage` per stage named, all started at once; yields once each
    stage has a live worker."""
    count = int(options.pop("expect", 1))
    with ExitStack() as stack:
        for stage in names:
            command = ("--stage", stage, *args)
            model = f"{MODULE}:{pipeline.capitalize()}"
            stack.enter_context(
                worker_process(url, model, prefix, *command, expect_consumers=None, **options)
            )
        for stage in names:
            wait_for_consumers(url, ModelKeys(keys_name(pipeline, stage), prefix), count)
        yield


def in_process(*models: type[Any]) -> list[Any]:
    instances = [model() for model in models]
    for model in instances:
        model.init_model()
    return instances


def inputs(count: int) -> list[np.ndarray]:
    return [np.arange(8, dtype=np.float32) + i for i in range(count)]


def records(directory: Path, stage: str) -> list[float]:
    found: list[float] = []
    for path in directory.glob(f"{stage}-*.jsonl"):
        found += [json.loads(line) for line in path.read_text().splitlines()]
    return found


@pytest.fixture(scope="module")
def served(redis_server: RedisServer) -> Iterator[str]:
    """A chain and a fan-out, every stage with a worker of its own; their prefix."""
    prefix = "pipelines"
    with (
        stages(redis_server.url, prefix, "chain", ["embed", "polarity"], "--batch-size", "4"),
        stages(redis_server.url, prefix, "fan", ["embed", "polarity", "topic"]),
        stages(redis_server.url, prefix, "half", ["embed"]),  # its topic stage: no worker
    ):
        yield prefix


def test_a_chain_answers_as_its_models_in_sequence(redis_server: RedisServer, served: str) -> None:
    items = inputs(20)
    embed, polarity = in_process(Embed, Polarity)
    expected = polarity.predict(embed.predict(items))
    url = redis_server.url
    with (
        Streamer("chain", redis_url=url, prefix=served) as streamer,
        Streamer("chain", redis_url=url, prefix=served, model=Chain) as with_class,
    ):
        got = streamer.predict(items, timeout=20)
        # through the pipeline's class: caller-side conversion of plain lists
        again = with_class.predict([item.tolist() for item in items], timeout=20)
    np.testing.assert_allclose(np.stack(got), np.stack(expected), rtol=1e-6)
    np.testing.assert_allclose(np.stack(again), np.stack(expected), rtol=1e-6)
    client = redis_server.client()
    stages_seen = {keys.model for keys in admin.find_models(client, served)}
    assert {"chain", "chain.polarity"} <= stages_seen  # broker status lists every stage
    for name in ("chain", "chain.polarity"):  # every stage's entries answered and deleted
        keys = ModelKeys(name, served)
        assert client.xlen(keys.stream) == 0
        assert int(client.get(keys.queued_bytes) or 0) == 0


def test_a_fan_out_joins_both_heads_into_one_answer(redis_server: RedisServer, served: str) -> None:
    items = inputs(12)
    embed, polarity, topic = in_process(Embed, Polarity, Topic)
    embeddings = embed.predict(items)
    with Streamer("fan", redis_url=redis_server.url, prefix=served) as streamer:
        got = streamer.predict(items, timeout=20)
    assert all(set(answer) == {"polarity", "topic"} for answer in got)
    np.testing.assert_allclose(
        np.stack([a["polarity"] for a in got]), np.stack(polarity.predict(embeddings)), rtol=1e-6
    )
    # topic's transform (x2) ran in topic's worker
    np.testing.assert_allclose(
        np.stack([a["topic"] for a in got]),
        np.stack(topic.predict([double(e) for e in embeddings])),
        rtol=1e-6,
    )
    client = redis_server.client()
    assert not list(client.scan_iter(f"mb:{{{served}:fan}}:join:*"))  # answered joins deleted


def test_an_item_keeps_its_priority_from_stage_to_stage(
    redis_server: RedisServer, served: str
) -> None:
    later = ModelKeys("half.topic", served)  # no worker: what the embedder forwards stays
    client = redis_server.client()
    with Streamer("half", redis_url=redis_server.url, prefix=served) as streamer:
        normal = streamer.submit(inputs(2), timeout=30)
        high = streamer.submit(inputs(3), timeout=30, priority="high")
        wait_until(
            lambda: (client.xlen(later.stream), client.xlen(later.at(HIGH).stream)) == (2, 3),
            20,
            "each item on its own level of the next stage",
        )
        assert int(client.get(later.queued_bytes)) > 0
        assert int(client.get(later.at(HIGH).queued_bytes)) > 0
        normal.cancel()
        high.cancel()


def test_an_error_in_stage_two_names_stage_two(redis_server: RedisServer, served: str) -> None:
    good, bad = inputs(2)
    bad[1] = np.nan  # the embedding keeps it; the head refuses it
    with Streamer("chain", redis_url=redis_server.url, prefix=served) as streamer:
        with pytest.raises(ModelError) as caught:
            streamer.predict([good, bad], timeout=20)
        assert len(streamer.predict([good], timeout=20)) == 1  # its batch-mate was fine
    assert caught.value.index == 1
    assert (
        caught.value.message == "stage 'polarity': ValueError: head got an embedding out of range"
    )
    assert caught.value.stage == "polarity"  # the reply's error map names it too


def test_a_fan_out_error_names_the_failing_branch(redis_server: RedisServer, served: str) -> None:
    bad = inputs(1)[0]
    bad[0] = np.nan
    said = r"stage '(polarity|topic)': ValueError: head got"
    with (
        Streamer("fan", redis_url=redis_server.url, prefix=served) as streamer,
        pytest.raises(ModelError, match=said),
    ):
        streamer.predict([bad], timeout=20)


def test_one_http_route_serves_the_pipeline(redis_server: RedisServer, served: str) -> None:
    items = inputs(2)
    embed, polarity = in_process(Embed, Polarity)
    expected = np.stack(polarity.predict(embed.predict(items)))
    bad = [1e9] + [0.0] * 7
    models = [f"{MODULE}:Chain", f"{MODULE}:Fan", f"{MODULE}:Half"]
    with gateway_process(redis_server.url, models, served) as (base, _):
        v1 = httpx.post(
            f"{base}/v1/models/chain/predict", json={"inputs": [x.tolist() for x in items]}
        )
        body = {
            "inputs": [
                {"name": "input", "datatype": "FP32", "shape": [2, 8],
                 "data": np.stack(items).ravel().tolist()}
            ]
        }  # fmt: skip
        v2 = httpx.post(f"{base}/v2/models/chain/infer", json=body)
        failed = httpx.post(f"{base}/v1/models/chain/predict", json={"inputs": [bad]})
        body["inputs"][0]["shape"] = [1, 8]
        body["inputs"][0]["data"] = items[0].tolist()
        fan = httpx.post(f"{base}/v2/models/fan/infer", json=body)  # the join: one per leaf
        # a pipeline is ready when every stage has a live worker
        ready = {name: httpx.get(f"{base}/v2/models/{name}/ready") for name in ("fan", "half")}
        stuck = httpx.post(  # its topic stage has no worker: the answer names it
            f"{base}/v1/models/half/predict",
            json={"inputs": [items[0].tolist()]},
            headers={"X-Request-Timeout": "1"},
        )
    assert v1.status_code == 200, v1.text
    np.testing.assert_allclose(np.array(v1.json()["outputs"]), expected, rtol=1e-5)
    assert v2.status_code == 200, v2.text
    [output] = v2.json()["outputs"]
    np.testing.assert_allclose(np.array(output["data"]).reshape(2, 2), expected, rtol=1e-5)
    assert fan.status_code == 200, fan.text
    assert [(o["name"], o["shape"]) for o in fan.json()["outputs"]] == [
        ("polarity", [1, 2]),
        ("topic", [1, 3]),
    ]
    assert ready["fan"].status_code == 200 and ready["fan"].json()["ready"] is True
    assert ready["half"].status_code == 503 and ready["half"].json()["ready"] is False
    assert failed.status_code == 500
    assert failed.json()["error"]["message"].startswith("item 0: stage 'polarity': ValueError")
    assert stuck.status_code == 504
    assert "stage 'topic' ('half.topic' in broker status) has no live worker" in stuck.text


def test_a_call_waiting_on_a_stage_without_workers_names_that_stage(
    redis_server: RedisServer, served: str
) -> None:
    """The half pipeline's topic stage has no worker: the call times out there, and its error
    says so (with the model class, or with the stage names alone)."""
    url = redis_server.url
    with (
        Streamer("half", redis_url=url, prefix=served, model=Half) as streamer,
        Streamer("half", redis_url=url, prefix=served, stages=["embed", "topic"]) as named,
        Streamer("half", redis_url=url, prefix=served) as plain,
    ):
        for caller in (streamer, named):
            with pytest.raises(DeadlineExceeded) as raised:
                caller.predict(inputs(2), timeout=1)
            error = raised.value
            assert error.stage == "topic" and error.index == 0
            assert str(error) == (
                "item 0: no reply within 1 s; stage 'topic' ('half.topic' in broker status) "
                "has no live worker: start one (worker start --model <the pipeline> --stage "
                "topic)"
            )
        with pytest.raises(DeadlineExceeded) as raised:  # not told the stages: as before
            plain.predict(inputs(1), timeout=0.5)
    assert str(raised.value) == "item 0: no reply within 0.5 s" and raised.value.stage is None


def test_queue_full_and_no_workers_of_a_pipeline_name_their_stage(
    redis_server: RedisServer, prefix: str
) -> None:
    """Backed up behind its topic stage, which has no worker, the half pipeline refuses new
    calls with QueueFull naming that stage; with no worker at all, NoWorkers names the first."""
    from broker import NoWorkers, QueueFull

    url = redis_server.url
    with Streamer("half", redis_url=url, prefix=prefix, model=Half, workers_grace=1) as streamer:
        with stages(url, prefix, "half", ["embed"], "--max-queue-items", "2"):
            futures = [streamer.submit(inputs(1), timeout=3) for _ in range(40)]
            errors = []
            for future in futures:
                with pytest.raises(MicrobatchError) as raised:
                    future.result(timeout=30)
                errors.append(raised.value)
        with pytest.raises(NoWorkers) as raised:
            streamer.predict(inputs(1), timeout=30)
    full = [error for error in errors if isinstance(error, QueueFull)]
    assert full, errors
    assert {type(error) for error in errors} == {QueueFull, DeadlineExceeded}
    assert all(error.stage == "topic" for error in errors)
    assert "; stage 'topic' ('half.topic' in broker status) has no live worker" in str(full[0])
    assert raised.value.stage == "embed"
    assert "model 'half' (its first stage, 'embed') under prefix" in str(raised.value)


@pytest.mark.slow
def test_withdrawn_items_are_not_computed_later_and_deadlines_travel(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    url = redis_server.url
    client = redis_server.client()
    first, later = ModelKeys("chain", prefix), ModelKeys("chain.polarity", prefix)
    items = inputs(4)
    inbox = first.inbox("by-hand")
    data = msgpack.packb(items[3].tolist())
    with (
        stages(url, prefix, "chain", ["embed"]),  # no worker of polarity yet
        Streamer("chain", redis_url=url, prefix=prefix) as streamer,
    ):
        withdrawn = streamer.submit(items[:2], timeout=60)
        kept = streamer.submit(items[2:3], timeout=60)
        fields = {**request_fields("late", inbox, 1500, data), "extra": "kept"}
        entry = client.xadd(first.stream, fields)
        wait_until(lambda: client.xlen(later.stream) == 4, 20, "the items on the next stage")
        withdrawn.cancel()  # the caller gives up once its items have moved on
        wait_until(lambda: client.zcard(later.withdrawn) == 2, 5, "the withdrawal")
        # The deadline travels: the caller's, not one counted from the forwarding.
        deadline = entry_time_ms(entry) + 1500
        [late] = [f for _, f in client.xrange(later.stream) if f[b"id"] == b"late"]
        assert int(late[b"deadline"]) == deadline and late[b"reply"].decode() == inbox
        assert late[b"extra"] == b"kept"  # fields a worker does not know travel on

        def redis_ms() -> int:
            seconds, micros = client.time()
            return int(seconds) * 1000 + int(micros) // 1000

        wait_until(lambda: redis_ms() > deadline, 5, "the deadline")
        with stages(url, prefix, "chain", ["polarity"], env={RECORD_ENV: str(tmp_path)}):
            assert len(kept.result(timeout=20)) == 1
            popped = client.blpop([inbox], 20)
            wait_until(lambda: client.xlen(later.stream) == 0, 10, "the stream drained")
    [embedded] = in_process(Embed)[0].predict(items[2:3])  # what polarity got of the item kept
    assert records(tmp_path, "polarity") == [pytest.approx(float(embedded[0]))]  # only it
    assert popped is not None
    reply = decode_reply(popped[1])
    assert reply.error_type == DeadlineExceeded.__name__
    assert reply.error_message == "stage 'polarity': deadline passed before the item was computed"
    assert client.xpending(later.stream, later.group)["pending"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["embed", "polarity"])
def test_kill_9_of_a_stage_worker_mid_load_loses_nothing(
    redis_server: RedisServer, prefix: str, victim: str
) -> None:
    """The first stage forwards (a worker killed after forwarding and before its ack has its
    entries forwarded again: duplicates the caller drops); the last one answers."""
    url = redis_server.url
    client = redis_server.client()
    keys = ModelKeys(keys_name("chain", victim), prefix)
    items = inputs(200)
    embed, polarity = in_process(Embed, Polarity)
    expected = np.stack(polarity.predict(embed.predict(items)))
    other = "polarity" if victim == "embed" else "embed"
    slow = ("--batch-size", "4", "--workers", "2", "--max-queue-items", "0")
    with (
        stages(url, prefix, "chain", [other], "--max-queue-items", "0"),
        stages(url, prefix, "chain", [victim], *slow, env={DELAY_ENV: "0.02"}, expect=2),
        Streamer("chain", redis_url=url, prefix=prefix) as streamer,
    ):
        futures = [streamer.submit(items[i : i + 4], timeout=60) for i in range(0, 200, 4)]

        def holders() -> list[str]:
            try:
                consumers = client.xinfo_consumers(keys.stream, keys.group)
            except redis.ResponseError:  # the stage's group is not created yet
                return []
            return [c["name"].decode() for c in consumers if c["pending"]]

        wait_until(lambda: bool(holders()), 10, f"a worker of {victim} holding items")
        os.kill(int(holders()[0].rsplit("-", 1)[1]), signal.SIGKILL)  # mid-batch
        got = [future.result(timeout=60) for future in futures]
    answers = np.stack([out for result in got for out in result])
    np.testing.assert_allclose(answers, expected, rtol=1e-6)  # 0 lost, each its own answer
    for name in ("chain", "chain.polarity"):
        assert client.xlen(ModelKeys(name, prefix).stream) == 0


@pytest.mark.slow
def test_a_slow_later_stage_holds_the_intake_back_with_queue_full(
    redis_server: RedisServer, prefix: str
) -> None:
    """A fast first stage stops reading while the stage after it is at its bound: that stage's
    stream stays near its bound (it grew with every call before, 30 times its bound in 12 s),
    the first stage's fills, and new calls are refused with QueueFull rather than left to
    time out."""
    from broker import QueueFull

    url = redis_server.url
    client = redis_server.client()
    later = ModelKeys("chain.polarity", prefix)
    bound = ("--max-queue-items", "4")
    with (
        stages(url, prefix, "chain", ["embed"], "--batch-size", "2", *bound),
        stages(
            url, prefix, "chain", ["polarity"], "--batch-size", "2", *bound, env={DELAY_ENV: "0.3"}
        ),  # fmt: skip
        Streamer("chain", redis_url=url, prefix=prefix) as streamer,
    ):
        futures, refused, peak = [], 0, 0
        for i in range(80):
            try:
                futures.append(streamer.submit(inputs(i + 1)[i:], timeout=60))
            except QueueFull:
                refused += 1
            peak = max(peak, client.xlen(later.stream))
            time.sleep(0.02)
        outcomes = []
        for future in futures:
            try:
                outcomes.append(type(future.result(timeout=90)).__name__)
            except QueueFull:
                outcomes.append("QueueFull")
        wait_until(lambda: client.xlen(later.stream) == 0, 30, "the later stage drained")
    refused += outcomes.count("QueueFull")
    assert refused > 0 and outcomes.count("list") + refused == 80  # answered or refused
    assert peak <= 4 + 8, peak  # its bound, and what the first stage had in hand


@pytest.mark.slow
def test_a_fan_out_over_a_redis_cluster_with_its_stages_on_different_primaries() -> None:
    """Forwarding and joins are commands of one slot each: a stage's stream on one node, the
    next stage's on another, the pipeline's inboxes and joins on a third."""
    prefix = "c1"  # its stages hash to slots of three different primaries
    items = inputs(10)
    embed, polarity, topic = in_process(Embed, Polarity, Topic)
    embeddings = embed.predict(items)
    bad = inputs(1)[0]
    bad[0] = np.nan
    with LocalCluster(primaries=3) as cluster:
        url = cluster.url(nodes=1)
        names = ("fan", "fan.polarity", "fan.topic")
        owners = {cluster.owner(ModelKeys(name, prefix).stream) for name in names}
        assert len(owners) == 3  # each stage on a primary of its own
        with (
            stages(url, prefix, "fan", ["embed", "polarity", "topic"]),
            Streamer("fan", redis_url=url, prefix=prefix) as streamer,
        ):
            got = streamer.predict(items, timeout=20)
            with pytest.raises(ModelError, match=r"stage '(polarity|topic)': ValueError"):
                streamer.predict([bad], timeout=20)
    np.testing.assert_allclose(
        np.stack([a["polarity"] for a in got]), np.stack(polarity.predict(embeddings)), rtol=1e-6
    )
    np.testing.assert_allclose(
        np.stack([a["topic"] for a in got]),
        np.stack(topic.predict([double(e) for e in embeddings])),
        rtol=1e-6,
    )


def test_a_stage_worker_refuses_what_pipelines_do_not_support(
    redis_server: RedisServer, prefix: str
) -> None:
    def start(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "gpu_worker.cli", "start", "--redis", redis_server.url]
        return subprocess.run(
            [*command, "--prefix", prefix, *args], cwd=ROOT, capture_output=True, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60,
        )  # fmt: skip

    chain = f"{MODULE}:Chain"
    for args, said in [
        (("--model", chain, "--stage", "polarity", "--partitions", "2"), "not partitioned"),
        (("--model", chain, "--stage", "nope"), "has no stage 'nope'"),
        (("--model", chain), "is a pipeline: give --stage <embed|polarity>"),
        (("--model", f"{MODULE}:Embed", "--stage", "embed"), "needs a Pipeline"),
    ]:
        done = start(*args)
        assert done.returncode == 2, done.stderr
        assert said in done.stderr


def acl_setuser(line: str) -> list[str]:
    """``ACL SETUSER`` arguments of one ACL file line (a selector in parentheses is one)."""
    tokens = re.findall(r"\([^)]*\)|\S+", line)
    assert tokens[0] == "user"
    return tokens[1:]


@pytest.mark.slow
def test_a_pipeline_runs_with_the_tenants_acl_users_and_nothing_is_refused(
    redis_server: RedisServer, prefix: str
) -> None:
    client = redis_server.client()
    client.execute_command(*functions.LOAD_COMMAND)  # the operator's job
    passwords = {role: uuid.uuid4().hex for role in ("GATEWAY", "WORKER")}
    env = {f"PW_{role}": password for role, password in passwords.items()}
    lines, _ = acl.render([prefix], password_env="PW_{ROLE}", environ=env)
    for line in lines:
        client.execute_command("ACL", "SETUSER", *acl_setuser(line))
    client.acl_log_reset()
    host = redis_server.url.split("//", 1)[1]

    def url(role: str) -> str:
        return f"redis://{prefix}-{role.lower()}:{passwords[role]}@{host}"

    items = inputs(3)
    with (
        stages(url("WORKER"), prefix, "fan", ["embed", "polarity", "topic"]),
        Streamer("fan", redis_url=url("GATEWAY"), prefix=prefix) as streamer,
    ):
        assert len(streamer.predict(items, timeout=20)) == 3

    async def withdraw() -> None:  # what a caller that gives up sends: request ids included
        transport = RedisTransport(url("GATEWAY"))
        await transport.cancel(ModelKeys("fan", prefix), [("0-1", 1)], ["r-1"])
        await transport.close()

    asyncio.run(withdraw())
    assert client.zrange(ModelKeys("fan", prefix).withdrawn, 0, -1) == [b"r-1"]
    denied = [entry for entry in client.acl_log() if entry["username"].startswith(prefix)]
    assert denied == []
    # the users stay confined: a stage worker may not write outside its tenant's keys
    worker = redis.Redis.from_url(url("WORKER"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.xadd("mb:{other:fan.polarity}:requests", {"v": "1"})


def test_foreign_entries_on_a_later_stage_end_answered_or_dead_lettered(
    redis_server: RedisServer, served: str
) -> None:
    """What a foreign client may XADD to a later stage's streams: a reply key outside the
    pipeline's inboxes, bogus carried deadlines, a deadline past what Redis can expire."""
    client = redis_server.client()
    chain, later = ModelKeys("chain", served), ModelKeys("chain.polarity", served)
    embedding = msgpack.packb([0.5] * 4)
    inbox = chain.inbox(f"foreign-{uuid.uuid4().hex[:8]}")
    stage_own = f"mb:{{{served}:chain.polarity}}:inbox:x"  # the stage's name, not the pipeline's
    for reply in (ModelKeys("fan", served).inbox("x"), stage_own, chain.stream):
        fields = request_fields("outside", reply, 5000, embedding)
        client.xadd(later.at(HIGH).stream, fields)  # type: ignore[arg-type]
    wait_until(lambda: client.xlen(later.at(HIGH).dead_letters) == 3, 20, "3 dead letters")
    assert client.type(chain.stream) == b"stream" and client.xlen(chain.stream) == 0
    # A carried deadline that is not ASCII digits is ignored; "0" is already past.
    bogus = ["abc", "-5", "", "1e3", "\u0663", " 1", "9" * 40, "0"]
    for n, deadline in enumerate(bogus):
        fields = {**request_fields(f"d{n}", inbox, 5000, embedding), "deadline": deadline}
        client.xadd(later.stream, fields)  # type: ignore[arg-type]
    replies = [decode_reply(client.blpop([inbox], 20)[1]) for _ in bogus]  # type: ignore[index]
    assert sorted(r.request_id for r in replies if r.ok) == [f"d{n}" for n in range(7)]
    [late] = [r for r in replies if not r.ok]
    assert (late.request_id, late.error_type) == ("d7", DeadlineExceeded.__name__)
    # A fan-out leaf's part whose deadline is past what PEXPIREAT takes still gets a TTL.
    fan, leaf = ModelKeys("fan", served), ModelKeys("fan.polarity", served)
    for n, timeout in enumerate(("9223372036854775807", "9" * 30)):
        fields = {**request_fields(f"t{n}", fan.inbox("f"), 5000, embedding), "timeout": timeout}
        client.xadd(leaf.stream, fields)  # type: ignore[arg-type]
        join = fan.join("f", f"t{n}")
        wait_until(lambda join=join: client.exists(join) == 1, 20, "the leaf's part")
        assert client.pttl(join) > 0  # type: ignore[operator]
        client.delete(join)


def test_a_stages_dead_letter_is_replayed_with_a_fresh_deadline(
    redis_server: RedisServer, prefix: str
) -> None:
    client = redis_server.client()
    later = ModelKeys("chain.polarity", prefix)
    fields = request_fields("r-1", ModelKeys("chain", prefix).inbox("c"), 5000, b"\xc0")
    client.xadd(later.dead_letters, {**fields, "deadline": "1", "dead_reason": "x"})
    later_keys = admin.model_keys(client, later.model, prefix)
    assert admin.replay_dead_letters(client, later_keys).replayed == 1
    [(_, replayed)] = client.xrange(later.stream)
    assert b"deadline" not in replayed and b"dead_reason" not in replayed
    assert replayed[b"timeout"] == b"5000"


@pytest.mark.slow
def test_the_pipeline_hops_bench_reports_both_arms() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.pipeline_hops", "--requests", "20"], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split(" p50 ")[0].strip() for line in lines] == [
        "one model (embed)",
        "chain embed->polarity",
    ]
    assert all("(20 requests)" in line for line in lines)
