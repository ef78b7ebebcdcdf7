"""Simulated clusters behind the router, in one process: the one module that composes the two.

The router does not know the simulator and the simulator does not know the router; this module
stands apart from both and puts them together. The embedded default (`specroute serve` with no
configuration) is the `routed` layout: four nodes run the engine with speculation (pool `fast`),
four without (pool `team`). The benchmark's `compare` also runs the other ways to use the same
eight nodes: all speculative, all standard.
Each engine listens on a loopback port the OS picks; the router listens where it is told.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from starlette.applications import Starlette

from router.app import create_app
from router.config import Listen, Settings
from router.content import CONTENT_KINDS, ContentKind
from router.server.listener import uvicorn_config
from router.server.server import RouterServer
from router.sim.profile import Profile, load_profile
from router.sim.replay import speed_curve
from router.sim.server import create_sim_app

LayoutName = Literal["routed", "all-speculative", "all-standard", "fast-alone", "team-alone"]
# The three ways to use eight nodes; the two single engines (four nodes) are the baselines.
LAYOUTS: tuple[LayoutName, ...] = ("routed", "all-speculative", "all-standard")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    speculative: bool
    engines: tuple[Profile, ...]


def layout(name: LayoutName, *, fast: Profile | None = None, team: Profile | None = None) -> list[PoolSpec]:
    fast = fast or load_profile("fast")
    team = team or load_profile("team")
    if name == "routed":
        return [PoolSpec("fast", True, (fast,)), PoolSpec("team", False, (team,))]
    if name == "all-speculative":
        return [PoolSpec("fast", True, (fast, fast))]
    if name == "all-standard":
        return [PoolSpec("team", False, (team, team))]
    if name == "fast-alone":
        return [PoolSpec("fast", True, (fast,))]
    return [PoolSpec("team", False, (team,))]


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def prior_speeds(profile: Profile, *, time_scale: float = 1.0) -> dict[ContentKind, dict[int, float]]:
    """A simulated pool's `prior_speed`: its profile's calibrated speeds, as the router will
    measure them (in wall-clock time, so `time_scale` times the simulated figure)."""
    return {
        kind: {users: round(speed * time_scale, 1) for users, speed in speed_curve(profile, kind).items()}
        for kind in CONTENT_KINDS
    }


def prefill_rate(profile: Profile) -> float:
    """Seconds per prompt token a simulated engine prefills alone: each token's own cost, and a
    full step's fixed cost per chunk of `max_num_batched_tokens` (the router learns the rest)."""
    step = profile.step
    return step.prefill_token_s + (step.base_s + step.expert_s) / profile.max_num_batched_tokens


def cluster_settings(
    pools: dict[str, tuple[bool, list[str]]],
    *,
    host: str,
    port: int,
    time_scale: float = 1.0,
    priors: dict[str, dict[ContentKind, dict[int, float]]] | None = None,
    ttft_target: float = 3.0,
    max_concurrency: int = 256,
    prefill_token_seconds: float | None = None,
) -> Settings:
    """Router settings for pools given as name -> (speculative, engine URLs), with each pool's
    prior speeds (`priors`, by pool name) if given, and the engines' prefill rate per prompt token
    (`prefill_token_seconds`, simulated) assumed until their metrics give it.

    The router's clocks follow the simulation's: scraping every simulated second, health checks
    every five, a client remembered for a simulated minute, the first-token target, the age of
    learned speeds and of the last acceptance measured. At 5x a one-second wall-clock scrape
    would be five simulated seconds old, and the router would see the engines late.
    """
    data: dict[str, Any] = {
        "listen": {"host": host, "port": port},
        "scrape": {
            "interval": 1.0 / time_scale,
            "timeout": 0.5,
            "stale_after": max(1.0, 5.0 / time_scale),
            "acceptance_max_age": 300.0 / time_scale,
        },
        "routing": {"ttft_target": ttft_target / time_scale},
        "conversations": {}
        if prefill_token_seconds is None
        else {"prefill_token_seconds": prefill_token_seconds / time_scale},
        "learn": {"half_life": 600.0 / time_scale},
        "health": {"interval": 5.0 / time_scale},
        "classify": {"client_memory_seconds": 60.0 / time_scale, "burst_hold_seconds": 0.02 / time_scale},
        "pools": {
            name: {
                "speculative": speculative,
                # Let the engines queue, as they did in the note; the router only forwards.
                "backends": {
                    f"{name}-{i + 1}": {"url": url, "max_concurrency": max_concurrency} for i, url in enumerate(urls)
                },
                "prior_speed": (priors or {}).get(name, {}),
            }
            for name, (speculative, urls) in pools.items()
        },
    }
    return Settings(**data)  # SPECROUTE_* variables still override, as with a file


