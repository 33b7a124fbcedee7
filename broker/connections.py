"""Every Redis connection microbatch makes is made here, from a URL (:mod:`broker.redis_url`).

- :func:`sync_client`: redis-py's client (heartbeats, the `broker` CLI, admin tools);
- :func:`async_client`: redis-py's asyncio client (consumer groups, takeovers, INFO, health);
- :func:`lane`: a lean hot-path connection (:class:`~broker.resp_lane.RespLane`), or for a
  cluster lanes to each node routed by hash slot (:class:`~broker.cluster_lane.ClusterLanes`);
  either way ``lane.at(key)`` is the lane for a key.

A redis://, rediss:// or unix:// URL goes to redis-py as it is, and lanes connect to its fixed
address. A redis+sentinel:// URL gives redis-py clients through
:meth:`redis.sentinel.Sentinel.master_for`, which ask the sentinels where the master is at each
connect and reconnect after a failover (a ``READONLY`` reply included), and lanes that do the
same (:class:`~broker.sentinel.SentinelMaster`); both also re-ask about once a second while in
use, and leave a master that a failover replaced even while it still takes writes (redis-py's
commands in flight to it, or retried, go to the new one). A
redis+cluster:// URL gives redis-py's cluster clients (:class:`redis.cluster.RedisCluster`,
following MOVED and ASK themselves) and :class:`~broker.cluster_lane.ClusterLanes`, which keep
one lean connection per node and follow them too. (The cluster clients are typed as the plain
ones here: they take the same commands, each sent to the node of its key.)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as async_cluster
import redis.asyncio.sentinel as async_sentinel
import redis.cluster
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry as SyncRetry

from .cluster_lane import UNSETTLED_FOR_S, ClusterLanes, ClusterMap, Settling
from .redis_url import (
    ClusterURL,
    DirectURL,
    RedisURL,
    SentinelURL,
    cluster_node_error,
    describe,
    parse,
)
from .resp_lane import (
    CONNECT_TIMEOUT_S,
    FOLLOW_EVERY_S,
    REPLY_TIMEOUT_S,
    LaneTarget,
    RespLane,
    keepalive_options,
)
from .resp_lane import ssl_context as make_ssl_context
from .resp_packing import use_hiredis_packing
from .sentinel import NoAnswer, SentinelMaster, error_text, first_answer, first_answer_sync


class _MasterConnection(redis.sentinel.SentinelManagedConnection):
    """redis-py's connection to a Sentinel service's master, which also asks where the
    master is when a command's retry reconnects it: redis-py (8.x) reconnects it to the
    address it had, a master that has just failed (silent, or demoted and refusing writes)."""

    _addressing = False

    def connect_to(self, address: Any) -> None:
        self._addressing = True
        try:
            super().connect_to(address)  # type: ignore[no-untyped-call]
        finally:
            self._addressing = False

    def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if self._addressing or not self.connection_pool.is_master:
            super().connect_check_health(*args, **kwargs)
        else:
            self.connect_to(self.connection_pool.get_master_address())


class _MasterTLSConnection(_MasterConnection, redis.SSLConnection):
    pass


class _AsyncMasterConnection(async_sentinel.SentinelManagedConnection):
    """:class:`_MasterConnection` for redis-py's asyncio client."""

    _addressing = False

    async def connect_to(self, address: Any) -> None:
        self._addressing = True
        try:
            await super().connect_to(address)  # type: ignore[no-untyped-call]
        finally:
            self._addressing = False

    async def connect_check_health(self, *args: Any, **kwargs: Any) -> None:
        if self._addressing or not self.connection_pool.is_master:
            await super().connect_check_health(*args, **kwargs)
        else:
            await self.connect_to(await self.connection_pool.get_master_address())


class _AsyncMasterTLSConnection(_AsyncMasterConnection, aioredis.SSLConnection):
    pass


