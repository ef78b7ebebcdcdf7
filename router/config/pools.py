"""Pools and their backends: the engines the router sends work to."""

from __future__ import annotations

import ipaddress
import os
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from router.config.base import Section
from router.content import ContentKind


class Backend(Section):
    """One engine (a vLLM or SGLang server) of a pool."""

    url: str = Field(
        description="The engine's root URL, `http://` or `https://`; a trailing `/v1` is dropped. A URL with "
        "`user:pass@` is refused (the password is never printed): give the key through `api_key_env`."
    )
    api_key_env: str | None = Field(
        default=None,
        description="Name of the environment variable holding the engine's API key, never the key itself. "
        "Unset: no key is sent (or the client's, with `forward_client_authorization`).",
    )
    max_concurrency: int = Field(
        default=64, ge=1, description="Requests the router sends this backend at once; more wait in the pool's queue."
    )
    discover: Literal["none", "dns", "srv"] = Field(
        default="none",
        description="Find this backend's engines by name (docs/discovery.md). `dns`: every address the URL's host "
        "resolves to (A and AAAA records; a Kubernetes headless Service) is a backend of the pool, on the URL's "
        "port, named `<name>@<address>:<port>`. `srv`: the host is an SRV name (`_http._tcp.vllm.llm.svc."
        "cluster.local`) and each target and port it lists is a backend (needs `specroute[dns]`). Resolved "
        "again every `discovery.interval`: an address that goes is drained, a new one takes work once a health "
        "check passes. `none`: the URL is one engine.",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        if "@" in urlsplit(value).netloc:
            # Never echoed: the message must not carry the password.
            raise ValueError(
                "must not hold a user name or password (user:pass@); give the engine's key in the "
                "environment variable named by api_key_env"
            )
        # The engine's root: request paths such as /v1/chat/completions are appended to it.
        return value.rstrip("/").removesuffix("/v1")

    def api_key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    @model_validator(mode="after")
    def _discoverable(self) -> Backend:
        if self.discover != "none" and urlsplit(self.url).scheme == "https":
            # The engines would be reached by address, and their certificates name the host.
            raise ValueError("discover works with http:// engines only: an https engine's certificate names its host")
        return self


class Discovery(Section):
    """How backends with `discover` are found (docs/discovery.md): every answer is checked and bounded."""

    interval: float = Field(default=5.0, gt=0, description="Names are resolved again this often, in seconds.")
    timeout: float = Field(
        default=2.0,
        gt=0,
        description="Longest wait for one name's answer; a name that fails keeps the backends it had.",
    )
    max_addresses: int = Field(
        default=32,
        ge=1,
        le=1024,
        description="Backends one name may give at most; of a longer answer the lowest addresses are kept (sorted, "
        "so that an answer in another order keeps the same ones), the rest counted and logged.",
    )
    networks: list[str] = Field(
        default=["0.0.0.0/0", "::/0"],
        min_length=1,
        description="Networks an address must be in to become a backend (e.g. the pod network `10.0.0.0/8`). "
        "Whatever this says, unspecified, multicast, link-local (a cloud's metadata service) and reserved "
        "addresses never are.",
    )
    nameservers: list[str] = Field(
        default=[],
        description="DNS servers to ask (`address` or `address:port`) instead of the system's resolver "
        "(/etc/hosts, /etc/resolv.conf). Needs `specroute[dns]`, as `discover: srv` does (which asks the "
        "system's nameservers when this is empty).",
    )

    @field_validator("networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ipaddress.ip_network(network)
            except ValueError as exc:
                raise ValueError(f"{network}: not a network ({exc})") from exc
        return value

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, value: list[str]) -> list[str]:
        for server in value:
            host, port = nameserver(server)
            ipaddress.ip_address(host)  # its ValueError names it
            if not 0 < port < 65536:
                raise ValueError(f"{server}: no such port")
        return value


def nameserver(value: str) -> tuple[str, int]:
    """`address` or `address:port` (`[v6]:port`) -> (address, port); port 53 by default."""
    if value.startswith("["):
        host, _, port = value[1:].partition("]")
        return host, int(port.removeprefix(":") or 53)
    if value.count(":") == 1:
        host, _, port = value.partition(":")
        return host, int(port)
    return value, 53


class Pool(Section):
    """Engines serving the same model the same way: with speculative decoding or without."""

    speculative: bool = Field(description="Whether the pool's engines use speculative decoding.")
    backends: dict[str, Backend] = Field(min_length=1, description="The pool's engines, by name (unique across pools).")
    queue_size: int = Field(
        default=256,
        ge=0,
        description="Requests that may wait in the router for a slot when every backend of the pool is at "
        "`max_concurrency`; past it: 503 `queue_full` with `Retry-After`.",
    )
    queue_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a request may wait in that queue; then 503 `queue_timeout` with `Retry-After`.",
    )
    priority_scheduling: bool = Field(
        default=False,
        description="The pool's engines schedule by priority (vLLM's `--scheduling-policy priority`): the router "
        "sets each request's `priority` (lower goes first), interactive work before batch work, Batch API lines "
        "and batch work borrowing the pool last, and within a class the client holding fewer of the pool's slots "
        "first. A client's own `priority` is replaced. Leave it off for engines that do not: vLLM refuses a "
        "priority other than 0 then.",
    )
    prior_speed: dict[ContentKind, dict[int, float]] = Field(
        default={},
        description="Per-user tokens/s the pool's engines give by concurrency, per content kind, e.g. "
        "`{prose: {1: 57, 4: 29.8}, code: {1: 104, 4: 42}}` (concurrencies ≥ 1, speeds > 0; a kind may be "
        "left out): the prediction before anything is learned, and what learned points are shrunk toward "
        "(`learn.prior_weight`). `specroute bench sweep` writes it as `prior-<kind>.yaml`. Empty: no prior.",
    )

    @field_validator("prior_speed")
    @classmethod
    def _speed_table(cls, value: dict[ContentKind, dict[int, float]]) -> dict[ContentKind, dict[int, float]]:
        for kind, table in value.items():
            if not table:
                raise ValueError(f"{kind}: give at least one concurrency: tokens/s")
            for concurrency, speed in table.items():
                if concurrency < 1:
                    raise ValueError(f"{kind}: concurrency {concurrency} must be at least 1")
                if not 0 < speed < float("inf"):
                    raise ValueError(f"{kind}: tokens/s at {concurrency} must be a positive number, not {speed}")
        return {kind: dict(sorted(table.items())) for kind, table in value.items()}
