"""Redis URLs: every form microbatch accepts, parsed into a typed description (no I/O but a
look at the TLS files a URL names).

::

    redis://[[user]:password@]host[:port][/db][?option=value&...]     one Redis over TCP
    rediss://...                                                     the same over TLS
    unix://[[user]:password@]/path/to/redis.sock[?db=N&...]           one Redis on a unix socket
    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?option=value&...]
    rediss+sentinel://...                                            Sentinel, all over TLS
    redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0][?option=value&...]
    rediss+cluster://...                                             Redis Cluster over TLS

In a Sentinel URL the hosts are the sentinels (port 26379 unless given; an IPv6 address in
brackets), ``service`` is the name the sentinels monitor the master under (``sentinel monitor
<service> ...``), ``db`` the database (default 0), and the user and password are those of the
master (and of its replicas, which serve as master after a failover). The options
``sentinel_username`` and ``sentinel_password`` log in to the sentinels, where they require it;
every other option is one of redis-py's URL options (``socket_timeout``, ``ssl_ca_certs``, ...)
for the connections to Redis; with ``rediss+sentinel`` the ``ssl_*`` ones apply to the
sentinels too. In a Cluster URL the hosts are any nodes of the cluster (port 6379 unless
given; one answering is enough, the others are asked when it does not), the database is 0
(the only one a cluster has), the user and password are those of the nodes, and the options are
redis-py's URL options. The other forms are redis-py's own. A user or password holding
``/ ? # @ :`` or ``%`` writes it percent-encoded (``%2F`` ...). A TLS URL's ``ssl_ca_certs``,
``ssl_certfile`` and ``ssl_keyfile`` must name readable files, and ``ssl_ca_path`` a directory.

Errors are :class:`RedisURLError` (a ValueError) with a one-line message that never shows a
password.
"""

from __future__ import annotations

import functools
import inspect
import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote

from redis.asyncio.connection import parse_url as redis_parse_url
from redis.connection import (
    URL_QUERY_ARGUMENT_PARSERS,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)

# redis-py's converters of its URL options' values (e.g. socket_timeout: float)
_OPTION_PARSERS: Mapping[str, Callable[[str], Any]] = URL_QUERY_ARGUMENT_PARSERS  # type: ignore[assignment]

DIRECT_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_PORT = 26379
CLUSTER_PORT = 6379
# Options of a Sentinel URL besides redis-py's URL options: they log in to the sentinels.
SENTINEL_AUTH = ("sentinel_username", "sentinel_password")
# redis-py's TLS settings, which its URL parser passes through as strings.
SSL_OPTIONS = (
    "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path",
    "ssl_ca_data", "ssl_password",
)  # fmt: skip
# The TLS options naming a file (ssl_ca_path: a directory) the client reads at each connect.
SSL_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")
FORMS = (
    "redis://[user:password@]host:port/db, rediss:// for TLS, unix:///path.sock, or "
    "redis+sentinel://[user:password@]host:port,host:port/service[/db], or "
    "redis+cluster://[user:password@]host:port[,host:port...]"
)


class RedisURLError(ValueError):
    """A Redis URL microbatch cannot use (the message is one line, without secrets)."""


@dataclass(frozen=True)
class Address:
    """A host and TCP port."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class DirectURL:
    """One Redis, at a fixed address: redis://, rediss:// or unix://. ``url`` is handed to
    redis-py as it is."""

    url: str = field(repr=False)
    tls: bool
    address: Address | None  # None for a unix socket
    path: str | None  # the unix socket's path
    db: int
    username: str | None
    password: str | None = field(repr=False)


@dataclass(frozen=True)
class SentinelURL:
    """A master found through Redis Sentinel: redis+sentinel:// or rediss+sentinel://."""

    sentinels: tuple[Address, ...]
    service: str
    db: int
    username: str | None
    password: str | None = field(repr=False)
    sentinel_username: str | None
    sentinel_password: str | None = field(repr=False)
    tls: bool
    options: Mapping[str, Any] = field(repr=False)  # redis-py connection options, typed

    def master_kwargs(self) -> dict[str, Any]:
        """redis-py connection keyword arguments for the master (``Sentinel.master_for``)."""
        kwargs: dict[str, Any] = {"db": self.db, **self.options}
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        if self.tls:
            kwargs["ssl"] = True
        return kwargs

    def sentinel_kwargs(self) -> dict[str, Any]:
        """redis-py connection keyword arguments for the sentinels: their own login, the
        socket options and, over TLS, the TLS options."""
        kwargs = {k: v for k, v in self.options.items() if k.startswith("socket_")}
        if self.tls:
            kwargs["ssl"] = True
            kwargs.update((k, v) for k, v in self.options.items() if k.startswith("ssl_"))
        if self.sentinel_username is not None:
            kwargs["username"] = self.sentinel_username
        if self.sentinel_password is not None:
            kwargs["password"] = self.sentinel_password
        return kwargs


