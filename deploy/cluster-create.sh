#!/bin/sh
# Form a Redis Cluster of the nodes given, once (docker-compose.cluster.yml).
#
#   MICROBATCH_REDIS_CLUSTER_PASSWORD=... sh deploy/cluster-create.sh REPLICAS HOST:PORT ...
#
# The nodes run deploy/redis-start.sh with --cluster-enabled yes; this logs in to them as the
# `cluster` ACL user (deploy/users.acl) and runs `redis-cli --cluster create` with REPLICAS
# replicas per primary (the first nodes given become the primaries), unless the first node
# says the cluster is formed already (a restart of the stack keeps it: each node's nodes.conf
# is in its volume). CLUSTER MEET takes addresses, so host names are resolved first. It waits
# until the first node says the cluster is ok.
#
# Environment:
#   MICROBATCH_REDIS_CLUSTER_PASSWORD  the password of the nodes' `cluster` ACL user
#   REDIS_CLI                          the redis-cli binary [default: redis-cli]
set -eu

if [ "$#" -lt 2 ]; then
    echo "usage: cluster-create.sh REPLICAS HOST:PORT [HOST:PORT ...]" >&2
    exit 2
fi
replicas=$1
shift
cli=${REDIS_CLI:-redis-cli}
REDISCLI_AUTH=${MICROBATCH_REDIS_CLUSTER_PASSWORD:?set MICROBATCH_REDIS_CLUSTER_PASSWORD}
export REDISCLI_AUTH

first=$1
info() {
    "$cli" --user cluster -h "${first%:*}" -p "${first##*:}" cluster info 2>/dev/null
}
if info | grep -q '^cluster_state:ok'; then
    echo "cluster-create.sh: the cluster is formed already"
    exit 0
fi
addresses=""
for node in "$@"; do
    host=${node%:*}
    address=$(getent hosts "$host" | awk '{ print $1; exit }')
    addresses="$addresses ${address:-$host}:${node##*:}"
done
# shellcheck disable=SC2086  # one argument per address
"$cli" --user cluster --cluster create $addresses --cluster-replicas "$replicas" --cluster-yes
tries=0
until info | grep -q '^cluster_state:ok'; do
    tries=$((tries + 1))
    if [ "$tries" -gt 60 ]; then
        echo "cluster-create.sh: the cluster is not ok after 30 s" >&2
        exit 1
    fi
    sleep 0.5
done
echo "cluster-create.sh: the cluster is formed"
