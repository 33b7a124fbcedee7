"""Gateway settings: the one object ``gateway start`` builds and hands down whole.

Constructor arguments win, else the environment (``MICROBATCH_GATEWAY_<FIELD>``: the one prefix,
which ``gateway start``'s options read too), else the defaults stated here. ``redis_url`` reads
``MICROBATCH_GATEWAY_REDIS_URL``, else ``REDIS_URL`` (the variable every microbatch command
shares), as the client's settings do. List settings read a JSON list, or a comma-separated
string (``model``'s also space-separated, as ``gateway start`` reads it; ``auth_tokens``
commas only). ``gunicorn -c deploy/gunicorn.conf.py`` and ``create_app()`` build it from the
environment alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from broker.cli_common import PREFIX_HELP, REDIS_HELP
from broker.client import DEFAULT_REDIS_URL, MAX_TIMEOUT_S
from broker.environment import is_service_link
from broker.keys import DEFAULT_PREFIX, check_prefix
from broker.logs import parse_format, parse_level, redact_url
from broker.multi_item import DEFAULT_ENTRY_ITEMS, MAX_ENTRY_ITEMS
from broker.redis_url import parse as parse_redis_url
from broker.worker_watch import DEFAULT_GRACE_S

from .reading import DEFAULT_MAX_JSON_CONTAINERS

ENV_PREFIX = "MICROBATCH_GATEWAY_"


def _split_list(value: Any, separators: str = ",") -> Any:
    """A JSON list, or entries separated by ``separators`` (a regex character class's
    contents), in one string or in each string of a list."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        value = [text]
    if isinstance(value, (list, tuple)):
        pattern = re.compile(f"[{separators}]")
        return [
            part.strip()
            for entry in value
            for part in (pattern.split(entry) if isinstance(entry, str) else [entry])
            if not isinstance(part, str) or part.strip()
        ]
    return value


def _no_token_in(given: Any, tokens: Any) -> bool:
    """Whether ``given`` (not empty) left no token once split, or an empty one."""
    blank = not given.strip() if isinstance(given, str) else not given
    if blank or not isinstance(tokens, list):
        return False
    return not tokens or any(isinstance(token, str) and not token.strip() for token in tokens)


