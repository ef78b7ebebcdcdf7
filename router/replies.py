"""The router's own errors as HTTP responses: the one place a `RouterError` meets Starlette."""

from __future__ import annotations

import json

from starlette.responses import Response

from router.errors import RouterError


def error_response(error: RouterError, extra_headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(error.body()),
        status_code=error.status_code,
        media_type="application/json",
        headers={**error.headers(), **(extra_headers or {})},
    )
