"""`broker status` and `broker dead-letters`, checked against what Redis holds; `broker acl`'s
help."""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
import redis
from typer.testing import CliRunner

from broker import Streamer, acl, admin, cli, functions
from broker.devserver import RedisServer, free_port
from broker.keys import ModelKeys
from broker.protocol import decode_reply, request_fields
from tests.conftest import ROOT, wait_until, worker_process


def broker_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`broker ARGS` run in this process, as `python -m broker.cli ARGS` with its output
    captured runs it (less the interpreter's start and imports, 0.6 s a run): its exit status,
    stdout and stderr. An exception the command lets out fails the test, as its traceback
    would. The tests of what only a process shows (signals, prompts, entry points) start one."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level  # the command sets up logging its way
    try:
        result = CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "80"}, prog_name="broker")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(
        ["broker", *args], result.exit_code, result.stdout, result.stderr
    )


def test_status_json_matches_redis(redis_server: RedisServer, prefix: str, tmp_path: Path) -> None:
    client = redis_server.client()

    keys = ModelKeys("toy", prefix)

    def batch_in_hand() -> int:
        return max((c.current_batch for c in admin.model_status(client, keys).consumers), default=0)

    def queued() -> int:
        return admin.model_status(client, keys).stream_length

    release = tmp_path / "release"
    with worker_process(
        redis_server.url, "tests.models:Toy", prefix, "--workers", "2", expect_consumers=2
    ):
        streamer = Streamer("toy", redis_url=redis_server.url, prefix=prefix)
        streamer.predict(["a", "b", "c"])
        # a batch that a worker holds until we release it (one short of full: after a full
        # batch, a worker reads the next one ahead and would hold the calls below too)
        blocker = streamer.submit([{"until": str(release)}] * 7)
        client.xadd(keys.dead_letters, {"id": "x", "dead_reason": "test", "data": b"123"})
        # Wait, in this process, for the state the command must then show as it stands: the
        # supervisor reports the batch in hand with its next heartbeat, and the other worker
        # answers these meanwhile (a read before they were queued would show 7 entries too).
        wait_until(lambda: batch_in_hand() == 7, 30, "the heartbeat to report the batch in hand")
        assert len(streamer.submit(["q1", "q2", "q3"]).result(timeout=30)) == 3
        # the 7 items of one call share one entry (docs/protocol.md, section 5.1)
        wait_until(lambda: queued() == 1, 30, "the other calls' answers")
        # held until released: the command reads the same state, however long it takes to start
        command = ("status", "--redis", redis_server.url, "--prefix", prefix, "--json")
        result = broker_cli(*command)
        assert result.returncode == 0, result.stderr
        (model,) = json.loads(result.stdout)
        assert max(c["current_batch"] for c in model["consumers"]) == 7
        assert (model["prefix"], model["model"]) == (prefix, "toy")
        assert model["live_consumers"] == 2
        # the bound the workers store: 8 batches of Toy's 8 per live worker, 256 MiB in all
        assert (model["queue_bound_items"], model["queue_bound_bytes"]) == (2 * 64, 2**28)
        assert model["dead_letters"] == 1 == client.xlen(keys.dead_letters)
        assert model["stream_length"] == client.xlen(keys.stream)  # the batch held, unanswered
        assert model["pending"] == 1 and model["queued_items"] == 7
        assert {c["name"] for c in model["consumers"]} == {
            name.decode() for name in client.zrange(keys.consumers, 0, -1)
        }
        release.touch()
        assert len(blocker.result(timeout=20)) == 7
        streamer.close()
        human = broker_cli("status", "--redis", redis_server.url, "--prefix", prefix)
        assert human.returncode == 0 and "toy" in human.stdout
        # nothing is cut at 80 columns (COLUMNS in the test's environment) or at a pipe's width
        for consumer in model["consumers"]:
            assert consumer["name"] in human.stdout
        assert prefix in human.stdout and "…" not in human.stdout


