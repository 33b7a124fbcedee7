"""Two tenants (prefixes) on one Redis, each with its own ACL users, workers and callers.

Redis is started by deploy/redis-start.sh with the ACL template rendered for tenant A and the
users of tenant B added from `broker acl --prefix B` (MICROBATCH_REDIS_EXTRA_ACL), the way
docs/deployment.md tells an operator to. Tenant A's gateway user then tries what an attacker
holding it would; nothing of tenant B may be read, popped, deleted, forged or expired, Redis
must not be blockable, and both tenants keep serving with nothing refused to them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker import Streamer, functions
from broker.devserver import find_redis_server, free_port
from broker.keys import HIGH, ModelKeys
from tests.conftest import ROOT, worker_process

TENANTS = ("ta", "tb")
ROLES = ("GATEWAY", "WORKER", "ADMIN", "KEDA", "OPERATOR")
DEPLOY = ROOT / "deploy"
NO_RETRY = Retry(NoBackoff(), 0)


def password_var(tenant: str, role: str) -> str:
    return f"PW_{tenant.upper()}_{role}"


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("tenants")
    passwords = {password_var(t, role): uuid.uuid4().hex for t in TENANTS for role in ROLES}
    env = {**os.environ, **passwords, "PYTHONPATH": str(ROOT)}
    version = (
        subprocess.run(
            [find_redis_server(), "--version"], capture_output=True, text=True, check=True
        )
        .stdout.split("v=")[1]
        .split(".")[:2]
    )
    # tenant B's users, as an operator prints them
    extra = tmp / "tenant-b.acl"
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "acl", "--prefix", "tb", "--password-env",
         "PW_{TENANT}_{ROLE}", "--redis-version", ".".join(version)],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    extra.write_text(done.stdout)
    port = free_port()
    start_env = {
        **env,
        "REDIS_SERVER": find_redis_server(),
        "MICROBATCH_PREFIX": "ta",
        "MICROBATCH_REDIS_ACLFILE": str(tmp / "users.acl"),
        "MICROBATCH_REDIS_EXTRA_ACL": str(extra),
        "MICROBATCH_REDIS_OPERATOR_PASSWORD": passwords["PW_TA_OPERATOR"],
        **{f"MICROBATCH_REDIS_{role}_PASSWORD": passwords[f"PW_TA_{role}"] for role in ROLES},
    }
    log = open(tmp / "redis.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(
        ["sh", str(DEPLOY / "redis-start.sh"), "--port", str(port), "--bind", "127.0.0.1",
         "--dir", str(tmp), "--appendonly", "no"],
        env=start_env, stdout=log, stderr=log,
    )  # fmt: skip

    def url(tenant: str | None, role: str) -> str:
        user = "operator" if tenant is None else f"{tenant}-{role.lower()}"
        password = passwords[password_var(tenant or "ta", role)]
        return f"redis://{user}:{password}@127.0.0.1:{port}/0"

    operator = redis.Redis.from_url(url(None, "OPERATOR"), socket_timeout=5, retry=NO_RETRY)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                operator.ping()
                break
            except redis.ConnectionError:
                assert server.poll() is None and time.monotonic() < deadline, "no redis-server"
                time.sleep(0.05)
        functions.load(operator)  # what `broker functions load` does, as the operator
        yield {"url": url, "operator": operator, "passwords": passwords, "tmp": tmp}
    finally:
        operator.close()
        server.send_signal(signal.SIGTERM)
        server.wait(10)
        log.close()


def refusals(operator: redis.Redis) -> list[tuple[str, str, str]]:
    """(user, command or key, reason) of every ACL LOG entry."""
    found = []
    for entry in operator.acl_log():
        found.append((entry["username"], entry["object"], entry["reason"]))
    return found


def serve_both(tenants: dict[str, Any], run: Callable[[], None]) -> None:
    """Run ``run`` while a worker of each tenant, logged in as its worker user, serves."""
    url = tenants["url"]
    logs = tenants["tmp"]
    with (
        worker_process(url("ta", "WORKER"), "tests.models:Toy", "ta", log_path=logs / "a.log"),
        worker_process(url("tb", "WORKER"), "tests.models:Toy", "tb", log_path=logs / "b.log"),
    ):
        run()


def test_tenants_serve_side_by_side_and_one_cannot_touch_the_other(
    tenants: dict[str, Any],
) -> None:
    url, operator = tenants["url"], tenants["operator"]
    a, b = ModelKeys("toy", "ta"), ModelKeys("toy", "tb")
    operator.acl_log_reset()

    def client(tenant: str, role: str) -> redis.Redis:
        return redis.Redis.from_url(url(tenant, role), socket_timeout=5, retry=NO_RETRY)

    def predict(tenant: str, items: list[str], priority: str = "normal") -> list[Any]:
        streamer = Streamer("toy", redis_url=url(tenant, "GATEWAY"), prefix=tenant, timeout=20)
        try:
            return [output["item"] for output in streamer.predict(items, priority=priority)]
        finally:
            streamer.close()

    async def burst(tenant: str, count: int) -> list[Any]:
        """Concurrent calls, which share multi-item entries (and their counters)."""
        streamer = Streamer("toy", redis_url=url(tenant, "GATEWAY"), prefix=tenant, timeout=20)
        try:
            calls = [streamer.apredict([f"{tenant}{i}"]) for i in range(count)]
            return [outputs[0]["item"] for outputs in await asyncio.gather(*calls)]
        finally:
            await streamer.aclose()

    def scenario() -> None:
        # 1. legitimate traffic of both tenants, at both priority levels and in multi-item
        # entries: served, and Redis refused nothing
        assert predict("ta", ["a1", "a2"]) == ["a1", "a2"]
        assert predict("ta", ["a3"], priority="high") == ["a3"]
        assert asyncio.run(burst("ta", 20)) == [f"ta{i}" for i in range(20)]
        assert predict("tb", ["b1"]) == ["b1"]
        # what KEDA's redis-streams scaler reads, of both levels: the priorities overlay
        # scales on the high level's stream too (its triggers could not read it)
        a_keda = client("ta", "KEDA")
        for level_stream in (a.stream, a.at(HIGH).stream):
            assert a_keda.xlen(level_stream) >= 0
            assert a_keda.xpending(level_stream, "workers")["pending"] >= 0
        assert refusals(operator) == []

        # what tenant B has that A will go after: a queued request, a reply in an inbox,
        # live consumers, its counter and bound
        b_worker = client("tb", "WORKER")
        b_inbox = b.inbox("victim")
        b_worker.xadd(b.dead_letters, {"kept": "1"})
        assert b_worker.rpush(b_inbox, b"a reply for tenant B") == 1
        b_consumers = operator.zrange(b.consumers, 0, -1)
        assert b_consumers
        before = {key: (operator.type(key), operator.ttl(key)) for key in _keys_of(b)}

        a_gateway, a_worker = client("ta", "GATEWAY"), client("ta", "WORKER")
        denied = redis.exceptions.NoPermissionError
        attacks: list[tuple[str, Callable[[], Any]]] = [
            # read or pop B's replies and requests
            ("lpop B inbox", lambda: a_gateway.lpop(b_inbox)),
            ("blmpop B inbox", lambda: a_gateway.blmpop(1, 1, b_inbox, direction="LEFT")),
            ("xrange B stream", lambda: a_gateway.xrange(b.stream)),
            ("xlen B stream", lambda: a_gateway.xlen(b.stream)),
            ("xread B stream", lambda: a_gateway.xread({b.stream: "0"})),
            ("xreadgroup B stream", lambda: a_gateway.xreadgroup("workers", "x", {b.stream: ">"})),
            ("get B counter", lambda: a_gateway.get(b.queued_bytes)),
            ("hmget B bound", lambda: a_gateway.hmget(b.queue_bound, "items")),
            ("zrange B consumers", lambda: a_gateway.zrangebyscore(b.consumers, 0, "+inf")),
            # delete B's queued requests or keys
            ("xdel B stream", lambda: a_gateway.xdel(b.stream, "0-1")),
            ("del B stream", lambda: a_gateway.delete(b.stream)),
            ("unlink B inbox", lambda: a_gateway.unlink(b_inbox)),
            # forge a live consumer (B's, and even A's own)
            ("zadd B consumers", lambda: a_gateway.zadd(b.consumers, {"forged": 2**52})),
            ("zadd A consumers", lambda: a_gateway.zadd(a.consumers, {"forged": 2**52})),
            ("hset A bound", lambda: a_gateway.hset(a.queue_bound, "items", 10**9)),
            # expire anything of B's (or A's own)
            ("expire B stream", lambda: a_gateway.expire(b.stream, 1)),
            ("expire B dead", lambda: a_gateway.expire(b.dead_letters, 1)),
            ("expire A stream", lambda: a_gateway.expire(a.stream, 1)),
            ("pexpire B consumers", lambda: a_gateway.pexpire(b.consumers, 1)),
            # through the functions: B's keys are refused at the FCALL itself
            ("fcall enqueue into B", lambda: _fcall_enqueue(a_gateway, b)),
            ("fcall reply into B", lambda: a_gateway.fcall(
                functions.REPLY, 1, b_inbox, functions.VERSION, 60, 1, b"forged")),
            ("fcall reply into A", lambda: a_gateway.fcall(
                functions.REPLY, 1, a.inbox("x"), functions.VERSION, 60, 1, b"forged")),
            ("fcall retire B", lambda: a_gateway.fcall(
                functions.RETIRE, 2, b.stream, b.heartbeat("x"), functions.VERSION, "workers",
                "x")),
            ("A worker replies into B", lambda: a_worker.fcall(
                functions.REPLY, 1, b_inbox, functions.VERSION, 60, 1, b"forged")),
            ("A worker xadd to B", lambda: a_worker.xadd(b.stream, {"v": "1"})),
            # run or load code, or block Redis
            ("eval", lambda: a_gateway.eval("while true do end", 0)),
            ("evalsha", lambda: a_gateway.evalsha("0" * 40, 0)),
            ("script load", lambda: a_gateway.script_load("return 1")),
            ("function load", lambda: a_gateway.function_load(
                "#!lua name=evil\nredis.register_function('evil', function() end)", True)),
            ("function flush", lambda: a_gateway.function_flush()),
            ("function delete", lambda: a_gateway.function_delete(functions.LIBRARY)),
            ("debug sleep", lambda: a_gateway.execute_command("DEBUG", "SLEEP", 10)),
            ("client pause", lambda: a_gateway.client_pause(10_000)),
            ("client kill", lambda: a_gateway.client_kill_filter(_type="normal")),
            ("keys", lambda: a_gateway.keys("*")),
            ("scan", lambda: a_gateway.scan(0)),
            ("flushall", lambda: a_gateway.flushall()),
            ("config set", lambda: a_gateway.config_set("maxmemory", "1")),
            ("shutdown", lambda: a_gateway.execute_command("SHUTDOWN", "NOSAVE")),
            ("multi", lambda: a_gateway.execute_command("MULTI")),
            ("publish", lambda: a_gateway.publish("channel", "x")),
            ("acl setuser", lambda: a_gateway.acl_setuser("ta-gateway", enabled=True,
                                                          commands=["+@all"])),
        ]  # fmt: skip
        allowed = []
        for name, attack in attacks:
            try:
                attack()
            except denied:
                continue
            except redis.ResponseError as exc:  # refused inside a function, by the ACL
                refused = ("can't run this command", "no permissions", "DEBUG command not allowed")
                if any(reason in str(exc) for reason in refused):
                    continue
                allowed.append(f"{name}: {exc}")
                continue
            allowed.append(name)
        assert not allowed, f"tenant A's users could: {allowed}"
        # a blocking read on its own inbox blocks only its own connection
        started = time.monotonic()
        assert a_gateway.blmpop(0.2, 1, a.inbox("idle"), direction="LEFT") is None
        assert operator.ping() and time.monotonic() - started < 5

        # B's keys are as they were: nothing read away, deleted, forged or given a TTL
        after = {key: (operator.type(key), operator.ttl(key)) for key in _keys_of(b)}
        assert after == before
        assert operator.lrange(b_inbox, 0, -1) == [b"a reply for tenant B"]
        assert operator.zrange(b.consumers, 0, -1) == b_consumers
        assert b"forged" not in operator.zrange(a.consumers, 0, -1)
        assert operator.ttl(a.stream) == -1
        assert functions.loaded_version(operator) == functions.VERSION
        assert operator.function_list(library="evil") == []
        refused = refusals(operator)
        assert refused and {user for user, _, _ in refused} <= {"ta-gateway", "ta-worker"}

        # 2. both tenants keep serving, and their traffic is refused nothing
        operator.acl_log_reset()
        assert predict("ta", ["a3"]) == ["a3"]
        assert predict("tb", ["b2", "b3"]) == ["b2", "b3"]
        assert refusals(operator) == []
        for connection in (a_gateway, a_worker, b_worker):
            connection.close()

    serve_both(tenants, scenario)


def _keys_of(keys: ModelKeys) -> list[str]:
    return [keys.stream, keys.dead_letters, keys.consumers, keys.queue_bound, keys.inbox("victim")]


def _fcall_enqueue(client: redis.Redis, keys: ModelKeys) -> Any:
    return client.fcall(
        functions.ENQUEUE, 4, keys.stream, keys.queued_bytes, keys.queue_bound, keys.consumers,
        1, 0, 0, 1, keys.inbox("x"), 1000, "", "forged", b"x",  # a version 1 call
    )  # fmt: skip


def test_the_users_of_a_tenant_are_printed_with_hashes_never_passwords(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PW_SHOP_GATEWAY": "s3cret-gw"}
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "acl", "--prefix", "shop", "--password-env",
         "PW_{TENANT}_{ROLE}"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "s3cret" not in done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[1] for line in lines] == [
        "shop-gateway", "shop-worker", "shop-admin", "shop-keda"
    ]  # fmt: skip
    assert lines[0].split()[2:4] == ["reset", "on"] and lines[0].split()[4].startswith("#")
    assert all(line.split()[3] == "off" for line in lines[1:])  # no password: cannot log in
    assert "PW_SHOP_WORKER is not set" in done.stderr


def test_tenants_whose_password_variables_would_clash_are_refused() -> None:
    """`shop-eu` and `shop_eu` both read REDIS_SHOP_EU_*_PASSWORD: their users got the same
    hashes, and each tenant could log in as the other."""
    from broker.acl import render

    with pytest.raises(ValueError, match="'shop-eu' and 'shop_eu' would share the password"):
        render(["shop-eu", "shop_eu"], password_env="REDIS_{TENANT}_{ROLE}_PASSWORD")
    lines, _ = render(["shop-eu", "shop-us"], password_env="REDIS_{TENANT}_{ROLE}_PASSWORD")
    assert len(lines) == 8
    done = subprocess.run(
        [sys.executable, "-m", "broker.cli", "acl", "--prefix", "Shop.EU", "--prefix", "shop-eu",
         "--password-env", "PW_{TENANT}_{ROLE}"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2 and "would share the password variable PW_SHOP_EU_" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_gateway_user_may_read_replies_as_the_protocol_tells_foreign_callers(
    tenants: dict[str, Any],
) -> None:
    """docs/protocol.md tells a caller to read replies with BLMPOP, or BLPOP and LPOP: the
    gateway user of `broker acl` was refused the latter two."""
    keys = ModelKeys("foreign", "ta")
    gateway = redis.Redis.from_url(tenants["url"]("ta", "GATEWAY"), retry=NO_RETRY)
    try:
        with redis.Redis.from_url(tenants["url"]("ta", "WORKER")) as worker:
            worker.rpush(keys.inbox("f"), b"r1", b"r2", b"r3")
        assert gateway.blpop([keys.inbox("f")], timeout=1) == (keys.inbox("f").encode(), b"r1")
        assert gateway.lpop(keys.inbox("f"), 2) == [b"r2", b"r3"]
    finally:
        gateway.close()
    assert not [r for r in refusals(tenants["operator"]) if r[1] in ("blpop", "lpop")]