class _FollowingPool(redis.sentinel.SentinelConnectionPool):
    """redis-py's Sentinel pool, which also asks the sentinels where the master is when a
    connection is taken (at most every FOLLOW_EVERY_S): its idle connections to a master a
    failover replaced are dropped then, not only once the old master refuses a write."""

    _asked_at = float("-inf")

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        tls = kwargs.pop("ssl", False)
        kwargs.setdefault("connection_class", _MasterTLSConnection if tls else _MasterConnection)
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now - self._asked_at >= FOLLOW_EVERY_S:
            self._asked_at = now
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                self.get_master_address()  # type: ignore[no-untyped-call]  # drops stale idle ones
        return super().get_connection(*args, **kwargs)


class _AsyncFollowingPool(async_sentinel.SentinelConnectionPool):
    """:class:`_FollowingPool` for redis-py's asyncio client, which also follows while
    commands are in flight: a connection to a master that went silent (its host lost, its
    process stopped) would hold its command until the reply timeout, so while any connection
    is in use the sentinels are asked every FOLLOW_EVERY_S, and once they name another master
    the connections in use to the old one are dropped (redis-py's retry then sends the
    command again, to the new master)."""

    _asked_at = float("-inf")
    _watch: asyncio.TimerHandle | None = None  # the next look at the connections in use
    _following: asyncio.Task[None] | None = None

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        tls = kwargs.pop("ssl", False)
        kwargs.setdefault(
            "connection_class", _AsyncMasterTLSConnection if tls else _AsyncMasterConnection
        )
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        await self._follow()
        connection = await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        self._watch_in_use()
        return connection

    async def _follow(self) -> None:
        """Ask the sentinels where the master is (at most every FOLLOW_EVERY_S); drop the
        connections to any other address, those in use included."""
        now = time.monotonic()
        if now - self._asked_at < FOLLOW_EVERY_S:
            return
        self._asked_at = now
        try:
            master = await self.get_master_address()  # type: ignore[no-untyped-call]
        except (redis.ConnectionError, redis.TimeoutError):
            return  # no master named: the connections in use may still be answered
        # idle ones too: one in use as redis-py dropped the idle ones may be back in the pool
        pooled: list[Any] = [*self._in_use_connections, *self._available_connections]
        stale = [c for c in pooled if c.is_connected and (c.host, c.port) != tuple(master)]
        for connection in stale:  # a command's retry, or the next, reconnects to the master
            with contextlib.suppress(redis.RedisError, OSError):
                await connection.disconnect(nowait=True)

    def _watch_in_use(self) -> None:
        """Look again in FOLLOW_EVERY_S (a timer, not a sleeping task: an event loop closed
        without closing the client leaves nothing pending)."""
        if self._watch is None:
            loop = asyncio.get_running_loop()
            self._watch = loop.call_later(FOLLOW_EVERY_S, self._look, loop)

    def _look(self, loop: asyncio.AbstractEventLoop) -> None:
        self._watch = None
        if self._in_use_connections and (self._following is None or self._following.done()):
            self._following = loop.create_task(self._follow_and_watch())

    async def _follow_and_watch(self) -> None:
        await self._follow()
        if self._in_use_connections:
            self._watch_in_use()

    async def disconnect(self, inuse_connections: bool = True) -> None:
        if inuse_connections and self._watch is not None:  # the pool is being closed
            self._watch.cancel()
            self._watch = None
        await super().disconnect(inuse_connections)


class _ConcurrentSyncSentinel(redis.sentinel.Sentinel):
    """redis-py's Sentinel, asking all its sentinels at once (see :class:`_ConcurrentSentinel`)."""

    def discover_master(self, service_name: str) -> tuple[str, int]:
        sentinels = list(self.sentinels)

        def asker(sentinel: Any) -> Callable[[], tuple[str, int]]:
            def ask() -> tuple[str, int]:
                return _up_master(self, sentinel.sentinel_masters(), service_name)

            return ask

        found = first_answer_sync([asker(s) for s in sentinels])
        return _found(self.sentinels, sentinels, service_name, found, redis.sentinel)