class GatewaySettings(BaseSettings):
    """Everything a gateway process needs; one instance per process, read at app creation."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, populate_by_name=True, extra="ignore", frozen=True
    )

    model: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Import path 'module:Class' of a ManagedModel subclass (or a Pipeline) to "
        "serve; repeat for several models (env: comma- or space-separated).",
    )
    prefix: str = Field(default=DEFAULT_PREFIX, description=PREFIX_HELP)
    redis_url: str = Field(
        default=DEFAULT_REDIS_URL,
        validation_alias=AliasChoices(f"{ENV_PREFIX}REDIS_URL", "REDIS_URL"),
        description=REDIS_HELP,
    )
    host: str = Field(
        default="127.0.0.1",
        description="Address to listen on (0.0.0.0 for all IPv4 addresses, :: for all IPv6 ones).",
    )
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port to listen on.")
    workers: int = Field(
        default=1,
        ge=1,
        description="gunicorn worker processes: about one per core left over by the model "
        "workers and Redis (on a small shared box, 1 does best).",
    )
    # At most a year, as every call's timeout: beyond, each request would fail with a 500.
    default_timeout: float = Field(
        default=30.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Seconds a request may wait for its result when it sends no X-Request-Timeout.",
    )
    max_timeout: float = Field(
        default=300.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Cap on a request's X-Request-Timeout (at most a year).",
    )
    max_items: int = Field(default=256, ge=1, description="Most items in one request (413).")
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1, description="Largest request body (413)."
    )
    max_json_containers: int = Field(
        default=DEFAULT_MAX_JSON_CONTAINERS,
        ge=1,
        description="Most arrays and objects a JSON body may hold, counted before it is "
        "parsed (413 above): each costs the parse about 90 bytes of memory for as little as "
        "2 bytes of JSON.",
    )
    max_held_body_bytes: int = Field(
        default=512 * 1024 * 1024,
        ge=1,
        description="Most bytes of request bodies one gateway process holds at once (from "
        "their first byte until each is answered); a body arriving past it is answered 503 "
        "and its connection closed. At least --max-body-bytes.",
    )
    max_queue_items: int = Field(
        default=0,
        ge=0,
        description="An extra cap on each model's queued items, stricter than the bound its "
        "workers store with it (worker start --max-queue-items), never looser; checked "
        "atomically with the enqueue, over it a request gets 503 at once (0: only the "
        "model's bound).",
    )
    max_queue_bytes: int = Field(
        default=0,
        ge=0,
        description="An extra cap on each model's queued payload bytes, stricter than the "
        "model's own (0: only the model's bound).",
    )
    wait_for_workers: bool = Field(
        default=False,
        description="Let requests wait for a worker until their timeout, however long their "
        "model has had none (e.g. while workers scale up from zero). Without it, a request "
        "whose model has had no live worker for MICROBATCH_GATEWAY_WORKERS_GRACE seconds "
        "(default 10) gets 503 NoWorkers, its items withdrawn.",
    )
    # Every duration is at most a year too: inf broke gunicorn's int(), or turned a limit off.
    workers_grace: float = Field(
        default=DEFAULT_GRACE_S,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Seconds a model may have no live worker before its requests get 503 "
        "NoWorkers (keep it at least twice the workers' --heartbeat-ttl).",
    )
    entry_items: int = Field(
        default=DEFAULT_ENTRY_ITEMS,
        ge=1,
        le=MAX_ENTRY_ITEMS,
        description="The most items of requests queued in one round trip that one stream entry "
        "carries (1: one entry per item, wire v1, for workers older than multi-item entries).",
    )
    retry_after: int = Field(
        default=1,
        ge=0,
        description="Retry-After seconds sent with every 503 error (QueueFull, "
        "BrokerUnavailable, NoWorkers, TooManyConnections, TooManyBodyBytes).",
    )
    preprocess_threads: int = Field(
        default=4, ge=1, description="Threads that run preprocess/validation off the event loop."
    )
    auth_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Bearer tokens accepted (none: auth off)."
    )
    auth_tokens_file: Path | None = Field(
        default=None,
        description="File of bearer tokens, one per line (a line starting with # is a "
        "comment; the rest of a line, spaces trimmed, is the token); with it (or "
        "MICROBATCH_GATEWAY_AUTH_TOKENS) the model routes need 'Authorization: Bearer "
        "<token>' (health, readiness, /metrics, /docs, /openapi.json and /v2 stay open: "
        "docs/gateway.md, Auth).",
    )
    header_timeout: float = Field(
        default=10.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Seconds a request's headers may take to arrive, from the connection (or "
        "the request's first byte); then 408 and the connection is closed.",
    )
    max_header_bytes: int = Field(
        default=65536,
        ge=1024,
        description="Most bytes of a request's URL and headers; more is answered 431 and the "
        "connection is closed.",
    )
    body_timeout: float = Field(
        default=30.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Seconds a request's body may take to arrive after its headers; then 408 "
        "and the connection is closed.",
    )
    keepalive_timeout: float = Field(
        default=5.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Seconds an idle connection stays open between requests.",
    )
    send_timeout: float = Field(
        default=30.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Seconds a client may leave its answers untaken (the gateway's send buffer "
        "full) before its connection is aborted.",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        description="Most open connections per gateway worker process; one more is answered "
        "503 and closed at once.",
    )
    graceful_timeout: float = Field(
        default=30.0,
        ge=0,
        le=MAX_TIMEOUT_S,
        description="Seconds in-flight requests get to finish after SIGTERM.",
    )
    max_requests: int = Field(
        default=0,
        ge=0,
        description="Requests a gateway worker process serves before gunicorn replaces it "
        "with a fresh one (its in-flight requests finish first, as after SIGTERM); 0: never. "
        "A bound on what a slow leak in a model's preprocess code can grow to.",
    )
    max_requests_jitter: int = Field(
        default=0,
        ge=0,
        description="A random 0 to this many requests added to --max-requests for each "
        "worker process, so that several are not replaced at once.",
    )
    log_level: str = Field(
        default="info", description="debug, info, warning, error or critical (any case)."
    )
    log_format: str = Field(default="text", description="text, or json: one JSON object per line.")
    access_log: bool = Field(
        default=False,
        description="Log one line per request (client, method, path without query, status, "
        "duration; never bodies or headers). Off, it costs nothing.",
    )

    @field_validator("port", mode="before")
    @classmethod
    def _not_a_service_link(cls, value: Any) -> Any:
        # A Kubernetes Service named microbatch-gateway gives every pod of its namespace
        # MICROBATCH_GATEWAY_PORT=tcp://<ip>:<port> (gunicorn binds by its own --bind here).
        if isinstance(value, str) and is_service_link(value):
            return cls.model_fields["port"].default
        return value

    @field_validator("model", "auth_tokens", mode="before")
    @classmethod
    def _split(cls, value: Any, info: ValidationInfo) -> Any:
        try:  # a model path holds no space; a token may
            split = _split_list(value, r",\s" if info.field_name == "model" else ",")
        except json.JSONDecodeError:  # its text is not quoted: it may hold tokens
            name = "--model" if info.field_name == "model" else f"{ENV_PREFIX}AUTH_TOKENS"
            raise ValueError(
                f"{name}: a value starting with '[' is read as a JSON list of strings, and "
                "this one is not JSON"
            ) from None
        if info.field_name == "auth_tokens" and _no_token_in(value, split):
            # ("${A},${B}" with both unset): as for an emptied tokens file, never auth off
            raise ValueError(
                f"{ENV_PREFIX}AUTH_TOKENS holds no token, or an empty one: give tokens, or "
                "leave it empty to serve without auth"
            )
        return split

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return check_prefix(value)

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        try:
            parse_redis_url(value)
        except ValueError as exc:
            raise ValueError(f"--redis: {exc}") from None
        return value

    @field_validator("host")
    @classmethod
    def _check_host(cls, value: str) -> str:
        host = value.strip()
        if not host or any(c.isspace() for c in host):  # '' would listen on every address
            raise ValueError(f"--host must be an address or a host name, not {value!r}")
        return host

    @field_validator("log_level")
    @classmethod
    def _check_level(cls, value: str) -> str:
        return parse_level(value)

    @field_validator("log_format")
    @classmethod
    def _check_format(cls, value: str) -> str:
        return parse_format(value)

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.default_timeout > self.max_timeout:
            raise ValueError("--default-timeout must not exceed --max-timeout")
        if self.max_held_body_bytes < self.max_body_bytes:
            raise ValueError("--max-held-body-bytes must be at least --max-body-bytes")
        return self

    def tokens(self) -> frozenset[str]:
        """Every accepted bearer token, from ``auth_tokens`` and ``auth_tokens_file``."""
        tokens = set(self.auth_tokens)
        path = self.auth_tokens_file
        if path is not None:
            in_file = {
                line
                for line in (raw.strip() for raw in path.read_text(encoding="utf-8").splitlines())
                if line and not line.startswith("#")
            }
            if not in_file:  # an emptied file (or a secret mounted empty) must not turn auth off
                raise ValueError(
                    f"--auth-tokens-file {path} holds no token (a line that is neither blank "
                    "nor a '#' comment): give one, or no file to serve without auth"
                )
            tokens |= in_file
        return frozenset(tokens)

    def __repr_args__(self) -> Any:  # never print tokens nor passwords
        for key, value in super().__repr_args__():
            if key == "redis_url":
                value = redact_url(value)
            yield key, ("***" if key == "auth_tokens" and value else value)
