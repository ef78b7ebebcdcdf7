"""Responses API affinity: which backend produced a stored response.

An engine keeps the responses it made (`store: true`, vLLM's and OpenAI's default); another
engine has never heard of them and answers 404. So the router remembers, for a while and for a
bounded number of ids, which backend answered with each response id, and sends what names that
id (`previous_response_id`, `GET`/`DELETE /v1/responses/{id}`) back there. Forgotten ids (expired,
evicted, or a restart) are routed as usual.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from router.config import Responses

# The ids the router deals with: what engines make (vLLM's `resp_<hex>`, OpenAI's `resp_...`).
# Any other is neither remembered (an engine's id of megabytes, `affinity_max` times) nor searched
# for (router.responses.locate: a client's `../../health` would name something else in a probe's path).
RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
# /v1/responses/{id}, /v1/responses/{id}/input_items, /v1/responses/{id}/cancel
_BY_ID = re.compile(r"^/v1/responses/([^/]+)(?:/[^/]+)?$")


def response_ref(method: str, path: str, payload: Mapping[str, Any]) -> str | None:
    """The stored response a request names, if any."""
    if not path.startswith("/v1/responses"):
        return None  # most requests: one comparison
    match = _BY_ID.match(path)
    if match is not None:
        return match.group(1)
    if method == "POST" and path == "/v1/responses":
        previous = payload.get("previous_response_id")
        return previous if isinstance(previous, str) else None
    return None


def made_response(method: str, path: str) -> bool:
    """Whether the answer to this request is a new stored response (its `id` worth remembering)."""
    return method == "POST" and path == "/v1/responses"


class ResponseAffinity:
    """Response id -> backend name, each for `affinity_seconds`, at most `affinity_max` of them,
    with the client that made it where known (a digest of its key, router.responses.stage)."""

    def __init__(self) -> None:
        # id -> (backend, expiry, the client that made it or None: any client may name it)
        self._owners: OrderedDict[str, tuple[str, float, bytes | None]] = OrderedDict()
        self.configure(Responses())

    def configure(self, config: Responses) -> None:
        self._ttl = config.affinity_seconds
        self._max = config.affinity_max
        self._trim()

    def __len__(self) -> int:
        return len(self._owners)

    def remember(self, response_id: str, backend: str, now: float, *, maker: bytes | None = None) -> None:
        if self._ttl <= 0 or self._max <= 0 or RESPONSE_ID.fullmatch(response_id) is None:
            return
        self._owners[response_id] = (backend, now + self._ttl, maker)
        self._owners.move_to_end(response_id)
        self._trim(now)

    def owner(self, response_id: str, now: float) -> str | None:
        found = self._owners.get(response_id)
        if found is None:
            return None
        if found[1] <= now:
            del self._owners[response_id]
            return None
        return found[0]

    def maker(self, response_id: str) -> bytes | None:
        """The client that made a remembered response (None: unknown, or not remembered)."""
        found = self._owners.get(response_id)
        return found[2] if found is not None else None

    def forget(self, response_id: str) -> None:
        self._owners.pop(response_id, None)

    def _trim(self, now: float | None = None) -> None:
        # Entries are in the order they were remembered, with one lifetime: the oldest expire first.
        while self._owners and (
            len(self._owners) > self._max or (now is not None and next(iter(self._owners.values()))[1] <= now)
        ):
            self._owners.popitem(last=False)