def test_status_shows_a_foreign_worker_whatever_its_heartbeat_holds(
    redis_server: RedisServer, prefix: str
) -> None:
    """A worker in another language vouches for itself as docs/protocol.md, section 11, says;
    what it keeps in its heartbeat key is its own, and an odd value shows no batch."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    client.xgroup_create(keys.stream, "workers", id="0", mkstream=True)
    values = {
        "ok": '{"expires_ms": 1, "batch": 3, "batch_ms": 12.7}',
        "text": '{"batch": "y", "batch_ms": [1]}',
        "nulls": '{"batch": null, "batch_ms": null}',  # JSON.stringify of NaN
        "odd": '{"batch": true, "batch_ms": -5}',
        "deep": "[" * 100_000,
        "not-json": "alive",
    }
    for name, value in values.items():
        client.xgroup_createconsumer(keys.stream, "workers", name)
        client.zadd(keys.consumers, {name: 2**52})
        client.set(keys.heartbeat(name), value, px=60_000)
    shown = {c.name: c for c in admin.model_status(client, keys).consumers}
    assert (shown["ok"].current_batch, shown["ok"].current_batch_ms) == (3, 12)
    for name in values.keys() - {"ok"}:
        assert (shown[name].current_batch, shown[name].current_batch_ms) == (0, 0), name
    result = broker_cli("status", "--redis", redis_server.url, "--prefix", prefix)
    assert result.returncode == 0, result.stderr
    assert "text" in result.stdout


def test_dead_letters_list_replay_purge(redis_server: RedisServer, prefix: str) -> None:
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    reply = keys.inbox("cli-test")
    for i in range(2):
        fields = request_fields(f"r{i}", reply, 30_000, msgpack.packb(f"item-{i}"))
        client.xadd(keys.dead_letters, {**fields, "dead_reason": "poison", "dead_entry": "1-1"})
    base = ("--name", "toy", "--prefix", prefix, "--redis", redis_server.url)

    listed = broker_cli("dead-letters", "list", *base, "--json")
    letters = json.loads(listed.stdout)
    assert [letter["request_id"] for letter in letters] == ["r0", "r1"]
    assert {letter["reason"] for letter in letters} == {"poison"}
    assert "item-0" not in listed.stdout  # payloads are never shown

    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        replayed = broker_cli("dead-letters", "replay", *base, "--id", letters[0]["dead_id"])
        assert "replayed 1" in replayed.stdout
        popped = client.blpop([reply], timeout=20)
        assert popped is not None
        answer = decode_reply(popped[1])
        assert answer.ok and answer.request_id == "r0" and answer.result["item"] == "item-0"
    assert client.xlen(keys.dead_letters) == 1

    refused = subprocess.run(
        [sys.executable, "-m", "broker.cli", "dead-letters", "purge", *base],
        cwd=ROOT,
        input="n\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and client.xlen(keys.dead_letters) == 1
    unasked = subprocess.run(  # no one to answer: stdin at its end
        [sys.executable, "-m", "broker.cli", "dead-letters", "purge", *base],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unasked.returncode == 1 and client.xlen(keys.dead_letters) == 1
    assert "give --yes to confirm without being asked" in unasked.stderr
    purged = broker_cli("dead-letters", "purge", *base, "--yes")
    assert "purged 1" in purged.stdout and client.xlen(keys.dead_letters) == 0


def test_dead_letters_list_never_hands_a_caller_s_text_to_the_terminal(
    redis_server: RedisServer, prefix: str
) -> None:
    """Request ids reached the operator's terminal raw: escape sequences (a window title, a
    cleared screen), newlines that forged table rows, rich markup."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    hostile = "\x1b]0;pwned\x07\x1b[2J\n| forged row |[bold red]x[/]"
    fields = request_fields(hostile, keys.inbox("c"), 30_000, msgpack.packb(1))
    client.xadd(keys.dead_letters, {**fields, "dead_reason": "poison", "dead_entry": "1-1"})
    listed = broker_cli("dead-letters", "list", "--name", "toy", "--prefix", prefix,
                        "--redis", redis_server.url)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert "\x1b" not in listed.stdout and "\x07" not in listed.stdout
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\n" in listed.stdout.replace("\n", "")
    assert "[bold red]x[/]" in listed.stdout  # shown, not read as markup
    assert json.loads(broker_cli("dead-letters", "list", "--name", "toy", "--prefix", prefix,
                                 "--redis", redis_server.url, "--json").stdout)[0][
        "request_id"] == hostile  # fmt: skip


def test_status_never_hands_a_consumer_name_to_the_terminal(
    redis_server: RedisServer, prefix: str
) -> None:
    """Consumer names (any name XREADGROUP was given, by any tenant's worker user) reached the
    operator's terminal raw in `broker status`, which reads every prefix: a window title, a
    cleared screen, rich markup."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    hostile = "w\x1b]0;pwned\x07\x1b[2J\nforged[bold red]x[/]"
    client.xgroup_create(keys.stream, "workers", id="0", mkstream=True)
    client.xadd(keys.stream, {"a": "b"})
    client.xreadgroup("workers", hostile, {keys.stream: ">"}, count=1)
    shown = subprocess.run(
        [sys.executable, "-m", "broker.cli", "status", "--prefix", prefix,
         "--redis", redis_server.url],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\x07" not in shown.stdout
    assert "w\\x1b]0;pwned\\x07\\x1b[2J\\nforged[bold red]x[/]" in shown.stdout


def test_unreachable_redis_is_one_clear_line() -> None:
    result = broker_cli("status", "--redis", "redis://127.0.0.1:1/0")
    assert result.returncode == 1
    assert result.stderr.startswith("Error: cannot reach Redis")
    assert "Traceback" not in result.stderr


def test_a_url_without_the_password_redis_requires_says_so() -> None:
    """It said "Redis refused the credentials: HELLO must be called with the client already
    authenticated, otherwise the HELLO AUTH <user> <pass> option can be used ...": redis-py's
    reason, about a command nobody typed, for a URL without credentials."""
    with RedisServer({"requirepass": "s3cret"}) as server:
        result = broker_cli("status", "--redis", f"redis://127.0.0.1:{server.port}/0")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: Redis requires a password, and the URL gives none: "
        "redis://[user:]password@host:port/db"
    )


def test_credentials_redis_refuses_are_one_line_saying_so(redis_server: RedisServer) -> None:
    url = redis_server.url.replace("redis://", "redis://nobody:s3cret@")
    result = broker_cli("status", "--redis", url)
    assert result.returncode == 1
    assert result.stderr.startswith("Error: Redis refused the credentials: "), result.stderr
    assert "s3cret" not in result.stderr and "Traceback" not in result.stderr


def test_acl_help_names_the_role_of_every_password_variable() -> None:
    roles = [user.role for user in (*acl.TENANT_USERS, *acl.SERVER_USERS) if user.role]
    help_text = " ".join(broker_cli("acl", "--help").stdout.split())
    named = help_text.split("{ROLE} becomes ", 1)[1].split(" and {TENANT}", 1)[0]
    assert sorted(named.replace(" or ", ", ").split(", ")) == sorted(roles)


def test_a_tenant_user_refused_is_one_clear_line(redis_server: RedisServer, prefix: str) -> None:
    """A tenant's admin user (broker acl) running `broker status` over every prefix, or over
    another tenant's, is refused by Redis: one line and exit status 1, not a traceback."""
    client = redis_server.client()
    other = f"{prefix}x"
    client.xadd(ModelKeys("toy", other).stream, {"v": "1"})
    client.xadd(ModelKeys("toy", prefix).stream, {"v": "1"})
    env = {"MICROBATCH_REDIS_ADMIN_PASSWORD": "pw"}
    lines, _ = acl.render([prefix], environ=env, redis_version="7.0")
    (admin_line,) = [line for line in lines if line.startswith(f"user {prefix}-admin ")]
    client.execute_command("ACL", "SETUSER", *setuser_rules(admin_line))
    url = redis_server.url.replace("redis://", f"redis://{prefix}-admin:pw@")
    try:
        own = broker_cli("status", "--redis", url, "--prefix", prefix, "--json")
        assert own.returncode == 0, own.stderr
        assert [m["prefix"] for m in json.loads(own.stdout)] == [prefix]
        for extra in ((), ("--prefix", other)):
            result = broker_cli("status", "--redis", url, *extra)
            assert result.returncode == 1, result.stderr
            assert result.stderr.startswith("Error: Redis refused"), result.stderr
            assert "Traceback" not in result.stderr
        listing = broker_cli(
            "dead-letters", "list", "--name", "toy", "--prefix", other, "--redis", url
        )
        assert listing.returncode == 1 and "Traceback" not in listing.stderr, listing.stderr
    finally:
        client.execute_command("ACL", "DELUSER", f"{prefix}-admin")


def test_dead_letters_of_a_model_redis_has_never_seen_is_an_error_naming_those_it_has(
    redis_server: RedisServer, prefix: str
) -> None:
    """A misspelt name does not list (or purge) nothing, silently; a model that is served but
    has no dead letter lists none, as before."""
    client = redis_server.client()
    client.xgroup_create(ModelKeys("toy", prefix).stream, "workers", mkstream=True)
    base = ("--prefix", prefix, "--redis", redis_server.url)
    for command in (("list",), ("replay",), ("purge", "--yes")):
        result = broker_cli("dead-letters", *command, "--name", "tyo", *base)
        assert result.returncode == 1, result.stderr
        assert result.stderr == (
            f"Error: no model 'tyo' under prefix {prefix!r}: Redis holds no queue or dead "
            "letter of it (models there: toy)\n"
        )
    served = broker_cli("dead-letters", "list", "--name", "toy", *base, "--json")
    assert served.returncode == 0 and json.loads(served.stdout) == [], served.stderr


def test_dead_letters_purge_with_nothing_to_purge_says_so_without_asking(
    redis_server: RedisServer, prefix: str
) -> None:
    """No dead letter (or none old enough): nothing to confirm, exit status 0."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    client.xgroup_create(keys.stream, "workers", mkstream=True)
    base = ("--name", "toy", "--prefix", prefix, "--redis", redis_server.url)

    def purge(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # no one to answer a question: stdin at its end
            [sys.executable, "-m", "broker.cli", "dead-letters", "purge", *base, *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )

    none = purge()
    assert none.returncode == 0, none.stderr
    assert none.stdout == f"no dead letters of toy (prefix {prefix}): nothing to purge\n"
    assert none.stderr == ""
    client.xadd(keys.dead_letters, {"id": "x", "dead_reason": "test", "data": b"1"})
    recent = purge("--older-than", "1d")
    assert recent.returncode == 0, recent.stderr
    assert recent.stdout == (
        f"no dead letters of toy (prefix {prefix}) dead-lettered over 1d ago: nothing to purge\n"
    )
    asked = purge()  # one to purge: asked, and no one answers
    assert asked.returncode == 1 and client.xlen(keys.dead_letters) == 1


def setuser_rules(line: str) -> list[str]:
    """``ACL SETUSER`` arguments of an ACL file line (a selector in parentheses is one)."""
    return re.findall(r"\([^)]*\)|\S+", line)[1:]


def test_the_admin_user_replays_and_purges_dead_letters_and_writes_nothing_else(
    redis_server: RedisServer, prefix: str
) -> None:
    """Its XADD, INCRBY, XDEL and DEL held on every key of the prefix: an admin could delete a
    model's queue or write into its inboxes."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    dead = [client.xadd(keys.dead_letters, {**request_fields(f"r{i}", keys.inbox("c"), 5000,
            b"\x90"), "dead_reason": "test"}).decode() for i in range(3)]  # fmt: skip
    lines, _ = acl.render([prefix], environ={"MICROBATCH_REDIS_ADMIN_PASSWORD": "pw"})
    (admin_line,) = [line for line in lines if line.startswith(f"user {prefix}-admin ")]
    client.execute_command("ACL", "SETUSER", *setuser_rules(admin_line))
    client.acl_log_reset()
    url = redis_server.url.replace("redis://", f"redis://{prefix}-admin:pw@")
    named = ["--name", "toy", "--prefix", prefix, "--redis", url]
    try:
        replay = broker_cli("dead-letters", "replay", *named, "--id", dead[0])
        assert replay.returncode == 0, replay.stderr
        one = broker_cli("dead-letters", "purge", "--yes", *named, "--id", dead[1])
        rest = broker_cli("dead-letters", "purge", "--yes", *named)
        assert (one.returncode, rest.returncode) == (0, 0), one.stderr + rest.stderr
        assert client.acl_log() == []
        assert client.xlen(keys.stream) == 1 and not client.exists(keys.dead_letters)
        tenant = redis.Redis(port=redis_server.port, username=f"{prefix}-admin", password="pw")
        refused = [("DEL", keys.stream), ("XADD", keys.inbox("c"), "*", "a", "b"),
                   ("XDEL", keys.stream, "1-0"), ("INCRBY", keys.packed_items, "1")]  # fmt: skip
        for command in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                tenant.execute_command(*command)
        tenant.close()
    finally:
        client.execute_command("ACL", "DELUSER", f"{prefix}-admin")


