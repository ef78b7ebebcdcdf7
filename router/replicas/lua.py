"""The Lua scripts `RedisStore` (router.replicas.redis) runs, each atomic on the server.

Every script takes the key prefix, the replica's id and its `ttl` (ms) first; what follows is
each script's own. A client's figures here are set, not added to: every call that carries them
carries the replica's whole count of that client, so a call lost or late is repaired by the next.
"""

from __future__ import annotations

# Its clock, the live replicas other than this one, and what each script shares.
_COMMON = """
local prefix, me, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local replicas = prefix .. ':replicas'
local own = prefix .. ':r:' .. me
local function others()
  local list = {}
  for _, r in ipairs(redis.call('ZRANGEBYSCORE', replicas, now, '+inf')) do
    if r ~= me then list[#list + 1] = r end
  end
  return list
end
local function count(value)
  local n = tonumber(value)
  if n and n > 0 then return math.floor(n) end
  return 0
end
-- The backends' slots in use and requests unread, summed over `list`: name, slots, unread, ...
local function backends(list)
  local sums, order = {}, {}
  for _, r in ipairs(list) do
    for which, suffix in ipairs({':b', ':u'}) do
      local b = redis.call('HGETALL', prefix .. ':r:' .. r .. suffix)
      for i = 1, #b, 2 do
        if not sums[b[i]] then
          sums[b[i]] = {0, 0}
          order[#order + 1] = b[i]
        end
        sums[b[i]][which] = sums[b[i]][which] + count(b[i + 1])
      end
    end
  end
  local flat = {}
  for _, name in ipairs(order) do
    flat[#flat + 1] = name
    flat[#flat + 1] = sums[name][1]
    flat[#flat + 1] = sums[name][2]
  end
  return flat
end
-- This replica's requests of `client` in flight: `here`.
local function set_here(client, here)
  if here > 0 then
    redis.call('HSET', own .. ':c', client, here)
  else
    redis.call('HDEL', own .. ':c', client)
  end
end
-- The client's requests on the other replicas, and its peak across all (faded to now, and
-- raised to the total now), as a string.
local function client(list, c, here, memory)
  local elsewhere = 0
  for _, r in ipairs(list) do
    elsewhere = elsewhere + count(redis.call('HGET', prefix .. ':r:' .. r .. ':c', c))
  end
  local peak = 0
  if memory > 0 then
    local peaks = prefix .. ':peaks'
    local p, w = string.match(redis.call('HGET', peaks, c) or '', '^(%d+) (%d+)$')
    if p then peak = tonumber(p) * 0.5 ^ ((now - tonumber(w)) / memory) end
    local total = here + elsewhere
    if total > 0 and total >= peak then
      peak = total
      redis.call('HSET', peaks, c, string.format('%d %d', total, now))
      redis.call('ZADD', prefix .. ':fades', now + memory * math.log(2 * total) / math.log(2), c)
    end
  end
  return elsewhere, string.format('%.3f', peak)
end
-- A little forgetting each call: what has faded, then the soonest to fade past the cap.
local function forget(memory, cap)
  if memory <= 0 then return end
  local peaks, fades = prefix .. ':peaks', prefix .. ':fades'
  local gone = redis.call('ZRANGEBYSCORE', fades, '-inf', now, 'LIMIT', 0, 16)
  local excess = math.min(16, redis.call('ZCARD', fades) - #gone - cap)
  if excess > 0 then
    for _, c in ipairs(redis.call('ZRANGE', fades, #gone, #gone + excess - 1)) do gone[#gone + 1] = c end
  end
  if #gone > 0 then
    redis.call('HDEL', peaks, unpack(gone))
    redis.call('ZREM', fades, unpack(gone))
  end
  redis.call('PEXPIRE', peaks, memory * 32 + ttl)
  redis.call('PEXPIRE', fades, memory * 32 + ttl)
end
"""

# ARGV: prefix, me, ttl, memory (ms), max clients, client, its requests here.
# Answers: the client's requests elsewhere, its peak, the backends' figures elsewhere.
CLIENT = (
    _COMMON
    + """
local memory, cap, c, here = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
set_here(c, here)
redis.call('PEXPIRE', own .. ':c', ttl)
local list = others()
local elsewhere, peak = client(list, c, here, memory)
forget(memory, cap)
return {elsewhere, peak, backends(list)}
"""
)