@dataclass(frozen=True)
class ClusterURL:
    """A Redis Cluster, found through any of its nodes: redis+cluster:// or rediss+cluster://."""

    nodes: tuple[Address, ...]
    username: str | None
    password: str | None = field(repr=False)
    tls: bool
    options: Mapping[str, Any] = field(repr=False)  # redis-py connection options, typed

    @property
    def db(self) -> int:
        """A cluster has database 0 only."""
        return 0

    def node_kwargs(self) -> dict[str, Any]:
        """redis-py connection keyword arguments for every node of the cluster."""
        kwargs: dict[str, Any] = dict(self.options)
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        if self.tls:
            kwargs["ssl"] = True
        return kwargs


RedisURL = DirectURL | SentinelURL | ClusterURL


def parse(url: str | RedisURL) -> RedisURL:
    """The description of ``url`` (returned as it is if already parsed); RedisURLError if
    microbatch cannot use it."""
    if isinstance(url, (DirectURL, SentinelURL, ClusterURL)):
        return url
    if not isinstance(url, str) or not url.strip():
        raise RedisURLError(f"the Redis URL is empty; give one of: {FORMS}")
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in (*DIRECT_SCHEMES, *SENTINEL_SCHEMES, *CLUSTER_SCHEMES):
        shown = f"'{scheme}://'" if sep and len(scheme) <= 30 else "no scheme"
        raise RedisURLError(f"the Redis URL has {shown}: give one of: {FORMS}")
    netloc, tail = _split_netloc(rest)
    if "#" in tail:
        raise RedisURLError(
            "the Redis URL has a '#' fragment: percent-encode '#' in a user or password as %23"
        )
    parsed: RedisURL
    if scheme in SENTINEL_SCHEMES:
        parsed = _parse_sentinel(scheme, netloc, tail)
    elif scheme in CLUSTER_SCHEMES:
        parsed = _parse_cluster(scheme, netloc, tail)
    else:
        parsed = _parse_direct(url, scheme)
    if parsed.tls:
        _check_tls_files(tail.partition("?")[2])
    return parsed


def _check_tls_files(query: str) -> None:
    """RedisURLError naming a TLS option whose file (or directory) cannot be read: redis-py
    finds it only at each connect, as a bare "No such file or directory" (the file unnamed)
    that callers and workers took for Redis being away."""
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in SSL_FILES or not values[0]:
            continue
        path = values[0]
        directory = name == "ssl_ca_path"
        found = os.path.isdir(path) if directory else os.path.isfile(path)
        if not found or not os.access(path, os.R_OK):
            kind = "directory" if directory else "file"
            raise RedisURLError(f"the Redis URL's {name} names no readable {kind}: {path[:200]}")


def credentials_refused(url: str | RedisURL, exc: BaseException) -> str:
    """Why Redis refused to let ``url`` in, after "Redis" or "Redis at <where>": where the URL
    holds no password, that one is needed (redis-py's own reason speaks of HELLO, or NOAUTH)."""
    if parse(url).password is None:
        return "requires a password, and the URL gives none: redis://[user:]password@host:port/db"
    return f"refused the credentials: {exc}"


def describe(url: str | RedisURL) -> str:
    """What a log may say of where ``url`` leads (no user, password or options)."""
    parsed = parse(url)
    if isinstance(parsed, SentinelURL):
        sentinels = ",".join(str(a) for a in parsed.sentinels)
        return f"service {parsed.service!r} (db {parsed.db}) via sentinels {sentinels}"
    if isinstance(parsed, ClusterURL):
        nodes = ",".join(str(a) for a in parsed.nodes)
        return f"cluster via {nodes}{' (TLS)' if parsed.tls else ''}"
    if parsed.path is not None:
        return f"unix socket {parsed.path} (db {parsed.db})"
    return f"{parsed.address} (db {parsed.db}{', TLS' if parsed.tls else ''})"


CLUSTER_NODE_HINT = "it is a node of a Redis Cluster; give a redis+cluster:// URL"


def cluster_node_error(url: str | RedisURL, cluster_info: Mapping[str, Any]) -> str | None:
    """What is wrong where ``url``, not a redis+cluster:// one, names a Redis Cluster node
    (``cluster_info``: the node's ``INFO cluster``), else None. Such a client gets MOVED for
    most keys: the model's keys, its replies and its heartbeats fail, a few at a time."""
    if isinstance(parse(url), ClusterURL) or str(cluster_info.get("cluster_enabled")) != "1":
        return None
    return f"Redis at {describe(url)} runs with cluster-enabled yes: {CLUSTER_NODE_HINT}"


