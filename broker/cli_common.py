"""What every microbatch command line shares (``worker``, ``gateway``, ``broker``).

Plain help (no boxes, nothing cut), ``-h`` as ``--help``, ``--version``, ``--log-level``
(debug, info, warning, error or critical, in any case) and ``--log-format``; a bad value is one
``Error: ...`` line and exit status 2.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from .environment import drop_service_links, unknown_variables
from .keys import check_prefix
from .logs import parse_format, parse_level

CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
LOG_LEVEL_HELP = "debug, info, warning, error or critical (any case)."
LOG_FORMAT_HELP = "text, or json: one JSON object per line."
PREFIX_HELP = (
    "Key prefix: separates deployments in one Redis (the gateways and workers of one "
    "deployment use the same)."
)
REDIS_HELP = (
    "Redis URL: redis://[user:password@]host:port/db (rediss:// for TLS), or "
    "redis+sentinel://[user:password@]host:26379,host:26379/service[/db] for a Sentinel "
    "service's master, or redis+cluster://[user:password@]host:port[,host:port] for a Redis "
    "Cluster (docs/deployment.md)."
)


class _Group(TyperGroup):
    """A command group that refuses a bad option value as the commands' own checks do: one
    ``Error: ...`` line, naming the variable a value read from the environment came from
    (click prints its usage lines first, and names the option even where nobody gave it)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except typer.BadParameter as exc:
            # (typer may bring click's classes or its own copy of them: matched by name)
            if type(exc).__name__ == "MissingParameter":  # the usage lines help there
                raise
            fail(_bad_value(exc))


def _bad_value(exc: typer.BadParameter) -> str:
    """Click's message for ``exc``, its option followed by the variable its value came from."""
    param, ctx = exc.param, exc.ctx
    if param is not None and ctx is not None and param.name and exc.param_hint is None:
        source = ctx.get_parameter_source(param.name)
        if source is not None and source.name == "ENVIRONMENT":
            variable = _variable_of(param, ctx)
            if variable:
                option = " / ".join(f"'{name}'" for name in param.opts)  # as click names it
                exc.param_hint = f"{option} (from {variable})"
    return str(exc.format_message())


def _variable_of(param: Any, ctx: Any) -> str | None:
    """The environment variable ``param`` read its value from."""
    names = param.envvar
    if not names and ctx.auto_envvar_prefix and param.name:
        names = f"{ctx.auto_envvar_prefix}_{param.name.upper()}"
    for name in [names] if isinstance(names, str) else names or []:
        if os.environ.get(name):
            return name
    return None


def new_app(help: str, **options: Any) -> typer.Typer:
    """A Typer app with the shared conventions (plain click help, ``-h``, no completion, a
    bad value refused in one line)."""
    options.setdefault("no_args_is_help", True)
    return typer.Typer(
        cls=_Group,
        help=help,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
        context_settings=CONTEXT_SETTINGS,
        **options,
    )


def version() -> str:
    """The installed microbatch's version."""
    try:
        return metadata.version("microbatch")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``Error: message`` on stderr (one line) and exit with ``code``."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"microbatch {version()}")
        raise typer.Exit()


def checked(parse: Callable[[str], str]) -> Callable[[str | None], str | None]:
    def callback(value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as exc:
            fail(str(exc))

    return callback


def check_environment(command: str, prefix: str, known: Iterable[str]) -> None:
    """Warn (on stderr, one line each) of the variables of ``prefix`` that are none of
    ``known``, naming the closest setting. A warning, not an error: Kubernetes' service links,
    compose's own variables and those of another version of microbatch share the prefix too."""
    for variable, hint in unknown_variables(prefix, known):
        typer.echo(f"Warning: {variable} is not a setting of `{command}`: ignored{hint}", err=True)


def run_app(app: typer.Typer, name: str, prefix: str) -> None:
    """Run a command's app, its environment rid of Kubernetes service links first: a Service
    named after the command (``microbatch-gateway``) gives every pod ``<PREFIX>_PORT=tcp://
    <ip>:<port>``, which click would read as --port and refuse (exit 2)."""
    dropped = drop_service_links(prefix)
    options = _option_variables(typer.main.get_command(app), prefix) if dropped else set()
    for variable in dropped:
        if variable in options:  # (another, such as ..._SIDECAR_PORT, is let be in silence)
            service = variable.removesuffix("_PORT").lower().replace("_", "-")
            typer.echo(
                f"Warning: {variable} holds a Kubernetes service link's address (of a Service "
                f"named {service}), not a setting: ignored",
                err=True,
            )
    app(prog_name=name)


def _option_variables(command: Any, prefix: str) -> set[str]:
    """The variables the options of ``command`` and its subcommands read: each one's own,
    and ``<prefix><NAME>`` (click's ``auto_envvar_prefix``)."""
    names: set[str] = set()
    for param in command.params:
        names.add(f"{prefix}{(param.name or '').upper()}")
        envvar = param.envvar
        names.update([envvar] if isinstance(envvar, str) else envvar or [])
    for sub in getattr(command, "commands", {}).values():
        names |= _option_variables(sub, prefix)
    return names


def version_option() -> Any:
    """``--version``: print ``microbatch <version>`` and exit 0."""
    return typer.Option(
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the version (microbatch <version>) and exit.",
    )


def log_level_option(envvar: str) -> Any:
    """``--log-level``, read from ``envvar`` too; the value arrives in lower case."""
    return typer.Option(
        "--log-level",
        envvar=envvar,
        metavar="LEVEL",
        callback=checked(parse_level),
        help=LOG_LEVEL_HELP,
    )


def log_format_option(envvar: str) -> Any:
    """``--log-format`` (text or json), read from ``envvar`` too."""
    return typer.Option(
        "--log-format",
        envvar=envvar,
        metavar="FORMAT",
        callback=checked(parse_format),
        help=LOG_FORMAT_HELP,
    )


def redis_option(own_envvar: str | None = None) -> Any:
    """``--redis URL``, read from ``REDIS_URL`` too (the one variable every command shares),
    after ``own_envvar`` where a command has one of its own."""
    envvar = "REDIS_URL" if own_envvar is None else [own_envvar, "REDIS_URL"]
    return typer.Option("--redis", envvar=envvar, help=REDIS_HELP)


def prefix_option(help: str, envvar: str | None = None) -> Any:
    """``--prefix``, the deployment's key prefix, read from ``envvar`` too (without one, from
    the variable a command's ``auto_envvar_prefix`` names)."""
    return typer.Option("--prefix", envvar=envvar, help=help, callback=checked(check_prefix))
