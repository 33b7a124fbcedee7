"""The Lua scripts microbatch runs in Redis, and how they are called (EVALSHA, EVAL fallback).

Two paths use a script: a bounded enqueue (one call per round trip, which checks the queue
bounds atomically with the XADDs, so many gateways cannot overshoot them together, and wakes a
blocked worker to a whole call at once; an unbounded one is a plain MULTI/EXEC) and a caller
withdrawing its items. The worker's hot path (ack, delete, reply) is plain commands.

Arguments travel as one msgpack blob (packed in C on the client, unpacked in C by Redis'
cmsgpack) rather than as hundreds of separate arguments. cmsgpack predates msgpack's bin type,
so blobs are packed with use_bin_type=False (bytes and str both become raw strings).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
from redis.exceptions import ResponseError

from .resp_lane import RespLane

# Append calls' entries, each call only if it fits the bounds.
# KEYS: stream, queued-bytes counter. ARGV: max items, max bytes (0: no limit), blob of
# [[data bytes, [field, value, ...], ...], ...] (one list per call, one list per entry).
# Returns per call {0, id...} when queued, {1} over the item bound, {2} over the byte bound.
ENQUEUE = """
local max_items, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local results, added = {}, 0
local length = max_items > 0 and redis.call('XLEN', KEYS[1]) or 0
local queued = max_bytes > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') or 0
for c, call in ipairs(cmsgpack.unpack(ARGV[3])) do
  local count, size = #call - 1, call[1]
  if max_items > 0 and length + count > max_items then
    results[c] = {1}
  elseif max_bytes > 0 and queued + size > max_bytes then
    results[c] = {2}
  else
    local out = {0}
    for i = 2, #call do
      out[i] = redis.call('XADD', KEYS[1], '*', unpack(call[i]))
    end
    length, queued, added = length + count, queued + size, added + size
    results[c] = out
  end
end
if added > 0 then redis.call('INCRBY', KEYS[2], added) end
return results
"""

# Withdraw entries whose caller gave up. One not yet delivered is deleted (no worker will read
# it) and its bytes released; one a worker already read is marked in the cancelled set (scored
# by expiry, ms) for the worker to skip, and the worker deletes it as usual. So an entry is
# deleted, and its bytes released, exactly once, and the worker's own deletes need no script.
# KEYS: stream, queued-bytes counter, cancelled set. ARGV: group, expiry (ms), now (ms),
# blob of [entry id, size, ...].
WITHDRAW = """
local released, items = 0, cmsgpack.unpack(ARGV[4])
for i = 1, #items, 2 do
  local id = items[i]
  if #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1) > 0 then
    redis.call('ZADD', KEYS[3], ARGV[2], id)
  elseif redis.call('XDEL', KEYS[1], id) == 1 then
    released = released + items[i + 1]
  end
end
if released > 0 then redis.call('DECRBY', KEYS[2], released) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[3])
return released
"""


# Remove a dead consumer from the group, but only if it holds no entries and has no heartbeat.
# KEYS: stream, the consumer's heartbeat key. ARGV: group, consumer.
RETIRE_CONSUMER = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""


def pack_args(value: Any) -> bytes:
    """Pack a script argument blob for cmsgpack."""
    packed: bytes = msgpack.packb(value, use_bin_type=False)
    return packed


class LuaScript:
    """A script called by its SHA1; EVAL (which also caches it) only when the server lacks it."""

    def __init__(self, body: str) -> None:
        self.body = body
        self.sha = hashlib.sha1(body.encode()).hexdigest()

    async def run(self, lane: RespLane, keys: list[str], args: list[Any]) -> Any:
        """Run on a lane; raises ResponseError for an error in the script."""
        try:
            return await lane.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            return await lane.execute("EVAL", self.body, len(keys), *keys, *args)


ENQUEUE_SCRIPT = LuaScript(ENQUEUE)
WITHDRAW_SCRIPT = LuaScript(WITHDRAW)
RETIRE_CONSUMER_SCRIPT = LuaScript(RETIRE_CONSUMER)