def _split_netloc(rest: str) -> tuple[str, str]:
    """(user info and hosts, the rest from the first '/', '?' or '#')."""
    ends = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    end = min(ends) if ends else len(rest)
    netloc, tail = rest[:end], rest[end:]
    if "@" in tail.split("?", 1)[0]:
        raise RedisURLError(
            "the user or password of the Redis URL holds '/', '?' or '#': percent-encode "
            "them (%2F, %3F, %23; '@' as %40)"
        )
    return netloc, tail


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon and password else None)


@functools.cache  # read from the classes' signatures: the same for every URL of a scheme
def _connection_options(scheme: str) -> frozenset[str]:
    """The keyword arguments redis-py's connection for ``scheme`` takes: the options its URL
    parser passes on (any other makes each connect fail with a TypeError)."""
    kinds = {"rediss": SSLConnection, "unix": UnixDomainSocketConnection}
    names: set[str] = set()
    for kind in kinds.get(scheme, Connection).__mro__:
        init = kind.__dict__.get("__init__")
        if init is not None:
            names.update(inspect.signature(init).parameters)
    return frozenset(names - {"self", "args", "kwargs"})


def _check_direct_options(url: str, scheme: str) -> None:
    """RedisURLError for an option a redis://, rediss:// or unix:// URL's connections would
    refuse at each connect: a misspelt one, or a TLS option without TLS."""
    known = _connection_options(scheme)
    for name in parse_qs(url.partition("?")[2], keep_blank_values=True):
        if not name.isidentifier():  # a stray '?' in a password: never quote it
            raise RedisURLError(
                "the Redis URL's options are malformed: use ?name=value&... (percent-encode "
                "'?' in a user or password as %3F)"
            )
        if name.startswith("ssl_") and scheme != "rediss":
            raise RedisURLError("the Redis URL has ssl_* options: use rediss:// for TLS")
        if name not in known:
            raise RedisURLError(
                f"the Redis URL has an unknown option {name[:40]!r} (known: what redis-py's "
                "connections take, e.g. socket_timeout, socket_connect_timeout, "
                "health_check_interval, client_name; not its pool's max_connections)"
            )


def _parse_direct(url: str, scheme: str) -> DirectURL:
    _check_direct_options(url, scheme)
    try:
        options: dict[str, Any] = dict(redis_parse_url(url))
    except ValueError as exc:
        message = str(exc)
        if "Port" in message or "port" in message:  # it quotes the port: a stray password?
            message = "its port is not a port number (1-65535)"
        raise RedisURLError(f"the Redis URL is malformed: {message}") from None
    if scheme != "unix":
        path = url.partition("://")[2].partition("?")[0]
        path = path[path.find("/") :] if "/" in path else ""
        if path.strip("/") and "db" not in options:
            if not path.strip("/").isdigit():
                raise RedisURLError("the Redis URL's path must be a database number (/0, /1, ...)")
            options["db"] = int(path.strip("/"))
    try:
        db = int(options.get("db", 0) or 0)
    except (TypeError, ValueError):
        raise RedisURLError("the Redis URL's db must be a number") from None
    if db < 0:
        raise RedisURLError("the Redis URL's db cannot be negative")
    if scheme == "unix":
        socket_path: str | None = options.get("path")
        if not socket_path:
            raise RedisURLError("a unix:// Redis URL needs the socket's path: unix:///path.sock")
        return DirectURL(
            url, False, None, socket_path, db, options.get("username"), options.get("password")
        )
    address = Address(options.get("host", "localhost"), int(options.get("port", 6379)))
    return DirectURL(
        url, scheme == "rediss", address, None, db, options.get("username"),
        options.get("password"),
    )  # fmt: skip


