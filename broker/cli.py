"""`broker`: look at queues and workers, and manage dead letters. A thin layer over admin."""

from __future__ import annotations

import json
import time
from typing import Annotated

import redis
import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table

from . import admin
from .cli_common import fail, log_format_option, log_level_option, new_app, version_option
from .client import DEFAULT_REDIS_URL
from .keys import DEFAULT_PREFIX, ModelKeys
from .logs import configure_logging

ENV = "MICROBATCH_BROKER_"
EXIT_STATUS = "Exit status: 0 on success; 1 when Redis cannot be reached; 2 for a bad option."

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
    configure_logging(log_level, log_format)


RedisOption = Annotated[
    str,
    typer.Option(
        "--redis",
        envvar="REDIS_URL",
        help="Redis URL: redis://[user:password@]host:port/db, or rediss:// for TLS.",
    ),
]
NameOption = Annotated[
    str, typer.Option("--name", envvar=f"{ENV}NAME", help="The model's name, e.g. mlp.")
]
PrefixOption = Annotated[
    str, typer.Option("--prefix", envvar=f"{ENV}PREFIX", help="The deployment's key prefix.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]


def _connect(url: str) -> redis.Redis:
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        fail(f"cannot reach Redis: {exc}", 1)
    return client


def _print(renderable: RenderableType) -> None:
    """Print tables whole: never cut at the terminal's width (or at 80 columns in a pipe);
    a terminal narrower than the tables wraps their lines instead."""
    console = Console()
    needed = Console(width=100_000).measure(renderable).maximum
    if needed > console.width:
        console = Console(width=needed)
    console.print(renderable)


def _table(title: str, columns: list[str], right: tuple[str, ...] = ()) -> Table:
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", no_wrap=True)
    return table


def _status_tables(models: list[admin.ModelStatus]) -> Group:
    counts = ("queued", "pending", "queued bytes", "live workers", "dead letters")
    summary = _table("microbatch models", ["prefix", "model", *counts], right=counts)
    columns = ["prefix", "model", "consumer", "alive", "pending", "idle s", "heartbeat s"]
    workers = _table("workers", [*columns, "batch", "batch s"])
    for model in models:
        summary.add_row(
            model.prefix,
            model.model,
            str(model.stream_length),
            str(model.pending),
            str(model.queued_bytes),
            str(model.live_consumers),
            str(model.dead_letters),
        )
        for consumer in model.consumers:
            expires = consumer.heartbeat_expires_in_ms
            workers.add_row(
                model.prefix,
                model.model,
                consumer.name,
                "yes" if consumer.alive else "no",
                str(consumer.pending),
                f"{consumer.idle_ms / 1000:.1f}",
                "-" if expires is None else f"{expires / 1000:+.1f}",
                str(consumer.current_batch) if consumer.current_batch else "-",
                f"{consumer.current_batch_ms / 1000:.1f}" if consumer.current_batch else "-",
            )
    return Group(summary, workers)


@app.command(short_help="Each model's queue and its workers.")
def status(
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    prefix: Annotated[
        str | None,
        typer.Option(envvar=f"{ENV}PREFIX", help="Only this prefix [default: every prefix]."),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh every second.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Each model's queue (stream length, pending, dead letters) and its workers."""
    client = _connect(redis_url)
    if as_json:
        typer.echo(json.dumps([m.as_dict() for m in admin.status(client, prefix)], indent=2))
        return
    if not watch:
        _print(_status_tables(admin.status(client, prefix)))
        return
    with Live(_status_tables(admin.status(client, prefix)), console=Console()) as live:
        try:
            while True:
                time.sleep(1.0)
                live.update(_status_tables(admin.status(client, prefix)))
        except KeyboardInterrupt:
            pass


@dead_app.command("list")
def list_dead(
    name: NameOption,
    prefix: PrefixOption = DEFAULT_PREFIX,
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    count: Annotated[int, typer.Option(help="Show at most this many.")] = 100,
    as_json: JsonOption = False,
) -> None:
    """List dead letters (ids, reasons and sizes; never payloads)."""
    letters = admin.dead_letters(_connect(redis_url), ModelKeys(name, prefix), count)
    if as_json:
        typer.echo(json.dumps([letter.__dict__ for letter in letters], indent=2))
        return
    table = _table(
        f"dead letters of {name} (prefix {prefix})",
        ["dead id", "request id", "reason", "bytes", "age s"],
        right=("bytes", "age s"),
    )
    for letter in letters:
        table.add_row(
            letter.dead_id,
            letter.request_id,
            letter.reason,
            str(letter.data_bytes),
            f"{letter.age_s:.0f}",
        )
    _print(table)


IdsOption = Annotated[
    list[str] | None,
    typer.Option("--id", help="Only this dead id (repeatable) [default: all]."),
]


@dead_app.command(short_help="Queue dead letters again (after fixing the model).")
def replay(
    name: NameOption,
    prefix: PrefixOption = DEFAULT_PREFIX,
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    ids: IdsOption = None,
) -> None:
    """Queue dead letters again (after fixing the model); they leave the dead-letter stream."""
    count = admin.replay_dead_letters(_connect(redis_url), ModelKeys(name, prefix), ids)
    typer.echo(f"replayed {count} dead letter(s) of {name}")


@dead_app.command()
def purge(
    name: NameOption,
    prefix: PrefixOption = DEFAULT_PREFIX,
    redis_url: RedisOption = DEFAULT_REDIS_URL,
    ids: IdsOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete dead letters for good."""
    if not yes and not typer.confirm(f"Delete dead letters of {name} (prefix {prefix})?"):
        raise typer.Exit(1)
    count = admin.purge_dead_letters(_connect(redis_url), ModelKeys(name, prefix), ids)
    typer.echo(f"purged {count} dead letter(s) of {name}")


def main() -> None:
    app(prog_name="broker")


if __name__ == "__main__":
    main()
