"""The Redis Functions library microbatch runs in Redis (``microbatch``), and how it is loaded.

Five functions, called with FCALL (docs/protocol.md, sections 2.1, 6, 7, 8 and 10.6):

- ``mb_enqueue``: append calls' entries to a model's stream, each call only if it fits the
  queue bound, atomically with the check (so many gateways cannot overshoot it together, and
  a blocked worker wakes once, to a whole call);
- ``mb_withdraw``: take back entries whose caller gave up;
- ``mb_retire``: remove a dead consumer from the group once it holds nothing;
- ``mb_reply``: push replies to reply lists, never to a key that is not a list, and never
  giving a TTL to a key the reply did not create;
- ``mb_release``: answer the library's version and revision (a worker's check at start).

Every function takes the library version its caller was written for as its first argument and
refuses a newer one (``MBVERSION``), so a library older than its callers is detected on the
first call. The library is loaded with ``FUNCTION LOAD REPLACE`` by ``broker functions load``
(an operator's user; on every primary of a Redis Cluster, since functions are per node); a
caller or worker whose Redis user may load functions (the default user of a development Redis)
loads it by itself when it finds it missing or old (of a Redis Cluster, on every primary that
lacks it or holds an older release; never over a newer one).

Arguments are flat (no blob to unpack): Redis hands a function its arguments as Lua strings,
and each function checks their shape and its per-call caps before it writes anything.
"""

from __future__ import annotations

import re
from typing import Any

from redis.cluster import RedisCluster

from .keys import (
    CANCELLED_TEMPLATE,
    CONSUMERS_TEMPLATE,
    GROUP,
    HEARTBEAT_TEMPLATE,
    LEVEL_SUFFIX,
    PACKED_ITEMS_TEMPLATE,
    QUEUE_BOUND_TEMPLATE,
    QUEUED_BYTES_TEMPLATE,
    STREAM_TEMPLATE,
)

LIBRARY = "microbatch"
VERSION = 2
# Changes to the library's code that keep its interface (a fix, a new limit) raise REVISION;
# a worker that finds an older revision of its version loaded replaces it if its user may,
# as callers replace an older version. A change of interface raises VERSION (and resets this).
REVISION = 2
THIS_RELEASE = (VERSION, REVISION)  # what callers compare a loaded library's release with

ENQUEUE = "mb_enqueue"
WITHDRAW = "mb_withdraw"
RETIRE = "mb_retire"
REPLY = "mb_reply"
RELEASE = "mb_release"

# What one FCALL of mb_enqueue (or mb_withdraw) may carry: Redis runs a function to its end
# without serving anyone else, so one call's work is capped (about 5 ms of Redis time for
# 4096 XADDs). The Python client splits its round trips to stay within them; one call of
# more items or bytes is refused before it is sent (InvalidInput).
MAX_CALL_ENTRIES = 4096
MAX_CALL_BYTES = 64 * 1024 * 1024  # data bytes: one item at the codec's size limit fits
# What one mb_withdraw may spend on the entries it reads (a step per field) and on the items
# of multi-item entries it checks or unmarks (a command each): past it, a handle is only
# marked, as for an entry a worker has read. The most a caller's own withdrawal needs is about
# 25,000 (4096 handles of entries with a traceparent); without the bound, 4096 handles of
# entries of 512 items cost 2 million commands, seconds of Redis.
MAX_WITHDRAW_STEPS = 8 * MAX_CALL_ENTRIES

# The most items one multi-item entry may hold: mb_enqueue passes XADD its 3 to 4 field pairs
# per item as one Lua unpack, which Redis caps at 8000 values.
MAX_ENTRY_ITEMS = 512

CANCELLED_TTL_MS = 10 * 60 * 1000  # how long a withdrawal is remembered for workers to skip
# A worker still counts towards the queue bound this long after its heartbeat's expiry: after
# Redis stalls for longer than the heartbeat TTL, every expiry is past until the supervisors
# renew them, and the calls waiting meanwhile met a bound of one worker's share. (Takeover
# likewise waits 2 s before it takes a lapsed worker's entries.)
LAPSED_WORKER_GRACE_MS = 2000
PUSH_CHUNK = 1000  # replies per RPUSH inside mb_reply (Lua's unpack has a stack limit)