def _parse_sentinel(scheme: str, netloc: str, tail: str) -> SentinelURL:
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    parts = hosts.split(",") if hosts else []
    sentinels = tuple(_address(part, number) for number, part in enumerate(parts, 1))
    if not sentinels:
        raise RedisURLError(
            "the Sentinel URL names no sentinel: redis+sentinel://host:26379,host:26379/service"
        )
    path, _, query = tail.partition("?")
    raw = path[1:]
    segments = raw.split("/") if raw else []
    if len(segments) > 1 and segments[-1] == "":  # a trailing slash
        segments.pop()
    if not segments or not segments[0]:
        raise RedisURLError(
            "the Sentinel URL names no service: redis+sentinel://host:26379/<service>[/<db>], "
            "the name in the sentinels' `sentinel monitor <service> ...`"
        )
    if len(segments) > 2 or not all(segments):
        raise RedisURLError("the Sentinel URL's path must be /<service> or /<service>/<db>")
    service = unquote(segments[0])
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise RedisURLError("the Sentinel URL's db (after the service) must be a number")
        db = int(segments[1])
    options, sentinel_auth = _sentinel_options(query)
    if scheme != "rediss+sentinel" and any(name.startswith("ssl_") for name in options):
        raise RedisURLError("the Sentinel URL has ssl_* options: use rediss+sentinel:// for TLS")
    return SentinelURL(
        sentinels=sentinels, service=service, db=db, username=username, password=password,
        sentinel_username=sentinel_auth.get("sentinel_username"),
        sentinel_password=sentinel_auth.get("sentinel_password"),
        tls=scheme == "rediss+sentinel", options=options,
    )  # fmt: skip


def _address(
    text: str, number: int, kind: str = "Sentinel", what: str = "sentinel",
    default_port: int = SENTINEL_PORT,
) -> Address:  # fmt: skip
    """A sentinel's (or node's) ``host[:port]`` (``[v6]:port`` for IPv6). Errors name the
    address by its ``number`` and host, never by its text: a password that went astray could
    be in it."""
    text = text.strip()
    where = f"{what} address {number}"
    if not text:
        raise RedisURLError(f"the Sentinel URL's {where} is empty (two commas?)")
    if text.startswith("["):
        host, bracket, port = text[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            raise RedisURLError(f"the {kind} URL's {where} is malformed: use [v6addr]:port")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise RedisURLError(f"the {kind} URL's {where} is no IPv6 address") from None
        port = port[1:]
    else:
        host, _, port = text.partition(":")
        if not host:
            raise RedisURLError(f"the {kind} URL's {where} has no host")
        if ":" in port:
            raise RedisURLError(f"the {kind} URL's {where}: write IPv6 addresses in [ ]")
    if not port:
        return Address(unquote(host), default_port)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RedisURLError(f"the {kind} URL's {where} ({host[:100]}) has a bad port")
    return Address(unquote(host), int(port))


def _sentinel_options(query: str, kind: str = "Sentinel") -> tuple[dict[str, Any], dict[str, str]]:
    """(redis-py connection options, the sentinels' login) from a Sentinel URL's query (or,
    with ``kind`` "Cluster", a Cluster URL's, which has no sentinels' login)."""
    try:
        pairs = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise RedisURLError(
            f"the {kind} URL's options are malformed: use ?name=value&..."
        ) from None
    options: dict[str, Any] = {}
    auth: dict[str, str] = {}
    sentinel = kind == "Sentinel"
    for name, values in pairs.items():
        value = values[0]
        if not name:
            raise RedisURLError(f"the {kind} URL's options are malformed: use ?name=value&...")
        if name in SENTINEL_AUTH and sentinel:
            if value:
                auth[name] = value
        elif name == "db":
            where = "in its path: /<service>/<db>" if sentinel else "as /0 or not at all"
            raise RedisURLError(f"give a {kind} URL's db {where}")
        elif name in _OPTION_PARSERS:
            try:
                options[name] = _OPTION_PARSERS[name](value)
            except (TypeError, ValueError):
                raise RedisURLError(f"the {kind} URL's option {name} has a bad value") from None
        elif name in SSL_OPTIONS:
            options[name] = value
        else:
            known = "sentinel_username, sentinel_password, and " if sentinel else ""
            raise RedisURLError(
                f"the {kind} URL has an unknown option {name[:40]!r} (known: "
                f"{known}redis-py's URL options)"
            )
    return options, auth


def _parse_cluster(scheme: str, netloc: str, tail: str) -> ClusterURL:
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    parts = hosts.split(",") if hosts else []
    nodes = tuple(
        _address(part, number, "Cluster", "node", CLUSTER_PORT)
        for number, part in enumerate(parts, 1)
    )
    if not nodes:
        raise RedisURLError("the Cluster URL names no node: redis+cluster://host:6379[,host:6379]")
    path, _, query = tail.partition("?")
    if path.strip("/") not in ("", "0"):
        raise RedisURLError(
            "the Cluster URL's path must be /0 or nothing: a Redis Cluster has database 0 only"
        )
    options, _ = _sentinel_options(query, "Cluster")
    if scheme != "rediss+cluster" and any(name.startswith("ssl_") for name in options):
        raise RedisURLError("the Cluster URL has ssl_* options: use rediss+cluster:// for TLS")
    return ClusterURL(
        nodes=nodes, username=username, password=password, tls=scheme == "rediss+cluster",
        options=options,
    )  # fmt: skip
