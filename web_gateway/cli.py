"""`gateway start`: check the settings, then run gunicorn with uvicorn workers (uvloop).

Every option is handed to the gunicorn master and its workers as its environment variable
(``MICROBATCH_GATEWAY_<OPTION>``, ``REDIS_URL``), which is also where it can come from, so
``gateway start`` and ``gunicorn -c deploy/gunicorn.conf.py`` read the same settings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from broker.client import DEFAULT_REDIS_URL
from broker.keys import DEFAULT_PREFIX
from broker.logs import FORMATS, check_level
from broker.redis_url import parse as parse_redis_url

from . import package_version

ENV = "MICROBATCH_GATEWAY_"
ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "gunicorn.conf.py"

app = typer.Typer(
    help="The microbatch HTTP gateway: FastAPI under gunicorn with uvicorn workers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"gateway, version {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """microbatch HTTP gateway."""


@app.command()
def start(
    model: Annotated[
        list[str],
        typer.Option(
            envvar=f"{ENV}MODEL",
            metavar="<str>",
            help="Import path 'module:Class' of a ManagedModel subclass to serve; repeat for "
            "several models (env: comma- or space-separated).",
        ),
    ],
    prefix: Annotated[
        str,
        typer.Option(envvar=f"{ENV}PREFIX", help="Key prefix: the one the workers use."),
    ] = DEFAULT_PREFIX,
    redis: Annotated[
        str,
        typer.Option(
            envvar="REDIS_URL",
            help="Redis URL: redis://[user:password@]host:port/db (rediss:// for TLS), or "
            "redis+sentinel://[user:password@]host:26379,host:26379/service[/db] for a "
            "Sentinel service's master, or redis+cluster://[user:password@]host:port[,host:port] "
            "for a Redis Cluster (docs/deployment.md).",
        ),
    ] = DEFAULT_REDIS_URL,
    host: Annotated[
        str, typer.Option(envvar=f"{ENV}HOST", help="Address to listen on (0.0.0.0 for all).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar=f"{ENV}PORT", help="TCP port to listen on.")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            envvar=f"{ENV}WORKERS",
            min=1,
            help="gunicorn worker processes: about one per core left over by the model workers "
            "and Redis (on a small shared box, 1 does best).",
        ),
    ] = 1,
    default_timeout: Annotated[
        float,
        typer.Option(
            envvar=f"{ENV}DEFAULT_TIMEOUT",
            min=0.001,
            help="Seconds a request may wait for its result when it sends no X-Request-Timeout.",
        ),
    ] = 30.0,
    max_timeout: Annotated[
        float,
        typer.Option(
            envvar=f"{ENV}MAX_TIMEOUT", min=0.001, help="Cap on a request's X-Request-Timeout."
        ),
    ] = 300.0,
    max_items: Annotated[
        int,
        typer.Option(envvar=f"{ENV}MAX_ITEMS", min=1, help="Most items in one request (413)."),
    ] = 256,
    max_body_bytes: Annotated[
        int,
        typer.Option(envvar=f"{ENV}MAX_BODY_BYTES", min=1, help="Largest request body (413)."),
    ] = 16 * 1024 * 1024,
    max_queue_items: Annotated[
        int,
        typer.Option(
            envvar=f"{ENV}MAX_QUEUE_ITEMS",
            min=0,
            help="An extra cap on each model's queued items, stricter than the bound its "
            "workers store with it (worker start --max-queue-items), never looser; checked "
            "atomically with the enqueue, over it a request gets 503 at once (0: only the "
            "model's bound).",
        ),
    ] = 0,
    max_queue_bytes: Annotated[
        int,
        typer.Option(
            envvar=f"{ENV}MAX_QUEUE_BYTES",
            min=0,
            help="An extra cap on each model's queued payload bytes, stricter than the model's "
            "own (0: only the model's bound).",
        ),
    ] = 0,
    wait_for_workers: Annotated[
        bool,
        typer.Option(
            "--wait-for-workers",
            envvar=f"{ENV}WAIT_FOR_WORKERS",
            help="Let requests wait for a worker until their timeout, however long their model "
            "has had none (e.g. while workers scale up from zero). Without it, a request whose "
            "model has had no live worker for MICROBATCH_GATEWAY_WORKERS_GRACE seconds "
            "(default 10) gets 503 NoWorkers, its items withdrawn.",
        ),
    ] = False,
    auth_tokens_file: Annotated[
        Path | None,
        typer.Option(
            envvar=f"{ENV}AUTH_TOKENS_FILE",
            help="File of bearer tokens, one per line; with it (or MICROBATCH_GATEWAY_AUTH_TOKENS)"
            " every route except health needs 'Authorization: Bearer <token>'.",
        ),
    ] = None,
    header_timeout: Annotated[
        float,
        typer.Option(
            envvar=f"{ENV}HEADER_TIMEOUT",
            min=0.001,
            help="Seconds a request's headers may take to arrive, from the connection (or the "
            "request's first byte); then 408 and the connection is closed.",
        ),
    ] = 10.0,
    body_timeout: Annotated[
        float,
        typer.Option(
            envvar=f"{ENV}BODY_TIMEOUT",
            min=0.001,
            help="Seconds a request's body may take to arrive after its headers; then 408 and "
            "the connection is closed.",
        ),
    ] = 30.0,
    keepalive_timeout: Annotated[
        float,
        typer.Option(
            envvar=f"{ENV}KEEPALIVE_TIMEOUT",
            min=0.001,
            help="Seconds an idle connection stays open between requests.",
        ),
    ] = 5.0,
    max_connections: Annotated[
        int,
        typer.Option(
            envvar=f"{ENV}MAX_CONNECTIONS",
            min=1,
            help="Most open connections per gateway worker process; one more is answered 503 "
            "and closed at once.",
        ),
    ] = 1000,
    graceful_timeout: Annotated[
        float,
        typer.Option(
            envvar=f"{ENV}GRACEFUL_TIMEOUT",
            min=0,
            help="Seconds in-flight requests get to finish after SIGTERM.",
        ),
    ] = 30.0,
    log_level: Annotated[
        str,
        typer.Option(
            envvar=f"{ENV}LOG_LEVEL", help="debug, info, warning, error or critical (any case)."
        ),
    ] = "info",
    log_format: Annotated[
        str,
        typer.Option(envvar=f"{ENV}LOG_FORMAT", help="text, or json: one JSON object per line."),
    ] = "text",
    access_log: Annotated[
        bool,
        typer.Option(
            "--access-log/--no-access-log",
            envvar=f"{ENV}ACCESS_LOG",
            help="Log one line per request (client, method, path without query, status, "
            "duration; never bodies or headers). Off, it costs nothing.",
        ),
    ] = False,
) -> None:
    """Serve MODEL(s) over HTTP until SIGTERM or Ctrl-C.

    Every option also reads its environment variable (REDIS_URL for --redis, otherwise
    MICROBATCH_GATEWAY_<OPTION>, e.g. MICROBATCH_GATEWAY_MAX_QUEUE_ITEMS). Bearer tokens come
    only from MICROBATCH_GATEWAY_AUTH_TOKENS or --auth-tokens-file, never from the command line.
    """
    models = [part for entry in model for part in entry.replace(",", " ").split()]
    env = {
        "MODEL": ",".join(models),
        "PREFIX": prefix,
        "HOST": host,
        "PORT": str(port),
        "WORKERS": str(workers),
        "DEFAULT_TIMEOUT": str(default_timeout),
        "MAX_TIMEOUT": str(max_timeout),
        "MAX_ITEMS": str(max_items),
        "MAX_BODY_BYTES": str(max_body_bytes),
        "MAX_QUEUE_ITEMS": str(max_queue_items),
        "MAX_QUEUE_BYTES": str(max_queue_bytes),
        "HEADER_TIMEOUT": str(header_timeout),
        "BODY_TIMEOUT": str(body_timeout),
        "KEEPALIVE_TIMEOUT": str(keepalive_timeout),
        "MAX_CONNECTIONS": str(max_connections),
        "WAIT_FOR_WORKERS": "true" if wait_for_workers else "false",
        "GRACEFUL_TIMEOUT": str(graceful_timeout),
        "LOG_LEVEL": log_level,
        "LOG_FORMAT": log_format,
        "ACCESS_LOG": "true" if access_log else "false",
    }
    if auth_tokens_file is not None:
        env["AUTH_TOKENS_FILE"] = str(auth_tokens_file)
    for key, value in env.items():
        os.environ[ENV + key] = value
    os.environ["REDIS_URL"] = redis
    os.environ.pop(f"{ENV}REDIS_URL", None)  # REDIS_URL, set just above, is the one to use

    # Fail here, with a clear message, rather than in every gunicorn worker's boot.
    from gpu_worker.model import ModelLoadError, load_model_class

    from .settings import GatewaySettings

    try:
        try:
            parse_redis_url(redis)
        except ValueError as exc:
            raise ValueError(f"--redis: {exc}") from None
        check_level(log_level)
        if log_format not in FORMATS:
            raise ValueError(
                f"--log-format must be one of {', '.join(FORMATS)}, not {log_format!r}"
            )
        settings = GatewaySettings()
        settings.tokens()
        names = [load_model_class(path).name for path in settings.model]
        if len(set(names)) != len(names):
            raise ValueError(f"two models have the same name: {names}")
        if not names:
            raise ValueError("give at least one --model")
    except (ValueError, OSError, ModelLoadError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None

    config = str(CONFIG) if CONFIG.exists() else "python:web_gateway.gunicorn_conf"
    argv = [sys.executable, "-m", "gunicorn", "-c", config]
    os.execv(sys.executable, argv)


def main() -> None:
    app(prog_name="gateway")


if __name__ == "__main__":
    main()
