"""The client's settings: the one object a :class:`~broker.client.Streamer` is configured by.

Constructor arguments win, else the environment (``MICROBATCH_CLIENT_<FIELD>``, the one
prefix), else the defaults stated here. ``redis_url`` reads ``MICROBATCH_CLIENT_REDIS_URL``,
else ``REDIS_URL`` (the variable every microbatch command shares). ``Streamer``'s keyword
arguments of the same names win over a ``settings=`` object and over the environment.

Imported by a Streamer when it is made, not by ``import broker`` (pydantic is slow to import).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import pydantic
import pydantic_settings
from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .client import DEFAULT_REDIS_URL, DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, check_timeout
from .environment import unknown_variables
from .keys import DEFAULT_PREFIX, check_prefix
from .logs import redact_url
from .multi_item import DEFAULT_ENTRY_ITEMS, MAX_ENTRY_ITEMS
from .priorities import parse_priority
from .redis_url import parse as parse_redis_url
from .worker_watch import DEFAULT_GRACE_S, WorkerWatch

ENV_PREFIX = "MICROBATCH_CLIENT_"


class ClientSettings(BaseSettings):
    """Everything a Streamer is told, one field per keyword argument of the same name."""

    # An empty variable is unset, as the commands' options take it (a blank line of an .env).
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        validation_alias=AliasChoices(f"{ENV_PREFIX}REDIS_URL", "REDIS_URL"),
        description="Redis URL, in any form that `worker start --redis` takes.",
    )
    prefix: str = Field(default=DEFAULT_PREFIX, description="Key prefix: the one the workers use.")
    timeout: float = Field(
        default=DEFAULT_TIMEOUT_S,
        description="Seconds a call may wait for its results when it is given no timeout.",
    )
    max_queue_items: int = Field(
        default=0,
        ge=0,
        description="An extra cap on the model's queued items, stricter than the bound its "
        "workers store with it, never looser (0: only the model's bound).",
    )
    max_queue_bytes: int = Field(
        default=0,
        ge=0,
        description="An extra cap on the model's queued payload bytes (0: only the model's).",
    )
    wait_for_workers: bool = Field(
        default=False,
        description="Let calls wait for a worker until their timeout, however long the model "
        "has had none, instead of failing with NoWorkers after workers_grace seconds.",
    )
    workers_grace: float = Field(
        default=DEFAULT_GRACE_S,
        le=MAX_TIMEOUT_S,
        description="Seconds the model may have no live worker before its calls fail with "
        "NoWorkers (keep it at least twice the workers' --heartbeat-ttl).",
    )

    entry_items: int = Field(
        default=DEFAULT_ENTRY_ITEMS,
        ge=1,
        le=MAX_ENTRY_ITEMS,
        description="The most items of concurrent calls sent together that one stream entry "
        "may carry (1: one entry per item, wire v1 only, for workers older than v2 entries).",
    )
    priority: str | int = Field(
        default="normal",
        description="The calls' default priority: normal or high (also 0 or 1); each call may "
        "name its own.",
    )

    @field_validator("priority")
    @classmethod
    def _check_priority(cls, value: str | int) -> str | int:
        parse_priority(value)  # ValueError naming what is accepted
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        parse_redis_url(value)  # RedisURLError (a ValueError) saying what is wrong
        return value

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return check_prefix(value)

    @field_validator("timeout")
    @classmethod
    def _check_timeout(cls, value: float) -> float:
        return check_timeout(value)

    @field_validator("workers_grace")
    @classmethod
    def _check_grace(cls, value: float) -> float:
        return WorkerWatch(value).grace_s

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Run whenever settings are made: where some field is left to the environment, the place
        # to say what in it was not used (from_values gives every field: nothing is read).
        given = getattr(init_settings, "init_kwargs", {})  # a key per field given, or its alias
        if len(given) < len(cls.model_fields):
            warn_unknown_variables()
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    def __repr_args__(self) -> Any:  # repr() and str(): never a password
        for key, value in super().__repr_args__():
            yield key, (redact_url(value) if key == "redis_url" else value)

    @classmethod
    def from_values(cls, **values: Any) -> ClientSettings:
        """``values`` and the defaults, without reading the environment. A bad value raises a
        ValueError as :meth:`resolve` does."""
        # The environment only fills the fields that were not given: give them all.
        fields = cls.model_fields.items()
        defaults = {name: field.get_default(call_default_factory=True) for name, field in fields}
        try:
            return cls(**{**defaults, **values})
        except ValidationError as exc:
            raise first_error(exc) from None

    @classmethod
    def resolve(cls, base: ClientSettings | None = None, **given: Any) -> ClientSettings:
        """``base`` (else the environment and the defaults), with the ``given`` values that are
        not None over it. A bad value raises the ValueError its check raised (RedisURLError for
        a bad URL), or a ValueError naming the setting."""
        given = {key: value for key, value in given.items() if value is not None}
        try:
            if base is None:
                try:
                    return cls(**given)
                except ValidationError as exc:
                    raise _naming_variable(first_error(exc), exc, given) from None
            return cls.from_values(**{**base.model_dump(), **given})
        except ValidationError as exc:
            raise first_error(exc) from None


class UnknownSettingWarning(UserWarning):
    """A ``MICROBATCH_CLIENT_`` variable that names no setting of the client: it is ignored."""


def warn_unknown_variables() -> None:
    """Warn (once a process for each) of the ``MICROBATCH_CLIENT_`` variables that name no
    setting, naming the closest one: a misspelt setting is ignored, and not in silence."""
    known = [f"{ENV_PREFIX}{name.upper()}" for name in ClientSettings.model_fields]
    # pydantic-settings reads the environment ignoring case (MICROBATCH_CLIENT_Timeout sets
    # the timeout): so is it checked here
    for variable, hint in unknown_variables(ENV_PREFIX, known, case_sensitive=False):
        message = f"{variable} is not a setting of microbatch's client: ignored{hint}"
        warnings.warn(message, UnknownSettingWarning, stacklevel=_callers_level())


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside microbatch and pydantic: a warning
    raised for settings then names the caller's line (``Streamer(...)``), not ours."""
    ours = tuple(
        os.path.dirname(module.__file__ or "") + os.sep
        for module in (sys.modules[__name__], pydantic, pydantic_settings)
    )
    level, frame = 2, sys._getframe(2)  # 1: warn_unknown_variables, which calls warn
    while frame.f_back is not None and frame.f_code.co_filename.startswith(ours):
        level, frame = level + 1, frame.f_back
    return level


