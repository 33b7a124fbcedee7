"""The Lua scripts microbatch runs in Redis, and how they are called (EVALSHA, EVAL fallback)."""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
from redis.exceptions import NoScriptError

# Arguments travel as one msgpack blob (packed in C on the client, unpacked in C by Redis'
# cmsgpack) rather than as hundreds of separate arguments. cmsgpack predates msgpack's bin
# type, so blobs are packed with use_bin_type=False (bytes and str both become raw strings).

# Append calls' entries, each call only if it fits the bound, atomically (so many gateways
# cannot overshoot the bound together, and a blocked worker wakes to a whole call at once).
# KEYS: stream, queued-bytes counter. ARGV: max items, max bytes (0: no limit), blob of
# [[data bytes, [field, value, ...], ...], ...] (one list per call, one list per entry).
# Returns per call {0, id...} when queued, {1} over the item bound, {2} over the byte bound.
ENQUEUE = """
local max_items, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local results = {}
for c, call in ipairs(cmsgpack.unpack(ARGV[3])) do
  local count, size = #call - 1, call[1]
  if max_items > 0 and redis.call('XLEN', KEYS[1]) + count > max_items then
    results[c] = {1}
  elseif max_bytes > 0 and tonumber(redis.call('GET', KEYS[2]) or '0') + size > max_bytes then
    results[c] = {2}
  else
    local out = {0}
    for i = 2, #call do
      out[i] = redis.call('XADD', KEYS[1], '*', unpack(call[i]))
    end
    if size > 0 then redis.call('INCRBY', KEYS[2], size) end
    results[c] = out
  end
end
return results
"""

# Delete entries and release their bytes from the counter, once: whichever side (the worker
# that answered, or the caller that withdrew it) deletes an entry first releases its bytes.
# KEYS: stream, queued-bytes counter. ARGV: group ('' to skip XACK), blob of [id, size, ...].
REMOVE = """
local released, pairs_ = 0, cmsgpack.unpack(ARGV[2])
for i = 1, #pairs_, 2 do
  if ARGV[1] ~= '' then redis.call('XACK', KEYS[1], ARGV[1], pairs_[i]) end
  if redis.call('XDEL', KEYS[1], pairs_[i]) == 1 then released = released + pairs_[i + 1] end
end
if released > 0 then redis.call('DECRBY', KEYS[2], released) end
return released
"""


# Which of the given entries were withdrawn (deleted by their caller) while a worker held them.
# KEYS: stream. ARGV: blob of [id, ...]. Returns the ids no longer in the stream.
WITHDRAWN = """
local gone = {}
for _, id in ipairs(cmsgpack.unpack(ARGV[1])) do
  if #redis.call('XRANGE', KEYS[1], id, id) == 0 then gone[#gone + 1] = id end
end
return gone
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

    async def run(self, client: Any, keys: list[str], args: list[Any]) -> Any:
        """Run on an asyncio client."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.eval(self.body, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: list[str], args: list[Any]) -> None:
        """Add to a pipeline; check its result with :meth:`is_missing` and :meth:`run` again."""
        pipe.evalsha(self.sha, len(keys), *keys, *args)

    @staticmethod
    def is_missing(result: Any) -> bool:
        return isinstance(result, NoScriptError)


ENQUEUE_SCRIPT = LuaScript(ENQUEUE)
REMOVE_SCRIPT = LuaScript(REMOVE)
WITHDRAWN_SCRIPT = LuaScript(WITHDRAWN)
