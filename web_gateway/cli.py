"""`gateway start`: options -> one :class:`GatewaySettings` -> gunicorn with uvicorn workers.

Each option's default and help come from its settings field, and each reads its environment
variable through one prefix (``MICROBATCH_GATEWAY_<OPTION>``; ``--redis`` reads
``MICROBATCH_GATEWAY_REDIS_URL``, else ``REDIS_URL``),
the prefix :class:`GatewaySettings` reads the rest with. The settings are checked here (a typo
fails at once, exit code 2), then served whole by gunicorn in this process.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from broker.cli_common import (
    CONTEXT_SETTINGS,
    PREFIX_HELP,
    check_environment,
    fail,
    log_format_option,
    log_level_option,
    new_app,
    prefix_option,
    redis_option,
    run_app,
    version_option,
)

from .settings import ENV_PREFIX, GatewaySettings

FIELDS = GatewaySettings.model_fields
EXIT_STATUS = (
    "Exit status: 0 after a graceful stop (SIGTERM, Ctrl-C); 2 for a bad option, an address "
    "it cannot listen on (--port in use, say) or a --model that cannot be imported; "
    "gunicorn's 3 when a worker process cannot boot, or 4 when one cannot load the app; 130 "
    "for a Ctrl-C while the command is still being loaded."
)

app = new_app("The microbatch HTTP gateway: FastAPI under gunicorn with uvicorn workers.")


@app.callback()
def _root(version: Annotated[bool, version_option()] = False) -> None:
    """microbatch HTTP gateway."""


def _default(field: str) -> Any:
    return FIELDS[field].default


def _option(field: str, *names: str, **kwargs: Any) -> Any:
    """The option of settings field ``field``: its default and its description (the options
    every command shares come from broker.cli_common instead)."""
    info = FIELDS[field]
    default = ... if field == "model" else info.default
    return typer.Option(default, *names, help=info.description, **kwargs)


def describe(exc: ValidationError) -> str:
    """The first problem of invalid settings, in one line, naming its option."""
    error = exc.errors()[0]
    if error["type"] == "value_error":  # the validators' own messages name their option
        return str(error["ctx"]["error"])
    if not error["loc"]:
        return str(error["msg"])
    field = str(error["loc"][0])
    if field == "redis_url":
        option = "--redis"
    elif field in ENV_ONLY:
        option = f"{ENV_PREFIX}{field.upper()}"
    else:
        option = "--" + field.replace("_", "-")
    return f"{option}: {error['msg']}"


@app.command(
    epilog=EXIT_STATUS,
    context_settings={**CONTEXT_SETTINGS, "auto_envvar_prefix": ENV_PREFIX.rstrip("_")},
)
def start(
    model: list[str] = _option("model", metavar="<str>"),
    prefix: Annotated[str, prefix_option(PREFIX_HELP)] = _default("prefix"),
    redis: Annotated[str, redis_option(f"{ENV_PREFIX}REDIS_URL")] = _default("redis_url"),
    host: str = _option("host"),
    port: int = _option("port"),
    workers: int = _option("workers"),
    default_timeout: float = _option("default_timeout"),
    max_timeout: float = _option("max_timeout"),
    max_items: int = _option("max_items"),
    max_body_bytes: int = _option("max_body_bytes"),
    max_json_containers: int = _option("max_json_containers"),
    max_held_body_bytes: int = _option("max_held_body_bytes"),
    max_queue_items: int = _option("max_queue_items"),
    max_queue_bytes: int = _option("max_queue_bytes"),
    wait_for_workers: bool = _option(
        "wait_for_workers", "--wait-for-workers/--no-wait-for-workers"
    ),
    entry_items: int = _option("entry_items"),
    auth_tokens_file: Path | None = _option("auth_tokens_file"),
    header_timeout: float = _option("header_timeout"),
    max_header_bytes: int = _option("max_header_bytes"),
    body_timeout: float = _option("body_timeout"),
    keepalive_timeout: float = _option("keepalive_timeout"),
    send_timeout: float = _option("send_timeout"),
    max_connections: int = _option("max_connections"),
    graceful_timeout: float = _option("graceful_timeout"),
    max_requests: int = _option("max_requests"),
    max_requests_jitter: int = _option("max_requests_jitter"),
    log_level: Annotated[str, log_level_option(f"{ENV_PREFIX}LOG_LEVEL")] = _default("log_level"),
    log_format: Annotated[str, log_format_option(f"{ENV_PREFIX}LOG_FORMAT")] = _default(
        "log_format"
    ),
    access_log: bool = _option("access_log", "--access-log/--no-access-log"),
    app_dir: str = typer.Option(
        ".",
        help="Import --model from this directory first (it is put on sys.path and on "
        "PYTHONPATH), as uvicorn's --app-dir.",
    ),
) -> None:
    """Serve MODEL(s) over HTTP until SIGTERM or Ctrl-C.

    Every option also reads its environment variable (MICROBATCH_GATEWAY_REDIS_URL, else
    REDIS_URL, for --redis; otherwise MICROBATCH_GATEWAY_<OPTION>, e.g.
    MICROBATCH_GATEWAY_MAX_QUEUE_ITEMS). Bearer tokens come
    only from MICROBATCH_GATEWAY_AUTH_TOKENS or --auth-tokens-file, never from the command line.
    """
    options = dict(locals())
    check_environment(
        "gateway start",
        ENV_PREFIX,
        (f"{ENV_PREFIX}{field.upper()}" for field in [*FIELDS, "app_dir"]),
    )
    options["redis_url"] = options.pop("redis")
    from gpu_worker.model import use_app_dir

    use_app_dir(options.pop("app_dir"))
    settings = _checked(options)
    from .server import serve

    serve(settings)


def _checked(options: dict[str, Any]) -> GatewaySettings:
    """The settings, with the model classes imported and their tokens read; else exit 2."""
    from gpu_worker.model import ModelLoadError, load_model_class

    try:
        try:
            settings = GatewaySettings(**options)
        except ValidationError as exc:
            raise ValueError(describe(exc)) from None
        try:
            settings.tokens()
        except OSError as exc:
            tokens_file = settings.auth_tokens_file
            raise ValueError(f"--auth-tokens-file {tokens_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError:  # its bytes are not quoted: they may be tokens
            raise ValueError(
                f"--auth-tokens-file {settings.auth_tokens_file}: not UTF-8 text"
            ) from None
        from .server import check_address

        check_address(settings.host, settings.port)
        names = [load_model_class(path).name for path in settings.model]
        if len(set(names)) != len(names):
            raise ValueError(f"two models have the same name: {names}")
        if not names:
            raise ValueError("give at least one --model")
    except (ValueError, OSError, ModelLoadError) as exc:
        fail(str(exc))
    return settings


# The settings read from the environment alone (docs/gateway.md, "env only").
ENV_ONLY = frozenset(FIELDS) - {"redis_url"} - set(inspect.signature(start).parameters)


def main() -> None:
    run_app(app, "gateway", ENV_PREFIX)


if __name__ == "__main__":
    main()