def _up_master(manager: Any, masters: dict[str, Any], service_name: str) -> tuple[str, int]:
    """The address of the service's master in one sentinel's SENTINEL MASTERS answer, checked
    as redis-py's Sentinel ``manager`` checks it; NoAnswer if it names none that is up."""
    state = masters.get(service_name)
    if not state or not manager.check_master_state(state, service_name):
        raise NoAnswer(f"names no up master of {service_name!r}")
    forced = manager._force_master_ip
    return (state["ip"] if forced is None else forced), state["port"]


def _found(
    preferred: list[Any], asked: list[Any], service_name: str,
    found: tuple[int, tuple[str, int] | None, list[tuple[int, BaseException]]], module: Any,
) -> tuple[str, int]:  # fmt: skip
    """The address a concurrent discovery found, its sentinel now asked first; the
    MasterNotFoundError of redis-py's sentinel ``module`` if none names one."""
    index, address, failures = found
    if address is None:
        errors = "; ".join(
            f"sentinel {_address_of(asked[i])}: {error_text(exc)}" for i, exc in failures
        )
        raise module.MasterNotFoundError(f"No master found for {service_name!r} ({errors})")
    if asked[index] in preferred:
        preferred.remove(asked[index])
        preferred.insert(0, asked[index])
    return address


def _address_of(client: Any) -> str:
    """host:port of a sentinel's client (its repr is its whole connection pool's)."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


class _ConcurrentSentinel(async_sentinel.Sentinel):
    """redis-py's asyncio Sentinel, asking all its sentinels at once: the same question and
    check, and the same preference for the one that answered last (see :mod:`broker.sentinel`)."""

    async def discover_master(self, service_name: str) -> tuple[str, int]:
        sentinels = list(self.sentinels)

        async def ask(sentinel: Any) -> tuple[str, int]:
            return _up_master(self, await sentinel.sentinel_masters(), service_name)

        found = await first_answer([ask(s) for s in sentinels])
        return _found(self.sentinels, sentinels, service_name, found, async_sentinel)


class _SyncSentinelRedis(redis.Redis):
    """A master_for client that also closes its sentinels' connections when closed."""

    sentinel_manager: redis.sentinel.Sentinel | None = None

    def close(self) -> None:
        super().close()
        if self.sentinel_manager is not None:
            for client in self.sentinel_manager.sentinels:
                client.close()


class _AsyncSentinelRedis(aioredis.Redis):
    """A master_for client that also closes its sentinels' connections when closed."""

    sentinel_manager: async_sentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.sentinel_manager is not None:
            await self.sentinel_manager.aclose()


# redis-py retries a failed command 10 times by default, with backoff: against a dead host (or
# a dead sentinel asked first) one command would stall for half a minute. Every user of these
# clients retries in its own loop (a worker's, the heartbeats', a caller's next call), so one
# retry (a pooled connection the server closed meanwhile) is enough, and a sentinel that fails
# is not retried: the next one is asked.
RETRIES = 1


def _sentinel_options(
    url: SentinelURL, options: dict[str, Any], no_retry: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the master's connection options, the sentinels') with the caller's ``options``:
    the URL's win, and the sentinels share the caller's socket settings, except that a
    sentinel answers within the connect timeout or is taken for dead (the next one is asked)."""
    master = {**options, **url.master_kwargs()}
    sentinels = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinels.update(url.sentinel_kwargs())
    sentinels["socket_timeout"] = sentinels.get("socket_connect_timeout") or CONNECT_TIMEOUT_S
    sentinels["retry"] = no_retry
    return master, sentinels


def _cluster_options(url: ClusterURL, options: dict[str, Any], accepted: Any) -> dict[str, Any]:
    """The caller's ``options`` with the URL's (which win), keeping those ``accepted`` (a
    cluster client's signature) takes, if it names them."""
    merged = {**options, **url.node_kwargs()}
    merged.pop("db", None)
    names = inspect.signature(accepted).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in names.values()):
        return merged
    return {k: v for k, v in merged.items() if k in names}


