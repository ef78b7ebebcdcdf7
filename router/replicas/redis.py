"""`RedisStore`: the replicas' shared figures in one Redis, each call one round trip.

Keys (the prefix in braces, a hash tag, so that every key lands in one slot):

    {prefix}:replicas       sorted set: live replicas, scored by when each expires (Redis's clock)
    {prefix}:r:<id>:c       hash: one replica's requests in flight per client
    {prefix}:r:<id>:b       hash: one replica's slots in use per backend
    {prefix}:r:<id>:u       hash: one replica's requests per backend sent since its last reading
    {prefix}:r:<id>:h       hash: one replica's slots held per backend, idle (router.replicas.lease)
    {prefix}:peaks          hash: each client's peak in flight across replicas, "<peak> <when, ms>"
    {prefix}:fades          sorted set: when each peak fades below half a request

A replica's hashes expire `ttl` after its last write, and it leaves `replicas` `ttl` after its
last sync: a crashed replica's figures age out. The peaks are capped at `max_clients`, the ones
fading soonest dropped first, and a faded one is dropped by the next call. Each call runs one
Lua script (router.replicas.lua), atomic on the server, so a claim for a backend's last slot is
granted to one replica; claims asked for at once go in one script, one round trip.

Every answer is checked before use: a Redis (or something in its place) that answers garbage is
a failing store (`StoreError`), never a number taken on trust.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.backends.engines import Elsewhere
from router.replicas import lua
from router.replicas.store import Ask, Claim, Claims, ClientShare, StoreError, View

_T = TypeVar("_T")

# The most any figure of a replica may be: a count past it is an answer out of shape.
_MOST = 10_000_000
_MOST_BACKENDS = 4096


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
        self._client = self._redis.register_script(lua.CLIENT)
        self._claim = self._redis.register_script(lua.CLAIM)
        self._ended = self._redis.register_script(lua.ENDED)
        self._sync = self._redis.register_script(lua.SYNC)
        # What every script takes first: the keys' prefix, this replica, its ttl (ms).
        self._head: tuple[str | int, ...] = ("{" + key_prefix + "}", replica, max(1, round(ttl * 1000)))
        self._memory_ms = round(memory * 1000)
        self._max_clients = max_clients
        self._broken = False  # a call failed: the next sync starts on new connections

    async def client(self, client: str, *, here: int) -> ClientShare:
        args = [*self._head, self._memory_ms, self._max_clients, client, here]
        answer = await self._run(self._client(args=args))
        match answer:
            case [elsewhere, peak, list() as backends]:
                return ClientShare(_count(elsewhere), _number(peak), _backends(backends))
        raise StoreError(f"a client's figures out of shape: {_show(answer)}")

    async def claim(self, asks: Sequence[Ask]) -> Claims:
        args = [*self._head, self._memory_ms, self._max_clients]
        for ask in asks:
            args += [ask.backend, ask.unread, ask.limit, ask.client, ask.here, int(ask.hold)]
        answer = await self._run(self._claim(args=args))
        match answer:
            case [list() as each, list() as backends] if len(each) == 3 * len(asks):
                claims = [
                    Claim(_granted(each[at]), _count(each[at + 1]), _number(each[at + 2]))
                    for at in range(0, len(each), 3)
                ]
                return Claims(claims, _backends(backends))
        raise StoreError(f"claims' answer out of shape: {_show(answer)}")

    async def ended(
        self,
        clients: Mapping[str, int],
        backends: Mapping[str, int],
        unread: Mapping[str, int],
        held: Mapping[str, int] | None = None,
    ) -> None:
        held = held or {}
        args = [*self._head, len(clients)]
        for client, here in clients.items():
            args += [client, here]
        for name in backends.keys() | held.keys():
            args += [name, backends.get(name, 0), unread.get(name, 0), held.get(name, 0)]
        await self._run(self._ended(args=args))

    async def sync(
        self, clients: Mapping[str, int], backends: Mapping[str, Elsewhere], held: Mapping[str, int] | None = None
    ) -> View:
        if self._broken:
            # Connections from before a failure (a Redis restarted since) would each fail once.
            await self._run(self._redis.connection_pool.disconnect())
            self._broken = False
        args = [*self._head, len(clients)]
        for client, count in clients.items():
            args += [client, count]
        held = held or {}
        for name in backends.keys() | held.keys():
            own = backends.get(name, Elsewhere())
            args += [name, own.in_flight, own.unread, held.get(name, 0)]
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


def _granted(value: Any) -> bool:
    if value not in (0, 1):
        raise StoreError(f"not a grant: {_show(value)}")
    return bool(value)


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
