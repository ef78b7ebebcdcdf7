"""Who may use the router, and who may steer it.

Client keys, the admin key and the keys allowed to use the override headers are read from environment
variables (comma-separated), never from the settings file, and compared in constant time.
"""

from __future__ import annotations

import hmac
import os

from router.config import Auth as AuthConfig
from router.config import KeyGroup
from router.errors import PermissionDenied, Unauthorized

# A request the router makes to itself (a batch line) carries this key in its ASGI scope. A
# server puts only the ASGI keys in a client's scope, so no client can claim it: such a request
# is trusted — no client key is asked of it, and its override headers count.
INTERNAL_SCOPE_KEY = "specroute.internal"


def _keys(env: str | None) -> tuple[bytes, ...]:
    if not env:
        return ()
    return tuple(key.strip().encode() for key in os.environ.get(env, "").split(",") if key.strip())


def _known(key: str | None, keys: tuple[bytes, ...]) -> bool:
    if key is None:
        return False
    candidate = key.encode()
    # Compare with every key, so the time taken does not tell which one came close.
    found = False
    for known in keys:
        found |= hmac.compare_digest(candidate, known)
    return found


class Auth:
    def __init__(self, config: AuthConfig) -> None:
        self._client_keys = _keys(config.client_keys_env)
        self._override_keys = _keys(config.override_keys_env)
        self._admin_keys = _keys(config.admin_key_env)
        self._overrides_restricted = config.override_keys_env is not None
        self._reject_overrides = config.untrusted_overrides == "reject"

    @property
    def required(self) -> bool:
        return bool(self._client_keys)

    def check_client(self, key: str | None) -> None:
        """Raise Unauthorized unless client keys are off or `key` is one of them."""
        if self._client_keys and not _known(key, self._client_keys):
            raise Unauthorized(
                "Incorrect API key provided." if key else "Missing API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    def check_admin(self, key: str | None) -> None:
        """Raise unless the admin API is on and `key` is its key (a client key is not)."""
        if not self._admin_keys:
            raise PermissionDenied("the admin API is off: set auth.admin_key_env", code="admin_disabled")
        if not _known(key, self._admin_keys):
            raise Unauthorized(
                "Incorrect admin key provided." if key else "Missing admin key: send 'Authorization: Bearer <key>'.",
                code="invalid_admin_key",
            )

    def may_override(self, key: str | None, header: str) -> bool:
        """Whether this client's override header counts; raises PermissionDenied if so configured."""
        if not self._overrides_restricted or _known(key, self._override_keys):
            return True
        if self._reject_overrides:
            raise PermissionDenied(
                f"this API key may not use the {header} header", param=header, code="override_denied"
            )
        return False


class KeyGroups:
    """Which group of `fairness.groups` an API key belongs to (the first that holds it)."""

    def __init__(self, groups: dict[str, KeyGroup]) -> None:
        self._keys = {name: _keys(group.keys_env) for name, group in groups.items()}
        self._weights = {name: group.weight for name, group in groups.items()}

    def of(self, key: str | None) -> str | None:
        if key is None:
            return None
        return next((name for name, keys in self._keys.items() if _known(key, keys)), None)

    def weight(self, group: str | None) -> float:
        return self._weights.get(group, 1.0) if group is not None else 1.0
