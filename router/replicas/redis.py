"""`RedisStore`: the replicas' shared figures in one Redis, each call one round trip.

Keys (the prefix in braces, a hash tag, so that every key lands in one slot):

    {prefix}:replicas       sorted set: live replicas, scored by when each expires (Redis's clock)
    {prefix}:r:<id>:c       hash: one replica's requests in flight per client
    {prefix}:r:<id>:b       hash: one replica's slots in use per backend
    {prefix}:r:<id>:u       hash: one replica's requests per backend sent since its last reading
    {prefix}:peaks          hash: each client's peak in flight across replicas, "<peak> <when, ms>"
    {prefix}:fades          sorted set: when each peak fades below half a request

A replica's hashes expire `ttl` after its last write, and it leaves `replicas` `ttl` after its
last sync: a crashed replica's figures age out. The peaks are capped at `max_clients`, the ones
fading soonest dropped first, and a faded one is dropped by the next call. Each call runs one
Lua script, atomic on the server, so a claim for a backend's last slot is granted to one replica.

Every answer is checked before use: a Redis (or something in its place) that answers garbage is
a failing store (`StoreError`), never a number taken on trust.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import redis.asyncio as redis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.backends.engines import Elsewhere
from router.replicas.store import Claim, ClientShare, StoreError, View

_T = TypeVar("_T")

# The most any figure of a replica may be: a count past it is an answer out of shape.
_MOST = 10_000_000
_MOST_BACKENDS = 4096

# What every script starts with: its clock, the live replicas other than this one, and the
# backends' figures summed over them.
_COMMON = """
local prefix, me = ARGV[1], ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local replicas = prefix .. ':replicas'
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
"""

# ARGV: prefix, me, client, its new requests here (1 or 0), memory (ms), ttl (ms), max clients
_CLIENT = (
    _COMMON
    + """
local client, delta = ARGV[3], tonumber(ARGV[4])
local memory, ttl, cap = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local mine = prefix .. ':r:' .. me .. ':c'
local here = redis.call('HINCRBY', mine, client, delta)
if here <= 0 then
  redis.call('HDEL', mine, client)
  here = 0
end
redis.call('PEXPIRE', mine, ttl)
local list = others()
local elsewhere = 0
for _, r in ipairs(list) do
  elsewhere = elsewhere + count(redis.call('HGET', prefix .. ':r:' .. r .. ':c', client))
end
local peak = 0
if memory > 0 then
  local peaks, fades = prefix .. ':peaks', prefix .. ':fades'
  local p, w = string.match(redis.call('HGET', peaks, client) or '', '^(%d+) (%d+)$')
  if p then peak = tonumber(p) * 0.5 ^ ((now - tonumber(w)) / memory) end
  local total = here + elsewhere
  if total > 0 and total >= peak then
    peak = total
    redis.call('HSET', peaks, client, string.format('%d %d', total, now))
    redis.call('ZADD', fades, now + memory * math.log(2 * total) / math.log(2), client)
  end
  -- A little forgetting each call: what has faded, then the soonest to fade past the cap.
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
return {elsewhere, string.format('%.3f', peak), backends(list)}
"""
)

# ARGV: prefix, me, backend, its requests here sent since the reading, limit, ttl (ms)
_CLAIM = (
    _COMMON
    + """
local backend, unread, limit, ttl = ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local slots, unread_here = prefix .. ':r:' .. me .. ':b', prefix .. ':r:' .. me .. ':u'
local n, u = 0, 0
for _, r in ipairs(others()) do
  n = n + count(redis.call('HGET', prefix .. ':r:' .. r .. ':b', backend))
  u = u + count(redis.call('HGET', prefix .. ':r:' .. r .. ':u', backend))
end
if count(redis.call('HGET', slots, backend)) + 1 + n > limit then return {0, n, u} end
redis.call('HINCRBY', slots, backend, 1)
redis.call('HSET', unread_here, backend, unread)
redis.call('PEXPIRE', slots, ttl)
redis.call('PEXPIRE', unread_here, ttl)
return {1, n, u}
"""
)

# ARGV: prefix, me, ttl (ms), number of clients, then client, count pairs, then backend, slots,
# unread triples
_SYNC = (
    _COMMON
    + """
local ttl, n = tonumber(ARGV[3]), tonumber(ARGV[4])
local own = prefix .. ':r:' .. me
redis.call('DEL', own .. ':c', own .. ':b', own .. ':u')
for i = 5, 4 + 2 * n, 2 do redis.call('HSET', own .. ':c', ARGV[i], ARGV[i + 1]) end
for i = 5 + 2 * n, #ARGV, 3 do
  redis.call('HSET', own .. ':b', ARGV[i], ARGV[i + 1])
  redis.call('HSET', own .. ':u', ARGV[i], ARGV[i + 2])
