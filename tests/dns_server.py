"""A DNS server on loopback for the discovery tests, answering from records a test changes.

UDP, one thread, dnspython's message parser: A, AAAA and SRV answers from `records`, and the
faults a broken or hostile server gives (`fault`): a server failure, silence, bytes that are no
DNS message, an answer to another query.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType
from typing import Literal

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

Fault = Literal["servfail", "nxdomain", "silent", "garbage", "wrong_id"]


class DnsServer:
    def __init__(self) -> None:
        # (name with its final dot, lower-case; "A", "AAAA" or "SRV") -> record texts
        self.records: dict[tuple[str, str], list[str]] = {}
        self.fault: Fault | None = None
        self.queries = 0
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def address(self) -> str:
        host, port = self._socket.getsockname()
        return f"{host}:{port}"

    def set(self, name: str, kind: str, values: list[str]) -> None:
        with self._lock:
            self.records[(name.lower().rstrip(".") + ".", kind)] = list(values)

    def __enter__(self) -> DnsServer:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self._socket.recvfrom(4096)
                self.queries += 1
                answer = self._answer(data)
                if answer is not None:
                    self._socket.sendto(answer, peer)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return  # closed under it at the end of a test that ran out of time
                raise

    def _answer(self, data: bytes) -> bytes | None:
        query = dns.message.from_wire(data)
        fault = self.fault
        if fault == "silent":
            return None
        if fault == "garbage":
            return b"\x00\x01 not a DNS message"
        response = dns.message.make_response(query)
        if fault == "wrong_id":
            response.id = (query.id + 1) % 65536
        if fault == "servfail":
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        question = query.question[0]
        name, kind = question.name.to_text().lower(), dns.rdatatype.to_text(question.rdtype)
        with self._lock:
            known = {key[0] for key in self.records}
            values = list(self.records.get((name, kind), []))
        if fault == "nxdomain" or name not in known:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        if values:
            response.answer.append(dns.rrset.from_text_list(name, 5, dns.rdataclass.IN, kind, values))
        response.flags |= dns.flags.AA
        return response.to_wire()