def _key_name(template: str) -> str:
    """A key template's own name, after ``mb:{prefix:model}:`` (``heartbeat:`` for a consumer's
    heartbeat key, whose name goes on)."""
    key = template.format(prefix="p", model="m", consumer="")
    return key.removeprefix("mb:{p:m}:")


CODE = (
    r"""#!lua name=microbatch
-- microbatch's functions: broker/functions.py and docs/protocol.md are their documentation.
local VERSION, REVISION = @VERSION@, @REVISION@
local MAX_ENTRIES, MAX_BYTES = @MAX_ENTRIES@, @MAX_BYTES@
local MAX_WITHDRAW_STEPS = @MAX_WITHDRAW_STEPS@
local MAX_ENTRY_ITEMS = @MAX_ENTRY_ITEMS@
local CANCELLED_TTL_MS, PUSH_CHUNK = @CANCELLED_TTL_MS@, @PUSH_CHUNK@
local LAPSED_WORKER_GRACE_MS = @LAPSED_WORKER_GRACE_MS@
local GROUP = '@GROUP@'
local LEVEL_SUFFIX = '@LEVEL_SUFFIX@'

-- Every call names the library version its caller was written for: a newer one is refused.
-- A version that is no whole number from 1 (`0`, `1.0`, `02`) is a malformed call: loading
-- a library would not help it.
local function version_error(args)
  local given = args[1]
  if type(given) ~= 'string' or not string.match(given, '^[1-9][0-9]*$') then
    return redis.error_reply('MBARGS the library version (the first argument after the ' ..
      'keys) must be a whole number from 1, not ' ..
      string.format('%q', string.sub(tostring(given), 1, 32)))
  end
  if tonumber(given) <= VERSION then return nil end
  return redis.error_reply('MBVERSION this Redis holds version ' .. VERSION ..
    ' of the microbatch library; the caller needs version ' .. given ..
    ': run `broker functions load`')
end

-- A count as callers and workers write it: ASCII digits only (tonumber also takes ' 2', '0x2',
-- '2.0' and '1e1', which would be queued and then refused by the worker that reads them).
local function digits(text)
  return string.match(text or '', '^[0-9]+$') and tonumber(text)
end

-- Each function names the keys it needs (docs/protocol.md, section 2.1).
local function keys_error(keys, needed, name)
  if #keys >= needed then return nil end
  return redis.error_reply('MBARGS ' .. name .. ' takes at least ' .. needed .. ' keys, not ' ..
    #keys)
end

-- The keys a function takes must be one model's (one partition's, one level's): key 1 a
-- request stream `mb:{tag}:requests` (with the high level's suffix or not), each other key
-- `mb:{tag}:` and its own name, the level's suffix on the leveled ones; a name ending in ':'
-- is a prefix (a consumer's heartbeat key). Otherwise a call could queue to one model and
-- count its bytes in another's counter, where no worker would ever release them.
local function model_keys_error(keys, names, name)
  local base, level = string.match(keys[1], '^(mb:{[^}]*}:)@REQUESTS@(.*)$')
  if not base or (level ~= '' and level ~= LEVEL_SUFFIX) then
    return redis.error_reply('MBARGS ' .. name .. ': key 1 must be a request stream ' ..
      '(mb:{prefix:model}:@REQUESTS@), not ' .. string.format('%q', string.sub(keys[1], 1, 200)))
  end
  for i = 2, #keys do
    local want = names[i]
    if want then
      local key, expected = keys[i], base .. want[1]
      local ok
      if string.sub(want[1], -1) == ':' then
        ok = #key > #expected and string.sub(key, 1, #expected) == expected
      else
        if want[2] then expected = expected .. level end
        ok = key == expected
      end
      if not ok then
        return redis.error_reply('MBARGS ' .. name .. ': key ' .. i .. ' must be ' .. expected ..
          (string.sub(expected, -1) == ':' and '<consumer>' or '') .. ' (the keys of key 1\'s ' ..
          'model), not ' .. string.format('%q', string.sub(key, 1, 200)))
      end
    end
  end
  return nil
end

-- Each function's keys after the stream: the name and whether it is leveled.
local ENQUEUE_KEYS = {nil, {'@QUEUED_BYTES@', true}, {'@QUEUE_BOUND@', false},
  {'@CONSUMERS@', false}, {'@PACKED_ITEMS@', true}}
local WITHDRAW_KEYS = {nil, {'@QUEUED_BYTES@', true}, {'@CANCELLED@', true},
  {'@PACKED_ITEMS@', true}}
local RETIRE_KEYS = {nil, {'@HEARTBEAT@', false}}

local function limit_error(name)
  return redis.error_reply('MBLIMIT one ' .. name .. ' may carry at most ' .. MAX_ENTRIES ..
    ' entries and ' .. MAX_BYTES .. ' data bytes')
end

-- The tighter of two bounds, 0 meaning none.
local function tighter(a, b)
  if a > 0 and (b <= 0 or a < b) then return a end
  return b
end

-- Field names and handle suffixes of item k of a v2 entry, made once at load rather than per
-- item (mb_enqueue's cost in Redis is mostly its per-item Lua work).
local ID_FIELD, TIMEOUT_FIELD, DATA_FIELD, TRACE_FIELD, MARK, NUMBER = {}, {}, {}, {}, {}, {}
for k = 0, MAX_ENTRY_ITEMS do
  local s = '' .. k  -- (at load, a library sees no globals such as tostring)
  ID_FIELD[k], TIMEOUT_FIELD[k], DATA_FIELD[k] = 'id.' .. s, 'timeout.' .. s, 'data.' .. s
  TRACE_FIELD[k], MARK[k], NUMBER[k] = 'traceparent.' .. s, '#' .. s, s
end

-- Appends one entry holding the `k` items noted in `pos` (the argument index of each item's
-- request id), `owner` (its call) and `slot` (where its handle goes in its call's result):
-- a lone item as a v1 entry, more as a v2 entry (docs/protocol.md, section 5.1). A call's
-- result gets each item's handle: the entry id or, in a v2 entry, `<entry id>#<i>`.
local function add_entry(stream, args, calls, pos, owner, slot, k, fields)
  local call = calls[owner[1]]
  local first = call[1]
  local reply = args[first + 1]
  if k == 1 then
    local j, timeout, trace = pos[1], args[first + 2], args[first + 3]
    local id
    if trace == '' then
      id = redis.call('XADD', stream, '*', 'v', '1', 'id', args[j], 'reply', reply,
        'timeout', timeout, 'data', args[j + 1])
    else
      id = redis.call('XADD', stream, '*', 'v', '1', 'id', args[j], 'reply', reply,
        'timeout', timeout, 'data', args[j + 1], 'traceparent', trace)
    end
    call[4][slot[1]] = id
    return
  end
  fields[1], fields[2], fields[3], fields[4] = stream, '*', 'v', '2'
  fields[5], fields[6], fields[7], fields[8] = 'reply', reply, 'n', NUMBER[k]
  local nf = 8
  for i = 1, k do
    local at, j, x = calls[owner[i]][1], pos[i], i - 1
    fields[nf + 1], fields[nf + 2] = ID_FIELD[x], args[j]
    fields[nf + 3], fields[nf + 4] = TIMEOUT_FIELD[x], args[at + 2]
    fields[nf + 5], fields[nf + 6] = DATA_FIELD[x], args[j + 1]
    nf = nf + 6
    local trace = args[at + 3]
    if trace ~= '' then
      fields[nf + 1], fields[nf + 2] = TRACE_FIELD[x], trace
      nf = nf + 2
    end
  end
  local id = redis.call('XADD', unpack(fields, 1, nf))
  for i = 1, k do calls[owner[i]][4][slot[i]] = id .. MARK[i - 1] end
end

-- Appends the items of the accepted calls, in order, consecutive items that share a reply
-- key (up to `pack` of them, across calls) as one entry. Each call is {its argument index,
-- n, size, result}. Returns how many items went into entries beyond one per entry.
local function add_items(stream, args, calls, pack)
  local pos, owner, slot, fields = {}, {}, {}, {}
  local k, entries, total, current = 0, 0, 0, nil
  for c = 1, #calls do
    local first, n = calls[c][1], calls[c][2]
    local reply = args[first + 1]
    for m = 0, n - 1 do
      if k > 0 and (k == pack or reply ~= current) then
        add_entry(stream, args, calls, pos, owner, slot, k, fields)
        entries, k = entries + 1, 0
      end
      k = k + 1
      pos[k], owner[k], slot[k] = first + 4 + 2 * m, c, m + 2
      current = reply
    end
    total = total + n
  end
  if k > 0 then
    add_entry(stream, args, calls, pos, owner, slot, k, fields)
    entries = entries + 1
  end
  return total - entries
end

-- KEYS: stream, queued-bytes counter, queue bound (hash), consumers (sorted set), from
--   version 2 the packed-items counter (items beyond one per entry: the stream holds
--   XLEN + that many items).
-- ARGV: version, the caller's max items, max bytes (0: none; they can only tighten the
--   model's bound), from version 2 the most items per entry (1: v1 entries only), then for
--   each call: n, reply key, timeout (ms), traceparent ('' for none), then n pairs of request
--   id and data.
-- The model's bound (written by its workers) is `items` per live worker (at least one) and
-- `bytes` in all; the stream's length counts its entries. Returns one result per call:
-- {0, handle, ...} when queued (one handle per item: its entry id, or `<entry id>#<i>` for
-- item i of a v2 entry), {1, bound} when refused by the item bound, {2, bound} when refused
-- by the byte bound, {3, bound} when the call alone has more items than the item bound (it
-- can never be queued whole).
local function enqueue(keys, args)
  local err = version_error(args) or keys_error(keys, 4, 'mb_enqueue')
    or model_keys_error(keys, ENQUEUE_KEYS, 'mb_enqueue')
  if err then return err end
  if not (string.match(args[2] or '', '^[0-9]+$') and string.match(args[3] or '', '^[0-9]+$'))
  then
    return redis.error_reply("MBARGS the caller's max items and max bytes (the arguments " ..
      'after the version) must be whole numbers from 0 (0: no bound of the caller\'s)')
  end
  local max_items, max_bytes = tonumber(args[2]), tonumber(args[3])
  local pack, at = 1, 4
  if tonumber(args[1]) >= 2 then
    pack = digits(args[4])
    if not pack or pack < 1 or pack > MAX_ENTRY_ITEMS then
      return redis.error_reply('MBARGS items per entry must be 1 to ' .. MAX_ENTRY_ITEMS)
    end
    if pack > 1 and not keys[5] then
      return redis.error_reply('MBARGS packing items needs the packed-items counter as key 5')
    end
    at = 5
  end
  -- The shape and the caps are checked before anything is written.
  local calls, entries, bytes = {}, 0, 0
  while at <= #args do
    local n = digits(args[at])
    if not n or n < 1 or at + 3 + 2 * n > #args then
      return redis.error_reply('MBARGS mb_enqueue: the call at argument ' .. at ..
        ' (the version is argument 1) is malformed: a call is <n> <reply key> <timeout ms> ' ..
        '<traceparent> then n pairs of request id and data, n a whole number of items from 1 ' ..
        'in ASCII digits')
    end
    if entries + n > MAX_ENTRIES then return limit_error('mb_enqueue') end
    local size = 0
    for j = at + 5, at + 3 + 2 * n, 2 do size = size + #args[j] end
    entries, bytes = entries + n, bytes + size
    if bytes > MAX_BYTES then return limit_error('mb_enqueue') end
    calls[#calls + 1] = {at, n, size}
    at = at + 4 + 2 * n
  end
  local bound = redis.call('HMGET', keys[3], 'items', 'bytes')
  local per_worker = tonumber(bound[1]) or 0
  -- An empty stream holds no items and no bytes: counters above 0 beside it were left by
  -- something that removed entries without releasing them (a worker older than multi-item
  -- entries dead-letters a v2 entry and releases neither its data.<i> bytes nor its n - 1
  -- packed items), and would refuse calls for good. They go back to 0 here. (A worker's
  -- acknowledgement between its XDEL and its DECRBY then takes a counter below 0 for a
  -- moment, which it adds back, as after a bare XADD: section 6 of docs/protocol.md.)
  local length = redis.call('XLEN', keys[1])
  local empty = length == 0
  if keys[5] then
    local packed_now = tonumber(redis.call('GET', keys[5])) or 0
    if empty and packed_now > 0 then
      redis.call('DECRBY', keys[5], packed_now)  -- (the commands a caller's ACL user runs)
      packed_now = 0
    end
    length = length + math.max(packed_now, 0)
  end
  if per_worker > 0 then
    -- Live workers are counted only when the queue could outgrow one worker's share: the
    -- bound is at least that share, so below it their number changes no outcome.
    local live = 1
    if length + entries > per_worker then
      local time = redis.call('TIME')
      local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
      live = math.max(redis.call('ZCOUNT', keys[4], now_ms - LAPSED_WORKER_GRACE_MS, '+inf'), 1)
    end
    max_items = tighter(max_items, per_worker * live)
  end
  max_bytes = tighter(max_bytes, tonumber(bound[2]) or 0)
  -- The counter takes every call's bytes at once (one command rather than a read and a
  -- write); the bytes of calls refused below are given back at the end.
  local queued = redis.call('INCRBY', keys[2], bytes) - bytes
  if empty and queued > 0 then
    redis.call('DECRBY', keys[2], queued)
    queued = 0
  end
  local results, added, accepted = {}, 0, {}
  for c, call in ipairs(calls) do
    local n, size = call[2], call[3]
    if max_items > 0 and n > max_items then
      results[c] = {3, max_items}
    elseif max_items > 0 and length + n > max_items then
      results[c] = {1, max_items}
    elseif max_bytes > 0 and queued + size > max_bytes then
      results[c] = {2, max_bytes}
    else
      -- Counted in items, as if each were an entry: the bound is never loosened within a call.
      length, queued, added = length + n, queued + size, added + size
      local out = {0}
      call[4], results[c] = out, out
      accepted[#accepted + 1] = call
    end
  end
  local packed = add_items(keys[1], args, accepted, pack)
  if packed > 0 and keys[5] then redis.call('INCRBY', keys[5], packed) end
  if added < bytes then redis.call('DECRBY', keys[2], bytes - added) end
  return results
end

-- The data bytes of an entry's fields, and the items it holds beyond one: n - 1 for a v2
-- entry whose `n` the workers would take (1 to MAX_ENTRY_ITEMS), else 0. Such an `n` also
-- bounds the loops over an entry's items: any other (a caller may XADD what it likes) is no
-- count of items, and the entry is one the workers dead-letter.
local function entry_size(fields)
  local size, n, v2 = 0, nil, false
  for f = 1, #fields - 1, 2 do
    local name = fields[f]
    if name == 'n' then  -- digits only, as the workers read it
      n = digits(fields[f + 1])
    elseif name == 'v' then
      v2 = fields[f + 1] == '2'
    elseif name == 'data' or string.sub(name, 1, 5) == 'data.' then
      size = size + #fields[f + 1]
    end
  end
  if v2 and n and n >= 1 and n <= MAX_ENTRY_ITEMS and n % 1 == 0 then return size, n end
  return size, nil
end

-- The steps one mb_withdraw spends (MAX_WITHDRAW_STEPS in all): a step per field of each
-- entry it reads, and per item of a multi-item entry it checks or unmarks. `spend` takes
-- `cost` more, or returns false (spending nothing) past the budget: the handle is then only
-- marked, as for an entry a worker has read (workers skip it), and a deleted entry's marks
-- are left to expire. Else 4096 handles of entries of 512 items took 2 million commands.
local function spend(budget, cost)
  if budget.steps + cost > MAX_WITHDRAW_STEPS then return false end
  budget.steps = budget.steps + cost
  return true
end

-- An entry no worker has read: its fields (a step each), or nil past the budget or if gone.
local function unread_fields(keys, entry, budget)
  if budget.steps >= MAX_WITHDRAW_STEPS then return nil end
  local found = redis.pcall('XRANGE', keys[1], entry, entry)
  if type(found) ~= 'table' or found.err ~= nil or #found == 0 then return nil end
  budget.steps = budget.steps + #found[1][2] / 2
  return found[1][2]
end

-- Withdraws items of v2 entries (handles `<entry id>#<i>`, grouped by entry): an entry no
-- worker has read whose every item is withdrawn (now, or marked before) is deleted (its
-- bytes and packed items released, the latter only when the packed-items counter is given);
-- otherwise each handle is marked in the cancelled set for the workers to skip. Returns the
-- bytes released.
local function withdraw_items(keys, group, entries, order, now_ms, budget)
  local released, packed = 0, 0
  for _, entry in ipairs(order) do
    local handles, deleted = entries[entry], false
    local pending = redis.pcall('XPENDING', keys[1], group, entry, entry, 1)
    local read = type(pending) == 'table' and pending.err == nil and #pending > 0
    local fields = keys[4] and not read and unread_fields(keys, entry, budget)
    if fields then  -- (no group yet: nobody has read it)
      local size, n = entry_size(fields)
      local seen, distinct = {}, 0
      for _, index in ipairs(handles) do
        if n and index >= 0 and index < n and not seen[index] then
          seen[index], distinct = true, distinct + 1
        end
      end
      -- the entry's other items may have been withdrawn before
      if n and distinct < n and spend(budget, n) then
        for index = 0, n - 1 do
          if not seen[index] and redis.call('ZSCORE', keys[3], entry .. '#' .. index) then
            seen[index], distinct = true, distinct + 1
          end
        end
      end
      if n and distinct == n then
        redis.call('XDEL', keys[1], entry)
        if spend(budget, n) then
          for index = 0, n - 1 do redis.call('ZREM', keys[3], entry .. '#' .. index) end
        end
        released, packed, deleted = released + size, packed + n - 1, true
      end
    end
    if not deleted then
      for _, index in ipairs(handles) do
        redis.call('ZADD', keys[3], now_ms + CANCELLED_TTL_MS, entry .. '#' .. index)
      end
    end
  end
  return released, packed
end

-- KEYS: stream, queued-bytes counter, cancelled set, from version 2 the packed-items counter.
-- ARGV: version, group, handle, ...
-- An entry no worker has read is deleted and its data bytes released; one a worker holds is
-- marked in the cancelled set (scored by expiry, ms) for the worker to skip. Items of v2
-- entries (`<entry id>#<i>`): see withdraw_items. Returns the bytes released.
local function withdraw(keys, args)
  local err = version_error(args) or keys_error(keys, 3, 'mb_withdraw')
    or model_keys_error(keys, WITHDRAW_KEYS, 'mb_withdraw')
  if err then return err end
  if args[2] ~= GROUP then  -- another name finds nothing read, and would delete what is
    return redis.error_reply('MBARGS the group (after the version) must be ' .. GROUP)
  end
  if #args - 2 > MAX_ENTRIES then return limit_error('mb_withdraw') end
  local time = redis.call('TIME')
  local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  local released, packed, items, order, budget = 0, 0, {}, {}, {steps = 0}
  for i = 3, #args do
    local id = args[i]
    local mark = string.find(id, '#', 1, true)
    local index = mark and digits(string.sub(id, mark + 1))
    if mark then
      if index then
        local entry = string.sub(id, 1, mark - 1)
        if not items[entry] then
          items[entry] = {}
          order[#order + 1] = entry
        end
        table.insert(items[entry], index)
      end
    else
      local pending = redis.pcall('XPENDING', keys[1], args[2], id, id, 1)
      local read = type(pending) == 'table' and pending.err == nil and #pending > 0
      local fields = not read and unread_fields(keys, id, budget)
      if fields then
        local size, n = entry_size(fields)  -- a whole v2 entry too, by its id
        released, packed = released + size, packed + (n or 1) - 1
        redis.call('XDEL', keys[1], id)
        if n and spend(budget, n) then
          for index = 0, n - 1 do redis.call('ZREM', keys[3], id .. MARK[index]) end
        end
      elseif read or budget.steps >= MAX_WITHDRAW_STEPS then
        redis.call('ZADD', keys[3], now_ms + CANCELLED_TTL_MS, id)
      end
    end
  end
  local item_bytes, item_packed = withdraw_items(keys, args[2], items, order, now_ms, budget)
  released, packed = released + item_bytes, packed + item_packed
  if released > 0 then redis.call('DECRBY', keys[2], released) end
  if packed > 0 and keys[4] then redis.call('DECRBY', keys[4], packed) end
  redis.call('ZREMRANGEBYSCORE', keys[3], '-inf', now_ms)
  return released
end

-- KEYS: stream, the consumer's heartbeat key. ARGV: version, group, consumer.
-- Removes the consumer from the group only if it holds no entries and has no heartbeat.
local function retire(keys, args)
  local err = version_error(args) or keys_error(keys, 2, 'mb_retire')
    or model_keys_error(keys, RETIRE_KEYS, 'mb_retire')
  if err then return err end
  if redis.call('EXISTS', keys[2]) == 1 then return 0 end
  if #redis.call('XPENDING', keys[1], args[2], '-', '+', 1, args[3]) > 0 then return 0 end
  return redis.call('XGROUP', 'DELCONSUMER', keys[1], args[2], args[3])
end

-- Checks every count, and the TTL, before anything is pushed: the checks of a call that failed
-- halfway would leave its first keys' replies written, for its worker to write again.
local function reply_args_error(keys, args)
  local ttl = args[2] or ''
  if #keys > 0 and not (string.match(ttl, '^[1-9][0-9]*$') and #ttl <= 9) then
    return redis.error_reply('MBARGS the reply TTL (after the version) must be a whole ' ..
      'number of seconds, 1 to 999999999')
  end
  local elements = 0
  for k = 1, #keys do
    if not string.match(args[2 + k] or '', '^[0-9]+$') then
      return redis.error_reply('MBARGS malformed mb_reply arguments for key ' .. k)
    end
    elements = elements + tonumber(args[2 + k])
  end
  if 2 + #keys + elements ~= #args then
    return redis.error_reply('MBARGS mb_reply was given ' .. (#args - 2 - #keys) ..
      ' replies where its counts add up to ' .. elements)
  end
end

-- KEYS: reply keys. ARGV: version, TTL (s), one count per key, then the replies, key by key.
-- A key that does not exist gets its replies and the TTL; a list gets its replies, and the
-- TTL only if it has one already (a reply never gives a TTL to a key it did not create);
-- any other type gets nothing. Returns {key, type, ...} of the keys refused.
local function reply(keys, args)
  local err = version_error(args) or reply_args_error(keys, args)
  if err then return err end
  local ttl, at, refused = args[2], 3 + #keys, {}
  for k, key in ipairs(keys) do
    local count = tonumber(args[2 + k])
    local kind = redis.call('TYPE', key)['ok']
    if kind == 'none' or kind == 'list' then
      local expires = kind == 'none' or redis.call('PTTL', key) >= 0
      for first = at, at + count - 1, PUSH_CHUNK do
        redis.call('RPUSH', key, unpack(args, first, math.min(first + PUSH_CHUNK, at + count) - 1))
      end
      if expires and count > 0 then redis.call('EXPIRE', key, ttl) end
    else
      refused[#refused + 1] = key
      refused[#refused + 1] = kind
    end
    at = at + count
  end
  return refused
end

redis.register_function{function_name='mb_enqueue', callback=enqueue,
  description='microbatch v' .. VERSION .. ': queue calls under the bound'}
redis.register_function{function_name='mb_withdraw', callback=withdraw, flags={'allow-oom'},
  description='microbatch v' .. VERSION .. ': withdraw entries whose caller gave up'}
redis.register_function{function_name='mb_retire', callback=retire, flags={'allow-oom'},
  description='microbatch v' .. VERSION .. ': remove a dead consumer holding nothing'}
redis.register_function{function_name='mb_reply', callback=reply, flags={'allow-oom'},
  description='microbatch v' .. VERSION .. ': push replies to reply lists'}
redis.register_function{function_name='mb_release',
  callback=function() return {VERSION, REVISION} end, flags={'no-writes', 'allow-stale'},
  description='microbatch v' .. VERSION .. ': this library\'s version and revision'}
""".replace("@VERSION@", str(VERSION))
    .replace("@REVISION@", str(REVISION))
    .replace("@MAX_ENTRIES@", str(MAX_CALL_ENTRIES))
    .replace("@MAX_BYTES@", str(MAX_CALL_BYTES))
    .replace("@MAX_WITHDRAW_STEPS@", str(MAX_WITHDRAW_STEPS))
    .replace("@MAX_ENTRY_ITEMS@", str(MAX_ENTRY_ITEMS))
    .replace("@CANCELLED_TTL_MS@", str(CANCELLED_TTL_MS))
    .replace("@LAPSED_WORKER_GRACE_MS@", str(LAPSED_WORKER_GRACE_MS))
    .replace("@PUSH_CHUNK@", str(PUSH_CHUNK))
    .replace("@GROUP@", GROUP)
    .replace("@LEVEL_SUFFIX@", LEVEL_SUFFIX)
    .replace("@REQUESTS@", _key_name(STREAM_TEMPLATE))
    .replace("@QUEUED_BYTES@", _key_name(QUEUED_BYTES_TEMPLATE))
    .replace("@QUEUE_BOUND@", _key_name(QUEUE_BOUND_TEMPLATE))
    .replace("@CONSUMERS@", _key_name(CONSUMERS_TEMPLATE))
    .replace("@PACKED_ITEMS@", _key_name(PACKED_ITEMS_TEMPLATE))
    .replace("@CANCELLED@", _key_name(CANCELLED_TEMPLATE))
    .replace("@HEARTBEAT@", _key_name(HEARTBEAT_TEMPLATE))
)