def test_the_admin_user_replays_all_dead_letters_without_naming_them(
    redis_server: RedisServer, prefix: str
) -> None:
    """`replay` without --id reads the last dead letter first (XREVRANGE), which the admin
    user was not granted: Redis refused it, and only --id replays worked for it."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    for i in range(2):
        fields = request_fields(f"r{i}", keys.inbox("c"), 5000, b"\x90")
        client.xadd(keys.dead_letters, {**fields, "dead_reason": "test"})
    lines, _ = acl.render([prefix], environ={"MICROBATCH_REDIS_ADMIN_PASSWORD": "pw"})
    (admin_line,) = [line for line in lines if line.startswith(f"user {prefix}-admin ")]
    client.execute_command("ACL", "SETUSER", *setuser_rules(admin_line))
    client.acl_log_reset()
    url = redis_server.url.replace("redis://", f"redis://{prefix}-admin:pw@")
    try:
        replay = broker_cli("dead-letters", "replay", "--name", "toy", "--prefix", prefix,
                            "--redis", url)  # fmt: skip
        assert replay.returncode == 0, replay.stderr
        assert "replayed 2" in replay.stdout
        assert client.acl_log() == []
        assert client.xlen(keys.stream) == 2 and not client.xlen(keys.dead_letters)
    finally:
        client.execute_command("ACL", "DELUSER", f"{prefix}-admin")


def test_a_bad_name_or_prefix_is_a_bad_option() -> None:
    for args in (("status", "--prefix", "a:b"), ("dead-letters", "list", "--name", "MLP")):
        result = broker_cli(*args, "--redis", "redis://127.0.0.1:1/0")
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("Error: invalid"), result.stderr


def test_status_finds_a_high_priority_only_queue_and_skips_foreign_keys(
    redis_server: RedisServer, prefix: str
) -> None:
    """A model whose callers queued only at high priority (no worker has made its normal
    stream yet) is listed with what it holds; a stream named like a model's but with a name no
    model may have is not microbatch's, and must not stop the listing."""
    client = redis_server.client()
    streamer = Streamer("hionly", redis_url=redis_server.url, prefix=prefix, wait_for_workers=True)
    try:
        call = streamer.submit([b"a", b"b"], timeout=30, priority="high")
        wait_until(
            lambda: client.xlen(ModelKeys("hionly", prefix).at(1).stream) == 1, 10, "the entry"
        )
        client.xadd(f"mb:{{{prefix}:NotAModel}}:requests", {"v": "1"})
        client.xadd(ModelKeys("pipe.stage", prefix).stream, {"v": "1"})
        (found, stage) = admin.status(client, prefix)
        assert (found.model, found.high_stream_length, found.queued_items) == ("hionly", 1, 2)
        assert stage.model == "pipe.stage" and stage.stream_length == 1
        call.cancel()
    finally:
        streamer.close()


