"""The errors the router itself raises, rendered once in OpenAI's error shape.

    RouterError
    ├── BadRequest            400  malformed JSON, bad override header, bad path, an upgrade request
    ├── Unauthorized          401  client keys are required and this is not one
    ├── PermissionDenied      403  this key may not use an override header
    ├── NotFound              404
    ├── MethodNotAllowed      405
    ├── RequestTimeout        408  the body did not arrive in time
    ├── PayloadTooLarge       413
    ├── HeadersTooLarge       431  the request head is too large, or has too many fields
    ├── RateLimited           429  (+ Retry-After, x-ratelimit-*) over a key's limit
    ├── LoopDetected          508  this router's health check reached this router (it is its own backend)
    ├── NoBackendAvailable    503  (+ Retry-After) queue full, queue wait over, pool down, too many connections
    └── UpstreamError         502  upstream unreachable or broken
        └── UpstreamTimeout   504

Errors that an upstream answers itself (its 4xx and 5xx) are passed through unchanged and
never become a RouterError. Pure: router.replies turns one into an HTTP response.
"""

from __future__ import annotations

import json
import math


class RouterError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def event(self) -> bytes:
        """The error as one server-sent event: how a stream that has already started ends."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(RouterError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(RouterError):
    status_code = 401
    error_type = "invalid_request_error"


class PermissionDenied(RouterError):
    status_code = 403
    error_type = "invalid_request_error"


class NotFound(RouterError):
    status_code = 404
    error_type = "invalid_request_error"


class MethodNotAllowed(RouterError):
    status_code = 405
    error_type = "invalid_request_error"


class Conflict(RouterError):
    status_code = 409
    error_type = "invalid_request_error"


class RequestTimeout(RouterError):
    status_code = 408
    error_type = "invalid_request_error"


class PayloadTooLarge(RouterError):
    status_code = 413
    error_type = "invalid_request_error"


class HeadersTooLarge(RouterError):
    status_code = 431
    error_type = "invalid_request_error"


class RateLimited(RouterError):
    """Over a limit of `fairness`: OpenAI's 429, its `type` the limit's kind (`requests`,
    `tokens`), with the waits its SDK reads (`retry-after-ms`, then `Retry-After`) and the
    client's `x-ratelimit-*` headers."""

    status_code = 429

    def __init__(self, message: str, *, kind: str, retry_after: float, headers: dict[str, str]) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.error_type = kind
        self.retry_after = retry_after
        self._headers = headers

    def headers(self) -> dict[str, str]:
        return {
            **self._headers,
            "Retry-After": str(max(1, math.ceil(self.retry_after))),
            "retry-after-ms": str(max(1, math.ceil(self.retry_after * 1000))),
        }


class LoopDetected(RouterError):
    status_code = 508
    error_type = "loop_detected"


class NoBackendAvailable(RouterError):
    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class ShuttingDown(RouterError):
    status_code = 503
    error_type = "service_unavailable"


class UpstreamError(RouterError):
    status_code = 502
    error_type = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    error_type = "upstream_timeout"