# ARGV: prefix, me, ttl, memory (ms), max clients, then for each slot asked for: the backend,
# its requests here sent since the reading, its limit, the client, the client's requests here,
# and 1 if it is a slot to hold (router.replicas.lease), else 0. Slots held count against the
# limit like slots in use. Answers: for each, granted (1 or 0), the client's requests elsewhere
# and its peak; then the backends' figures elsewhere (slots in use, not held).
CLAIM = (
    _COMMON
    + """
local memory, cap = tonumber(ARGV[4]), tonumber(ARGV[5])
local list = others()
local answers = {}
local function taken(r, backend)
  local key = prefix .. ':r:' .. r
  return count(redis.call('HGET', key .. ':b', backend)) + count(redis.call('HGET', key .. ':h', backend))
end
for i = 6, #ARGV - 5, 6 do
  local backend, limit, c, here = ARGV[i], tonumber(ARGV[i + 2]), ARGV[i + 3], tonumber(ARGV[i + 4])
  local n = 0
  for _, r in ipairs(list) do n = n + taken(r, backend) end
  local granted = 0
  if taken(me, backend) + 1 + n <= limit then
    redis.call('HINCRBY', own .. (ARGV[i + 5] == '1' and ':h' or ':b'), backend, 1)
    redis.call('HSET', own .. ':u', backend, ARGV[i + 1])
    granted = 1
  end
  set_here(c, here)
  local elsewhere, peak = client(list, c, here, memory)
  answers[#answers + 1] = granted
  answers[#answers + 1] = elsewhere
  answers[#answers + 1] = peak
end
for _, suffix in ipairs({':c', ':b', ':u', ':h'}) do redis.call('PEXPIRE', own .. suffix, ttl) end
forget(memory, cap)
return {answers, backends(list)}
"""
)

# ARGV: prefix, me, ttl, number of clients, then client, requests here pairs, then backend,
# slots ended (less those taken from the held), unread, change in slots held quadruples.
ENDED = (
    _COMMON
    + """
local n = tonumber(ARGV[4])
for i = 5, 4 + 2 * n, 2 do set_here(ARGV[i], tonumber(ARGV[i + 1])) end
for i = 5 + 2 * n, #ARGV - 3, 4 do
  local ended, held = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 3])
  if ended ~= 0 then redis.call('HINCRBY', own .. ':b', ARGV[i], 0 - ended) end  -- never "-0"
  redis.call('HSET', own .. ':u', ARGV[i], ARGV[i + 2])
  if held ~= 0 then redis.call('HINCRBY', own .. ':h', ARGV[i], held) end
end
for _, suffix in ipairs({':c', ':b', ':u', ':h'}) do redis.call('PEXPIRE', own .. suffix, ttl) end
return 1
"""
)

# ARGV: prefix, me, ttl, number of clients, then client, count pairs, then backend, slots in
# use, unread, slots held quadruples. Answers: the other live replicas, and the backends' figures on them.
SYNC = (
    _COMMON
    + """
local n = tonumber(ARGV[4])
redis.call('DEL', own .. ':c', own .. ':b', own .. ':u', own .. ':h')
for i = 5, 4 + 2 * n, 2 do redis.call('HSET', own .. ':c', ARGV[i], ARGV[i + 1]) end
for i = 5 + 2 * n, #ARGV - 3, 4 do
  redis.call('HSET', own .. ':b', ARGV[i], ARGV[i + 1])
  redis.call('HSET', own .. ':u', ARGV[i], ARGV[i + 2])
  redis.call('HSET', own .. ':h', ARGV[i], ARGV[i + 3])
end
for _, suffix in ipairs({':c', ':b', ':u', ':h'}) do redis.call('PEXPIRE', own .. suffix, ttl) end
redis.call('ZADD', replicas, now + ttl, me)
redis.call('ZREMRANGEBYSCORE', replicas, '-inf', now)
redis.call('PEXPIRE', replicas, ttl)
local list = others()
return {#list, backends(list)}
"""
)
