"""Backends found by name: a backend with `discover` stands for every address its name resolves to.

Each address is a backend of the pool (`<name>@<address>:<port>`). Names are resolved again
every `discovery.interval`; a new address becomes a backend that takes work once a health check
passes; an address that has gone is drained (its requests finish, none are sent to it) and
removed once idle; one that comes back before then is resumed, with its health and readings.

A DNS answer is input from outside: it is checked (router.config.Discovery's networks, never an
unspecified, multicast, link-local or reserved address), bounded (`max_addresses`, the lowest
kept) and, when it fails, times out or holds no usable address, changes nothing: the backends
the name had stay, and their health checks judge them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

from router.backends.backend import Address, Backend
from router.backends.health import HealthChecker
from router.backends.pools import Pools
from router.config import Backend as BackendConfig
from router.config import Discovery as DiscoveryConfig
from router.config import Health
from router.config import Pool as PoolConfig
from router.content import ContentKind
from router.logs import Unforeseen
from router.metrics import Metrics
from router.routing.learn import SpeedModel

logger = logging.getLogger("specroute.discovery")

# Why an address of an answer is not a backend (the `why` label of specroute_discovery_refused_total).
REFUSALS = ("malformed", "unusable", "network", "over_limit")


class ResolveError(Exception):
    """A name could not be resolved (no such name, no answer, a server failure)."""


class Resolver(Protocol):
    async def addresses(self, host: str, port: int) -> list[Address]:
        """The host's A and AAAA records, each with `port`."""
        ...

    async def services(self, name: str) -> list[Address]:
        """The addresses and ports of the SRV name's targets (the lowest priority's)."""
        ...


class SystemResolver:
    """The system's resolver (getaddrinfo: /etc/hosts, /etc/resolv.conf): A and AAAA only."""

    async def addresses(self, host: str, port: int) -> list[Address]:
        try:
            found = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
            )
        except (socket.gaierror, UnicodeError) as exc:
            raise ResolveError(str(exc)) from exc
        return [Address(str(sockaddr[0]), port) for _, _, _, _, sockaddr in found]

    async def services(self, name: str) -> list[Address]:
        raise ResolveError("SRV records need the resolver of specroute[dns]")


@dataclass(frozen=True, slots=True)
class Screened:
    kept: list[Address]  # sorted, at most the limit
    refused: Counter[str]  # by reason (REFUSALS)


def screen(
    answer: Iterable[Address], *, networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...], limit: int
) -> Screened:
    """The addresses of an answer that may be backends: within `networks`, none that no engine
    has (unspecified, multicast, link-local, reserved), without repeats, the lowest `limit`."""
    refused: Counter[str] = Counter()
    usable: dict[tuple[int, int, int], Address] = {}
    for address in answer:
        try:
            ip = ipaddress.ip_address(address.host)
        except ValueError:
            refused["malformed"] += 1
            continue
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_unspecified or ip.is_multicast or ip.is_link_local or ip.is_reserved or not 0 < address.port < 65536:
            refused["unusable"] += 1
        elif not any(ip in network for network in networks):
            refused["network"] += 1
        else:
            usable[(ip.version, int(ip), address.port)] = Address(str(ip), address.port)
    kept = [usable[key] for key in sorted(usable)]
    if len(kept) > limit:
        refused["over_limit"] += len(kept) - limit
        kept = kept[:limit]
    return Screened(kept, refused)


@dataclass(frozen=True, slots=True)
class _Name:
    """One configured backend with `discover`: the name it resolves and what its backends take."""

    pool: str
    name: str
    config: BackendConfig
    prior: Mapping[ContentKind, Mapping[int, float]]

    @property
    def host(self) -> str:
        return urlsplit(self.config.url).hostname or ""

    def url(self, address: Address) -> str:
        parts = urlsplit(self.config.url)
        return urlunsplit((parts.scheme, address.netloc, parts.path, "", ""))