def _startup_nodes(url: ClusterURL, node_class: Any) -> list[Any]:
    return [node_class(a.host, a.port) for a in url.nodes]


# What a redis-py client of any URL raises when Redis cannot serve: its errors, and those of its
# cluster client that are no RedisError (no node of the cluster reachable, a slot not covered).
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


def _pause_before_again(exc: redis.exceptions.ClusterError, settling: Settling) -> float:
    """The pause before a redis-py cluster client sends again a command that failed with
    ``exc``; or raises what its caller gets instead: a ConnectionError for a cluster that is
    down or did not settle in time, ``exc`` itself for any other error."""
    if isinstance(exc, redis.exceptions.ClusterDownError):
        raise redis.ConnectionError(f"CLUSTERDOWN {exc}") from None
    if "TTL exhausted" not in str(exc):  # (it gave up on redirections: the command ran nowhere)
        raise exc
    pause = settling.next_pause()
    if pause is None:
        raise redis.ConnectionError(
            f"the cluster did not settle in {UNSETTLED_FOR_S:g} s: {exc}"
        ) from None
    return pause


# redis-py's cluster clients follow up to 16 redirections of a command at once and then give up
# ("TTL exhausted"): a few milliseconds while the end of a slot migration reaches the nodes one
# at a time, the source sending each command to the target and the target back. Like the lanes
# (broker.cluster_lane), the clients below send it again after growing pauses until the nodes
# agree, for up to UNSETTLED_FOR_S, and then raise a ConnectionError (Redis unavailable).
# A CLUSTERDOWN reply (a node without a replica is down) is a ConnectionError too, as on the
# lanes: redis-py raises it as an error reply, which code that expects one (BUSYGROUP) would
# take for its own.


@contextlib.contextmanager
def _closed_as_unavailable() -> Iterator[None]:
    """A ConnectionError where redis-py's asyncio cluster client hit a connection that another
    task's topology refresh closed while this one used it (its reader or writer gone:
    AttributeError or TypeError on None, deep inside redis-py)."""
    try:
        yield
    except (AttributeError, TypeError) as exc:
        if "'NoneType' object" not in str(exc):
            raise
        raise redis.ConnectionError(f"connection closed while in use: {exc}") from None


