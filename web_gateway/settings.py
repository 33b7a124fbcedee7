"""Gateway settings: constructor arguments, else environment (``MICROBATCH_GATEWAY_<FIELD>``).

``redis_url`` also reads ``REDIS_URL`` (the variable every microbatch command shares). List
settings (``model``, ``auth_tokens``) read a comma-separated string or a JSON list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from broker.client import DEFAULT_REDIS_URL
from broker.keys import DEFAULT_PREFIX, check_prefix
from broker.worker_watch import DEFAULT_GRACE_S

ENV_PREFIX = "MICROBATCH_GATEWAY_"


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class GatewaySettings(BaseSettings):
    """Everything a gateway process needs; one instance per process, read at app creation."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, populate_by_name=True, extra="ignore", frozen=True
    )

    model: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Import paths 'module:Class' of the ManagedModel subclasses to serve "
        "(env MICROBATCH_GATEWAY_MODEL: comma-separated).",
    )
    prefix: str = Field(default=DEFAULT_PREFIX, description="Key prefix shared with the workers.")
    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        validation_alias=AliasChoices("redis_url", "REDIS_URL", f"{ENV_PREFIX}REDIS_URL"),
        description="Redis URL (env REDIS_URL).",
    )
    default_timeout: float = Field(default=30.0, gt=0, description="Seconds a request may take.")
    max_timeout: float = Field(
        default=300.0, gt=0, description="Cap on X-Request-Timeout (seconds)."
    )
    max_items: int = Field(default=256, ge=1, description="Most items in one request.")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1, description="Largest request body.")
    max_queue_items: int = Field(
        default=0, ge=0, description="Extra, stricter cap on a model's queue, in items (0: none)."
    )
    max_queue_bytes: int = Field(
        default=0, ge=0, description="Extra, stricter cap on a model's queue, in bytes (0: none)."
    )
    wait_for_workers: bool = Field(
        default=False,
        description="Let requests wait for a worker until their timeout, however long the model "
        "has had none (e.g. while workers scale up from zero), instead of 503 NoWorkers.",
    )
    workers_grace: float = Field(
        default=DEFAULT_GRACE_S,
        gt=0,
        description="Seconds a model may have no live worker before its requests get 503 "
        "NoWorkers (at least twice the workers' --heartbeat-ttl).",
    )
    retry_after: int = Field(default=1, ge=0, description="Retry-After seconds sent with a 503.")
    preprocess_threads: int = Field(
        default=4, ge=1, description="Threads that run preprocess/validation off the event loop."
    )
    auth_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Bearer tokens accepted (none: auth off)."
    )
    auth_tokens_file: Path | None = Field(
        default=None, description="File with one bearer token per line (added to auth_tokens)."
    )
    header_timeout: float = Field(
        default=10.0, gt=0, description="Seconds a request's headers may take to arrive (408)."
    )
    body_timeout: float = Field(
        default=30.0, gt=0, description="Seconds a request's body may take after its headers."
    )
    keepalive_timeout: float = Field(
        default=5.0, gt=0, description="Seconds an idle connection stays open between requests."
    )
    max_connections: int = Field(
        default=1000, ge=1, description="Most open connections per gateway process (503 above)."
    )
    access_log: bool = Field(
        default=False, description="Log one line per request (no bodies, headers or queries)."
    )

    @field_validator("model", "auth_tokens", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return check_prefix(value)

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.default_timeout > self.max_timeout:
            raise ValueError("default_timeout must not exceed max_timeout")
        return self

    def tokens(self) -> frozenset[str]:
        """Every accepted bearer token, from ``auth_tokens`` and ``auth_tokens_file``."""
        tokens = set(self.auth_tokens)
        if self.auth_tokens_file is not None:
            for line in self.auth_tokens_file.read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    tokens.add(line)
        return frozenset(tokens)

    def __repr_args__(self) -> Any:  # never print tokens
        for key, value in super().__repr_args__():
            yield key, ("***" if key == "auth_tokens" and value else value)