class Discovery:
    def __init__(
        self,
        pools: Pools,
        health: HealthChecker,
        speeds: SpeedModel,
        metrics: Metrics,
        *,
        forget: Callable[[str], None],
    ) -> None:
        """`forget(name)`: what is kept of a backend elsewhere (metrics, learned speeds) is
        dropped; called one refresh after the backend was removed, once nothing of it runs."""
        self._pools = pools
        self._health = health
        self._speeds = speeds
        self._metrics = metrics
        self._forget = forget
        self.config = DiscoveryConfig()
        self._health_config = Health()
        self.resolver: Resolver = SystemResolver()
        self._names: list[_Name] = []
        self._failing: set[tuple[str, str]] = set()  # names whose failure is logged already
        self._unforeseen = Unforeseen(logger)
        # The reasons each name's answers were refused for, logged already: a reason is logged
        # once (an answer that refuses a few more or fewer every time is counted, not logged).
        self._refusing: dict[tuple[str, str], set[str]] = {}
        self._removed: list[str] = []  # to forget at the next refresh
        self._wake = asyncio.Event()

    def configure(
        self, pools: Mapping[str, PoolConfig], config: DiscoveryConfig, health: Health, resolver: Resolver
    ) -> None:
        """The (re)loaded `pools` and `discovery` sections; a change is resolved at once."""
        names = [
            _Name(pool_name, name, backend, pool.prior_speed)
            for pool_name, pool in pools.items()
            for name, backend in pool.backends.items()
            if backend.discover != "none"
        ]
        changed = names != self._names or config != self.config
        self._names, self.config, self._health_config, self.resolver = names, config, health, resolver
        keys = {(n.pool, n.name) for n in names}
        self._failing &= keys
        self._refusing = {key: value for key, value in self._refusing.items() if key in keys}
        if changed:
            self._wake.set()

    @property
    def names(self) -> list[tuple[str, str]]:
        """(pool, backend) of each configured backend with `discover`."""
        return [(name.pool, name.name) for name in self._names]

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.refresh()
            except Exception as exc:  # a bug of ours: never the end of every name's resolving
                self._unforeseen.log(exc, "discovery failed")

    async def refresh(self) -> None:
        """Resolve every name once and bring its pool's backends in line with the answers."""
        for removed in self._removed:
            self._forget(removed)
        self._removed = []
        names = self._names
        answers = await asyncio.gather(*(self._resolve(name) for name in names))
        added: list[Backend] = []
        for name, answer in zip(names, answers, strict=True):
            if answer is not None and name in self._names:  # not taken away by a reload meanwhile
                added += self._reconcile(name, answer)
        if added:
            # A new backend takes work once it has passed a health check.
            await self._health.probe(added, first=True)
        self._sweep()

    async def _resolve(self, name: _Name) -> list[Address] | None:
        key = (name.pool, name.name)
        answers = self._metrics.discovery_answers
        try:
            async with asyncio.timeout(self.config.timeout):
                if name.config.discover == "srv":
                    answer = await self.resolver.services(name.host)
                else:
                    answer = await self.resolver.addresses(name.host, urlsplit(name.config.url).port or 80)
        except Exception as exc:
            if not isinstance(exc, (ResolveError, TimeoutError, OSError)):  # a resolver's bug, or ours
                self._unforeseen.log(exc, "backend %s (pool %s): resolving %s failed", name.name, name.pool, name.host)
            answers.labels(name.pool, name.name, "failed").inc()
            if key not in self._failing:
                self._failing.add(key)
                logger.warning(
                    "backend %s (pool %s): %s does not resolve (%s); its backends are kept",
                    name.name,
                    name.pool,
                    name.host,
                    str(exc) or type(exc).__name__,
                )
            return None
        if key in self._failing:
            self._failing.discard(key)
            logger.info("backend %s (pool %s): %s resolves again", name.name, name.pool, name.host)
        screened = screen(
            answer,
            networks=tuple(ipaddress.ip_network(network) for network in self.config.networks),
            limit=self.config.max_addresses,
        )
        for why, count in screened.refused.items():
            self._metrics.discovery_refused.labels(name.pool, name.name, why).inc(count)
        logged = self._refusing.setdefault(key, set())
        if not logged.issuperset(screened.refused):
            logged.update(screened.refused)
            logger.warning(
                "backend %s (pool %s): %s gave addresses that are not used: %s",
                name.name,
                name.pool,
                name.host,
                ", ".join(f"{count} {why}" for why, count in sorted(screened.refused.items())),
            )
        if not screened.kept:
            answers.labels(name.pool, name.name, "empty").inc()
            return None
        answers.labels(name.pool, name.name, "ok").inc()
        return screened.kept

    def _reconcile(self, name: _Name, addresses: list[Address]) -> list[Backend]:
        pool = self._pools.get(name.pool)
        if pool is None:
            return []
        current = {b.address: b for b in pool.backends if b.found_by == name.name}
        wanted = set(addresses)
        for address, backend in current.items():
            gone = address not in wanted
            if backend.gone != gone:
                backend.gone = gone
                state = "drained: %s no longer resolves to it" if gone else "resumed: %s resolves to it again"
                logger.info("backend %s (pool %s) " + state, backend.name, pool.name, name.host)
        added = [
            Backend(
                f"{name.name}@{address.netloc}",
                pool.name,
                name.config,
                url=name.url(address),
                found_by=name.name,
                address=address,
            )
            for address in addresses
            if address not in current
        ]
        for backend in added:
            backend.outlier.config = self._health_config
            self._speeds.add_prior(backend.name, name.prior)
            logger.info("backend %s (pool %s) found: %s resolves to it", backend.name, pool.name, name.host)
        pool.backends = [*pool.backends, *added]
        pool.wake()
        return added

    def _sweep(self) -> None:
        """Remove the backends whose address has gone, once nothing runs on them."""
        for pool in self._pools:
            idle = [b for b in pool.backends if b.gone and b.in_flight == 0]
            if idle:
                pool.backends = [b for b in pool.backends if b not in idle]
                for backend in idle:
                    logger.info("backend %s (pool %s) removed: drained", backend.name, pool.name)
                self._removed += [b.name for b in idle]
            pool.wake()