def test_a_count_below_one_is_a_bad_option_and_a_huge_one_lists_them_all(
    redis_server: RedisServer, prefix: str
) -> None:
    """--count 0 or -1 went to Redis and came back as 'Redis failed' (exit 1); a count over
    what Redis' COUNT takes, too."""
    client = redis_server.client()
    client.xadd(ModelKeys("toy", prefix).dead_letters, {"id": "x", "dead_reason": "test"})
    listing = ("dead-letters", "list", "--name", "toy", "--prefix", prefix, "--json")
    for count in ("0", "-1"):
        result = broker_cli(*listing, "--redis", redis_server.url, "--count", count)
        assert result.returncode == 2, result.stderr
        assert "Invalid value for '--count'" in result.stderr
    result = broker_cli(*listing, "--redis", redis_server.url, "--count", str(10**30))
    assert result.returncode == 0, result.stderr
    assert [letter["reason"] for letter in json.loads(result.stdout)] == ["test"]


def test_a_password_env_naming_anything_but_role_and_tenant_is_one_clear_line() -> None:
    """'{NOPE}' printed "Error: 'NOPE'", Python's KeyError."""
    for template in ("PW_{NOPE}", "PW_{ROLE", "PW_{}", "PW_{0}"):
        result = broker_cli("acl", "--prefix", "shop", "--password-env", template)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == (
            f"Error: --password-env may name {{ROLE}} and {{TENANT}} only, not {template!r}"
        )


def test_a_misspelt_variable_of_the_prefix_is_one_warning_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "broker.cli", "status", "--redis", "redis://127.0.0.1:1/0"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MICROBATCH_BROKER_PREFX": "shop"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1  # past the settings: Redis did not answer
    assert result.stderr.splitlines()[0] == (
        "Warning: MICROBATCH_BROKER_PREFX is not a setting of `broker`: ignored "
        "(did you mean MICROBATCH_BROKER_PREFIX?)"
    )


