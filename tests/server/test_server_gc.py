"""`RouterServer` freezes what its startup built out of the garbage collector's reach
(router/server/server.py): served and stopped in a process that goes on (a test run, a program
serving a router more than once), what it built is collected as if it had not."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

import pytest
from starlette.applications import Starlette

from router.app import create_app
from router.config import Settings
from router.server.listener import uvicorn_config
from router.server.server import RouterServer
from tests.conftest import settings_data
from tests.fake_engine import FakeEngine
from tests.servers import ServerThread
from tests.wait import until

pytestmark = pytest.mark.e2e  # the router served on loopback in front of a fake engine


async def _serve_and_stop(engine_url: str, store: Path) -> weakref.ref[Starlette]:
    app = create_app(Settings(**settings_data(engine_url, engine_url, batch={"store_dir": str(store)})))
    config = uvicorn_config(app, app.state.router.settings, host="127.0.0.1", port=0, log_level="warning")
    server = RouterServer(config)
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started or serving.done(), message="the router started")
    assert server.started, serving.exception()
    server.should_exit = True
    await serving
    return weakref.ref(app)


def test_a_router_served_and_stopped_is_collected(tmp_path: Path) -> None:
    with ServerThread(FakeEngine().app()) as engine:
        apps = [asyncio.run(_serve_and_stop(engine.url, tmp_path)) for _ in range(2)]
    gc.collect()
    assert [app() for app in apps] == [None, None]
    assert gc.get_freeze_count() == 0
