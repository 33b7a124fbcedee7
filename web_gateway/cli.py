"""`gateway start`: options -> one :class:`GatewaySettings` -> gunicorn with uvicorn workers.

Each option's default and help come from its settings field, and each reads its environment
variable through one prefix (``MICROBATCH_GATEWAY_<OPTION>``; ``REDIS_URL`` for ``--redis``),
the prefix :class:`GatewaySettings` reads the rest with. The settings are checked here (a typo
fails at once, exit code 2), then served whole by gunicorn in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from . import package_version
from .settings import ENV_PREFIX, GatewaySettings

FIELDS = GatewaySettings.model_fields

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
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """microbatch HTTP gateway."""


def _option(field: str, *names: str, **kwargs: Any) -> Any:
    """The option of settings field ``field``: its default and its description."""
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
    option = "--redis" if field == "redis_url" else "--" + field.replace("_", "-")
    return f"{option}: {error['msg']}"


@app.command(context_settings={"auto_envvar_prefix": ENV_PREFIX.rstrip("_")})
def start(
    model: list[str] = _option("model", metavar="<str>"),
    prefix: str = _option("prefix"),
    redis: str = _option("redis_url", "--redis", envvar="REDIS_URL"),
    host: str = _option("host"),
    port: int = _option("port"),
    workers: int = _option("workers"),
    default_timeout: float = _option("default_timeout"),
    max_timeout: float = _option("max_timeout"),
    max_items: int = _option("max_items"),
    max_body_bytes: int = _option("max_body_bytes"),
    max_queue_items: int = _option("max_queue_items"),
    max_queue_bytes: int = _option("max_queue_bytes"),
    wait_for_workers: bool = _option("wait_for_workers", "--wait-for-workers"),
    auth_tokens_file: Path | None = _option("auth_tokens_file"),
    header_timeout: float = _option("header_timeout"),
    body_timeout: float = _option("body_timeout"),
    keepalive_timeout: float = _option("keepalive_timeout"),
    max_connections: int = _option("max_connections"),
    graceful_timeout: float = _option("graceful_timeout"),
    log_level: str = _option("log_level"),
    log_format: str = _option("log_format"),
    access_log: bool = _option("access_log", "--access-log/--no-access-log"),
    app_dir: str = typer.Option(
        ".",
        help="Import --model from this directory first (it is put on sys.path and on "
        "PYTHONPATH), as uvicorn's --app-dir.",
    ),
) -> None:
    """Serve MODEL(s) over HTTP until SIGTERM or Ctrl-C.

    Every option also reads its environment variable (REDIS_URL for --redis, otherwise
    MICROBATCH_GATEWAY_<OPTION>, e.g. MICROBATCH_GATEWAY_MAX_QUEUE_ITEMS). Bearer tokens come
    only from MICROBATCH_GATEWAY_AUTH_TOKENS or --auth-tokens-file, never from the command line.
    """
    options = dict(locals())
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
        settings.tokens()
        names = [load_model_class(path).name for path in settings.model]
        if len(set(names)) != len(names):
            raise ValueError(f"two models have the same name: {names}")
        if not names:
            raise ValueError("give at least one --model")
    except (ValueError, OSError, ModelLoadError) as exc:
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    return settings


def main() -> None:
    app(prog_name="gateway")


if __name__ == "__main__":
    main()
