"""The admin API: drain and resume backends or pools, reload the configuration.

Every route asks for the admin key (`auth.admin_key_env`) before it reads anything else; with
no admin key configured the API is off (403). Client keys never open it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.backends.backend import Backend
from router.errors import BadRequest
from router.request.headers import bearer
from router.request.payload import parse_json
from router.runtime import Router

if TYPE_CHECKING:
    from router.workers.peers import Peers


def admin_routes(router: Router, workers: Peers | None = None) -> list[Route]:
    """`workers`: the other worker processes, each told what this one was (router.workers)."""

    async def drain(request: Request) -> Response:
        return await _everywhere(request, workers, await _set_draining(request, router, draining=True))

    async def resume(request: Request) -> Response:
        return await _everywhere(request, workers, await _set_draining(request, router, draining=False))

    async def reload(request: Request) -> Response:
        router.plan.auth.check_admin(bearer(request.headers.get("authorization")))
        return await _everywhere(request, workers, {"reloaded": True, **router.reload()})

    return [
        Route("/admin/drain", drain, methods=["POST"]),
        Route("/admin/resume", resume, methods=["POST"]),
        Route("/admin/reload", reload, methods=["POST"]),
    ]


async def _set_draining(request: Request, router: Router, *, draining: bool) -> dict[str, Any]:
    router.plan.auth.check_admin(bearer(request.headers.get("authorization")))
    target = _target(await request.body(), max_depth=router.plan.json_depth)
    [(kind, name)] = target.items()
    backends = router.set_draining(
        pool=target.get("pool"),
        backend=target.get("backend"),
        draining=draining,
        reason=f"asked through the admin API ({kind} {name})",
    )
    return {"draining": draining, "backends": [_view(backend) for backend in backends]}


async def _everywhere(request: Request, workers: Peers | None, done: dict[str, Any]) -> Response:
    """Done here: the same request to the other workers, and how many of them did it too."""
    if workers is None or not workers.public(request):
        return JSONResponse(done)
    headers = {"authorization": request.headers.get("authorization", ""), "content-type": "application/json"}
    answers = await workers.ask("POST", request.url.path, headers=headers, body=await request.body())
    summary = workers.summary(sum(answer.status == 200 for answer in answers))
    return JSONResponse({**done, "workers": summary})


def _target(body: bytes, *, max_depth: int) -> dict[str, str]:
    """`{"pool": NAME}` or `{"backend": NAME}`, exactly one of them."""
    payload = parse_json(body, max_depth=max_depth)
    if not isinstance(payload, dict) or len(payload) != 1 or not payload.keys() <= {"pool", "backend"}:
        raise BadRequest('send {"pool": NAME} or {"backend": NAME}', code="invalid_target")
    [(key, name)] = payload.items()
    if not isinstance(name, str):
        raise BadRequest(f"{key} must be a string", param=key, code="invalid_target")
    return {key: name}


def _view(backend: Backend) -> dict[str, Any]:
    # `in_flight` reaching 0 is the operator's sign that the engine may be restarted.
    return {"pool": backend.pool, "backend": backend.name, "draining": backend.draining, "in_flight": backend.in_flight}