LOAD_COMMAND = ("FUNCTION", "LOAD", "REPLACE", CODE)

HOW_TO_LOAD = (
    "run `broker functions load --redis URL` as a Redis user allowed to load functions "
    "(docs/deployment.md, 'Functions')"
)

_VERSION_LINE = re.compile(r"^local VERSION(?:, REVISION)? = (\d+)(?:, (\d+))?$", re.MULTILINE)


def code_release(code: str) -> tuple[int, int] | None:
    """The library version and revision written in a library's code (None if it has no
    version; revision 0 if it has none)."""
    found = _VERSION_LINE.search(code)
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2) or 0)


def code_version(code: str) -> int | None:
    """The library version written in a library's code (None if it has none)."""
    release = code_release(code)
    return release[0] if release else None


def listed_release(listed: Any) -> tuple[int, int] | None:
    """The version and revision of the microbatch library in a reply to ``FUNCTION LIST
    LIBRARYNAME microbatch WITHCODE`` (None if the reply holds no such library)."""
    release = None
    for library in listed or []:
        info = _as_dict(library)
        if _text(info.get("library_name")) == LIBRARY:
            release = code_release(_text(info.get("library_code", "")))
    return release


def answered_release(answer: Any) -> tuple[int, int] | None:
    """The version and revision in mb_release's answer (None if it is not two numbers)."""
    if isinstance(answer, list | tuple) and len(answer) == 2:
        version, revision = answer
        if isinstance(version, int) and isinstance(revision, int):
            return version, revision
    return None