end
for _, suffix in ipairs({':c', ':b', ':u'}) do redis.call('PEXPIRE', own .. suffix, ttl) end
redis.call('ZADD', replicas, now + ttl, me)
redis.call('ZREMRANGEBYSCORE', replicas, '-inf', now)
redis.call('PEXPIRE', replicas, ttl)
local list = others()
return {#list, backends(list)}
"""
)


class RedisStore:
    """A `Store` (router.replicas.store) in one Redis, through redis-py's asyncio client."""

    def __init__(
        self,
        url: str,
        *,
        replica: str,
        key_prefix: str,
        ttl: float,
        memory: float,
        max_clients: int,
        max_connections: int,
        socket_timeout: float,
    ) -> None:
        """`memory`: seconds in which a client's peak halves (classify.client_memory_seconds)."""
        # No retries: a call that fails is the store failing, and the caller decides alone.
        # redis-py closes a connection whose command was cancelled mid-answer (a caller's timeout).
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=socket_timeout,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
            protocol=2,  # RESP2: what every Redis (and Valkey, KeyDB) speaks, and all these scripts need
        )
        self._redis = redis.Redis(connection_pool=pool)
        self._client = self._redis.register_script(_CLIENT)
        self._claim = self._redis.register_script(_CLAIM)
        self._sync = self._redis.register_script(_SYNC)
        self._prefix = "{" + key_prefix + "}"
        self._replica = replica
        self._ttl_ms = max(1, round(ttl * 1000))
        self._memory_ms = round(memory * 1000)
        self._max_clients = max_clients
        self._broken = False  # a call failed: the next sync starts on new connections

    async def client(self, client: str, *, new: int) -> ClientShare:
        args: list[str | int] = [
            self._prefix,
            self._replica,
            client,
            new,
            self._memory_ms,
            self._ttl_ms,
            self._max_clients,
        ]
        answer = await self._run(self._client(args=args))
        match answer:
            case [elsewhere, peak, list() as backends]:
                return ClientShare(_count(elsewhere), _number(peak), _backends(backends))
        raise StoreError(f"a client's figures out of shape: {_show(answer)}")

    async def claim(self, backend: str, *, unread: int, limit: int) -> Claim:
        args: list[str | int] = [self._prefix, self._replica, backend, unread, limit, self._ttl_ms]
        answer = await self._run(self._claim(args=args))
        match answer:
            case [0 | 1 as granted, elsewhere, unread_elsewhere]:
                return Claim(bool(granted), Elsewhere(_count(elsewhere), _count(unread_elsewhere)))
        raise StoreError(f"a claim's answer out of shape: {_show(answer)}")

    async def ended(self, clients: Mapping[str, int], backends: Mapping[str, int], unread: Mapping[str, int]) -> None:
        own = f"{self._prefix}:r:{self._replica}"
        pipe = self._redis.pipeline(transaction=False)
        for client, ended in clients.items():
            pipe.hincrby(f"{own}:c", client, -ended)
        for name, ended in backends.items():
            pipe.hincrby(f"{own}:b", name, -ended)
        for name, count in unread.items():
            pipe.hset(f"{own}:u", name, count)
        for suffix in (":c", ":b", ":u"):
            pipe.pexpire(own + suffix, self._ttl_ms)
        await self._run(self._send(pipe))

    async def _send(self, pipe: Pipeline) -> None:
        """A pipeline sent, and its connection given back: leaving the pipeline raises too when
        the connection broke, so both happen within `_run`."""
        async with pipe:
            await pipe.execute()

    async def sync(self, clients: Mapping[str, int], backends: Mapping[str, Elsewhere]) -> View:
        if self._broken:
            # Connections from before a failure (a Redis restarted since) would each fail once.
            await self._run(self._redis.connection_pool.disconnect())
            self._broken = False
        args: list[str | int] = [self._prefix, self._replica, self._ttl_ms, len(clients)]
        for client, count in clients.items():
            args += [client, count]
        for name, own in backends.items():
            args += [name, own.in_flight, own.unread]
        answer = await self._run(self._sync(args=args))
        match answer:
            case [replicas, list() as figures]:
                return View(_count(replicas), _backends(figures))
        raise StoreError(f"a sync's answer out of shape: {_show(answer)}")

    async def aclose(self) -> None:
        await self._redis.aclose(close_connection_pool=True)

    async def _run(self, call: Awaitable[_T]) -> _T:
        """The one place where what goes wrong with Redis becomes a `StoreError`: redis-py's own
        errors, and whatever its parser raises on an answer that is not RESP at all."""
        try:
            return await call
        except Exception as exc:
            self._broken = True
            raise StoreError(f"{type(exc).__name__}: {exc}"[:200]) from exc


def _count(value: Any) -> int:
    if isinstance(value, bytes) and value.isdigit() and len(value) < 9:
        value = int(value)
    if type(value) is not int or not 0 <= value <= _MOST:
        raise StoreError(f"not a count: {_show(value)}")
    return value


def _number(value: Any) -> float:
    try:
        number = float(value.decode("ascii") if isinstance(value, bytes) and len(value) < 32 else "nan")
    except (UnicodeDecodeError, ValueError):
        number = math.nan
    if not 0 <= number <= _MOST:  # NaN fails too
        raise StoreError(f"not a peak: {_show(value)}")
    return number


def _backends(flat: list[Any]) -> dict[str, Elsewhere]:
    if len(flat) % 3 or len(flat) > 3 * _MOST_BACKENDS:
        raise StoreError(f"backends' figures out of shape ({len(flat)} values)")
    figures = {}
    for at in range(0, len(flat), 3):
        name = flat[at]
        if not isinstance(name, bytes) or len(name) > 256:
            raise StoreError(f"not a backend's name: {_show(name)}")
        figures[name.decode("utf-8", "replace")] = Elsewhere(_count(flat[at + 1]), _count(flat[at + 2]))
    return figures


def _show(value: Any) -> str:
    return repr(value)[:80]
