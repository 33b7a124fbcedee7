#!/bin/sh
# Start redis-server with deploy/redis.conf and the ACL users of deploy/users.acl.
#
#   MICROBATCH_PREFIX=default MICROBATCH_REDIS_OPERATOR_PASSWORD=... \
#   MICROBATCH_REDIS_GATEWAY_PASSWORD=... MICROBATCH_REDIS_WORKER_PASSWORD=... \
#   MICROBATCH_REDIS_ADMIN_PASSWORD=... sh deploy/redis-start.sh [redis-server options ...]
#
# users.acl is a template (see its header; `broker acl --template` writes it): this script
# renders it into the ACL file Redis loads, for the prefix MICROBATCH_PREFIX, with the SHA-256
# of each password taken from the environment (a user whose variable is unset or empty is
# disabled) and the commands this server's version knows, then adds the users of more prefixes
# from MICROBATCH_REDIS_EXTRA_ACL. Options given to this script go to redis-server after the
# config file, so they win over it (e.g. --port 6380 --dir /tmp/data --maxmemory 4gb).
#
#   sh deploy/redis-start.sh --render-acl     # only write the ACL file (for a Redis run elsewhere)
#
# Environment:
#   MICROBATCH_REDIS_CONF          the config file        [default: redis.conf beside this script]
#   MICROBATCH_REDIS_ACL_TEMPLATE  the ACL template       [default: users.acl beside this script]
#   MICROBATCH_REDIS_ACLFILE       where the rendered ACL file is written and loaded from
#                                  [default: /tmp/microbatch-users.acl]
#   MICROBATCH_PREFIX              the prefix (tenant) whose users are rendered [default: default]
#   MICROBATCH_REDIS_EXTRA_ACL     a file of more ACL lines to add, e.g. the users of other
#                                  prefixes from `broker acl --prefix P --password-env ...`
#   REDIS_SERVER                   the redis-server binary [default: redis-server]
#   REDIS_VERSION                  render for this Redis version (e.g. 7.2) instead of asking
#                                  REDIS_SERVER (for --render-acl without a local redis-server)
#   MICROBATCH_REDIS_RUN_CONF      the copy of the config file Redis runs from (Sentinel rewrites
#                                  a node's config at a failover: never the file shipped here)
#                                  [default: beside the ACL file, <its name without .acl>.conf]
#   MICROBATCH_REDIS_CLUSTER_RULES rules added to every user but default, replication, sentinel and
#                                  cluster: on the nodes of a Redis Cluster, what cluster-aware
#                                  clients send besides their commands (the rules
#                                  `broker acl --cluster` adds: +cluster|slots +cluster|shards
#                                  +asking +readonly +command +multi +exec)
#   MICROBATCH_REDIS_REPLICATION_PASSWORD
#                                  also: this node logs in to its master as the replication user
#                                  whenever it is a replica (Sentinel setups: every node, since
#                                  any may be demoted); the password goes into the copy (mode
#                                  600), not onto the command line. Add --replicaof HOST PORT to
#                                  start a replica.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
conf=${MICROBATCH_REDIS_CONF:-$here/redis.conf}
template=${MICROBATCH_REDIS_ACL_TEMPLATE:-$here/users.acl}
aclfile=${MICROBATCH_REDIS_ACLFILE:-/tmp/microbatch-users.acl}
server=${REDIS_SERVER:-redis-server}
prefix=${MICROBATCH_PREFIX:-default}
extra=${MICROBATCH_REDIS_EXTRA_ACL:-}
cluster_rules=${MICROBATCH_REDIS_CLUSTER_RULES:-}

case "$prefix" in
    "" | *[!A-Za-z0-9_.-]*)
        echo "redis-start.sh: invalid MICROBATCH_PREFIX '$prefix': use letters, digits, '_', '-' or '.'" >&2
        exit 1 ;;
esac

case "$cluster_rules" in
    *[!A-Za-z0-9_.@|+\ -]*)
        echo "redis-start.sh: MICROBATCH_REDIS_CLUSTER_RULES: only +command|subcommand rules" >&2
        exit 1 ;;
esac

# "7.2" from "Redis server v=7.2.4 sha=..."
version=${REDIS_VERSION:-$("$server" --version | sed -n 's/.* v=\([0-9]*\)\.\([0-9]*\).*/\1.\2/p')}
if [ -z "$version" ]; then
    echo "redis-start.sh: cannot tell the version of $server (set REDIS_VERSION)" >&2
    exit 1
fi
if [ "${version%%.*}" -lt 7 ]; then
    echo "redis-start.sh: microbatch needs Redis 7.0 or later (Functions); $server is $version" >&2
    exit 1
fi

# password:VAR -> "on #<sha256>" or "off"
substitutions=""
for var in $(sed -n '/^[[:space:]]*#/!s/.*password:\([A-Za-z0-9_]*\).*/\1/p' "$template" | sort -u); do
    eval "value=\${$var:-}"
    if [ -n "$value" ]; then
        rule="on #$(printf '%s' "$value" | sha256sum | cut -c1-64)"
    else
        rule="off"
        echo "redis-start.sh: $var is not set: its user is disabled" >&2
    fi
    substitutions="$substitutions;s/password:$var\$/$rule/;s/password:$var /$rule /"
done

umask 077
cluster_sed=""
if [ -n "$cluster_rules" ]; then
    cluster_sed="/^user \(default\|replication\|sentinel\|cluster\) /!s/\$/ $cluster_rules/"
fi
sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d' -e "s/%PREFIX%/$prefix/g" \
    -e "${substitutions#;}" -e "$cluster_sed" "$template" |
    awk -v version="$version" '
        function newer(need,    a, b) {
            split(need, a, "."); split(version, b, ".")
            return (b[1] + 0 > a[1] + 0) || (b[1] + 0 == a[1] + 0 && b[2] + 0 >= a[2] + 0)
        }
        {
            line = ""
            for (i = 1; i <= NF; i++) {
                field = $i
                if (match(field, /@[0-9]+\.[0-9]+$/)) {
                    if (!newer(substr(field, RSTART + 1))) continue
                    field = substr(field, 1, RSTART - 1)
                }
                line = line (line == "" ? "" : " ") field
            }
            print line
        }' >"$aclfile"
if [ -n "$extra" ]; then
    sed -e '/^[[:space:]]*#/d' -e '/^[[:space:]]*$/d' "$extra" >>"$aclfile"
fi

if [ "${1:-}" = --render-acl ]; then
    echo "redis-start.sh: wrote $aclfile (for Redis $version)" >&2
    exit 0
fi

# Redis runs from a copy of the config file, made anew at each start: CONFIG REWRITE (which
# Sentinel sends when it reconfigures a node) then never touches the file shipped here.
runconf=${MICROBATCH_REDIS_RUN_CONF:-${aclfile%.acl}.conf}
cp "$conf" "$runconf"
if [ -n "${MICROBATCH_REDIS_REPLICATION_PASSWORD:-}" ]; then
    case "$MICROBATCH_REDIS_REPLICATION_PASSWORD" in
        *[!A-Za-z0-9_.-]*)
            echo "redis-start.sh: MICROBATCH_REDIS_REPLICATION_PASSWORD: use letters, digits, '_', '-' or '.'" >&2
            exit 1 ;;
    esac
    printf '\nmasteruser replication\nmasterauth %s\n' "$MICROBATCH_REDIS_REPLICATION_PASSWORD" >>"$runconf"
fi
exec "$server" "$runconf" --aclfile "$aclfile" "$@"