def describe_release(release: tuple[int, int]) -> str:
    """A loaded library's version and revision, as the commands and logs say them."""
    return f"version {release[0]} revision {release[1]}"


def is_missing(error: BaseException) -> bool:
    """Whether an error reply to FCALL means the library is not loaded, or too old, or the
    server has no Functions at all (Redis before 7.0)."""
    text = str(error)
    lowered = text.lower()
    return (
        "function not found" in lowered
        or text.startswith("MBVERSION")
        or ("unknown command" in lowered and "fcall" in lowered)
    )


def missing_message(error: BaseException) -> str:
    """Why FCALL failed, and what the operator should do about it."""
    text = str(error)
    if "unknown command" in text.lower():
        return f"this Redis has no Functions ({text}): microbatch needs Redis 7.0 or later"
    if text.startswith("MBVERSION"):
        return f"the microbatch library in Redis is older than this code: {HOW_TO_LOAD}"
    return f"the microbatch functions are not loaded in Redis: {HOW_TO_LOAD}"


def _targets(client: Any) -> list[dict[str, Any]]:
    """How to address each server the library must be in: every primary of a Redis Cluster
    (``target_nodes``), or the one server of any other client."""
    if isinstance(client, RedisCluster):
        return [{"target_nodes": node} for node in client.get_primaries()]  # type: ignore[no-untyped-call]
    return [{}]