class _AsyncCluster(async_cluster.RedisCluster):
    """redis-py's asyncio cluster client, waiting out a cluster that keeps redirecting; a
    cluster that is down, or a connection closed under a command, is a ConnectionError.

    redis-py refreshes its slot map by closing every connection of the client, also those that
    other tasks are using; made with ``reinitialize_steps=0`` (see :func:`async_client`), it
    does so only when a node fails or the cluster is down, not every few MOVED replies."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        settling = Settling()
        while True:
            try:
                with _closed_as_unavailable():
                    return await super().execute_command(*args, **kwargs)
            except redis.exceptions.ClusterError as exc:
                pause = _pause_before_again(exc, settling)
            await asyncio.sleep(pause)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        """redis-py's pipeline (the commands it sends again one by one go through this client's
        own command); a connection closed under it is a ConnectionError."""
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        async def execute_or_unavailable(*args: Any, **kwargs: Any) -> Any:
            with _closed_as_unavailable():
                return await execute(*args, **kwargs)

        pipe.execute = execute_or_unavailable  # type: ignore[method-assign]
        return pipe


class _LazyCluster(redis.cluster.RedisCluster):
    """redis-py's cluster client, which reads the slot map at its first command rather than
    when it is made (as every other client here connects): a process that starts before the
    cluster answers waits for it like any other, instead of failing at once. A cluster that
    cannot be reached, or is down, is a redis-py ConnectionError, as a single Redis would be.
    A cluster that keeps redirecting a command is waited out as by :class:`_AsyncCluster`."""

    def __init__(self, **kwargs: Any) -> None:  # the real one runs at first use
        self.__dict__["_lazy_kwargs"] = kwargs

    def __getattr__(self, name: str) -> Any:
        kwargs = self.__dict__.get("_lazy_kwargs")
        if kwargs is None or name.startswith("__"):
            raise AttributeError(name)
        self.__dict__["_lazy_kwargs"] = None
        try:
            super().__init__(**kwargs)
        except redis.exceptions.RedisClusterException as exc:
            self.__dict__["_lazy_kwargs"] = kwargs
            raise _cluster_failure(exc) from None
        return getattr(self, name)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return _waiting_out(super().execute_command, args, kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        """redis-py's pipeline, whose commands the cluster redirects are waited out too (it
        sends those again one by one, with the cluster client's own command, not this one's)."""
        pipe = super().pipeline(transaction, shard_hint)  # type: ignore[no-untyped-call]
        resend = getattr(pipe, "parent_execute_command", None)
        if resend is not None:
            pipe.parent_execute_command = lambda *a, **kw: _waiting_out(resend, a, kw)
        return pipe

    def close(self) -> None:
        if self.__dict__.get("_lazy_kwargs") is None:  # never connected: nothing to close
            super().close()


def _waiting_out(execute: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """A command of redis-py's cluster client, sent again after pauses while the cluster
    keeps redirecting it (:class:`Settling`); a cluster it cannot reach is a ConnectionError."""
    settling = Settling()
    while True:
        try:
            return execute(*args, **kwargs)
        except redis.exceptions.RedisClusterException as exc:
            raise _cluster_failure(exc) from None
        except redis.exceptions.ClusterError as exc:
            pause = _pause_before_again(exc, settling)
        time.sleep(pause)


_REFUSALS = (redis.AuthenticationError, redis.exceptions.AuthorizationError)


def _cluster_failure(exc: redis.exceptions.RedisClusterException) -> redis.RedisError:
    """What a single Redis would have raised for a cluster that cannot be used: the nodes'
    refusal of the credentials as such (waiting will not help), anything else as a
    ConnectionError (the cluster cannot be reached, or is down)."""
    cause = exc.__cause__
    if isinstance(cause, _REFUSALS):
        return type(cause)(str(cause))
    return redis.ConnectionError(str(exc))


def sync_client(url: str | RedisURL, **options: Any) -> redis.Redis:
    """redis-py's client of ``url`` (a failed command retried once); ``options`` are
    redis-py's (socket_timeout, ...)."""
    parsed = parse(url)
    options.setdefault("retry", SyncRetry(NoBackoff(), RETRIES))
    if isinstance(parsed, ClusterURL):
        kwargs = _cluster_options(parsed, options, redis.cluster.RedisCluster.__init__)
        nodes = _startup_nodes(parsed, redis.cluster.ClusterNode)
        return cast(redis.Redis, _LazyCluster(startup_nodes=nodes, **kwargs))
    if not isinstance(parsed, SentinelURL):
        return redis.Redis.from_url(parsed.url, **options)
    master, sentinel_kwargs = _sentinel_options(parsed, options, SyncRetry(NoBackoff(), 0))
    manager = _ConcurrentSyncSentinel(  # type: ignore[no-untyped-call]
        [(a.host, a.port) for a in parsed.sentinels], sentinel_kwargs=sentinel_kwargs
    )
    client: _SyncSentinelRedis = manager.master_for(  # type: ignore[no-untyped-call]
        parsed.service,
        redis_class=_SyncSentinelRedis,
        connection_pool_class=_FollowingPool,
        **master,
    )
    client.sentinel_manager = manager
    return client


def cluster_node_misuse(client: redis.Redis, url: str | RedisURL) -> str | None:
    """:func:`broker.redis_url.cluster_node_error` of ``client``'s server (None where INFO is
    refused or the URL is a redis+cluster:// one)."""
    if isinstance(parse(url), ClusterURL):
        return None
    try:
        cluster_info = client.info("cluster")
    except redis.RedisError:
        return None  # INFO refused (an ACL): nothing to check with
    return cluster_node_error(url, cluster_info)


