"""`specroute bench compare`: one scenario on each way to use the same simulated eight nodes.

Each layout runs in a process of its own (engines and router), so that the load generator has
the other core; every layout starts clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from router.bench.load import Target
from router.sim.cluster import LayoutName, layout, serve_cluster

T = TypeVar("T")


def _serve_layout(name: LayoutName, time_scale: float, ready: Any) -> None:
    asyncio.run(serve_cluster(layout(name), port=0, time_scale=time_scale, on_ready=lambda url, banner: ready.put(url)))


@contextlib.contextmanager
def running_layout(name: LayoutName, *, time_scale: float) -> Iterator[str]:
    """A simulated layout and its router in a child process; yields the router's base URL."""
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    process = context.Process(target=_serve_layout, args=(name, time_scale, ready), daemon=True)
    process.start()
    try:
        yield ready.get(timeout=60)
    finally:
        process.terminate()
        process.join(15)
        if process.is_alive():
            process.kill()
            process.join()
        ready.close()
        ready.join_thread()


def run_on_layouts(
    names: tuple[LayoutName, ...],
    scenario: Callable[[Target], Coroutine[Any, Any, T]],
    *,
    model: str,
    time_scale: float,
    on_layout: Callable[[LayoutName], None] | None = None,
) -> dict[str, T]:
    results: dict[str, T] = {}
    for name in names:
        if on_layout:
            on_layout(name)
        with running_layout(name, time_scale=time_scale) as base_url:
            target = Target(base_url=base_url, model=model, time_scale=time_scale)
            results[name] = asyncio.run(scenario(target))
    return results