def example(base_url: str, model: str) -> str:
    return f"""\
Try it:
  curl -N {base_url}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "stream": true, "messages": [{{"role": "user", "content": "Tell me about tides."}}]}}'
or with the OpenAI client:
  from openai import OpenAI
  client = OpenAI(base_url="{base_url}", api_key="none")
  for chunk in client.chat.completions.create(model="{model}", stream=True,
          messages=[{{"role": "user", "content": "Write a Python LRU cache."}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
Add the header 'X-Job-Type: batch' to send a request to the team pool."""


async def serve_cluster(
    pools: list[PoolSpec] | None = None,
    *,
    host: str | None = None,
    port: int | None = None,
    time_scale: float = 1.0,
    ttft_target: float = 3.0,
    on_ready: Callable[[str, str], Any] = lambda base_url, banner: print(banner, flush=True),
    prompt_tokens_details: bool = False,
    max_concurrency: int = 256,
) -> None:
    """Serve until stopped; `on_ready(base_url, banner)` once every server listens.
    `prompt_tokens_details`: the engines' usage says the prompt tokens they found cached.
    `max_concurrency`: the router's slots on each engine (256: the engines queue, not the router).

    The router listens on `host` and `port` if given, else where `listen.*` says: its default
    (127.0.0.1:8000) or the environment's `SPECROUTE_LISTEN__HOST` (0.0.0.0 in a container)."""
    pools = pools or layout("routed")
    apps: list[tuple[Starlette, socket.socket]] = []
    urls: dict[str, tuple[bool, list[str]]] = {}
    lines = []
    for pool in pools:
        urls[pool.name] = (pool.speculative, [])
        for profile in pool.engines:
            sock = _bind("127.0.0.1", 0)
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            urls[pool.name][1].append(url)
            apps.append(
                (create_sim_app(profile, time_scale=time_scale, prompt_tokens_details=prompt_tokens_details), sock)
            )
            kind = "speculative" if profile.speculative else "standard"
            lines.append(f"  pool {pool.name}: {profile.name} engine, {kind}, {profile.nodes} nodes  {url}")
    # The router starts knowing what the simulated engines give: their calibrated speeds.
    priors = {pool.name: prior_speeds(pool.engines[0], time_scale=time_scale) for pool in pools}
    settings = cluster_settings(
        urls,
        host=host or "127.0.0.1",
        port=8000 if port is None else port,
        time_scale=time_scale,
        priors=priors,
        ttft_target=ttft_target,
        max_concurrency=max_concurrency,
        prefill_token_seconds=prefill_rate(pools[0].engines[0]),
    )
    host = host if host is not None else settings.listen.host
    router_sock = _bind(host, settings.listen.port if port is None else port)
    listen = Listen(host=host, port=router_sock.getsockname()[1])
    settings = settings.model_copy(update={"listen": listen})
    configs = [uvicorn.Config(app, log_level="warning", access_log=False, server_header=False) for app, _ in apps]
    apps.append((create_app(settings), router_sock))
    configs.append(uvicorn_config(apps[-1][0], settings, log_level="warning"))
    # The router's server shuts down gracefully; it is the last one started, so the first to hear
    # SIGTERM or Ctrl-C (see the end).
    servers = [*(uvicorn.Server(config) for config in configs[:-1]), RouterServer(configs[-1])]
    tasks = [asyncio.create_task(server.serve(sockets=[sock])) for server, (_, sock) in zip(servers, apps, strict=True)]
    while not all(server.started for server in servers):
        if any(task.done() for task in tasks):
            break
        await asyncio.sleep(0.02)
    else:
        nodes = sum(profile.nodes for pool in pools for profile in pool.engines)
        base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{settings.listen.port}/v1"
        scale = "real time" if time_scale == 1 else f"{time_scale:g}x real time"
        model = pools[0].engines[0].model
        on_ready(
            base_url,
            f"specroute: router at {base_url}, in front of a simulated {nodes}-node cluster ({scale})\n"
            + "\n".join(lines)
            + f"\nMetrics: {base_url.removesuffix('/v1')}/metrics\n"
            + example(base_url, model),
        )
    # One server stopping (Ctrl-C reaches whichever installed its handler last) stops them all.
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for server in servers:
        server.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