def test_a_dead_id_that_is_malformed_or_names_nothing_is_refused_and_nothing_is_done(
    redis_server: RedisServer, prefix: str
) -> None:
    """A malformed --id was a traceback (`1-0@x`), 'Redis failed' (purge `garbage`) or, like
    an id of no dead letter, 'replayed 0' with exit status 0: a typo looked like success."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    kept = client.xadd(keys.dead_letters, {"id": "x", "dead_reason": "test"}).decode()
    base = ("--name", "toy", "--prefix", prefix, "--redis", redis_server.url)
    for command in (("replay",), ("purge", "--yes")):
        for bad in ("garbage", "1-0@x", "1-0@300", "99999999999999999999-0", f"{kept}@"):
            result = broker_cli("dead-letters", *command, *base, "--id", bad)
            assert result.returncode == 2, result.stderr
            assert result.stderr.startswith(f"Error: --id: invalid dead id {bad!r}")
            assert "Traceback" not in result.stderr
        result = broker_cli("dead-letters", *command, *base, "--id", kept, "--id", f"{kept}@1")
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip() == (
            f"Error: no dead letter {kept}@1 of toy (prefix {prefix}); nothing done"
        )
        assert client.xlen(keys.dead_letters) == 1 and client.xlen(keys.stream) == 0
    purged = broker_cli("dead-letters", "purge", "--yes", *base, "--id", kept)
    assert purged.returncode == 0 and "purged 1" in purged.stdout


def test_replaying_all_dead_letters_reads_them_a_page_at_a_time(
    redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    for i in range(5):
        client.xadd(keys.dead_letters, {"id": f"r{i}", "data": b"xy", "dead_reason": "test"})
    monkeypatch.setattr(admin, "DEAD_PAGE", 2)
    assert admin.replay_dead_letters(client, keys).replayed == 5
    assert [fields[b"id"] for _, fields in client.xrange(keys.stream)] == [
        f"r{i}".encode() for i in range(5)
    ]
    assert client.xlen(keys.dead_letters) == 0 and client.get(keys.queued_bytes) == b"10"


def test_replay_leaves_dead_letters_without_a_request_and_counts_multi_item_ones(
    redis_server: RedisServer, prefix: str
) -> None:
    """A dead letter holding nothing but its dead_* fields stopped the replay ("XADD fields
    must be a non-empty dict") after replaying those before it; one shaped as a whole
    multi-item entry (a foreign worker's) was counted without its data.<i> bytes and packed
    items, which the workers then took below 0."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    client.xadd(keys.dead_letters, {"id": "r0", "data": b"xy", "dead_reason": "test"})
    empty = _text_id(client.xadd(keys.dead_letters, {"dead_reason": "x", "dead_entry": "1-1"}))
    items = {"id.0": "a", "data.0": b"abc", "id.1": "b", "data.1": b"d", "id.2": "c"}
    whole = {"v": "2", "n": "3", "reply": keys.inbox("c"), **items, "data.2": b"ef"}
    client.xadd(keys.dead_letters, {**whole, "dead_reason": "test"})
    listed = {letter.data_bytes for letter in admin.dead_letters(client, keys, 10)}
    assert listed == {2, 0, 6}
    base = ("--name", "toy", "--prefix", prefix, "--redis", redis_server.url)
    replayed = broker_cli("dead-letters", "replay", *base)
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout.strip() == "replayed 2 dead letter(s) of toy"
    assert replayed.stderr.strip() == (
        "note: left 1 dead letter(s) holding no request (nothing but their dead_* fields): "
        f"`broker dead-letters purge --name toy --id {empty}`"
    )
    assert client.xlen(keys.stream) == 2 and client.xlen(keys.dead_letters) == 1
    assert client.get(keys.queued_bytes) == b"8" and client.get(keys.packed_items) == b"2"


def _text_id(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def test_dead_letters_of_partitions_dropped_by_a_lower_count_are_listed_and_purged(
    redis_server: RedisServer, prefix: str
) -> None:
    """With --partitions lowered (the stored count 2, from 4), `status` showed partition 3's
    dead letters but `dead-letters` took the stored count: it listed none of them, and could
    neither replay nor purge them."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix, partitions=4)
    client.set(keys.partitions_key, 2)
    client.xadd(keys.stream, {"v": "1"})  # (a queue of the model, as workers leave it)
    dropped = keys.of(3)
    client.xadd(dropped.dead_letters, {"id": "r3", "dead_reason": "test"})
    base = ("--name", "toy", "--prefix", prefix, "--redis", redis_server.url)
    listed = broker_cli("dead-letters", "list", *base, "--json")
    assert listed.returncode == 0, listed.stderr
    (letter,) = json.loads(listed.stdout)
    assert (letter["request_id"], letter["partition"]) == ("r3", 3)
    assert letter["dead_id"].endswith("@3")
    purged = broker_cli("dead-letters", "purge", "--yes", *base)
    assert purged.returncode == 0 and "purged 1" in purged.stdout, purged.stderr
    assert not client.exists(dropped.dead_letters)


def test_dead_letters_of_a_pipeline_s_later_stage_are_named_as_the_docs_say(
    redis_server: RedisServer, prefix: str
) -> None:
    """`--name sentiment.classifier` (docs/pipelines.md) was refused as an invalid model
    name, exit status 2: a later stage's dead letters were out of the command's reach."""
    client = redis_server.client()
    stage = ModelKeys("chain.polarity", prefix)
    client.xadd(stage.dead_letters, {"id": "r1", "dead_reason": "test"})
    base = ("--name", "chain.polarity", "--prefix", prefix, "--redis", redis_server.url)
    listed = broker_cli("dead-letters", "list", *base, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [letter["request_id"] for letter in json.loads(listed.stdout)] == ["r1"]
    purged = broker_cli("dead-letters", "purge", "--yes", *base)
    assert "purged 1" in purged.stdout and not client.exists(stage.dead_letters)
    for bad in ("chain.", ".polarity", "a.b.c"):
        refused = broker_cli("dead-letters", "list", "--name", bad, "--redis", redis_server.url)
        assert refused.returncode == 2 and refused.stderr.startswith("Error: invalid model name")


def _keys_of(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Every key of ``prefix`` with its TTL in ms (-1: none)."""
    return {key.decode(): client.pttl(key) for key in client.scan_iter(f"mb:{{{prefix}:*")}


def test_forget_deletes_what_a_removed_model_left_and_nothing_while_it_is_in_use(
    redis_server: RedisServer, prefix: str
) -> None:
    """A model removed from a deployment left its streams, consumer group, counters, bound,
    sets and partition count in Redis for good, with no TTL and no command to delete them."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    base = ("--name", "toy", "--prefix", prefix, "--redis", redis_server.url)
    with worker_process(redis_server.url, "tests.models:Toy", prefix):
        with Streamer("toy", redis_url=redis_server.url, prefix=prefix) as streamer:
            streamer.predict([1, 2])
            streamer.predict([3], priority="high")
        in_use = broker_cli("forget", "--yes", *base)
        assert in_use.returncode == 1, in_use.stderr
        assert "has 1 live worker(s), which read all of its 1 partition(s)" in in_use.stderr
        assert client.exists(keys.stream, keys.queue_bound) == 2
    client.zadd(keys.cancelled, {"1-0": 1})  # (left by a caller, pruned by workers only)
    # a call withdrawn a moment ago, which a pipeline's later stages may still hold
    client.zadd(keys.withdrawn, {"c.7": int(time.time() * 1000) + 60_000})
    client.xadd(keys.stream, {"v": "1"})
    queued = broker_cli("forget", "--yes", *base)
    assert queued.returncode == 1
    assert queued.stderr.strip() == (
        f"Error: not forgetting toy (prefix {prefix}): partition 0 holds 1 entry(ies) queued "
        "or pending"
    )
    client.delete(keys.stream)
    client.xadd(keys.at(1).stream, {"v": "1"})
    client.xtrim(keys.at(1).stream, maxlen=0)  # an empty stream, as workers leave it
    left = _keys_of(client, prefix)
    assert [key for key, ttl in left.items() if ttl < 0]  # what nothing deleted before
    forgot = broker_cli("forget", "--yes", *base)
    assert forgot.returncode == 0, forgot.stderr
    assert forgot.stdout.startswith(f"forgot toy (prefix {prefix}): deleted ")
    assert {key: ttl for key, ttl in _keys_of(client, prefix).items() if ttl < 0} == {}
    # the withdrawn set is left to expire (it was deleted: later stages computed those calls)
    assert client.zscore(keys.withdrawn, "c.7") is not None
    assert 0 < client.pttl(keys.withdrawn) <= functions.CANCELLED_TTL_MS
    unknown = broker_cli("forget", "--yes", *base)
    assert unknown.returncode == 1 and "no model 'toy'" in unknown.stderr


def test_forget_deletes_the_partitions_live_workers_no_longer_read(
    redis_server: RedisServer, prefix: str
) -> None:
    """After --partitions was lowered (4 to 2), the dropped partitions' keys stayed for good
    (and `broker status` listed them as the model's)."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix, partitions=4)
    now_ms = int(client.time()[0]) * 1000
    client.set(keys.partitions_key, 2)
    for part in keys.each():
        client.xgroup_create(part.stream, part.group, "0", mkstream=True)
        client.hset(part.queue_bound, mapping={"items": 8, "bytes": 0})
    for part in keys.each()[:2]:  # a live worker of 2 partitions vouches in each
        client.zadd(part.consumers, {"w-1": now_ms + 600_000})
    # and one still started with 4 (the stored count is the last written): not its partitions
    client.zadd(keys.of(3).consumers, {"w-2": now_ms + 600_000})
    base = ("--name", "toy", "--prefix", prefix, "--redis", redis_server.url)
    assert "they no longer read partition 2\n" in broker_cli("forget", *base).stdout
    client.delete(keys.of(3).consumers)
    client.xadd(keys.of(3).dead_letters, {"id": "r", "dead_reason": "test"})
    refused = broker_cli("forget", "--yes", *base)
    assert refused.returncode == 1
    assert "partitions 2, 3 of toy" in refused.stderr
    assert "partition 3 holds 1 dead letter(s)" in refused.stderr
    assert broker_cli("dead-letters", "purge", "--yes", *base).returncode == 0
    forgot = broker_cli("forget", "--yes", *base)
    assert forgot.returncode == 0, forgot.stderr
    assert "they no longer read partitions 2, 3" in forgot.stdout
    assert f"forgot partitions 2, 3 of toy (prefix {prefix}): deleted 4 key(s)" in forgot.stdout
    left = _keys_of(client, prefix)
    assert not [key for key in left if ":p2}" in key or ":p3}" in key]
    assert {keys.stream, keys.of(1).stream, keys.consumers, keys.partitions_key} <= set(left)
    (model,) = admin.status(client, prefix)
    assert len(model.partitions) == 2


def test_status_of_a_prefix_without_queues_says_which_prefixes_have_some(
    redis_server: RedisServer, prefix: str
) -> None:
    """A misspelt --prefix printed empty tables and exit status 0, as an idle deployment."""
    functions.load(redis_server.client())  # (no note about the library either)
    redis_server.client().xadd(ModelKeys("toy", prefix).stream, {"v": "1"})
    result = broker_cli("status", "--redis", redis_server.url, "--prefix", f"{prefix}x")
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"note: no queue under prefix '{prefix}x' (prefixes with")
    assert prefix in result.stderr.split("prefixes with queues: ")[1]
    listed = broker_cli("status", "--redis", redis_server.url, "--prefix", prefix)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    as_json = broker_cli("status", "--redis", redis_server.url, "--prefix", f"{prefix}x", "--json")
    assert (as_json.stdout.strip(), as_json.stderr) == ("[]", "")


def test_status_says_when_the_functions_library_is_missing_or_older(
    redis_server: RedisServer, prefix: str
) -> None:
    """Workers whose Redis user may not load functions serve on with an older library (a
    warning in each worker's log): nothing an operator looks at said so."""
    admin_client = redis_server.client()
    admin_client.xadd(ModelKeys("toy", prefix).stream, {"v": "1"})
    status = ("status", "--redis", redis_server.url, "--prefix", prefix)
    try:
        admin_client.function_flush()
        missing = broker_cli(*status)
        assert missing.returncode == 0
        assert missing.stderr.startswith("note: the microbatch functions library is not loaded")
        assert "broker functions load" in missing.stderr
        older = functions.CODE.replace(
            f"local VERSION, REVISION = {functions.VERSION}, {functions.REVISION}\n",
            f"local VERSION, REVISION = {functions.VERSION}, {functions.REVISION - 1}\n",
        )
        admin_client.function_load(older, True)
        old = broker_cli(*status)
        assert old.stderr.startswith(
            f"note: the microbatch functions library is version {functions.VERSION} revision "
            f"{functions.REVISION - 1}, older than this release's"
        ), old.stderr
    finally:
        functions.load(admin_client)
    assert broker_cli(*status).stderr == ""


def test_dead_letters_list_says_how_many_it_leaves_out(
    redis_server: RedisServer, prefix: str
) -> None:
    """--count 100 (the default) of 2,500 dead letters showed 100 rows and no hint of more."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix, partitions=2)
    client.set(keys.partitions_key, 2)
    for part in (keys, keys.of(1), keys.at(1)):
        client.xadd(part.dead_letters, {"id": "x", "dead_reason": "test"})
    listing = ("dead-letters", "list", "--name", "toy", "--prefix", prefix)
    some = broker_cli(*listing, "--redis", redis_server.url, "--count", "2")
    assert some.returncode == 0, some.stderr
    title = " ".join(some.stdout.split())  # (a title wider than the table wraps)
    assert f"dead letters of toy (prefix {prefix}): 2 of 3, the oldest first " in title
    every = " ".join(broker_cli(*listing, "--redis", redis_server.url).stdout.split())
    assert f"dead letters of toy (prefix {prefix}): 3 " in every


def test_status_counts_workers_gone_for_good_instead_of_a_row_each(
    redis_server: RedisServer, prefix: str
) -> None:
    """After an hour of worker restarts, `status` showed one row per worker gone (60 after
    60 restarts), each 'idle 0.0' as if it had just read, though it had left the group."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    now_ms = int(client.time()[0]) * 1000
    client.xgroup_create(keys.stream, keys.group, "0", mkstream=True)
    client.xadd(keys.stream, {"v": "1"})
    client.xreadgroup(keys.group, "holder-1", {keys.stream: ">"})  # died holding an entry
    client.zadd(keys.consumers, {f"gone-{i}": now_ms - 60_000 for i in range(3)})
    client.zadd(keys.consumers, {"holder-1": now_ms - 60_000})
    human = broker_cli("status", "--redis", redis_server.url, "--prefix", prefix)
    assert human.returncode == 0, human.stderr
    assert "holder-1" in human.stdout and "gone-" not in human.stdout
    assert "not shown: 3 worker(s) gone, holding nothing" in " ".join(human.stdout.split())
    as_json = broker_cli("status", "--redis", redis_server.url, "--prefix", prefix, "--json")
    (model,) = json.loads(as_json.stdout)
    in_group = {c["name"]: c["in_group"] for c in model["consumers"]}
    assert in_group == {"holder-1": True, "gone-0": False, "gone-1": False, "gone-2": False}


def test_purge_older_than_keeps_the_recent_dead_letters_for_a_periodic_clean_up(
    redis_server: RedisServer, prefix: str
) -> None:
    """Dead letters are uncapped, and purge could only delete all of them (those just
    dead-lettered, not looked at yet, too) or name each: no clean-up to run periodically."""
    client = redis_server.client()
    keys = ModelKeys("toy", prefix)
    now_ms = int(client.time()[0]) * 1000
    for lane, ms in ((keys, now_ms - 3 * 86_400_000), (keys.at(1), now_ms - 90_000)):
        client.xadd(lane.dead_letters, {"id": "old", "dead_reason": "t"}, id=f"{ms}-0")
        client.xadd(lane.dead_letters, {"id": "new", "dead_reason": "t"})
    lines, _ = acl.render([prefix], environ={"MICROBATCH_REDIS_ADMIN_PASSWORD": "pw"})
    (admin_line,) = [line for line in lines if line.startswith(f"user {prefix}-admin ")]
    client.execute_command("ACL", "SETUSER", *setuser_rules(admin_line))
    client.acl_log_reset()
    url = redis_server.url.replace("redis://", f"redis://{prefix}-admin:pw@")
    purge = ("dead-letters", "purge", "--yes", "--name", "toy", "--prefix", prefix, "--redis", url)
    try:
        for bad in ("7x", "-1", "d", "1e3", "9" * 30 + "d"):
            refused = broker_cli(*purge, f"--older-than={bad}")
            assert refused.returncode == 2, refused.stderr
            assert refused.stderr.startswith(f"Error: --older-than: {bad!r} is not an age")
        both = broker_cli(*purge, "--older-than", "1d", "--id", f"{now_ms}-0")
        assert (both.returncode, both.stderr) == (2, "Error: give --id or --older-than, not both\n")
        days = broker_cli(*purge, "--older-than", "2d")
        assert days.stdout == "purged 1 dead letter(s) of toy dead-lettered over 2d ago\n"
        minute = broker_cli(*purge, "--older-than", "60")
        assert minute.returncode == 0, minute.stderr
        assert minute.stdout == "purged 1 dead letter(s) of toy dead-lettered over 60s ago\n"
        assert client.acl_log() == []
    finally:
        client.execute_command("ACL", "DELUSER", f"{prefix}-admin")
    left = [fields[b"id"] for lane in (keys, keys.at(1)) for _, fields in
            client.xrange(lane.dead_letters)]  # fmt: skip
    assert left == [b"new", b"new"]


@contextmanager
def watching(prefix: str, redis_url: str) -> Iterator[subprocess.Popen[str]]:
    """`broker status --watch` as a process of its own (it runs until a signal), its output
    piped; killed on the way out if it still runs."""
    command = [sys.executable, "-m", "broker.cli", "status", "--watch", "--prefix", prefix]
    watch = subprocess.Popen(
        [*command, "--redis", redis_url],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield watch
    finally:
        watch.kill()
        watch.wait()


def stopped_by_ctrl_c(watch: subprocess.Popen[str]) -> tuple[str, str]:
    """Ctrl-C (SIGINT) to a watch: its stdout and stderr, once it has exited with status 0."""
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=10)
    assert watch.returncode == 0, err
    return out, err


def test_a_status_watch_waits_for_a_redis_not_answering_yet(prefix: str) -> None:
    """`status --watch` started before Redis answers (a pane opened while Redis restarts)
    exited at once with 'cannot reach Redis' (status 1), though its help promises to ride out
    outages; it now says so once, waits, and shows the status once Redis answers."""
    port = free_port()
    with watching(prefix, f"redis://127.0.0.1:{port}/0") as watch:
        time.sleep(3)
        assert watch.poll() is None, watch.communicate()
        with RedisServer(port=port):
            time.sleep(3)
            assert watch.poll() is None
            out, err = stopped_by_ctrl_c(watch)
    assert err.count("Redis cannot be reached") == 1, err
    assert "microbatch models" in out, out  # the status tables, once Redis answered


def test_a_status_watch_into_a_pipe_writes_every_frame(
    redis_server: RedisServer, prefix: str
) -> None:
    """Into a pipe (`status --watch | tee log`) a watch wrote nothing until it stopped, and
    then only its last frame: each refresh now follows the last, under a line with its time."""
    client = redis_server.client()
    client.xgroup_create(ModelKeys("toy", prefix).stream, "workers", mkstream=True)
    with watching(prefix, redis_server.url) as watch:
        # each frame is written as it is shown (not held in a buffer)
        shown, _, _ = select.select([watch.stdout], [], [], 10)
        time.sleep(2.5)
        out, _ = stopped_by_ctrl_c(watch)
    assert shown, out
    assert re.match(r"== \d\d:\d\d:\d\d ==\n", out), out
    frames = re.findall(r"^== \d\d:\d\d:\d\d ==$", out, re.MULTILINE)
    assert len(frames) >= 3, out
    assert out.count("toy") == len(frames), out  # each frame whole
    assert out.endswith("\n"), out


def test_a_status_watch_rides_out_redis_being_away(redis_server: RedisServer) -> None:
    """`status --watch` exited with a traceback-free 'Redis failed' (status 1) at the first
    refresh after Redis went away (a restart, a failover), ending the operator's watch."""
    from rich.text import Text

    from broker.cli import _watched_status
    from broker.devserver import free_port

    away = redis.Redis(port=free_port(), socket_connect_timeout=1)
    shown = _watched_status(away, None)
    assert isinstance(shown, Text) and "Redis cannot be reached" in shown.plain
    assert not isinstance(_watched_status(redis_server.client(), None), Text)


def test_status_refuses_watch_with_json() -> None:
    """--json printed one snapshot and exited 0, silently dropping --watch: a script that
    meant to follow the queue stopped after one read."""
    result = broker_cli("status", "--watch", "--json", "--redis", "redis://127.0.0.1:1/0")
    assert result.returncode == 2, result.stderr
    assert result.stderr == "Error: --watch refreshes the tables: it takes no --json\n"
    assert result.stdout == ""


def test_a_service_user_refused_by_status_is_told_which_user_may(
    redis_server: RedisServer, prefix: str
) -> None:
    """The NOPERM of a gateway's user said "give --prefix", which fails the same way with it:
    only the tenant's admin user (or the operator) may read the queues."""
    client = redis_server.client()
    lines, _ = acl.render([prefix], environ={"MICROBATCH_REDIS_GATEWAY_PASSWORD": "pw"})
    (gateway_line,) = [line for line in lines if line.startswith(f"user {prefix}-gateway ")]
    client.execute_command("ACL", "SETUSER", *setuser_rules(gateway_line))
    url = redis_server.url.replace("redis://", f"redis://{prefix}-gateway:pw@")
    try:
        for extra in ((), ("--prefix", prefix)):
            result = broker_cli("status", "--redis", url, *extra)
            assert result.returncode == 1, result.stderr
            assert "by the operator" in result.stderr and "admin user" in result.stderr
    finally:
        client.execute_command("ACL", "DELUSER", f"{prefix}-gateway")
