#!/bin/sh
# Start a Redis Sentinel watching the microbatch master (docker-compose.sentinel.yml).
#
#   MICROBATCH_SENTINEL_MASTER_HOST=redis MICROBATCH_REDIS_SENTINEL_PASSWORD=... \
#   sh deploy/sentinel-start.sh [redis-server --sentinel options ...]
#
# Sentinel rewrites its configuration file as it learns the replicas, the other sentinels and
# each failover, so this script writes a fresh one (to MICROBATCH_SENTINEL_CONF) only when
# there is none yet, then runs `redis-server <it> --sentinel [options]`.
#
# Environment:
#   MICROBATCH_SENTINEL_SERVICE        the service name clients give in their redis+sentinel://
#                                      URL [default: mymaster]
#   MICROBATCH_SENTINEL_MASTER_HOST    the master to watch at first [default: redis]
#   MICROBATCH_SENTINEL_MASTER_PORT    its port [default: 6379]
#   MICROBATCH_SENTINEL_QUORUM         sentinels that must agree the master is down [default: 2]
#   MICROBATCH_SENTINEL_DOWN_AFTER_MS  how long without an answer before it is down [default:
#                                      5000; keep it well below the callers' workers grace, 10 s]
#   MICROBATCH_SENTINEL_FAILOVER_TIMEOUT_MS                                [default: 60000]
#   MICROBATCH_REDIS_SENTINEL_PASSWORD the password of the Redis nodes' `sentinel` ACL user
#                                      (deploy/users.acl), which this sentinel logs in as
#   MICROBATCH_SENTINEL_PASSWORD       if set, clients must give it to this sentinel
#                                      (?sentinel_password=... in their URL)
#   MICROBATCH_SENTINEL_CONF           the configuration file [default: /tmp/sentinel.conf]
#   REDIS_SERVER                       the redis-server binary [default: redis-server]
set -eu

conf=${MICROBATCH_SENTINEL_CONF:-/tmp/sentinel.conf}
server=${REDIS_SERVER:-redis-server}
service=${MICROBATCH_SENTINEL_SERVICE:-mymaster}
host=${MICROBATCH_SENTINEL_MASTER_HOST:-redis}
port=${MICROBATCH_SENTINEL_MASTER_PORT:-6379}
quorum=${MICROBATCH_SENTINEL_QUORUM:-2}
down_after=${MICROBATCH_SENTINEL_DOWN_AFTER_MS:-5000}
failover_timeout=${MICROBATCH_SENTINEL_FAILOVER_TIMEOUT_MS:-60000}

for value in "$service" "$host" "$port" "$quorum" "$down_after" "$failover_timeout" \
    "${MICROBATCH_REDIS_SENTINEL_PASSWORD:-}" "${MICROBATCH_SENTINEL_PASSWORD:-}"; do
    case "$value" in
        *[!A-Za-z0-9_.-]*)
            echo "sentinel-start.sh: settings and passwords: use letters, digits, '_', '-' or '.'" >&2
            exit 1 ;;
    esac
done

if [ ! -s "$conf" ]; then
    umask 077
    {
        echo "port 26379"
        echo "daemonize no"
        echo "logfile \"\""
        echo "sentinel resolve-hostnames yes"
        echo "sentinel announce-hostnames yes"
        echo "sentinel monitor $service $host $port $quorum"
        echo "sentinel down-after-milliseconds $service $down_after"
        echo "sentinel failover-timeout $service $failover_timeout"
        echo "sentinel parallel-syncs $service 1"
        if [ -n "${MICROBATCH_REDIS_SENTINEL_PASSWORD:-}" ]; then
            echo "sentinel auth-user $service sentinel"
            echo "sentinel auth-pass $service $MICROBATCH_REDIS_SENTINEL_PASSWORD"
        fi
        if [ -n "${MICROBATCH_SENTINEL_PASSWORD:-}" ]; then
            echo "requirepass $MICROBATCH_SENTINEL_PASSWORD"
        fi
    } >"$conf"
fi
exec "$server" "$conf" --sentinel "$@"
