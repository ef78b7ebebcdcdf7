"""`specroute bench compare`: one scenario on each way to use the same simulated eight nodes.

Each layout runs in a process of its own (engines and router), so that the load generator has
the other core; every layout starts clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from router.bench.load import Target
from router.demo import LayoutName, PoolSpec, layout, serve_cluster

T = TypeVar("T")


def _serve_pools(
    pools: list[PoolSpec],
    time_scale: float,
    routing_mode: str | None,
    environ: dict[str, str],
    details: bool,
    ttft_target: float,
    slots: int,
    ready: Any,
) -> None:
    if routing_mode is not None:
        os.environ["SPECROUTE_ROUTING__MODE"] = routing_mode  # this child process's own environment
    os.environ.update(environ)
    asyncio.run(
        serve_cluster(
            pools,
            port=0,
            time_scale=time_scale,
            ttft_target=ttft_target,
            on_ready=lambda url, banner: ready.put(url),
            prompt_tokens_details=details,
            max_concurrency=slots,
        )
    )


@contextlib.contextmanager
def running_layout(
    name: LayoutName,
    *,
    time_scale: float,
    routing_mode: str | None = None,
    environ: dict[str, str] | None = None,
    prompt_tokens_details: bool = False,
    slots: int = 256,
) -> Iterator[str]:
    """A simulated layout and its router in a child process; yields the router's base URL.
    `environ`: settings for its router (`SPECROUTE_*`); `prompt_tokens_details`: the engines'
    usage says the prompt tokens they found cached."""
    with running_pools(
        layout(name),
        time_scale=time_scale,
        routing_mode=routing_mode,
        environ=environ,
        prompt_tokens_details=prompt_tokens_details,
        slots=slots,
    ) as base_url:
        yield base_url


@contextlib.contextmanager
def running_pools(
    pools: list[PoolSpec],
    *,
    time_scale: float,
    routing_mode: str | None = None,
    environ: dict[str, str] | None = None,
    prompt_tokens_details: bool = False,
    ttft_target: float = 3.0,
    slots: int = 256,
) -> Iterator[str]:
    """Simulated pools and their router in a child process; yields the router's base URL.
    `slots`: the router's on each engine."""
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    args = (pools, time_scale, routing_mode, environ or {}, prompt_tokens_details, ttft_target, slots, ready)
    process = context.Process(target=_serve_pools, args=args, daemon=True)
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


def run_on_layout(
    name: LayoutName,
    scenario: Callable[[Target], Coroutine[Any, Any, T]],
    *,
    model: str,
    time_scale: float,
    routing_mode: str | None = None,
    environ: dict[str, str] | None = None,
    slots: int = 256,
) -> T:
    """Start the layout clean, run the scenario against its router, stop it."""
    with running_layout(
        name, time_scale=time_scale, routing_mode=routing_mode, environ=environ, slots=slots
    ) as base_url:
        return asyncio.run(scenario(Target(base_url=base_url, model=model, time_scale=time_scale)))