LIST_COMMAND = ("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY, "WITHCODE")


def loaded_release(client: Any) -> tuple[int, int] | None:
    """The version and revision of the library loaded in Redis (a redis-py client), or None
    if none is; of a Redis Cluster, the oldest of its primaries' (None if one lacks it)."""
    releases = []
    for target in _targets(client):
        release = listed_release(client.execute_command(*LIST_COMMAND, **target))
        if release is None:
            return None
        releases.append(release)
    return min(releases, default=None)


def loaded_version(client: Any) -> int | None:
    """The version of the library loaded in Redis (a redis-py client), or None if none is;
    of a Redis Cluster, the oldest of its primaries' (None if one lacks it)."""
    release = loaded_release(client)
    return release[0] if release else None


def load(client: Any) -> tuple[tuple[int, int] | None, tuple[int, int]]:
    """Load (or replace) the library with a redis-py client (on every primary of a Redis
    Cluster): (the version and revision it replaced, or None, and those now loaded)."""
    before = loaded_release(client)
    for target in _targets(client):
        client.execute_command(*LOAD_COMMAND, **target)
    return before, THIS_RELEASE


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return {_text(k): v for k, v in value.items()}
    items = list(value)
    return {_text(k): v for k, v in zip(items[::2], items[1::2], strict=False)}


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
