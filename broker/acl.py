"""Redis ACL users for microbatch: server-wide users, and four users per prefix (tenant).

A prefix is a tenant: its users touch only keys of the form ``mb:{<prefix>:...`` (prefixes
cannot hold ``:``, ``{``, ``}`` nor a glob character, so no other prefix's keys match), only
the commands their side of the code sends, and each write only on the keys that side writes
(ACL selectors, the parts in parentheses). No service user may run Lua of its own or load
functions: they call the microbatch library with FCALL (Redis checks the commands and keys a
function runs against the caller's ACL). Loading the library is a server-wide power (it is
code every tenant runs), so only the server's ``operator`` has it.

``broker acl`` prints these users; deploy/users.acl is :func:`template` (checked by the tests),
which deploy/redis-start.sh renders with the shell for one prefix.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .keys import LEVEL_SUFFIX, check_prefix

PLACEHOLDER = "%PREFIX%"
DEFAULT_PASSWORD_ENV = "MICROBATCH_REDIS_{ROLE}_PASSWORD"
OLDEST_REDIS = "7.0"

# What a cluster-aware client sends besides its commands (`broker acl --cluster`): the slot
# map, ASKING / READONLY while following redirections and reading from replicas, COMMAND (redis-py's
# cluster client reads the command table to find keys), and MULTI / EXEC (microbatch's lanes send
# a pipeline of one slot as one transaction, so that it runs whole on one node).
CLUSTER_RULES = "+cluster|slots +cluster|shards +asking +readonly +command +multi +exec"

# Sent by the client library at connect time: HELLO and AUTH need no permission; redis-py >= 5
# sends CLIENT SETINFO (Redis 7.2's; its refusal is harmless but logged); SELECT for a URL naming
# a database other than 0.
CONNECT = "+ping +select +client|setinfo@7.2"


def _keys(kind: str) -> str:
    """The key pattern of one kind of key of every model of the prefix, and of every
    partition of its queue (``*`` spans a partition's ``<model>:p<k>``)."""
    return f"mb:{{{PLACEHOLDER}:*}}:{kind}"


TENANT_KEYS = f"~mb:{{{PLACEHOLDER}:*"  # every key of the prefix

# Kinds of key that each priority level has its own of: the high level's end in LEVEL_SUFFIX.
LEVELED = ("requests", "dead", "cancelled", "queued-bytes", "packed-items")


def _leveled(kind: str) -> list[str]:
    """The key patterns of one kind: of both priority levels, where each level has its own."""
    pattern = _keys(kind)
    return [pattern, pattern + LEVEL_SUFFIX] if kind in LEVELED else [pattern]


def _any(*kinds: str) -> str:
    """A selector's key patterns (``~pattern ...``) for these kinds, of both levels."""
    return " ".join(f"~{pattern}" for kind in kinds for pattern in _leveled(kind))


@dataclass(frozen=True)
class User:
    """One ACL user: its name, the role naming its password variable, rules and comment."""

    name: str
    role: str | None  # None: no password (the user is off)
    rules: str  # space-separated, selectors in parentheses
    comment: str

    @property
    def per_prefix(self) -> bool:
        return PLACEHOLDER in self.name


SERVER_USERS = (
    User(
        "default",
        None,
        "off ~* +@all",
        """No anonymous access: every client logs in as one of the users below (off: nobody can
log in as default). Its rules are only for Redis itself: at start it replays the AOF's
MULTI/EXEC blocks (every function call's writes among them) as this user, and Redis 7.0 (and
later releases until it was fixed) re-checks their commands against its rules, dropping the
transactions it may not run: every request queued before a restart.""",
    ),
    User(
        "operator",
        "OPERATOR",
        f"%R~mb:* resetchannels -@all {CONNECT} +time +info +function|load +function|list "
        "+scan +xlen +get +mget +hgetall +hmget +zrange +xpending +xinfo|consumers "
        "+xinfo|groups +xinfo|stream +xrange +type +ttl +pttl +exists +llen +lrange "
        "+zrangebyscore +acl|log +acl|whoami +config|get +slowlog|get",
        """The server's operator (not a tenant's): loads the functions every tenant calls
(`broker functions load`: FUNCTION LOAD REPLACE, FUNCTION LIST), reads every tenant's queues
(`broker status` without --prefix: SCAN, TIME, XLEN, GET, MGET, HMGET, ZRANGE, XPENDING,
XINFO), the Redis healthcheck (PING), and diagnosis (TYPE, TTL, LRANGE, ...; ACL LOG,
CONFIG GET, SLOWLOG GET: server-wide, so no tenant's user has them). Reads keys, writes none.""",
    ),
    User(
        "replication",
        "REPLICATION",
        "resetchannels -@all +ping +psync +replconf",
        """Replicas of this Redis (`masteruser replication` and `masterauth` in their
redis.conf; Sentinel setups): off unless its password is set.""",
    ),
    User(
        "sentinel",
        "SENTINEL",
        "resetchannels &__sentinel__:hello -@all +ping +info +role +multi +exec +slaveof "
        "+config|rewrite +client|setname +client|kill +script|kill +subscribe +publish",
        """Redis Sentinel's own connections to every node (`sentinel auth-user <service> sentinel`
and `sentinel auth-pass <service> <its password>` in sentinel.conf): watching (PING, INFO,
ROLE, the hello channel) and failing over (MULTI, SLAVEOF, CONFIG REWRITE, CLIENT KILL,
EXEC). Off unless its password is set.""",
    ),
    User(
        "cluster",
        "CLUSTER",
        f"~mb:* resetchannels -@all {CONNECT} +info +command +config|get +cluster +migrate "
        "+restore +restore-asking +asking +readonly",
        """A Redis Cluster's administrator: `redis-cli --cluster create` (CLUSTER ADDSLOTS, MEET,
REPLICATE, ...), `--cluster reshard` (CLUSTER SETSLOT, GETKEYSINSLOT, MIGRATE of microbatch's
keys, which the target node RESTOREs as this user) and `--cluster check`. Off unless its
password is set.""",
    ),
)

TENANT_USERS = (
    User(
        f"{PLACEHOLDER}-gateway",
        "GATEWAY",
        " ".join(
            f"%RW~{pattern}"
            for kind in (
                "requests",
                "queued-bytes",
                "packed-items",
                "queue-bound",
                "consumers",
                "cancelled",
                "withdrawn",
            )
            for pattern in _leveled(kind)
        )
        + f" %RW~{_keys('inbox:*')} %R~{_keys('partitions')} resetchannels -@all {CONNECT} "
        "+time +info +fcall +blmpop +blpop +lpop "
        "+zrangebyscore +zcount +hmget +xlen +get +xpending +xrange "
        f"({_any('requests')} +xadd +xdel) "
        f"({_any('queued-bytes', 'packed-items')} +incrby +decrby) "
        f"({_any('cancelled', 'withdrawn')} +zadd +zremrangebyscore) "
        f"({_any('cancelled')} +zscore +zrem)",
        """The HTTP gateways (web_gateway) and Python callers (broker.Streamer) of the prefix:
  enqueue: FCALL mb_enqueue -> HMGET, XLEN, GET, INCRBY, XADD; TIME and ZCOUNT (the live
    workers) once the queue outgrows one worker's share, DECRBY when it refuses a call
    and when it finds counters left above 0 beside an empty stream
  withdraw a cancelled call: FCALL mb_withdraw -> TIME, XPENDING, ZADD, XRANGE, XDEL, DECRBY,
    ZREMRANGEBYSCORE (and, for items of multi-item entries, ZSCORE and ZREM); and ZADD,
    ZREMRANGEBYSCORE of its request ids on the withdrawn set (for
    a pipeline's later stages)
  replies: BLMPOP on its inboxes (those of every partition: mb:{prefix:model:pk}:inbox:*);
    BLPOP and LPOP for foreign callers that read replies as docs/protocol.md says. No MULTI:
    a transaction of any length runs as one, holding Redis for every tenant (a foreign caller
    queues through mb_enqueue, whose calls are capped)
  the model's partition count: GET (read only)
  health and model readiness: PING, TIME, ZRANGEBYSCORE (live consumers)
  the eviction-policy check at start: INFO (its memory section names maxmemory_policy)
FCALL needs read and write access to the keys it is given; the writes themselves are allowed
only where they belong (the selectors): XADD and XDEL on request streams, INCRBY and DECRBY
on the byte and packed-item counters, ZADD and ZREMRANGEBYSCORE on the cancelled and
withdrawn sets, ZREM on the cancelled set. So it cannot forge a consumer, change a bound,
delete or expire anything, nor touch workers' keys.""",
    ),
    User(
        f"{PLACEHOLDER}-worker",
        "WORKER",
        f"{TENANT_KEYS} resetchannels -@all {CONNECT} +time +info +fcall +xgroup|create "
        "+xgroup|delconsumer +xreadgroup +xack +xdel +xclaim +xpending +xinfo|consumers +xadd "
        "+xlen +decrby +incrby +zmscore +zcard +zadd +zrem +zrangebyscore +zremrangebyscore "
        f"+hset (~{_keys('heartbeat:*')} +set +del +exists) (~{_keys('partitions')} +set +get) "
        f"({_any('packed-items', 'queued-bytes')} +get) (~{_keys('queue-bound')} +hmget) "
        f"(~{_keys('inbox:*')} +type +pttl +rpush +expire) "
        f"(~{_keys('join:*')} +hgetall +pexpireat +del) +multi +exec",
        """The GPU/CPU workers of the prefix (worker start: supervisor and children):
  consumer group: XGROUP CREATE (MKSTREAM), XREADGROUP
  replies: FCALL mb_reply -> TYPE, PTTL, RPUSH, EXPIRE, on inbox keys only (a selector; of
    every partition), so that no reply can touch a stream, a counter or a set
  acks: XACK, XDEL, DECRBY, INCRBY (queued-bytes floor), ZMSCORE and ZCARD (withdrawn entries)
  takeover of dead consumers: XINFO CONSUMERS, EXISTS, XPENDING, XCLAIM, XACK;
    retire one: FCALL mb_retire -> EXISTS, XPENDING, XGROUP DELCONSUMER
  dead letters: XADD
  a pipeline's stages (docs/pipelines.md): forwarding, MULTI, XADD and INCRBY on the next
    stage's stream and counter, EXEC; withdrawn request ids: ZMSCORE; fan-out joins: MULTI,
    HSET, PEXPIREAT, HGETALL, EXEC, then DEL, on join hashes only (a selector);
    backpressure: HMGET of the next stage's queue bound, ZRANGEBYSCORE (its live workers), XLEN,
    GET of its queued-bytes and packed-items counters (read only)
  heartbeats: TIME, ZADD, ZREMRANGEBYSCORE, ZREM; SET, DEL, EXISTS on heartbeat keys only;
    ZREMRANGEBYSCORE of the expired marks of the cancelled, answered and withdrawn sets
  the queue bound: HSET; the partition count: SET, and GET at start (a lowered count is
    warned of), on its key only
  metrics (--metrics-port): XLEN, XPENDING, TIME, ZRANGEBYSCORE; GET of the packed-items
    counters (queued items)
  liveness of the connection: PING; the eviction-policy check at start: INFO""",
    ),
    User(
        f"{PLACEHOLDER}-admin",
        "ADMIN",
        f"{TENANT_KEYS} resetchannels -@all {CONNECT} +time +info +scan +xlen +get +mget "
        "+hgetall +hmget +zrange +xpending +xinfo|consumers +xinfo|groups +xinfo|stream +xrange "
        f"+xrevrange +multi +exec +discard +acl|whoami ({_any('requests')} +xadd) "
        f"({_any('queued-bytes')} +incrby) ({_any('dead')} +xdel +xtrim +del)",
        """The prefix's operators: `broker status --prefix` and `broker dead-letters`
(broker/admin.py).
  status: SCAN, TIME, XLEN, GET, MGET, HMGET, ZRANGE, XPENDING, XINFO CONSUMERS
  dead letters: XRANGE, XREVRANGE (where replaying them all stops), MULTI, XADD and INCRBY
    on request streams and their byte counters (replay), XDEL, XTRIM (purge --older-than)
    and DEL on dead-letter streams only (the selectors), EXEC
SCAN is not limited by key patterns: it lists the names (never the contents) of every key.""",
    ),
    User(
        f"{PLACEHOLDER}-keda",
        "KEDA",
        " ".join(f"%R~{pattern}" for pattern in _leveled("requests"))
        + f" resetchannels -@all {CONNECT} +xlen +xpending +xinfo|groups",
        """KEDA's redis-streams scaler (deploy/k8s): XLEN for stream length, XPENDING for pending
entries (XINFO GROUPS for lagCount, not used here). Reads request streams only, of both
priority levels (the priorities overlay scales on the high level's too).""",
    ),
)

HEADER = """\
# Redis ACL users of a microbatch deployment: a TEMPLATE, rendered by deploy/redis-start.sh.
# Generated by `broker acl --template` (broker/acl.py): change that, not this file.
#
# Redis cannot read this file as it is, on purpose. At start, redis-start.sh writes the real
# ACL file (its path: MICROBATCH_REDIS_ACLFILE) from it:
#   * comment and blank lines are dropped (Redis' ACL files allow neither);
#   * %PREFIX% becomes the tenant's prefix, MICROBATCH_PREFIX (default: default);
#   * `password:VAR` becomes `on #<sha256 of $VAR>` when the environment variable VAR is set
#     and not empty, else `off`: a user without a password cannot log in at all. Only hashes
#     reach the rendered file; no password is ever written into this repository;
#   * a rule written `+command@X.Y` is kept (as `+command`) on Redis X.Y or newer and dropped on
#     older servers, which would refuse to load an ACL naming a command they do not know;
#   * the lines of the file MICROBATCH_REDIS_EXTRA_ACL, if set, are added: the users of more
#     prefixes, printed by `broker acl --prefix P --password-env ...`.
#
# A prefix is a tenant: its users (<prefix>-gateway, -worker, -admin, -keda) may touch only
# keys mb:{<prefix>:... and no Pub/Sub channel, and run only the commands their side of the
# code sends, the commands inside the microbatch functions included (Redis checks the commands
# and keys a function calls against the caller's ACL). No service user may run Lua of its own
# (EVAL) or load functions: FCALL runs only what the operator loaded.
# tests/e2e/test_deploy.py runs a gateway and a worker logged in as these users and asserts that
# Redis refused nothing (ACL LOG), so a command added to the code without its rule here fails CI.
"""


def password_variable(user: User, prefix: str | None, password_env: str) -> str:
    """The environment variable holding ``user``'s password."""
    assert user.role is not None
    tenant = re.sub(r"[^A-Za-z0-9_]", "_", prefix).upper() if prefix else ""
    return password_env.format(ROLE=user.role, TENANT=tenant)


def _refuse_shared_variables(prefixes: Sequence[str], password_env: str) -> None:
    """ValueError where two prefixes' users would read their passwords from one variable
    (``shop-eu`` and ``shop_eu`` both make ``SHOP_EU``): each tenant could log in as the
    other."""
    seen: dict[str, str] = {}
    for prefix in dict.fromkeys(prefixes):
        for user in TENANT_USERS:
            if user.role is None:
                continue
            variable = password_variable(user, prefix, password_env)
            other = seen.setdefault(variable, prefix)
            if other != prefix:
                raise ValueError(
                    f"prefixes {other!r} and {prefix!r} would share the password variable "
                    f"{variable} (their users could log in as each other): rename one, or "
                    "give a --password-env that tells them apart"
                )


def _line(user: User, password: str, prefix: str | None) -> str:
    rules, name = user.rules, user.name
    if prefix is not None:
        name, rules = name.replace(PLACEHOLDER, prefix), rules.replace(PLACEHOLDER, prefix)
    if user.role is None:
        return f"user {name} reset {rules}"
    return f"user {name} reset {password} {rules}"


def template() -> str:
    """deploy/users.acl: every user, with %PREFIX%, `password:VAR` and version marks."""
    parts = [HEADER]
    for user in (*SERVER_USERS, *TENANT_USERS):
        comment = "\n".join(f"# {line}".rstrip() for line in user.comment.splitlines())
        password = ""
        if user.role is not None:
            password = f"password:{password_variable(user, None, DEFAULT_PASSWORD_ENV)}"
        parts.append(f"\n{comment}\n{_line(user, password, None)}\n")
    return "".join(parts)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


def _for_version(line: str, version: str) -> str:
    """Drop the rules newer than ``version``; strip the marks of the others."""
    wanted = _version(version)
    kept = []
    for token in line.split(" "):
        mark = re.search(r"@(\d+)\.(\d+)$", token)
        if mark:
            if (int(mark[1]), int(mark[2])) > wanted:
                continue
            token = token[: mark.start()]
        kept.append(token)
    return " ".join(kept)


def password_rule(variable: str, environ: Mapping[str, str]) -> str:
    """``on #<sha256>`` of the variable's value, or ``off`` when it is unset or empty."""
    value = environ.get(variable, "")
    if not value:
        return "off"
    return "on #" + hashlib.sha256(value.encode()).hexdigest()


def render(
    prefixes: Sequence[str],
    *,
    server: bool = False,
    password_env: str = DEFAULT_PASSWORD_ENV,
    redis_version: str = OLDEST_REDIS,
    cluster: bool = False,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """ACL file lines for the server-wide users (with ``server``) and each prefix's users.

    Returns the lines and the password variables that were unset (their users are ``off``).
    """
    environ = os.environ if environ is None else environ
    try:
        password_env.format(ROLE="", TENANT="")
    except (KeyError, IndexError, ValueError):
        raise ValueError(
            f"--password-env may name {{ROLE}} and {{TENANT}} only, not {password_env!r}"
        ) from None
    if len(prefixes) > 1 and "{TENANT}" not in password_env:
        raise ValueError("several prefixes need a --password-env naming {TENANT}")
    oldest = _version(OLDEST_REDIS)
    if not re.fullmatch(r"\d+\.\d+", redis_version) or _version(redis_version) < oldest:
        raise ValueError(f"--redis-version must be {OLDEST_REDIS} or later, as X.Y")
    for prefix in prefixes:
        check_prefix(prefix)
    _refuse_shared_variables(prefixes, password_env)
    lines, unset = [], []
    chosen: list[tuple[User, str | None]] = (
        [(user, None) for user in SERVER_USERS] if server else []
    )
    chosen += [(user, tenant) for tenant in prefixes for user in TENANT_USERS]
    for user, tenant in chosen:
        password = ""
        if user.role is not None:
            variable = password_variable(user, tenant, password_env)
            password = password_rule(variable, environ)
            if password == "off":
                unset.append(variable)
        line = _line(user, password, tenant)
        servers = ("REPLICATION", "SENTINEL", "CLUSTER")
        if cluster and user.name != "default" and user.role not in servers:
            line += " " + CLUSTER_RULES
        lines.append(_for_version(line, redis_version))
    return lines, unset
