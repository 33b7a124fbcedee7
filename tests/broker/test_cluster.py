"""A Redis Cluster (3 primaries on loopback) given as a redis+cluster:// URL: lanes routed by
hash slot follow MOVED, ASK and TRYAGAIN; the broker commands, the Python client and workers
(a batch loop, and `worker start`) work against it; `broker status` covers every primary."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from typer.testing import CliRunner

from broker import BrokerUnavailable, MicrobatchError, Streamer, connections, functions
from broker.cli import app
from broker.cluster_lane import ClusterLanes, key_slot
from broker.keys import HIGH, NORMAL, ModelKeys
from broker.liveness import server_times_ms
from broker.protocol import CallRequests
from broker.redis_transport import RedisTransport
from broker.transport import UNBOUNDED, PartitionsChanged
from gpu_worker.batching import BatchLoop, BatchSettings
from gpu_worker.heartbeat import Heartbeats
from tests.broker.test_redis_transport import library_code
from tests.cluster_local import LocalCluster
from tests.conftest import ROOT, worker_process
from tests.sentinel_local import wait_for


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(primaries=3) as setup:
        yield setup


def models_on_every_primary(cluster: LocalCluster, prefix: str) -> list[ModelKeys]:
    """One model name per primary, each served by a different primary."""
    found: dict[int, ModelKeys] = {}
    for number in range(1000):
        keys = ModelKeys(f"m{number}", prefix)
        found.setdefault(cluster.owner(keys.stream), keys)
        if len(found) == len(cluster.primaries()):
            return list(found.values())
    raise AssertionError("no model names spread over every primary")


def test_every_key_of_a_model_shares_its_hash_slot() -> None:
    """What keeps each multi-key command and function call of a model on one node."""
    keys = ModelKeys("m", "p.x")
    names = [keys.stream, keys.dead_letters, keys.consumers, keys.cancelled, keys.queued_bytes,
             keys.queue_bound, keys.inbox("c-1"), keys.heartbeat("w-1")]  # fmt: skip
    assert len({key_slot(name) for name in names}) == 1
    assert key_slot(ModelKeys("n", "p.x").stream) != key_slot(keys.stream)


def migrate_slot(cluster: LocalCluster, key: str, to_port: int, keys_first: int | None) -> None:
    """Move ``key``'s slot to the primary at ``to_port`` by hand (what `redis-cli --cluster
    reshard` does): IMPORTING / MIGRATING, MIGRATE of the keys (only the first ``keys_first``
    of them if given: the slot is left half-migrated), then SETSLOT NODE on every primary."""
    source = cluster.owner(key)
    slot = key_slot(key)
    src, dst = cluster.client(source), cluster.client(to_port)
    src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    names = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    moving = names if keys_first is None else names[:keys_first]
    if moving:
        src.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *moving)
    if keys_first is None:
        for port in cluster.primaries():
            with cluster.client(port) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    src.close()
    dst.close()


def finish_migration(cluster: LocalCluster, key: str, to_port: int, from_port: int) -> None:
    slot = key_slot(key)
    with cluster.client(from_port) as src, cluster.client(to_port) as dst:
        names = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if names:
            src.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *names)
        dst_id = dst.cluster("myid")
        for port in cluster.primaries():
            with cluster.client(port) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_lanes_follow_moved_ask_and_tryagain(cluster: LocalCluster) -> None:
    tag = f"{{lanes{uuid.uuid4().hex[:6]}}}"
    a, b = f"{tag}:a", f"{tag}:b"

    async def main() -> None:
        lanes = connections.lanes(cluster.url())
        assert isinstance(lanes, ClusterLanes)
        lane = lanes.at(a)
        assert await lane.execute("SET", a, "1") == b"OK"
        # one pipeline of several commands: one transaction on the slot's node
        assert await lane.pipeline([("SET", b, "2"), ("MGET", a, b)]) == [b"OK", [b"1", b"2"]]
        source = cluster.owner(a)
        target = next(port for port in cluster.primaries() if port != source)
        # half-migrated: `a` moved, `b` not; a single key goes by ASK, both keys get
        # TRYAGAIN until the migration is done
        await asyncio.to_thread(migrate_slot, cluster, a, target, 1)
        moved = (await asyncio.to_thread(cluster.client(target).execute_command, "CLUSTER",
                                         "COUNTKEYSINSLOT", key_slot(a)))  # fmt: skip
        assert moved == 1
        values = {await lane.execute("GET", a), await lane.execute("GET", b)}
        assert values == {b"1", b"2"}
        both = asyncio.ensure_future(lane.execute("MGET", a, b))
        await asyncio.sleep(0.2)
        assert not both.done()  # TRYAGAIN, sent again meanwhile
        epoch = lanes.map.epoch
        await asyncio.to_thread(finish_migration, cluster, a, target, source)
        assert await asyncio.wait_for(both, 10) == [b"1", b"2"]  # then MOVED, followed
        assert await lane.execute("INCR", f"{tag}:n") == 1
        assert lanes.map.known(key_slot(a)).port == target
        assert lanes.map.epoch != epoch
        lanes.close()

    asyncio.run(main())


def test_a_migration_s_end_reaching_the_nodes_one_at_a_time_is_waited_out(
    cluster: LocalCluster,
) -> None:
    """SETSLOT NODE told to the source before the target: meanwhile each sends the command to
    the other (MOVED both ways). The lanes and redis-py's clients (which give up after 16
    redirections, a few ms) wait, with pauses, until the target takes the slot."""
    key = f"{{settle{uuid.uuid4().hex[:6]}}}:a"

    async def main() -> None:
        lanes = connections.lanes(cluster.url())
        assert isinstance(lanes, ClusterLanes)
        lane = lanes.at(key)
        assert await lane.execute("SET", key, "1") == b"OK"
        async_client = connections.async_client(cluster.url())
        sync_client = connections.sync_client(cluster.url())
        assert await async_client.get(key) == sync_client.get(key) == b"1"  # slot maps read
        source = cluster.owner(key)
        target = next(port for port in cluster.primaries() if port != source)
        await asyncio.to_thread(migrate_slot, cluster, key, target, 1000)  # keys moved, unended
        with cluster.client(source) as src, cluster.client(target) as dst:
            dst_id = dst.cluster("myid")
            src.execute_command("CLUSTER", "SETSLOT", key_slot(key), "NODE", dst_id)
            with pytest.raises(redis.exceptions.MovedError):  # not its slot yet, says the target
                dst.execute_command("GET", key)

        async def async_pipeline_get() -> object:
            async with async_client.pipeline(transaction=False) as pipe:
                pipe.get(key)
                return (await pipe.execute())[0]

        def sync_pipeline_get() -> object:
            with sync_client.pipeline(transaction=False) as pipe:
                pipe.get(key)
                return pipe.execute()[0]

        gets = [
            asyncio.ensure_future(lane.execute("GET", key)),
            asyncio.ensure_future(async_client.get(key)),
            asyncio.ensure_future(asyncio.to_thread(sync_client.get, key)),
            asyncio.ensure_future(async_pipeline_get()),
            asyncio.ensure_future(asyncio.to_thread(sync_pipeline_get)),
        ]
        await asyncio.sleep(0.3)
        assert not any(get.done() for get in gets)  # sent back and forth, then after pauses
        await asyncio.to_thread(finish_migration, cluster, key, target, source)
        assert await asyncio.wait_for(asyncio.gather(*gets), 10) == [b"1"] * 5
        assert lanes.map.known(key_slot(key)).port == target
        lanes.close()
        await async_client.aclose()
        sync_client.close()

    asyncio.run(main())


def test_a_cluster_client_closed_under_its_commands_fails_them_as_connection_errors(
    cluster: LocalCluster,
) -> None:
    """redis-py's asyncio cluster client closes all its connections to refresh its slot map
    (after a CLUSTERDOWN or a failed node), also those other tasks are using; their commands
    then failed deep inside redis-py (AttributeError: a writer gone). Now they fail as a
    ConnectionError, which the code here takes for Redis unavailable, and pipelines alike."""
    key = f"{{closed{uuid.uuid4().hex[:6]}}}:a"

    async def main() -> tuple[int, int]:
        client = connections.async_client(cluster.url())
        await client.set(key, "1")
        answered = failed = 0
        closing = True

        async def use(pipelined: bool) -> None:
            nonlocal answered, failed
            while closing:
                try:
                    if pipelined:
                        async with client.pipeline(transaction=False) as pipe:
                            pipe.get(key)
                            await pipe.execute()
                    else:
                        await client.get(key)
                    answered += 1
                except redis.ConnectionError:
                    failed += 1

        users = [asyncio.ensure_future(use(pipelined=n % 2 == 0)) for n in range(8)]
        for _ in range(100):
            await asyncio.sleep(0.002)
            await client.aclose()  # what redis-py's own refresh does
        closing = False
        await asyncio.gather(*users)  # anything but a ConnectionError raises here
        await client.aclose()
        return answered, failed

    answered, failed = asyncio.run(main())
    assert answered > 0 and failed > 0  # the closing reached commands in flight


def test_a_streamer_and_a_worker_loop_over_a_cluster(cluster: LocalCluster, prefix: str) -> None:
    """Models on every primary, the library loaded on each primary by the first call there;
    `broker status` lists them all; dead letters and functions load work."""
    url = cluster.url()
    models = models_on_every_primary(cluster, prefix)
    for port in cluster.primaries():
        with cluster.client(port) as client:
            client.function_flush()

    async def serve_and_call() -> list[object]:
        transport = RedisTransport(url)
        loops = [
            BatchLoop(lambda items: items, transport, keys, "w-1", BatchSettings(block_ms=50))
            for keys in models
        ]
        serving = [asyncio.ensure_future(loop.run()) for loop in loops]
        try:
            outputs: list[object] = []
            for keys in models:
                streamer = Streamer(keys.model, redis_url=url, prefix=prefix,
                                    wait_for_workers=True)  # fmt: skip
                outputs += await streamer.apredict([keys.model, "x"], timeout=10)
                await streamer.aclose()
            return outputs
        finally:
            for loop in loops:
                loop.stop()
            await asyncio.gather(*serving)
            await transport.close()

    outputs = asyncio.run(serve_and_call())
    assert outputs == [item for keys in models for item in (keys.model, "x")]
    for port in cluster.primaries():  # loaded by the workers, each on its stream's node
        with cluster.client(port) as client:
            assert client.function_list(library=functions.LIBRARY)
    cli = CliRunner()
    status = cli.invoke(app, ["status", "--redis", url, "--prefix", prefix, "--json"])
    assert status.exit_code == 0, status.output
    rows = json.loads(status.output)
    assert sorted(row["model"] for row in rows) == sorted(keys.model for keys in models)
    assert all(row["stream_length"] == 0 and row["pending"] == 0 for row in rows)
    dead = models[1]
    with cluster.client(cluster.owner(dead.stream)) as client:
        client.xadd(dead.dead_letters, {"id": "r1", "dead_reason": "test", "data": b"123"})
    letters = cli.invoke(app, ["dead-letters", "list", "--name", dead.model, "--prefix", prefix,
                               "--redis", url, "--json"])  # fmt: skip
    assert letters.exit_code == 0 and json.loads(letters.output)[0]["reason"] == "test"
    replayed = cli.invoke(app, ["dead-letters", "replay", "--name", dead.model, "--prefix",
                                prefix, "--redis", url])  # fmt: skip
    assert replayed.exit_code == 0 and "replayed 1" in replayed.output
    with cluster.client(cluster.owner(dead.stream)) as client:
        assert client.xlen(dead.stream) == 1 and client.xlen(dead.dead_letters) == 0
    for port in cluster.primaries():
        with cluster.client(port) as client:
            client.function_flush()
    loaded = cli.invoke(app, ["functions", "load", "--redis", url])
    assert loaded.exit_code == 0 and "loaded the microbatch library" in loaded.output
    for port in cluster.primaries():
        with cluster.client(port) as client:
            assert client.function_list(library=functions.LIBRARY)
    bad = cli.invoke(
        app, ["status", "--redis", f"redis+cluster://127.0.0.1:{cluster.nodes[0].port}/3"]
    )
    assert bad.exit_code == 2 and "database 0 only" in bad.output


def test_worker_start_and_predict_over_a_cluster(cluster: LocalCluster, prefix: str) -> None:
    """A real `worker start` process and a blocking Streamer, given any node's URL; the
    worker's heartbeats count on its stream's node."""
    url = cluster.url(nodes=1)
    other = f"redis+cluster://127.0.0.1:{cluster.nodes[2].port}"
    with worker_process(url, "tests.models:Toy", prefix, "--max-latency", "0"):
        streamer = Streamer("toy", redis_url=other, prefix=prefix)
        try:
            outputs = streamer.predict([1, 2, 3], timeout=20)
        finally:
            streamer.close()
    assert [output["item"] for output in outputs] == [1, 2, 3]
    with connections.sync_client(url) as client:
        assert isinstance(client, redis.cluster.RedisCluster)


def test_the_acl_users_of_broker_acl_cluster_serve_a_cluster(prefix: str) -> None:
    """The users `broker acl --server --prefix P --cluster` prints, set on every node: the
    operator loads the functions on every primary, a worker and a caller serve as their own
    users, the admin reads `broker status`, and no node refused any of them anything."""
    import re

    from broker import acl

    roles = ("GATEWAY", "WORKER", "ADMIN", "KEDA", "OPERATOR")
    passwords = {f"PW_{role}": uuid.uuid4().hex for role in roles}
    lines, _ = acl.render([prefix], server=True, password_env="PW_{ROLE}", cluster=True,
                          environ=passwords)  # fmt: skip

    def url(user: str, role: str) -> str:
        return cluster.url(f"{user}:{passwords['PW_' + role]}@")

    with LocalCluster(primaries=3) as cluster:
        for node in cluster.nodes:
            with cluster.client(node.port) as client:
                for line in lines:
                    _, name, rules = line.split(" ", 2)
                    if name != "default":  # the tests' own access stays
                        client.execute_command(
                            "ACL", "SETUSER", name, *re.findall(r"\([^)]*\)|\S+", rules)
                        )
                client.function_flush()
        cli = CliRunner()
        loaded = cli.invoke(app, ["functions", "load", "--redis", url("operator", "OPERATOR")])
        assert loaded.exit_code == 0, loaded.output
        keys = ModelKeys("echo", prefix)
        # and a partitioned model: replies to each partition's inboxes
        spread = ModelKeys("spread", prefix, partitions=3)
        with connections.sync_client(cluster.url()) as client:
            client.set(spread.partitions_key, 3)  # as its supervisor would store it

        async def serve_and_call() -> list[object]:
            transport = RedisTransport(url(f"{prefix}-worker", "WORKER"))
            settings = BatchSettings(block_ms=50)
            loops = [
                BatchLoop(lambda items: items, transport, served, "w-1", settings)
                for served in (keys, spread)
            ]
            serving = [asyncio.ensure_future(loop.run()) for loop in loops]
            try:
                outputs: list[object] = []
                for name in ("echo", "spread"):
                    streamer = Streamer(name, redis_url=url(f"{prefix}-gateway", "GATEWAY"),
                                        prefix=prefix, wait_for_workers=True)  # fmt: skip
                    outputs += await streamer.apredict(["a", "b"], timeout=10)
                    calls = [streamer.apredict([i], timeout=10) for i in range(6)]
                    outputs += [out for got in await asyncio.gather(*calls) for out in got]
                    await streamer.aclose()
                return outputs
            finally:
                for loop in loops:
                    loop.stop()
                await asyncio.gather(*serving)
                await transport.close()

        assert asyncio.run(serve_and_call()) == ["a", "b", *range(6)] * 2
        admin = url(f"{prefix}-admin", "ADMIN")
        status = cli.invoke(app, ["status", "--redis", admin, "--prefix", prefix, "--json"])
        assert status.exit_code == 0, status.output
        assert sorted(row["model"] for row in json.loads(status.output)) == ["echo", "spread"]
        for node in cluster.nodes:
            with cluster.client(node.port) as client:
                assert client.acl_log() == [], (node.port, client.acl_log())


def migrate_key_by_key(cluster: LocalCluster, key: str, to_port: int) -> int:
    """Move ``key``'s slot to ``to_port`` a key at a time, with pauses (clients meet it
    half-migrated); returns how many keys moved."""
    source = cluster.owner(key)
    slot = key_slot(key)
    moved = 0
    with cluster.client(source) as src, cluster.client(to_port) as dst:
        src_id, dst_id = src.cluster("myid"), dst.cluster("myid")
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        while names := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1):
            src.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *names)
            moved += 1
            time.sleep(0.05)
        for port in cluster.primaries():
            with cluster.client(port) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    return moved


def test_calls_and_a_worker_loop_go_on_while_the_model_s_slot_migrates(
    cluster: LocalCluster, prefix: str
) -> None:
    """Calls keep coming while every key of the model moves, one by one, to a primary that
    lacks the functions: each call is answered right, nothing is dead-lettered, and the
    library is loaded there by the first call that needs it."""
    url = cluster.url()
    keys = ModelKeys("mover", prefix)
    source = cluster.owner(keys.stream)
    target = next(port for port in cluster.primaries() if port != source)
    with cluster.client(target) as client:
        client.function_flush()

    epochs: list[int] = []

    async def run() -> tuple[list[object], int]:
        transport = RedisTransport(url)
        loop = BatchLoop(lambda items: items, transport, keys, "w-1", BatchSettings(block_ms=50))
        serving = asyncio.ensure_future(loop.run())
        streamer = Streamer("mover", redis_url=url, prefix=prefix, wait_for_workers=True)
        try:
            await streamer.apredict([-1], timeout=10)  # the keys exist before they move
            epochs.append(transport.clock_epoch)
            migration = asyncio.ensure_future(
                asyncio.to_thread(migrate_key_by_key, cluster, keys.stream, target)
            )
            outputs: list[object] = []
            number = 0
            while not migration.done() or number < 20:
                outputs += await streamer.apredict([number, number + 1], timeout=10)
                number += 2
            moved = await migration
            await streamer.apredict([number], timeout=10)
            epochs.append(transport.clock_epoch)
            return outputs, moved
        finally:
            await streamer.aclose()
            loop.stop()
            await serving
            await transport.close()

    outputs, moved = asyncio.run(run())
    assert moved >= 2  # the stream and its byte counter, at least
    assert epochs[0] != epochs[1]  # the worker's clock is read again, from the new node
    assert outputs == list(range(len(outputs)))
    assert cluster.owner(keys.stream) == target
    with cluster.client(target) as client:
        assert client.function_list(library=functions.LIBRARY)
        assert client.xlen(keys.dead_letters) == 0 and client.xlen(keys.stream) == 0


def test_a_redis_url_of_a_cluster_node_says_to_use_redis_cluster(
    cluster: LocalCluster, prefix: str
) -> None:
    """A redis:// URL means one server: a call whose slot another node serves fails with
    BrokerUnavailable saying what URL to give, never hangs or goes astray."""
    from broker.errors import BrokerUnavailable

    keys = next(
        ModelKeys(f"n{number}", prefix)
        for number in range(100)
        if cluster.owner(ModelKeys(f"n{number}", prefix).stream) != cluster.nodes[0].port
    )
    url = f"redis://127.0.0.1:{cluster.nodes[0].port}/0"
    streamer = Streamer(keys.model, redis_url=url, prefix=prefix)
    try:
        with pytest.raises(BrokerUnavailable, match="redis\\+cluster://"):
            streamer.predict([1], timeout=5)
    finally:
        streamer.close()

    async def read() -> None:
        transport = RedisTransport(url)
        try:
            with pytest.raises(BrokerUnavailable, match="MOVED"):
                await transport.read_batch(keys, "w", 1, 10)
        finally:
            await transport.close()

    asyncio.run(read())


def _worker_start(url: str, *options: str) -> subprocess.CompletedProcess[str]:
    """`worker start` of the Toy model at ``url``, with ``options``, run to its end."""
    command = [sys.executable, "-m", "gpu_worker.cli", "start", "--model", "tests.models:Toy"]
    return subprocess.run(
        [*command, "--redis", url, *options],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_the_commands_refuse_a_redis_url_of_a_cluster_node_at_start(
    cluster: LocalCluster, prefix: str
) -> None:
    """`broker` printed a MovedError traceback, and `worker start` served, died at its first
    MOVED and was restarted without end; the gateway started as if all was well."""
    from broker.devserver import free_port
    from broker.redis_transport import startup_warnings

    url = f"redis://127.0.0.1:{cluster.nodes[0].port}/0"
    hint = "runs with cluster-enabled yes: it is a node of a Redis Cluster; give a redis+cluster://"
    status = CliRunner().invoke(app, ["status", "--redis", url, "--prefix", prefix])
    assert status.exit_code == 2 and hint in status.output and "Traceback" not in status.output
    done = _worker_start(url, "--prefix", prefix)
    assert done.returncode == 2, done.stderr
    assert hint in done.stderr.strip().splitlines()[-1] and "restarting" not in done.stderr

    async def warnings(of_url: str) -> list[str]:
        client = connections.async_client(of_url)
        try:
            return await startup_warnings(client, of_url)
        finally:
            await client.aclose()

    assert any(hint in warning for warning in asyncio.run(warnings(url)))
    cluster_url = f"redis+cluster://127.0.0.1:{cluster.nodes[0].port}"
    assert asyncio.run(warnings(cluster_url)) == []
    (nobody,) = asyncio.run(warnings(f"redis://127.0.0.1:{free_port()}/0"))
    assert "does not answer" in nobody and "503 BrokerUnavailable until it does" in nobody


def test_a_worker_started_before_the_cluster_answers_waits_for_it() -> None:
    """As with one Redis: no node answering is `--redis-wait` seconds of waiting, then one
    error line (exit status 2), never a traceback; the password never shows."""
    from broker.devserver import free_port

    url = f"redis+cluster://worker:s3cret@127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    done = _worker_start(url, "--redis-wait", "2")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: Redis at redis+cluster://worker:***@127.0.0.1:"), last
    assert "did not answer within 2 s (--redis-wait)" in last
    assert "Traceback" not in done.stderr and "s3cret" not in done.stderr


def test_a_cluster_refusing_the_credentials_says_so_at_once(cluster: LocalCluster) -> None:
    """As with one Redis or Sentinel: wrong credentials are not an unreachable cluster, so
    `worker start` fails at once (not after --redis-wait seconds of waiting) and `broker`
    says the credentials were refused; the password never shows."""
    url = cluster.url(credentials="worker:s3cret@")
    with pytest.raises(redis.AuthenticationError):
        connections.sync_client(url).ping()
    shown = CliRunner().invoke(app, ["status", "--redis", url])
    assert shown.exit_code == 1 and "Redis refused the credentials" in shown.output, shown.output
    started = time.monotonic()
    done = _worker_start(url, "--redis-wait", "30")
    assert done.returncode == 2 and time.monotonic() - started < 20, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "refused the credentials" in last and "s3cret" not in done.stderr, last


def prefix_spreading_partitions(cluster: LocalCluster, prefix: str, partitions: int) -> str:
    """A prefix under which model toy's partitions are each served by another primary."""
    for number in range(1000):
        keys = ModelKeys("toy", f"{prefix}-{number}", partitions=partitions)
        if len({cluster.owner(part.stream) for part in keys.each()}) == partitions:
            return keys.prefix
    raise AssertionError("no prefix spreads the partitions over the primaries")


def test_a_partitioned_queue_spread_over_the_primaries(cluster: LocalCluster, prefix: str) -> None:
    """Three partitions on three primaries: a `worker start --partitions 3` reads each on its
    node, callers spread their calls over them and every call is answered; `broker status`
    and the dead letters show each partition, read from its own node."""
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    url = cluster.url()
    with worker_process(url, "tests.models:Toy", spread, "--partitions", "3"):
        # one entry per item, so that the entries added show how the calls were spread
        with Streamer("toy", redis_url=url, prefix=spread, entry_items=1) as streamer:
            futures = [streamer.submit([f"a{i}", f"b{i}"]) for i in range(30)]
            for i, future in enumerate(futures):
                assert [out["item"] for out in future.result(timeout=30)] == [f"a{i}", f"b{i}"]
        added = []
        for part in keys.each():
            with cluster.client(cluster.owner(part.stream)) as client:
                added.append(int(client.xinfo_stream(part.stream)["entries-added"]))
        assert sum(added) == 60 and all(count >= 10 for count in added)  # calls in turn
        cli = CliRunner()
        shown = cli.invoke(app, ["status", "--redis", url, "--prefix", spread, "--json"])
        assert shown.exit_code == 0, shown.output
        [row] = json.loads(shown.output)
        assert [p["stream"] for p in row["partitions"]] == [part.stream for part in keys.each()]
        assert row["stream_length"] == 0 and row["pending"] == 0 and row["live_consumers"] == 1
        assert all(p["queue_bound_items"] > 0 for p in row["partitions"])  # each node's copy
    last = keys.of(2)
    with cluster.client(cluster.owner(last.stream)) as client:
        client.xadd(last.dead_letters, {"id": "r2", "dead_reason": "test", "data": b"12"})
    letters = cli.invoke(app, ["dead-letters", "list", "--name", "toy", "--prefix", spread,
                               "--redis", url, "--json"])  # fmt: skip
    assert letters.exit_code == 0, letters.output
    [letter] = json.loads(letters.output)
    assert letter["partition"] == 2 and letter["dead_id"].endswith("@2")


def test_broker_status_names_the_node_of_each_partition(cluster: LocalCluster, prefix: str) -> None:
    """On a cluster, which primary holds each partition depends on its hash slot (two may share
    one): `broker status` says, in a node column and in the JSON, so an operator can see
    whether a partitioned model is spread over the primaries."""
    keys = ModelKeys("toy", prefix, partitions=3)
    for part in keys.each():
        with cluster.client(cluster.owner(part.stream)) as client:
            client.xgroup_create(part.stream, keys.group, id="0", mkstream=True)
    with cluster.client(cluster.owner(keys.partitions_key)) as client:
        client.set(keys.partitions_key, "3")
    url, cli = cluster.url(), CliRunner()
    shown = cli.invoke(app, ["status", "--redis", url, "--prefix", prefix, "--json"])
    assert shown.exit_code == 0, shown.output
    [row] = json.loads(shown.output)
    expected = [f"127.0.0.1:{cluster.owner(part.stream)}" for part in keys.each()]
    assert [p["node"] for p in row["partitions"]] == expected
    table = cli.invoke(app, ["status", "--redis", url, "--prefix", prefix])
    assert table.exit_code == 0, table.output
    assert "node" in table.output and all(node in table.output for node in expected)


def test_a_partitioned_model_s_clocks_are_read_on_each_partition_s_node(
    cluster: LocalCluster, prefix: str
) -> None:
    """Heartbeats score each partition's consumers by its own node's clock: one TIME per node."""
    keys = ModelKeys("toy", prefix_spreading_partitions(cluster, prefix, 3), partitions=3)

    def times_asked() -> dict[int, int]:
        asked = {}
        for port in cluster.primaries():
            with cluster.client(port) as client:
                stats: Any = client.info("commandstats")
                asked[port] = int(stats.get("cmdstat_time", {}).get("calls", 0))
        return asked

    with connections.sync_client(cluster.url()) as client:
        client.ping()  # the slot map read first
        before = times_asked()
        clocks = server_times_ms(client, [part.consumers for part in keys.each()] * 2)
    after = times_asked()
    assert len(clocks) == 6 and clocks[:3] == clocks[3:]
    assert {port: after[port] - before[port] for port in after} == dict.fromkeys(after, 1)


def test_both_priority_levels_of_a_partitioned_queue_on_a_cluster(
    cluster: LocalCluster, prefix: str
) -> None:
    """Each partition's high stream shares its slot (and node); a worker serves both levels of
    every partition, and every call of either level is answered."""
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    for part in keys.each():
        assert key_slot(part.at(HIGH).stream) == key_slot(part.stream)
    url = cluster.url()
    with worker_process(url, "tests.models:Toy", spread, "--partitions", "3"):
        with Streamer("toy", redis_url=url, prefix=spread, entry_items=1) as streamer:
            futures = [
                streamer.submit([f"a{i}"], priority="high" if i % 2 else "normal")
                for i in range(30)
            ]
            for i, future in enumerate(futures):
                assert future.result(timeout=30)[0]["item"] == f"a{i}"
        added = {NORMAL: 0, HIGH: 0}
        for part in keys.lanes():
            with cluster.client(cluster.owner(part.stream)) as client:
                added[part.level] += int(client.xinfo_stream(part.stream)["entries-added"])
                assert client.xlen(part.stream) == 0
        assert added == {NORMAL: 15, HIGH: 15}


class _Counting(RedisTransport):
    """A transport that counts the mb_reply calls it had to send alone (a round trip of
    their own before the acknowledgements), and notes the inboxes replies came from."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.alone = 0
        self.popped: list[str] = []

    async def _send_replies(self, call: Any) -> None:
        self.alone += 1
        await super()._send_replies(call)

    async def pop_replies(self, inbox: str, count: int, timeout_s: float) -> list[bytes]:
        got = await super().pop_replies(inbox, count, timeout_s)
        self.popped += [inbox] * len(got)
        return got


def test_a_partition_s_replies_go_to_its_own_node_with_its_acks(
    cluster: LocalCluster, prefix: str
) -> None:
    """Three partitions on three primaries: a call on partition k is answered in the
    caller's inbox of partition k's namespace, on k's node (RPUSHed and BLMPOPed there), and
    once each node's connection has answered an mb_reply, the worker writes the replies in
    the same transaction as the acks (no mb_reply alone). A reply to the model's inbox for
    an entry of partition k (a caller with one inbox) still comes, written first, alone."""
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    url = cluster.url()
    with cluster.client(cluster.owner(keys.partitions_key)) as client:
        client.set(keys.partitions_key, 3)  # as a supervisor would store it
    for port in cluster.primaries():
        with cluster.client(port) as client:
            client.config_resetstat()
    worker = _Counting(url)
    caller: list[_Counting] = []

    class Counted(Streamer):
        def _make_transport(self) -> RedisTransport:
            caller.append(_Counting(self.redis_url))
            return caller[-1]

    async def run() -> tuple[list[object], int, int]:
        loop = BatchLoop(lambda items: items, worker, keys, "w-1", BatchSettings(block_ms=50))
        serving = asyncio.ensure_future(loop.run())
        streamer = Counted("toy", redis_url=url, prefix=spread, wait_for_workers=True)
        try:
            for i in range(9):  # each partition's node answers an mb_reply, alone
                assert await streamer.apredict([i], timeout=10) == [i]
            warm = worker.alone
            calls = [streamer.apredict([f"a{i}", f"b{i}"], timeout=10) for i in range(30)]
            outputs = [item for result in await asyncio.gather(*calls) for item in result]
            riding = worker.alone - warm
            # a caller with one inbox (the model's) for an entry of partition 2
            two = keys.of(2)
            inbox = keys.inbox("one-inbox")
            with connections.sync_client(url) as sync:
                enqueue = (two.stream, two.queued_bytes, two.queue_bound, two.consumers)
                data = b"\xa3one"  # msgpack "one"
                sync.fcall("mb_enqueue", 4, *enqueue, 1, 0, 0, 1, inbox, 10000, "", "r1", data)
                popped = await asyncio.to_thread(sync.blpop, [inbox], 10)
            assert popped is not None and b"r1" in popped[1]
            return outputs, riding, worker.alone - warm - riding
        finally:
            await streamer.aclose()
            loop.stop()
            await serving
            await worker.close()

    outputs, riding, foreign = asyncio.run(run())
    assert outputs == [item for i in range(30) for item in (f"a{i}", f"b{i}")]
    assert riding == 0  # every reply went in its partition's transaction
    assert foreign == 1  # written alone, before its entry was acknowledged on p2's node
    [core_transport] = caller
    client_id = core_transport.popped[0].rsplit(":", 1)[1]
    inboxes = {part.inbox(client_id) for part in keys.each()}
    assert set(core_transport.popped) == inboxes and len(core_transport.popped) == 69
    for part in keys.each():
        assert key_slot(part.inbox(client_id)) == key_slot(part.stream)
    for port in cluster.primaries():  # each node pushed and popped replies of its partition
        with cluster.client(port) as client:
            stats: Any = client.info("commandstats")
            assert stats["cmdstat_rpush"]["calls"] > 0 and stats["cmdstat_blmpop"]["calls"] > 0


def worker_children(supervisor: subprocess.Popen[bytes]) -> list[str]:
    """The pids of a `worker start` supervisor's worker processes."""
    found = subprocess.run(["pgrep", "-P", str(supervisor.pid)], capture_output=True, text=True)
    return sorted(found.stdout.split())


@pytest.mark.slow
def test_a_primary_without_replica_killed_and_restarted_under_load(
    prefix: str, tmp_path: Path
) -> None:
    """The node serving the model dies (kill -9) with no replica to take over, and comes back
    3 s later from its append-only file: meanwhile calls are refused (BrokerUnavailable,
    CLUSTERDOWN on the other nodes), none is lost, the worker process rides it out (none
    exits to be restarted), and calls are answered again once it is back."""
    config = {"appendonly": "yes", "appendfsync": "always"}
    with LocalCluster(primaries=3, redis_config=config) as cluster:
        url = cluster.url(nodes=3)
        owner = cluster.owner(ModelKeys("toy", prefix).stream)
        node = next(node for node in cluster.nodes if node.port == owner)
        log_path = tmp_path / "worker.log"
        with worker_process(url, "tests.models:Toy", prefix, log_path=log_path) as supervisor:
            workers = worker_children(supervisor)

            async def load() -> tuple[list[tuple[float, str]], float]:
                streamer = Streamer("toy", redis_url=url, prefix=prefix)
                outcomes: list[tuple[float, str]] = []

                async def call(item: int) -> None:
                    sent = time.monotonic()
                    try:
                        [output] = await asyncio.wait_for(streamer.apredict([item], timeout=15), 20)
                        outcomes.append((sent, "ok" if output["item"] == item else "wrong"))
                    except MicrobatchError as exc:
                        outcomes.append((sent, type(exc).__name__))
                    except Exception as exc:  # untyped, or no end: lost
                        outcomes.append((sent, f"lost: {exc!r}"))

                started = time.monotonic()
                calls, item, faults = [], 0, ["kill", "restart"]
                while (now := time.monotonic() - started) < 12:
                    if faults == ["kill", "restart"] and now >= 3:
                        node.kill()
                        faults.pop(0)
                    if faults == ["restart"] and now >= 6:
                        await asyncio.to_thread(node.start)
                        faults.pop(0)
                    calls.append(asyncio.ensure_future(call(item)))
                    item += 1
                    await asyncio.sleep(0.02)
                await asyncio.gather(*calls)
                streamer.close()
                return outcomes, started

            outcomes, started = asyncio.run(load())
            assert worker_children(supervisor) == workers, log_path.read_text()[-3000:]
    kinds = Counter(kind for _, kind in outcomes)
    assert set(kinds) <= {"ok", "BrokerUnavailable"}, kinds
    assert kinds["BrokerUnavailable"] > 0  # the outage was met
    late = [kind for sent, kind in outcomes if sent - started > 10]
    assert late and set(late) == {"ok"}, Counter(late)


@pytest.mark.slow  # a cluster failover
def test_a_command_in_flight_to_a_primary_gone_silent_fails_once_its_replica_takes_over() -> None:
    """A command sent to a primary that then went silent (stopped: its connection stays open,
    nothing answers) is not held until the 10 s reply timeout: once a failover promotes its
    replica the connection is dropped, the command fails as a connection error (the
    caller's BrokerUnavailable) and the next one is answered by the new primary."""

    with LocalCluster(primaries=3, replicas=1, node_timeout_ms=1000) as setup:
        k = f"{{m{uuid.uuid4().hex[:6]}}}:k"
        old = setup.owner(k)
        node = setup.node(old)
        assert node.process is not None
        other = next(n.port for n in setup.nodes if n.port != old)

        def promoted() -> bool:
            """Whether a live node names another primary for the key's slot."""
            with setup.client(other) as client:
                slot = int(client.execute_command("CLUSTER", "KEYSLOT", k))
                slots = client.execute_command("CLUSTER", "SLOTS")
            return any(a <= slot <= b and int(p[1]) != old for a, b, p, *_ in slots)

        async def main() -> tuple[float, float]:
            lanes = connections.lanes(setup.url(nodes=len(setup.nodes)))
            assert await lanes.at(k).execute("SET", k, "kept") == b"OK"
            assert await lanes.at(k).execute("WAIT", 1, 5000) == 1  # the replica has it
            os.kill(node.process.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(redis.ConnectionError):
                    await asyncio.wait_for(lanes.at(k).execute("GET", k), 15)
                failed_after = time.monotonic() - started
                await asyncio.to_thread(wait_for, promoted, 30, "the replica to take over")
                assert await lanes.at(k).execute("GET", k) == b"kept"
                return failed_after, time.monotonic() - started
            finally:
                os.kill(node.process.pid, signal.SIGCONT)
                lanes.close()

        failed_after, answered_after = asyncio.run(main())
        assert failed_after < 8, f"the command in flight failed after {failed_after:.1f} s"
        assert answered_after < 10


def test_broker_forget_deletes_a_partitioned_model_from_every_primary(
    cluster: LocalCluster, prefix: str
) -> None:
    """Each partition's keys are deleted on its own node, in one transaction of its slot."""
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    url = cluster.url()
    with connections.sync_client(url) as client:
        client.set(keys.partitions_key, 3)
        for part in keys.each():
            client.xgroup_create(part.stream, part.group, "0", mkstream=True)
            client.zadd(part.cancelled, {"1-0": 1})
            client.hset(part.queue_bound, mapping={"items": 8, "bytes": 0})
        client.xadd(keys.of(2).dead_letters, {"id": "r2", "dead_reason": "test"})
    cli = CliRunner()
    named = ["--name", "toy", "--prefix", spread, "--redis", url]
    refused = cli.invoke(app, ["forget", "--yes", *named])
    assert refused.exit_code == 1 and "partition 2 holds 1 dead letter(s)" in refused.output
    assert cli.invoke(app, ["dead-letters", "purge", "--yes", *named]).exit_code == 0
    forgot = cli.invoke(app, ["forget", "--yes", *named])
    assert forgot.exit_code == 0, forgot.output
    assert f"forgot toy (prefix {spread}): deleted 10 key(s)" in forgot.output
    for port in cluster.primaries():
        with cluster.client(port) as node:
            assert list(node.scan_iter(f"mb:{{{spread}:*")) == []


@pytest.fixture(scope="module")
def lenient_cluster() -> Iterator[LocalCluster]:
    """Three primaries that go on serving their slots while another serves none (`cluster-
    require-full-coverage no`): for the tests that stop one."""
    config = {"cluster-require-full-coverage": "no"}
    with LocalCluster(primaries=3, node_timeout_ms=1000, redis_config=config) as setup:
        yield setup


@contextlib.contextmanager
def stopped(node: Any) -> Iterator[None]:
    """The redis-server of ``node`` stopped (SIGSTOP: its connections stay open and nothing
    answers), continued afterwards."""
    assert node.process is not None
    os.kill(node.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(node.process.pid, signal.SIGCONT)


@pytest.mark.slow  # a cluster primary stopped (failover)
def test_calls_avoid_a_partition_whose_primary_went_silent(
    lenient_cluster: LocalCluster, prefix: str
) -> None:
    """Three partitions on three primaries, partition 1's stopped: the enqueue in flight to it
    holds back none to the others, and once it has waited a second, new calls go to the
    partitions whose primaries answer."""
    cluster = lenient_cluster
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    url = cluster.url(nodes=3)
    with cluster.client(cluster.owner(keys.partitions_key)) as client:
        client.set(keys.partitions_key, 3)  # as a supervisor would store it
    owners = [cluster.owner(part.stream) for part in keys.each()]

    def queued(partitions: tuple[int, ...] = (0, 2)) -> int:
        total = 0
        for part in (keys.of(k) for k in partitions):
            with cluster.client(owners[part.partition]) as client:
                total += int(client.xlen(part.stream)) if client.exists(part.stream) else 0
        return total

    with Streamer("toy", redis_url=url, prefix=spread, entry_items=1) as streamer:
        warm = [streamer.submit([i], timeout=30) for i in range(3)]  # one call to each node
        wait_for(lambda: queued((0, 1, 2)) == 3, 10, "the first calls to be queued", 0.05)
        before = queued()
        with stopped(cluster.node(owners[1])):
            futures = []
            for i in range(30):
                futures.append(streamer.submit([i], timeout=30))
                time.sleep(0.1)
            # (well before the enqueue in flight to partition 1 fails, at its 10 s reply timeout)
            with contextlib.suppress(TimeoutError):
                wait_for(lambda: queued() - before >= 20, 4, "the calls to reach 0 and 2", 0.05)
            added = queued() - before
        wait_for(lambda: queued((0, 1, 2)) == 33, 20, "every call to be queued", 0.05)
        to_one = queued((1,)) - 1
        for future in warm + futures:
            future.cancel()
    # about 10 calls in the first second, a third of them to partition 1, then 20 more to
    # partitions 0 and 2 (in turn, 10 calls of 30 would have gone to each partition)
    assert added >= 20, added
    assert to_one < 10, to_one


@pytest.mark.slow  # a cluster primary stopped (failover)
def test_the_heartbeats_of_partitions_on_other_primaries_go_on_while_one_is_silent(
    lenient_cluster: LocalCluster, prefix: str
) -> None:
    """Three partitions on three primaries, partition 1's stopped: the supervisor's renewals
    fail there only, so the others' heartbeats stay current (they lapsed 5 s in, one TTL,
    when every partition was renewed in one round trip), and partition 1's is renewed again
    once its primary answers."""
    cluster = lenient_cluster
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    owners = [cluster.owner(part.stream) for part in keys.each()]
    heartbeats = Heartbeats(cluster.url(nodes=3), keys, ttl_s=2.0, queue_bound=(30, 0))

    def live(partition: int) -> bool:
        part = keys.of(partition)
        with cluster.client(owners[partition]) as client:
            seconds, micros = client.time()
            score = client.zscore(part.consumers, "w-1")
        return score is not None and score > seconds * 1000 + micros // 1000

    try:
        assert heartbeats.renew({"w-1": {}})
        with stopped(cluster.node(owners[1])):
            renewed = []
            started = time.monotonic()
            while time.monotonic() - started < 4.5:  # more than twice the TTL
                renewed.append(heartbeats.renew({"w-1": {}}))
                time.sleep(0.3)
            assert all(renewed)
            assert live(0) and live(2)
        wait_for(lambda: heartbeats.renew({"w-1": {}}) and live(1), 20, "partition 1's renewal")
    finally:
        heartbeats.close()


def test_a_partition_is_set_aside_for_its_node_s_silence_only(
    lenient_cluster: LocalCluster, prefix: str
) -> None:
    """A worker's sweep of a partition whose node lacks the library (and may not load it) is
    an outage as ever (BrokerUnavailable), not a silent node: the partition is not set aside."""
    cluster = lenient_cluster
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    one = keys.of(1)
    owner = cluster.owner(one.stream)

    async def main() -> BrokerUnavailable:
        transport = RedisTransport(cluster.url(nodes=3))
        try:
            await transport.ensure_group(keys)
            with cluster.client(owner) as client:  # a consumer gone without a trace: dead
                client.xadd(one.stream, {"id": "r1"})
                client.xreadgroup(one.group, "gone", {one.stream: ">"})
                client.function_flush()
            transport._may_load = False  # (as for a user refused FUNCTION LOAD)
            with pytest.raises(BrokerUnavailable) as raised:
                for _ in range(len(keys.lanes())):  # each sweep starts from the next lane
                    await transport.reclaim(keys, "w-1", 0, 10)
            assert transport._aside == {}
            return raised.value
        finally:
            await transport.close()
            with cluster.client(owner) as client:
                client.execute_command(*functions.LOAD_COMMAND)

    error = asyncio.run(main())
    assert not isinstance(error, PartitionsChanged), error


@pytest.mark.slow
def test_a_primary_gone_silent_leaves_the_partitions_on_the_other_primaries_served(
    prefix: str, tmp_path: Path
) -> None:
    """Three partitions on three primaries without replicas (`cluster-require-full-coverage
    no`): the primary of partition 1 stops answering for 8 s (SIGSTOP: its connections stay
    open, nothing answers) under steady load from a Streamer. The calls the client puts on
    partitions 0 and 2 go on being answered meanwhile; every call gets its right answer or a
    typed error, the worker process rides it out, and the load is served whole again after."""
    config = {"cluster-require-full-coverage": "no"}
    with LocalCluster(primaries=3, node_timeout_ms=1000, redis_config=config) as cluster:
        spread = prefix_spreading_partitions(cluster, prefix, 3)
        keys = ModelKeys("toy", spread, partitions=3)
        url = cluster.url(nodes=3)
        node = cluster.node(cluster.owner(keys.of(1).stream))
        assert node.process is not None
        log_path = tmp_path / "worker.log"
        with worker_process(
            url, "tests.models:Toy", spread, "--partitions", "3", log_path=log_path
        ) as supervisor:
            workers = worker_children(supervisor)

            async def load() -> tuple[list[tuple[float, float, str]], float, float]:
                streamer = Streamer("toy", redis_url=url, prefix=spread, entry_items=1)
                outcomes: list[tuple[float, float, str]] = []  # (sent, ended, outcome)

                async def call(item: int) -> None:
                    sent = time.monotonic()
                    try:
                        [output] = await asyncio.wait_for(streamer.apredict([item], timeout=15), 20)
                        kind = "ok" if output["item"] == item else "wrong"
                    except MicrobatchError as exc:
                        kind = type(exc).__name__
                    except Exception as exc:  # untyped, or no end: lost
                        kind = f"lost: {exc!r}"
                    outcomes.append((sent, time.monotonic(), kind))

                for item in range(9):  # every partition's node has answered before the fault
                    await call(-1 - item)
                outcomes.clear()
                started = time.monotonic()
                stopped = resumed = 0.0
                calls, item = [], 0
                while (now := time.monotonic() - started) < 16:
                    if not stopped and now >= 3:
                        os.kill(node.process.pid, signal.SIGSTOP)
                        stopped = time.monotonic()
                    if stopped and not resumed and now >= 11:
                        os.kill(node.process.pid, signal.SIGCONT)
                        resumed = time.monotonic()
                    calls.append(asyncio.ensure_future(call(item)))
                    item += 1
                    await asyncio.sleep(0.025)
                await asyncio.gather(*calls)
                streamer.close()
                return outcomes, stopped, resumed

            try:
                outcomes, stopped, resumed = asyncio.run(load())
            finally:
                os.kill(node.process.pid, signal.SIGCONT)
            assert worker_children(supervisor) == workers, log_path.read_text()[-3000:]
    kinds = Counter(kind for *_, kind in outcomes)
    while_stopped = sorted(ended for _, ended, kind in outcomes
                           if kind == "ok" and stopped + 1 <= ended < resumed)  # fmt: skip
    answers = sorted(ended for _, ended, kind in outcomes if kind == "ok")
    gaps = [b - a for a, b in itertools.pairwise(answers) if stopped <= a < resumed]
    print(
        f"\n{len(outcomes)} calls: {dict(kinds)}; answered while the primary was stopped "
        f"(from 1 s after): {len(while_stopped)}; longest time without an answer while "
        f"stopped: {max(gaps, default=resumed - stopped):.2f} s"
    )
    assert set(kinds) <= {"ok", "BrokerUnavailable", "DeadlineExceeded", "QueueFull"}, kinds
    # about 280 calls are sent in the 7 s after the stop's first second, all to partitions 0
    # and 2 (the client avoids partition 1 by then); before, none was answered in that time
    assert len(while_stopped) >= 40, kinds
    late = [kind for sent, _, kind in outcomes if sent > resumed + 3]
    assert late and set(late) == {"ok"}, Counter(late)


@pytest.mark.slow
def test_a_partition_set_aside_comes_back_on_the_replica_a_failover_promotes() -> None:
    """Partition 1's primary goes silent for good (SIGSTOP) and the cluster promotes its
    replica: the worker, which set the partition aside, finds the new primary and serves the
    partition there again, so every call sent once the failover has settled is answered."""
    config = {"cluster-require-full-coverage": "no"}
    with LocalCluster(primaries=3, replicas=1, redis_config=config) as cluster:
        spread = prefix_spreading_partitions(cluster, "aside", 3)
        keys = ModelKeys("toy", spread, partitions=3)
        url = cluster.url(nodes=len(cluster.nodes))
        old = cluster.owner(keys.of(1).stream)
        other = cluster.owner(keys.of(0).stream)
        with cluster.client(cluster.owner(keys.partitions_key)) as client:
            client.set(keys.partitions_key, 3)  # as a supervisor would store it

        def promoted() -> bool:
            with cluster.client(other) as client:
                slot = int(client.execute_command("CLUSTER", "KEYSLOT", keys.of(1).stream))
                slots = client.execute_command("CLUSTER", "SLOTS")
            return any(a <= slot <= b and int(p[1]) != old for a, b, p, *_ in slots)

        async def main() -> tuple[list[tuple[float, str]], float]:
            worker = RedisTransport(url)
            loop = BatchLoop(lambda items: items, worker, keys, "w-1", BatchSettings(block_ms=50))
            serving = asyncio.ensure_future(loop.run())
            streamer = Streamer(
                "toy", redis_url=url, prefix=spread, entry_items=1, wait_for_workers=True
            )
            outcomes: list[tuple[float, str]] = []

            async def call(item: int) -> None:
                sent = time.monotonic()
                try:
                    [output] = await streamer.apredict([item], timeout=5)
                    outcomes.append((sent, "ok" if output == item else "wrong"))
                except MicrobatchError as exc:
                    outcomes.append((sent, type(exc).__name__))

            try:
                for item in range(9):  # every partition's node has answered before the fault
                    await call(item)
                with stopped(cluster.node(old)):
                    await asyncio.to_thread(wait_for, promoted, 30, "the replica to take over")
                    settled = time.monotonic() + 4
                    calls = []
                    while time.monotonic() < settled + 4:
                        calls.append(asyncio.ensure_future(call(len(calls))))
                        await asyncio.sleep(0.05)
                    await asyncio.gather(*calls)
                return outcomes, settled
            finally:
                await streamer.aclose()
                loop.stop()
                await serving
                await worker.close()

        outcomes, settled = asyncio.run(main())
    late = Counter(kind for sent, kind in outcomes if sent >= settled)
    assert late and set(late) == {"ok"}, late


def _releases(cluster: LocalCluster) -> dict[int, tuple[int, int] | None]:
    """The library's release on each primary, by port."""
    return {port: functions.loaded_release(cluster.client(port)) for port in cluster.primaries()}


def test_a_primary_missing_the_library_gets_it_and_a_newer_one_elsewhere_is_kept(
    cluster: LocalCluster, prefix: str
) -> None:
    """A caller or worker that found the library missing on one primary loaded its own
    release on every primary with REPLACE: a later release's library there (a fleet's newer
    workers') was replaced by this older one, and nothing put it back."""
    newer = library_code(functions.VERSION, functions.REVISION + 1)
    keys = ModelKeys("m", prefix)
    lacking = cluster.owner(keys.stream)
    try:
        for port in cluster.primaries():
            cluster.client(port).function_load(newer, True)
        cluster.client(lacking).function_delete(functions.LIBRARY)
        call = CallRequests(keys.inbox("a"), 1000, ["a.0"], [b"x"])

        async def main() -> None:
            transport = RedisTransport(cluster.url())  # the default user: may load
            try:
                (ids,) = await transport.enqueue(keys, [call], UNBOUNDED)
                assert isinstance(ids, list)
            finally:
                await transport.close()

        asyncio.run(main())
        ours, later = (
            (functions.VERSION, functions.REVISION),
            (functions.VERSION, functions.REVISION + 1),
        )
        assert _releases(cluster) == {
            port: ours if port == lacking else later for port in cluster.primaries()
        }
    finally:
        for port in cluster.primaries():
            cluster.client(port).function_load(functions.CODE, True)


@pytest.mark.slow
def test_renewals_tried_partition_by_partition_say_that_the_supervisor_goes_round(
    lenient_cluster: LocalCluster, prefix: str
) -> None:
    """Every primary silent: one renewal tried the partitions one by one, each for seconds
    (about 8 s each through the cluster client), so the supervisor's loop went round once in
    over 60 s with 6 partitions or more, and its `/live` answered 503: Kubernetes restarted the
    pods for a Redis outage. Each partition tried now counts as the loop going round."""
    cluster = lenient_cluster
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    went_round: list[float] = []
    heartbeats = Heartbeats(
        cluster.url(nodes=3), keys, ttl_s=2.0, progress=lambda: went_round.append(0.0)
    )
    try:
        assert heartbeats.renew({"w-1": {}})
        went_round.clear()
        with contextlib.ExitStack() as stack:
            for port in cluster.primaries():
                stack.enter_context(stopped(cluster.node(port)))
            assert not heartbeats.renew({"w-1": {}})
        assert len(went_round) >= keys.partitions  # once before each partition tried alone
    finally:
        heartbeats.close()


def test_renewals_refused_on_every_partition_are_said_every_10_s_not_per_partition(
    lenient_cluster: LocalCluster, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every partition failing (a cluster down, a user refused them all) logged one line a
    partition at every renewal, every second, besides the outage's one line every 10 s."""
    cluster = lenient_cluster
    spread = prefix_spreading_partitions(cluster, prefix, 3)
    keys = ModelKeys("toy", spread, partitions=3)
    user = f"nozadd{uuid.uuid4().hex[:6]}"
    for port in cluster.primaries():
        cluster.client(port).acl_setuser(
            user, enabled=True, passwords=["+pw"], commands=["+@all", "-zadd"], keys=["*"]
        )
    heartbeats = Heartbeats(cluster.url(credentials=f"{user}:pw@", nodes=3), keys, ttl_s=2.0)
    try:
        with caplog.at_level(logging.WARNING, logger="microbatch.heartbeat"):
            for _ in range(3):
                assert not heartbeats.renew({"w-1": {}})
        said = [r.getMessage() for r in caplog.records if r.name == "microbatch.heartbeat"]
        assert len(said) == 1 and said[0].startswith("cannot renew heartbeats"), said
    finally:
        heartbeats.close()
        for port in cluster.primaries():
            cluster.client(port).acl_deluser(user)
