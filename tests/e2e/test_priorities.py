"""Request priorities: carried from every caller to the high level's stream, batched first by
real workers, the normal level never starved beyond STARVE_AFTER batches, and entries of both
levels taken over from a killed worker (real redis-server, real `worker start` processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from starlette.testclient import TestClient

from broker import Streamer, admin, codec, functions, partitions
from broker.devserver import RedisServer
from broker.functions import ENQUEUE
from broker.keys import HIGH, MAX_PARTITIONS, NORMAL, ModelKeys
from broker.priorities import STARVE_AFTER, LevelTurns, parse_priority
from broker.protocol import decode_reply
from tests.conftest import wait_until, worker_process
from tests.models import DELAY_ENV
from web_gateway.app import create_app
from web_gateway.settings import GatewaySettings

TOY = "tests.models:Toy"
DOUBLER = "tests.gateway_models:Doubler"


def added(client: redis.Redis, key: str) -> int:
    """How many entries a stream was ever given (XINFO STREAM), 0 if it does not exist."""
    try:
        return int(client.xinfo_stream(key)["entries-added"])
    except redis.ResponseError:
        return 0


def queue_early(url: str, prefix: str, calls: list[tuple[Any, str]]) -> tuple[Streamer, list[Any]]:
    """Queue one-item calls (item, priority) in order, before any worker runs."""
    streamer = Streamer("toy", redis_url=url, prefix=prefix, wait_for_workers=True, timeout=60)
    futures = [streamer.submit([item], priority=priority) for item, priority in calls]
    keys = ModelKeys("toy", prefix, partitions=2)
    client = redis.Redis.from_url(url)
    queued = lambda: sum(  # noqa: E731  (items: entries and what multi-item entries pack)
        client.xlen(part.stream) + int(client.get(part.packed_items) or 0) for part in keys.lanes()
    )
    wait_until(lambda: queued() == len(calls), 30, "the calls to be queued")
    return streamer, futures


def results(futures: list[Future[list[Any]]]) -> list[dict[str, Any]]:
    return [future.result(timeout=60)[0] for future in futures]


def test_priority_names_levels_and_their_keys() -> None:
    assert parse_priority(None) == parse_priority("normal") == parse_priority(0) == NORMAL
    assert parse_priority("HIGH") == parse_priority("1") == parse_priority(1) == HIGH
    assert parse_priority(" High\t") == HIGH  # surrounding whitespace is ignored
    for bad in ("urgent", 2, -1, True, 1.0, "", "01", "+1", "\u0661", [1], {"priority": 1}):
        with pytest.raises(ValueError, match="use 'high' or 'normal'"):
            parse_priority(bad)
    # a huge value is shown shortened in the error, never echoed whole
    for huge in ("h" * 1_000_000, [1] * 1_000_000, 10**5000, [10**5000]):
        with pytest.raises(ValueError, match="use 'high' or 'normal'") as refused:
            parse_priority(huge)
        assert len(str(refused.value)) < 150
    keys = ModelKeys("toy", "demo", partitions=2)
    high = keys.at(HIGH)
    # the high level has its own stream, dead letters, cancelled set and byte counter, in the
    # slot of its partition; it shares the partition's bound, consumers and heartbeats
    assert high.stream == "mb:{demo:toy}:requests:high"
    assert high.dead_letters == "mb:{demo:toy}:dead:high"
    assert high.cancelled == "mb:{demo:toy}:cancelled:high"
    assert high.queued_bytes == "mb:{demo:toy}:queued-bytes:high"
    assert (high.queue_bound, high.consumers) == (keys.queue_bound, keys.consumers)
    assert keys.of(1).at(HIGH).stream == "mb:{demo:toy:p1}:requests:high"
    assert [k.lane for k in keys.lanes()] == [0, 1, MAX_PARTITIONS, MAX_PARTITIONS + 1]
    for lane in (0, 1, MAX_PARTITIONS, MAX_PARTITIONS + 1):
        tagged = partitions.tag("17-3", lane)
        assert partitions.untag(tagged) == ("17-3", lane)
        assert partitions.is_high(tagged) == (lane >= MAX_PARTITIONS)
    assert partitions.tag("17-3", MAX_PARTITIONS + 1) == "17-3@1h"


def test_the_turns_give_the_normal_level_a_batch_after_starve_after_high_ones() -> None:
    turns = LevelTurns()
    orders = []
    for _ in range(2 * (STARVE_AFTER + 1)):
        order = turns.order()
        orders.append(order[0])
        took_normal = order[0] == NORMAL
        turns.took(1 if took_normal else 0, normal_waiting=True)
    expected = ([HIGH] * STARVE_AFTER + [NORMAL]) * 2
    assert orders == expected
    turns.took(0, normal_waiting=False)  # nothing waits: no streak
    assert turns.streak == 0 and turns.order() == (HIGH, NORMAL)


def test_a_bad_priority_is_refused_by_the_client_and_over_http(
    redis_server: RedisServer, prefix: str
) -> None:
    with pytest.raises(ValueError, match="invalid priority 'urgent'"):
        Streamer("toy", redis_url=redis_server.url, prefix=prefix, priority="urgent")
    streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
    with pytest.raises(ValueError, match="invalid priority 'top'"):
        streamer.predict([1], priority="top")
    with pytest.raises(ValueError, match="invalid priority 3"):
        streamer.submit([1], priority=3)
    streamer.close()
    app = create_app(GatewaySettings(model=[DOUBLER], redis_url=redis_server.url, prefix=prefix))
    with TestClient(app, raise_server_exceptions=False) as http:
        body = {"inputs": [[1, 2, 3, 4]]}
        answer = http.post("/v1/models/doubler/predict", json=body, headers={"X-Priority": "9"})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"].startswith("X-Priority: invalid priority '9'")
        v2 = {
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}],
            "parameters": {"priority": "urgent"},
        }
        answer = http.post("/v2/models/doubler/infer", json=v2)
        assert answer.status_code == 400
        assert "the 'priority' parameter: invalid priority 'urgent'" in answer.json()["error"]
        # a huge header or parameter is refused without being echoed back whole
        answer = http.post(
            "/v1/models/doubler/predict", json=body, headers={"X-Priority": "h" * 60_000}
        )
        assert answer.status_code == 400 and len(answer.content) < 300
        v2["parameters"] = {"priority": ["high"] * 100_000}
        answer = http.post("/v2/models/doubler/infer", json=v2)
        assert answer.status_code == 400 and len(answer.content) < 300
    assert redis_server.client().exists(ModelKeys("doubler", prefix).stream) == 0  # none queued


def test_the_priority_travels_from_header_parameter_and_client_to_its_level(
    redis_server: RedisServer, prefix: str
) -> None:
    url = redis_server.url
    keys = ModelKeys("doubler", prefix)
    client = redis_server.client()
    # one entry per item, so that the entries each level was given count the items sent to it
    settings = GatewaySettings(model=[DOUBLER], redis_url=url, prefix=prefix, entry_items=1)
    app = create_app(settings)
    v2_input = {"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    with worker_process(url, DOUBLER, prefix), TestClient(app) as http:
        v1 = {"inputs": [[1, 2, 3, 4], [0, 0, 0, 1]]}
        for headers in ({"X-Priority": "high"}, {}, {"X-Priority": "normal"}):
            answer = http.post("/v1/models/doubler/predict", json=v1, headers=headers)
            assert answer.json() == {"outputs": [[2, 4, 6, 8], [0, 0, 0, 2]]}
        for parameters, headers in (
            ({"priority": "high"}, {}),
            ({"priority": 1}, {"X-Priority": "normal"}),  # the parameter wins
            ({}, {"X-Priority": "HIGH"}),
            ({"priority": 0}, {}),
        ):
            body = {"inputs": [v2_input], "parameters": parameters}
            answer = http.post("/v2/models/doubler/infer", json=body, headers=headers)
            assert answer.json()["outputs"][0]["data"] == [2, 4, 6, 8]
        with Streamer(
            "doubler", redis_url=url, prefix=prefix, priority="high", entry_items=1
        ) as streamer:
            assert streamer.predict([[1, 1, 1, 1]])[0].tolist() == [2, 2, 2, 2]
            assert streamer.predict([[1, 1, 1, 1]], priority="normal")[0].tolist() == [2] * 4
        with Streamer("doubler", redis_url=url, prefix=prefix, entry_items=1) as streamer:
            streamer.predict([[1, 1, 1, 1]], priority="high")
            streamer.predict([[1, 1, 1, 1]])
    # v1: 2 high, 4 normal; v2: 3 high, 1 normal; the client: 2 high, 2 normal
    assert added(client, keys.at(HIGH).stream) == 2 + 3 + 2
    assert added(client, keys.stream) == 4 + 1 + 2
    for level in (NORMAL, HIGH):  # every entry answered and deleted
        assert client.xlen(keys.at(level).stream) == 0


def test_with_a_backlog_high_items_are_answered_before_normal_ones_queued_earlier(
    redis_server: RedisServer, prefix: str
) -> None:
    calls = [(f"n{i}", "normal") for i in range(6)] + [(f"h{i}", "high") for i in range(6)]
    streamer, futures = queue_early(redis_server.url, prefix, calls)
    with worker_process(redis_server.url, TOY, prefix, "--batch-size", "2"):
        answers = results(futures)
    streamer.close()
    batch_of = {answer["item"]: answer["batch_no"] for answer in answers}
    high = [batch_of[f"h{i}"] for i in range(6)]
    normal = [batch_of[f"n{i}"] for i in range(6)]
    # three batches of high items (fewer than STARVE_AFTER), then the normal ones, in order
    assert max(high) < min(normal)
    assert normal == sorted(normal) and high == sorted(high)


def test_the_normal_level_waits_at_most_starve_after_batches_while_high_ones_keep_coming(
    redis_server: RedisServer, prefix: str
) -> None:
    calls = [(f"n{i}", "normal") for i in range(5)] + [(f"h{i}", "high") for i in range(40)]
    streamer, futures = queue_early(redis_server.url, prefix, calls)
    with worker_process(redis_server.url, TOY, prefix, "--batch-size", "2"):
        answers = results(futures)
    streamer.close()
    batches: dict[int, set[str]] = {}
    for answer in answers:
        batches.setdefault(answer["batch_no"], set()).add(answer["item"][0])
    last_normal = max(no for no, levels in batches.items() if "n" in levels)
    streak = longest = 0
    for no in range(last_normal + 1):  # normal items wait in every one of these batches
        streak = 0 if "n" in batches[no] else streak + 1
        longest = max(longest, streak)
    assert longest == STARVE_AFTER  # high first, but never more than K batches in a row
    assert batches[0] == {"h"}
    # high items kept coming: most of them were still queued when the last normal one went
    assert sum(1 for no, levels in batches.items() if no > last_normal and levels == {"h"}) > 5


@pytest.mark.slow  # kill -9 and the heartbeat lapse: ~12 s
def test_a_killed_worker_s_entries_of_both_levels_are_taken_over(
    redis_server: RedisServer, prefix: str
) -> None:
    url = redis_server.url
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    calls = [(f"h{i}", "high") for i in range(4)] + [(f"n{i}", "normal") for i in range(4)]
    streamer, futures = queue_early(url, prefix, calls)
    args = ("--batch-size", "2", "--heartbeat-ttl", "2")
    # each batch takes a while, so that the first read's entries of both levels are pending
    with worker_process(url, TOY, prefix, *args, env={DELAY_ENV: "1.0"}):
        [consumer] = [m.decode() for m in client.zrange(keys.consumers, 0, -1)]

        def held(level: int) -> int:
            try:
                summary: Any = client.xpending(keys.at(level).stream, keys.group)
            except redis.ResponseError:  # the worker has not made its groups yet
                return 0
            counts = {c["name"].decode(): c["pending"] for c in summary["consumers"]}
            return int(counts.get(consumer, 0))

        wait_until(lambda: held(HIGH) > 0 and held(NORMAL) > 0, 30, "entries of both levels")
        victim = int(consumer.rsplit("-", 1)[1])
        os.kill(victim, signal.SIGKILL)  # the worker child; its supervisor starts another
        answers = results(futures)
    streamer.close()
    assert sorted(answer["item"] for answer in answers) == sorted(item for item, _ in calls)
    assert any(answer["pid"] != victim for answer in answers if answer["item"][0] == "h")
    assert any(answer["pid"] != victim for answer in answers if answer["item"][0] == "n")
    for level in (NORMAL, HIGH):  # nothing queued, pending or dead-lettered on either level
        part = keys.at(level)
        assert client.xlen(part.stream) == 0 and client.xlen(part.dead_letters) == 0
        assert int(client.xpending(part.stream, part.group)["pending"]) == 0


def test_a_foreign_client_queues_at_either_level_with_plain_xadd_and_the_function(
    redis_server: RedisServer, prefix: str
) -> None:
    # as docs/protocol.md describes it, without microbatch's client: the high level's stream
    # is the normal one's name with ":high" appended
    keys = ModelKeys("toy", prefix)
    client = redis_server.client()
    functions.load(client)  # what `broker functions load` does
    with worker_process(redis_server.url, TOY, prefix):
        for level in (HIGH, NORMAL):
            stream = keys.at(level).stream
            inbox = keys.inbox(f"foreign-{level}")
            data = codec.encode(f"plain-{level}")
            fields = {"v": "1", "id": "a", "reply": inbox, "timeout": "30000", "data": data}
            client.xadd(stream, fields)  # type: ignore[arg-type]
            part = keys.at(level)
            fcall_keys = (part.stream, part.queued_bytes, part.queue_bound, part.consumers)
            data = codec.encode(f"fcall-{level}")
            # one call of one item, as a caller written for version 1 of the library sends it
            call = (1, 0, 0, 1, inbox, 30000, "", "b", data)
            outcome: Any = client.fcall(ENQUEUE, 4, *fcall_keys, *call)
            assert outcome[0][0] == 0  # queued
            replies = {}
            for _ in range(2):
                _, raw = client.blpop([inbox], timeout=30)
                reply = decode_reply(raw)
                replies[reply.request_id] = reply.result["item"]
            assert replies == {"a": f"plain-{level}", "b": f"fcall-{level}"}
            assert added(client, stream) == 2


def test_the_priorities_overlay_gives_keda_the_base_triggers_for_the_high_stream(
    tmp_path: Path,
) -> None:
    from gpu_worker import load_model_class
    from tests.e2e.test_deploy import BIN, DEPLOY, config_map_literals, json_patch, k8s_find

    overlay = yaml.safe_load((DEPLOY / "k8s/overlays/priorities/kustomization.yaml").read_text())
    assert overlay["resources"] == ["../../base"]
    scaled = k8s_find("ScaledObject")
    base = scaled["spec"]["triggers"]
    (patch,) = overlay["patches"]
    patched = json_patch(scaled, yaml.safe_load(patch["patch"]))
    literals = config_map_literals()
    name = load_model_class(literals["MICROBATCH_WORKER_MODEL"]).name
    keys = ModelKeys(name, literals["MICROBATCH_WORKER_PREFIX"])
    triggers = patched["spec"]["triggers"]
    assert triggers[: len(base)] == base
    high = triggers[len(base) :]
    assert len(high) == len(base) and len({t["name"] for t in triggers}) == len(triggers)
    for before, after in zip(base, high, strict=True):
        assert after["metadata"]["stream"] == keys.at(HIGH).stream
        assert {**after["metadata"], "stream": keys.stream} == before["metadata"]
        assert after["type"] == before["type"]
    written = tmp_path / "scaledobject.yaml"
    written.write_text(yaml.safe_dump(patched))
    schema = DEPLOY / "k8s" / "schemas" / "scaledobject.json"
    checker = [str(BIN / "check-jsonschema"), "--schemafile", str(schema), str(written)]
    done = subprocess.run(checker, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_priorities_work_over_a_partitioned_queue(redis_server: RedisServer, prefix: str) -> None:
    url = redis_server.url
    keys = ModelKeys("toy", prefix, partitions=2)
    client = redis_server.client()
    client.set(keys.partitions_key, 2)  # as the workers will store it: callers spread now
    calls = [(f"n{i}", "normal") for i in range(8)] + [(f"h{i}", "high") for i in range(8)]
    streamer, futures = queue_early(url, prefix, calls)
    for part in keys.each():  # each partition got calls of both levels, on its own streams
        assert client.xlen(part.stream) > 0 and client.xlen(part.at(HIGH).stream) > 0
    with worker_process(url, TOY, prefix, "--batch-size", "2", "--partitions", "2"):
        answers = results(futures)
    streamer.close()
    assert sorted(a["item"] for a in answers) == sorted(item for item, _ in calls)
    high = [a["batch_no"] for a in answers if a["item"][0] == "h"]
    normal = [a["batch_no"] for a in answers if a["item"][0] == "n"]
    assert 0 in high and 0 not in normal  # the first batch is of high items
    assert sum(high) / len(high) < sum(normal) / len(normal)
    for part in keys.lanes():
        assert client.xlen(part.stream) == 0


def test_status_and_dead_letters_cover_the_high_level(
    redis_server: RedisServer, prefix: str
) -> None:
    url = redis_server.url
    keys = ModelKeys("toy", prefix)
    high = keys.at(HIGH)
    client = redis_server.client()
    calls = [(f"n{i}", "normal") for i in range(3)] + [(f"h{i}", "high") for i in range(2)]
    streamer, futures = queue_early(url, prefix, calls)
    [model] = admin.status(client, prefix)
    high_items = sum(part.queued_items for part in model.high)
    assert (model.queued_items, high_items) == (5, 2)
    assert model.high_stream_length <= 2 and model.stream_length <= 5  # entries
    assert [p.priority for p in model.high] == ["high"]
    shown = subprocess.run(
        [sys.executable, "-m", "broker.cli", "status", "--redis", url, "--prefix", prefix],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0 and "high" in shown.stdout
    # an entry whose reply key is outside the model's inboxes is dead-lettered, on its level
    data = codec.encode("stray")
    fields = {"v": "1", "id": "stray", "reply": "elsewhere", "timeout": "30000", "data": data}
    client.xadd(high.stream, fields)  # type: ignore[arg-type]
    with worker_process(url, TOY, prefix):
        results(futures)
        wait_until(lambda: client.xlen(high.dead_letters) == 1, 30, "the dead letter")
    streamer.close()
    [letter] = admin.dead_letters(client, keys)
    assert letter.priority == "high" and letter.dead_id.endswith("@0h")
    assert letter.request_id == "stray"
    assert admin.replay_dead_letters(client, keys, [letter.dead_id]).replayed == 1
    assert client.xlen(high.dead_letters) == 0 and client.xlen(high.stream) == 1
    assert admin.purge_dead_letters(client, keys) == 0
