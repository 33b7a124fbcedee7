"""`broker`: look at queues and workers, and manage dead letters. A thin layer over admin."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import redis
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from . import acl, admin, connections, functions
from .cli_common import (
    check_environment,
    checked,
    fail,
    log_format_option,
    log_level_option,
    new_app,
    prefix_option,
    redis_option,
    run_app,
    version_option,
)
from .client import DEFAULT_REDIS_URL
from .keys import DEFAULT_PREFIX, ModelKeys, check_keys_name
from .logs import configure_logging
from .redis_url import RedisURLError, credentials_refused

ENV = "MICROBATCH_BROKER_"
MAX_COUNT = 2**63 - 1  # the most Redis' XRANGE ... COUNT takes
EXIT_STATUS = (
    "Exit status: 0 on success; 1 when Redis cannot be reached or refuses a command (an ACL "
    "user's NOPERM, say), or (dead-letters, forget) holds nothing of the named model, or "
    "(dead-letters) no dead letter of an --id given, or (forget) the model is in use, or "
    "(purge, forget) the confirmation was declined; 2 for a bad option; 130 for a "
    "Ctrl-C while the command is still being loaded."
)

app = new_app(
    "Inspect microbatch queues and workers in Redis, and manage dead letters.",
    epilog=EXIT_STATUS,
)
dead_app = new_app(
    "Requests that could not be answered normally (poison requests, malformed entries)."
)
app.add_typer(
    dead_app,
    name="dead-letters",
    short_help="List, replay or purge dead letters (requests that could not be answered).",
)


@app.callback()
def _root(
    version: Annotated[bool, version_option()] = False,
    log_level: Annotated[str, log_level_option(f"{ENV}LOG_LEVEL")] = "warning",
    log_format: Annotated[str, log_format_option(f"{ENV}LOG_FORMAT")] = "text",
) -> None:
    """microbatch queues, workers and dead letters."""
    read = ("LOG_LEVEL", "LOG_FORMAT", "NAME", "PREFIX")
    check_environment("broker", ENV, (f"{ENV}{name}" for name in read))
    configure_logging(log_level, log_format)


functions_app = new_app(
    "The Redis Functions library that gateways, callers and workers call (microbatch)."
)
app.add_typer(
    functions_app,
    name="functions",
    short_help="Load the Redis Functions library, or print its code.",
)


RedisOption = Annotated[str, redis_option()]
NameOption = Annotated[
    str,
    typer.Option(
        "--name",
        envvar=f"{ENV}NAME",
        help="The model's name, e.g. mlp (a pipeline's later stage: <pipeline>.<stage>).",
        callback=checked(check_keys_name),
    ),
]
PrefixOption = Annotated[str, prefix_option("The deployment's key prefix.", f"{ENV}PREFIX")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def _connect(url: str, wait: bool = False) -> redis.Redis:
    """A client of ``url`` that Redis answered; else one line and exit status 1 (2 for a bad
    URL). ``wait``: while Redis cannot be reached, say so once and try again every second."""
    try:
        client = connections.sync_client(url, socket_connect_timeout=2, socket_timeout=5)
    except RedisURLError as exc:
        fail(f"--redis: {exc}", 2)
    said = False
    while True:
        try:
            client.ping()
            break
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
            fail(f"Redis {credentials_refused(url, exc)}", 1)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not wait:
                fail(f"cannot reach Redis: {exc}", 1)
            if not said:
                typer.echo(f"Redis cannot be reached ({exc}); trying again every second", err=True)
                said = True
            time.sleep(1.0)
        except redis.RedisError as exc:
            fail(f"cannot reach Redis: {exc}", 1)
    misuse = connections.cluster_node_misuse(client, url)
    if misuse:
        fail(f"--redis: {misuse}", 2)
    return client


@contextmanager
def _redis_errors(prefix: str | None) -> Iterator[None]:
    """A Redis error after connecting (a tenant user's NOPERM, a lost connection) as one
    line and exit status 1, not a traceback."""
    try:
        yield
    except redis.exceptions.NoPermissionError as exc:
        fail(f"Redis refused a command to this user: {exc}{_refusal_hint(prefix)}", 1)
    except redis.RedisError as exc:
        fail(f"Redis failed: {exc}", 1)


def _refusal_hint(prefix: str | None) -> str:
    """Which users may read the queues: a service user's NOPERM is no typo in the command."""
    if prefix:
        return " (the queues are read by the tenant's admin user, or by the operator)"
    return (
        " (every prefix is read by the operator; a tenant's admin user reads its own: "
        "give --prefix)"
    )


def _served_keys(client: redis.Redis, name: str, prefix: str) -> ModelKeys:
    """The keys of model ``name`` under ``prefix``; exit status 1 if Redis holds neither a
    queue nor a dead letter of it (a misspelt name would otherwise list nothing, silently)."""
    keys = admin.served_keys(client, name, prefix)
    if any(client.xlen(lane.dead_letters) for lane in keys.lanes()):
        return keys
    models = {found.model for found in admin.find_models(client, prefix) if found.prefix == prefix}
    if name in models:
        return keys
    known = ", ".join(sorted(models))
    fail(
        f"no model {name!r} under prefix {prefix!r}: Redis holds no queue or dead letter of it "
        f"(models there: {known or 'none'})",
        1,
    )


def _confirm(question: str) -> None:
    """Ask ``question``; exit status 1, deleting nothing, unless the answer is yes (without a
    terminal to answer, say how to confirm instead: click's bare 'Aborted!' did not)."""
    try:
        confirmed = typer.confirm(question)
    except typer.Abort:  # stdin closed: no one to answer
        confirmed = False
        typer.echo("", err=True)
    if not confirmed:
        fail("nothing deleted: not confirmed (give --yes to confirm without being asked)", 1)


def _print(renderable: RenderableType) -> None:
    """Print tables whole: never cut at the terminal's width (or at 80 columns in a pipe);
    a terminal narrower than the tables wraps their lines instead."""
    console = Console()
    needed = Console(width=100_000).measure(renderable).maximum
    if needed > console.width:
        console = Console(width=needed)
    console.print(renderable)


def _inert(value: str) -> Text:
    """``value`` shown as it is, nothing in it read as markup, and unprintable characters
    (escape sequences, newlines) written as Python escapes: never acted on by a terminal."""
    return Text("".join(c if c.isprintable() else repr(c)[1:-1] for c in value))


def _table(title: str, columns: list[str], right: tuple[str, ...] = ()) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", no_wrap=True)
    return table


def _shown_lanes(model: admin.ModelStatus) -> list[admin.PartitionStatus]:
    """The queues of a model worth a line each: its partitions (if several), and the high
    level of those whose high level holds anything."""
    high = [p for p in model.high if p.stream_length or p.pending or p.dead_letters]
    if len(model.partitions) > 1 or high:
        return [*model.partitions, *high]
    return []


def _status_tables(models: list[admin.ModelStatus]) -> Group:
    counts = ("queued", "pending", "queued bytes", "live workers", "dead letters")
    summary = _table("microbatch models", ["prefix", "model", *counts], right=counts)
    columns = ["prefix", "model", "consumer", "alive", "pending", "idle s", "heartbeat s"]
    workers = _table(
        "workers", [*columns, "batch", "batch s"], right=("pending", "idle s", "heartbeat s")
    )
    gone = 0
    shares = ("queued", "pending", "queued bytes", "dead letters", "bound items", "bound bytes")
    on_nodes = any(part.node for model in models for part in model.partitions)
    lanes = ["prefix", "model", "partition", *(["node"] if on_nodes else []), "priority"]
    partitions = _table("partitions", [*lanes, *shares], right=shares)
    for model in models:
        summary.add_row(
            model.prefix,
            model.model,
            str(model.queued_items),
            str(model.pending),
            str(model.queued_bytes),
            str(model.live_consumers),
            str(model.dead_letters),
        )
        for part in _shown_lanes(model):
            partitions.add_row(
                model.prefix,
                model.model,
                str(part.partition),
                *([part.node] if on_nodes else []),
                part.priority,
                str(part.queued_items),
                str(part.pending),
                str(part.queued_bytes),
                str(part.dead_letters),
                str(part.queue_bound_items) if part.queue_bound_items else "-",
                str(part.queue_bound_bytes) if part.queue_bound_bytes else "-",
            )
        for consumer in model.consumers:
            if not consumer.alive and not consumer.in_group:
                gone += 1  # (its heartbeat lapsed; the consumers set forgets it in an hour)
                continue
            expires = consumer.heartbeat_expires_in_ms
            workers.add_row(
                model.prefix,
                model.model,
                _inert(consumer.name),  # any name a worker user gave XREADGROUP
                "yes" if consumer.alive else "no",
                str(consumer.pending) if consumer.in_group else "-",
                f"{consumer.idle_ms / 1000:.1f}" if consumer.in_group else "-",
                "-" if expires is None else f"{expires / 1000:+.1f}",
                str(consumer.current_batch) if consumer.current_batch else "-",
                f"{consumer.current_batch_ms / 1000:.1f}" if consumer.current_batch else "-",
            )
    if gone:
        workers.caption = (
            f"not shown: {gone} worker(s) gone, holding nothing (heartbeat lapsed within the "
            "hour; --json lists them)"
        )
        workers.caption_justify = "left"
    if partitions.rows:  # only models spread over partitions or with high-priority entries
        return Group(summary, partitions, workers)
    return Group(summary, workers)


@app.command(short_help="Each model's queue and its workers.")
def status(
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    prefix: Annotated[
        str | None, prefix_option("Only this prefix [default: every prefix].", f"{ENV}PREFIX")
    ] = None,
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="Refresh the tables every second, through Redis outages, also one at the "
            "start (a line says Redis cannot be reached until it answers); Ctrl-C stops. Not "
            "with --json. Into a pipe or a file, each second's tables follow the last, under a "
            "line with the time (== HH:MM:SS ==).",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Each model's queue (stream length, pending, dead letters) and its workers."""
    if watch and as_json:
        fail("--watch refreshes the tables: it takes no --json")
    try:
        client = _connect(redis_url, wait=watch)
    except KeyboardInterrupt:  # a watch stopped before Redis answered
        return
    with _redis_errors(prefix):
        if as_json:
            typer.echo(json.dumps([m.as_dict() for m in admin.status(client, prefix)], indent=2))
            return
        if not watch:
            models = admin.status(client, prefix)
            _print(_status_tables(models))
            if not models:
                _say_where_models_are(client, prefix)
            _say_if_library_is_old(client)
            return
        try:
            if Console().is_terminal:
                _watch_live(client, prefix)
            else:
                _watch_frames(client, prefix)
        except KeyboardInterrupt:
            pass


def _watch_live(client: redis.Redis, prefix: str | None) -> None:
    """Refresh the status tables in place, every second, until Ctrl-C."""
    with Live(_status_tables(admin.status(client, prefix)), console=Console()) as live:
        while True:
            time.sleep(1.0)
            live.update(_watched_status(client, prefix))


def _watch_frames(client: redis.Redis, prefix: str | None) -> None:
    """Into a pipe or a file (`status --watch | tee log`), where a refresh in place would
    leave only the last frame: write each second's tables after the last, under a line with
    the time (``== HH:MM:SS ==``) and followed by an empty line, each written out at once.
    A reader that goes away (`| head`) ends it."""
    shown: RenderableType = _status_tables(admin.status(client, prefix))
    try:
        while True:
            typer.echo(f"== {time.strftime('%H:%M:%S')} ==")
            _print(shown)
            typer.echo("")
            sys.stdout.flush()
            time.sleep(1.0)
            shown = _watched_status(client, prefix)
    except BrokenPipeError:
        # (Python's own flush at exit would fail again, with a warning)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _watched_status(client: redis.Redis, prefix: str | None) -> RenderableType:
    """The status tables, or, while Redis cannot be reached, a line saying so: a watch rides
    out an outage (a restart, a failover) instead of exiting."""
    try:
        return _status_tables(admin.status(client, prefix))
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        when = time.strftime("%H:%M:%S")
        return Text(f"{when} Redis cannot be reached ({exc}); trying again every second")


def _say_if_library_is_old(client: redis.Redis) -> None:
    """A note (stderr) where the functions library is missing from Redis (from a primary of a
    cluster) or older than this release's; nothing for a user who may not list functions."""
    try:
        loaded = functions.loaded_release(client)
    except redis.ResponseError:  # NOPERM
        return
    ours = functions.THIS_RELEASE
    if loaded is None:
        said = "is not loaded (callers and workers whose Redis user may load it do so themselves)"
    elif loaded < ours:
        said = (
            f"is {functions.describe_release(loaded)}, older than this release's "
            f"{functions.describe_release(ours)}"
        )
    else:
        return
    typer.echo(f"note: the microbatch functions library {said}: {functions.HOW_TO_LOAD}", err=True)


def _say_where_models_are(client: redis.Redis, prefix: str | None) -> None:
    """A note (stderr) for a status that found no model: a misspelt --prefix shows empty
    tables otherwise, as an idle deployment would."""
    if prefix is None:
        typer.echo("note: this Redis holds no microbatch queue", err=True)
        return
    others = ", ".join(admin.prefixes(client)) or "none"
    typer.echo(f"note: no queue under prefix {prefix!r} (prefixes with queues: {others})", err=True)


@dead_app.command("list")
def list_dead(
    name: NameOption,
    prefix: PrefixOption = DEFAULT_PREFIX,
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    count: Annotated[
        int, typer.Option(min=1, help="Show at most this many, the oldest first.")
    ] = 100,
    as_json: JsonOption = False,
) -> None:
    """List dead letters (ids, reasons and sizes; never payloads)."""
    client = _connect(redis_url)
    count = min(count, MAX_COUNT)  # more than Redis' COUNT takes is all of them
    with _redis_errors(prefix):
        keys = _served_keys(client, name, prefix)
        letters = admin.dead_letters(client, keys, count)
        total = sum(int(client.xlen(lane.dead_letters)) for lane in keys.lanes())
    if as_json:
        typer.echo(json.dumps([letter.__dict__ for letter in letters], indent=2))
        return
    shown = f"{len(letters)} of {total}, the oldest first" if total > len(letters) else total
    table = _table(
        f"dead letters of {name} (prefix {prefix}): {shown}",
        ["dead id", "request id", "reason", "bytes", "age s"],
        right=("bytes", "age s"),
    )
    for letter in letters:
        table.add_row(
            letter.dead_id,
            _inert(letter.request_id),  # written by any caller
            _inert(letter.reason),  # any writer of the dead-letter stream
            str(letter.data_bytes),
            f"{letter.age_s:.0f}",
        )
    _print(table)


def _check_ids(ids: list[str] | None) -> list[str] | None:
    """Each --id as `dead-letters list` shows it, else one error line and exit status 2."""
    for text in ids or ():
        try:
            admin.parse_dead_id(text)
        except ValueError as exc:
            fail(f"--id: {exc}")
    return ids or None  # (no --id: all of them)


IdsOption = Annotated[
    list[str] | None,
    typer.Option(
        "--id",
        help="Only this dead id, as `dead-letters list` shows it (repeatable) [default: all].",
        callback=_check_ids,
    ),
]


def _dead_targets(client: redis.Redis, name: str, prefix: str, ids: list[str] | None) -> ModelKeys:
    """The keys of the model whose dead letters the command acts on; exit status 1 (nothing
    done) if one of ``ids`` names no dead letter of it."""
    keys = _served_keys(client, name, prefix)
    missing = admin.missing_dead_letters(client, keys, ids) if ids else []
    if missing:
        fail(f"no dead letter {', '.join(missing)} of {name} (prefix {prefix}); nothing done", 1)
    return keys


@dead_app.command(short_help="Queue dead letters again (after fixing the model).")
def replay(
    name: NameOption,
    prefix: PrefixOption = DEFAULT_PREFIX,
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    ids: IdsOption = None,
) -> None:
    """Queue dead letters again (after fixing the model); they leave the dead-letter stream."""
    client = _connect(redis_url)
    with _redis_errors(prefix):
        replayed = admin.replay_dead_letters(client, _dead_targets(client, name, prefix, ids), ids)
    typer.echo(f"replayed {replayed.replayed} dead letter(s) of {name}")
    if replayed.empty:
        shown = " ".join(f"--id {dead}" for dead in replayed.empty[:10])
        more = f" (and {len(replayed.empty) - 10} more)" if len(replayed.empty) > 10 else ""
        typer.echo(
            f"note: left {len(replayed.empty)} dead letter(s) holding no request (nothing but "
            f"their dead_* fields): `broker dead-letters purge --name {name} {shown}`{more}",
            err=True,
        )


AGE = re.compile(r"([0-9]+(?:\.[0-9]*)?)([smhd]?)")  # an --older-than: 3600, 90m, 12h, 7d
AGE_UNITS_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _age_ms(value: str) -> int | None:
    """An --older-than age in ms, or None if it is not one."""
    match = AGE.fullmatch(value)
    if match is None:
        return None
    age_ms = float(match[1]) * AGE_UNITS_S[match[2]] * 1000
    return int(age_ms) if age_ms < 2**63 else None


def _age_text(value: str) -> str:
    """An --older-than age as said back: a bare number of seconds gets its unit (60s)."""
    return value + "s" if value[-1:].isdigit() or value.endswith(".") else value


def _check_age(value: str | None) -> str | None:
    if value is not None and _age_ms(value) is None:
        fail(f"--older-than: {value!r} is not an age: give e.g. 3600, 90m, 12h or 7d")
    return value


@dead_app.command()
def purge(
    name: NameOption,
    prefix: PrefixOption = DEFAULT_PREFIX,
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    ids: IdsOption = None,
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than",
            metavar="AGE",
            help="Only those dead-lettered longer ago than this: seconds, or with a unit "
            "(90m, 12h, 7d) [default: all]. For a periodic clean-up, with --yes.",
            callback=_check_age,
        ),
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete dead letters for good (asked first unless --yes; with none to delete, says so and
    asks nothing)."""
    if ids and older_than is not None:
        fail("give --id or --older-than, not both")
    which = f" dead-lettered over {_age_text(older_than)} ago" if older_than is not None else ""
    age_ms = None if older_than is None else _age_ms(older_than) or 0
    client = _connect(redis_url)
    with _redis_errors(prefix):
        keys = _dead_targets(client, name, prefix, ids)
        if not ids and not admin.has_dead_letters(client, keys, age_ms):
            typer.echo(f"no dead letters of {name} (prefix {prefix}){which}: nothing to purge")
            return
    if not yes:
        _confirm(f"Delete dead letters of {name} (prefix {prefix}){which}?")
    with _redis_errors(prefix):
        if age_ms is not None:
            count = admin.purge_old_dead_letters(client, keys, age_ms)
        else:
            count = admin.purge_dead_letters(client, keys, ids)
    typer.echo(f"purged {count} dead letter(s) of {name}{which}")


def _partition_list(parts: list[ModelKeys]) -> str:
    numbers = [part.partition for part in parts]
    if len(numbers) > 2 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"partitions {numbers[0]}-{numbers[-1]}"
    return ("partition " if len(numbers) == 1 else "partitions ") + ", ".join(map(str, numbers))


@app.command(short_help="Delete what Redis keeps of a model no worker serves any more.")
def forget(
    name: NameOption,
    prefix: PrefixOption = DEFAULT_PREFIX,
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete what Redis keeps of a model no worker serves any more (removed from the
    deployment), or, while live workers serve it, of the partitions they no longer read
    (after --partitions was lowered): its streams and consumer group, counters, queue bound,
    sets and partition count. Nothing else deletes them; heartbeats and inboxes expire by
    themselves.

    Refuses, deleting nothing (exit status 1), while any of it holds entries queued or pending,
    or dead letters: let the queue drain, and replay or purge the dead letters first. A worker
    started later simply begins anew. Needs a Redis user that may delete the prefix's keys:
    none of those `broker acl` prints may (a tenant's admin cannot delete a queue).
    """
    client = _connect(redis_url)
    with _redis_errors(prefix):
        keys = _served_keys(client, name, prefix)
        parts, live = admin.forgettable(client, keys)
        if not parts:
            fail(
                f"{name} (prefix {prefix}) has {live} live worker(s), which read all of its "
                f"{keys.partitions} partition(s): stop them first",
                1,
            )
        whole = len(parts) == keys.partitions
        what = name if whole else f"{_partition_list(parts)} of {name}"
        if not whole:
            typer.echo(
                f"{name} has {live} live worker(s); they no longer read {_partition_list(parts)}"
            )
        try:
            admin.check_forgettable(client, parts)
        except admin.ForgetRefused as exc:
            fail(f"not forgetting {what} (prefix {prefix}): {exc}", 1)
        if not yes:
            _confirm(f"Delete what Redis keeps of {what} (prefix {prefix})?")
        try:
            deleted = admin.forget(client, parts)
        except admin.ForgetRefused as exc:
            fail(f"not forgetting {what} (prefix {prefix}): {exc}", 1)
    typer.echo(f"forgot {what} (prefix {prefix}): deleted {deleted} key(s)")


@app.command("acl", short_help="Print the Redis ACL users of one or more tenants (prefixes).")
def acl_users(
    prefixes: Annotated[
        list[str] | None,
        typer.Option(
            "--prefix",
            help="Print the users of this prefix (tenant): PREFIX-gateway, -worker, -admin and "
            "-keda, each limited to the prefix's keys (repeatable).",
        ),
    ] = None,
    server: Annotated[
        bool,
        typer.Option(
            "--server",
            help="Also print the server-wide users: default (off), operator (loads the "
            "functions, reads every prefix, diagnosis), replication, sentinel and cluster (a "
            "Redis Cluster's administrator).",
        ),
    ] = False,
    password_env: Annotated[
        str,
        typer.Option(
            help="Name of the environment variable holding each user's password; {ROLE} "
            "becomes GATEWAY, WORKER, ADMIN, KEDA, OPERATOR, REPLICATION, SENTINEL or CLUSTER "
            "and {TENANT} the prefix in upper case ('.' and '-' as '_'). Several prefixes "
            "need {TENANT}.",
        ),
    ] = acl.DEFAULT_PASSWORD_ENV,
    redis_version: Annotated[
        str,
        typer.Option(
            help="The Redis version the users are for (X.Y): commands newer than it are left "
            "out, since Redis refuses an ACL naming a command it does not know. Give 7.2 or "
            "later on such a server, so that redis-py's CLIENT SETINFO is allowed.",
        ),
    ] = acl.OLDEST_REDIS,
    cluster: Annotated[
        bool,
        typer.Option(
            "--cluster",
            help="Also allow what cluster-aware clients send: CLUSTER SLOTS|SHARDS, ASKING, "
            "READONLY, COMMAND, MULTI and EXEC (a Redis Cluster).",
        ),
    ] = False,
    template: Annotated[
        bool,
        typer.Option(
            "--template",
            help="Print the template deploy/redis-start.sh renders (deploy/users.acl) instead.",
        ),
    ] = False,
) -> None:
    """Print Redis ACL users (ACL file lines) for one or more prefixes.

    Passwords come from environment variables and are printed only as SHA-256 hashes
    ('on #<hash>'); a user whose variable is unset or empty is printed 'off' (it cannot log
    in), and said so on stderr. Load the lines as Redis' aclfile, or as ACL SETUSER commands.
    """
    if template:
        typer.echo(acl.template(), nl=False)
        return
    if not prefixes and not server:
        fail("give --prefix PREFIX (repeatable), --server, or --template")
    try:
        lines, unset = acl.render(
            prefixes or [],
            server=server,
            password_env=password_env,
            redis_version=redis_version,
            cluster=cluster,
        )
    except ValueError as exc:
        fail(str(exc))
    for variable in unset:
        typer.echo(f"note: {variable} is not set: its user is off", err=True)
    typer.echo("\n".join(lines))


@functions_app.command("load")
def load_functions(redis_url: RedisOption = DEFAULT_REDIS_URL) -> None:
    """Load the microbatch library into Redis, replacing any older one (FUNCTION LOAD REPLACE).

    Run it once per Redis (and again after a Redis without persistence restarts, or after an
    upgrade of microbatch), as a user allowed to load functions; with a redis+cluster:// URL it
    loads every primary (run it again after adding a node). Safe to repeat.
    """
    client = _connect(redis_url)
    try:
        before, after = functions.load(client)
    except redis.RedisError as exc:
        fail(f"could not load the microbatch functions: {exc}", 1)
    loaded = functions.describe_release(after)
    if before is None:
        typer.echo(f"loaded the microbatch library, {loaded}")
    else:
        replaced = functions.describe_release(before)
        typer.echo(f"loaded the microbatch library, {loaded} (replaced {replaced})")


@functions_app.command("dump")
def dump_functions() -> None:
    """Print the library's Lua code (for redis-cli or a managed Redis's console).

    broker functions dump | redis-cli -x FUNCTION LOAD REPLACE
    """
    typer.echo(functions.CODE, nl=False)


def main() -> None:
    run_app(app, "broker", ENV)


if __name__ == "__main__":
    main()
