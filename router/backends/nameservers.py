"""The resolver over dnspython (`specroute[dns]`): SRV records, and chosen nameservers.

Imported only when `discover: srv` or `discovery.nameservers` is configured (router.runtime).
Every failure dnspython reports (no such name, no answer, a malformed or truncated reply, no
nameserver answering within the lifetime) is a `ResolveError`: the name keeps its backends.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import dns._asyncio_backend
import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver

from router.backends.backend import Address
from router.backends.discovery import ResolveError


class DnsResolver:
    def __init__(self, nameservers: list[tuple[str, int]], *, timeout: float, limit: int) -> None:
        """`nameservers` empty: the system's (/etc/resolv.conf). `limit`: SRV targets looked up at most."""
        resolver = dns.asyncresolver.Resolver(configure=not nameservers)
        if nameservers:
            resolver.nameservers = [dns.nameserver.Do53Nameserver(host, port) for host, port in nameservers]
        resolver.lifetime = timeout
        self._resolver = resolver
        self._backend = _ClosingBackend()
        self._limit = limit

    async def addresses(self, host: str, port: int) -> list[Address]:
        found: list[Address] = []
        failures: list[dns.exception.DNSException] = []
        for kind in (dns.rdatatype.A, dns.rdatatype.AAAA):
            try:
                answer = await self._resolver.resolve(host, kind, search=True, backend=self._backend)
            except dns.resolver.NoAnswer:
                continue  # the name has addresses of the other family only
            except dns.exception.DNSException as exc:
                failures.append(exc)
                continue
            found += [Address(record.address, port) for record in answer]
        if failures and not found:
            raise ResolveError(str(failures[0])) from failures[0]
        return found

    async def services(self, name: str) -> list[Address]:
        try:
            answer = await self._resolver.resolve(name, dns.rdatatype.SRV, search=True, backend=self._backend)
        except dns.exception.DNSException as exc:
            raise ResolveError(str(exc)) from exc
        records = list(answer)
        if not records:
            return []
        # The lowest priority's targets are the ones to use while any of them answers (RFC 2782).
        first = min(record.priority for record in records)
        targets = sorted({(record.target.to_text(), record.port) for record in records if record.priority == first})
        found = await asyncio.gather(
            *(self.addresses(target, port) for target, port in targets[: self._limit]), return_exceptions=True
        )
        addresses = [address for each in found if not isinstance(each, BaseException) for address in each]
        if not addresses and any(isinstance(each, BaseException) for each in found):
            raise ResolveError(f"none of the targets of {name} resolves")
        return addresses


class _ClosingBackend(dns._asyncio_backend.Backend):
    """dnspython's asyncio backend (its private module: the one place it is touched, held by
    tests/backends/test_nameservers.py), but a query cancelled while its UDP socket is being made
    (a name's `discovery.timeout`, or the router stopping) closes that socket. uvloop's
    `create_datagram_endpoint` does not (0.23: no cleanup around its `await waiter`): the transport
    it made was left to the garbage collector, which reports it as a ResourceWarning."""

    async def make_socket(self, af: int, socktype: int, *args: Any, **kwargs: Any) -> Any:
        making = super().make_socket(af, socktype, *args, **kwargs)  # type: ignore[no-untyped-call]
        if socktype != socket.SOCK_DGRAM:
            return await making
        made = asyncio.ensure_future(making)
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            # It is made within a loop iteration or two: wait for it (not cancelling it), close it.
            await asyncio.wait([made])
            if not made.cancelled() and made.exception() is None:
                await made.result().close()
            raise