def async_client(url: str | RedisURL, **options: Any) -> aioredis.Redis:
    """redis-py's asyncio client of ``url`` (bytes replies, TCP keepalive, a health check on
    connections idle 15 s, commands packed by hiredis, a failed command retried once, a
    reply awaited for at most REPLY_TIMEOUT_S: none of microbatch's commands on it block);
    ``options`` are redis-py's."""
    parsed = parse(url)
    options.setdefault("retry", AsyncRetry(NoBackoff(), RETRIES))
    options.setdefault("socket_timeout", REPLY_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
    options.setdefault("socket_keepalive", True)
    options.setdefault("socket_keepalive_options", keepalive_options())
    options.setdefault("health_check_interval", 15)
    options["decode_responses"] = False
    if isinstance(parsed, ClusterURL):
        kwargs = _cluster_options(parsed, options, async_cluster.RedisCluster.__init__)
        nodes = _startup_nodes(parsed, async_cluster.ClusterNode)
        kwargs.setdefault("reinitialize_steps", 0)  # a MOVED patches the slot map
        return cast(aioredis.Redis, _AsyncCluster(startup_nodes=nodes, **kwargs))
    if not isinstance(parsed, SentinelURL):
        return use_hiredis_packing(aioredis.Redis.from_url(parsed.url, **options))
    master, sentinel_kwargs = _sentinel_options(parsed, options, AsyncRetry(NoBackoff(), 0))
    manager = _ConcurrentSentinel(  # type: ignore[no-untyped-call]
        [(a.host, a.port) for a in parsed.sentinels], sentinel_kwargs=sentinel_kwargs
    )
    client = manager.master_for(
        parsed.service, redis_class=_AsyncSentinelRedis,
        connection_pool_class=_AsyncFollowingPool, **master,
    )  # fmt: skip
    client.sentinel_manager = manager
    return use_hiredis_packing(client)


def lane_target(
    url: str | RedisURL, connect_timeout_s: float = CONNECT_TIMEOUT_S
) -> LaneTarget | ClusterMap:
    """Where a lane of ``url`` connects, and how it logs in (for a cluster: its slot map)."""
    parsed = parse(url)
    if isinstance(parsed, ClusterURL):
        return ClusterMap(parsed, connect_timeout_s)
    if not isinstance(parsed, SentinelURL):
        return LaneTarget.from_url(parsed.url)
    tls = make_ssl_context(dict(parsed.options)) if parsed.tls else None
    return LaneTarget(
        ssl=tls, db=parsed.db, username=parsed.username, password=parsed.password,
        source=SentinelMaster(parsed, connect_timeout_s, tls), label=describe(parsed),
    )  # fmt: skip


def lane(
    url: str | RedisURL | LaneTarget,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    reply_timeout_s: float | None = REPLY_TIMEOUT_S,
) -> RespLane:
    """A lean connection to ``url``'s Redis (its master, for a Sentinel URL). Lanes given
    one :func:`lane_target` share its way of finding the master. (A cluster's: :func:`lanes`.)"""
    target = url if isinstance(url, LaneTarget) else lane_target(url, connect_timeout_s)
    if isinstance(target, ClusterMap):
        raise ValueError("a cluster has a lane per node: use connections.lanes")
    return RespLane(target, connect_timeout_s, reply_timeout_s)


def lanes(
    url: str | RedisURL | LaneTarget | ClusterMap,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    reply_timeout_s: float | None = REPLY_TIMEOUT_S,
) -> RespLane | ClusterLanes:
    """:func:`lane`, or for a cluster a lane to each node routed by hash slot; either way
    ``lanes(...).at(key)`` is the lane for ``key``. Those given one :func:`lane_target` share
    its way of finding the master (or the slot map)."""
    if isinstance(url, (str, DirectURL, SentinelURL, ClusterURL)):
        url = lane_target(url, connect_timeout_s)
    if isinstance(url, ClusterMap):
        return ClusterLanes(url, connect_timeout_s, reply_timeout_s)
    return RespLane(url, connect_timeout_s, reply_timeout_s)