def _naming_variable(
    error: ValueError, exc: ValidationError, given: Mapping[str, Any]
) -> ValueError:
    """``error``, saying which environment variable held the bad value when its setting was
    not given (read from the environment), as the commands' errors name theirs."""
    loc = exc.errors()[0]["loc"]
    where = str(loc[0]) if loc else ""
    for field in ClientSettings.model_fields:
        variables = _variables(field)
        if field in given or (where != field and where not in variables):
            continue
        # the first one set is the one read (REDIS_URL only without MICROBATCH_CLIENT_REDIS_URL)
        variable = next((name for name in variables if os.environ.get(name)), None)
        if variable is not None:
            return type(error)(f"{error} (from {variable})")
    return error


def _variables(field: str) -> list[str]:
    """The environment variables a setting is read from, in the order they are tried."""
    alias = ClientSettings.model_fields[field].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    return [f"{ENV_PREFIX}{field.upper()}"]


def first_error(exc: ValidationError) -> ValueError:
    """The first problem of invalid settings as one ValueError: the check's own error where a
    check raised one, else ``<setting>: <pydantic's message>``."""
    error = exc.errors()[0]
    raised = error.get("ctx", {}).get("error")
    if error["type"] == "value_error" and isinstance(raised, ValueError):
        return raised
    where = ".".join(str(part) for part in error["loc"])
    return ValueError(f"{where}: {error['msg']}" if where else str(error["msg"]))
