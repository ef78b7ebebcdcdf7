"""`GET /router/status`: the live view of every pool and backend, as JSON."""

from __future__ import annotations

import time
from typing import Any

from router.config import Settings
from router.content import CONTENT_KINDS
from router.learn import SpeedModel, crossover
from router.pools import Backend, Pools
from router.quantiles import percentile


def status(settings: Settings, pools: Pools, speeds: SpeedModel) -> dict[str, Any]:
    now = time.monotonic()
    standard = [b.name for pool in pools if not pool.speculative for b in pool.backends]
    return {
        "routing": {
            "mode": settings.routing.mode,
            "interactive_pool": settings.pool_for("interactive"),
            "batch_pool": settings.pool_for("batch"),
            "crossover": settings.routing.crossover,
            "kv_threshold": settings.routing.kv_threshold,
            "ttft_target": settings.routing.ttft_target,
        },
        "pools": {
            pool.name: {
                "speculative": pool.speculative,
                "accepting": pool.accepting,
                "in_flight": pool.in_flight,
                "queued": {"interactive": pool.queued("interactive"), "batch": pool.queued("batch")},
                "backends": {
                    backend.name: _backend(backend, speeds, standard if pool.speculative else None, now, settings)
                    for backend in pool.backends
                },
            }
            for pool in pools
        },
    }


def _backend(
    backend: Backend, speeds: SpeedModel, standard: list[str] | None, now: float, settings: Settings
) -> dict[str, Any]:
    engine = backend.engine
    acceptance = backend.acceptance
    ttfts = list(backend.recent_ttft)
    curves = {}
    for kind in CONTENT_KINDS:
        curve = speeds.curve(backend.name, kind)
        if curve is not None:
            curves[kind] = [
                {"concurrency": c, "tokens_per_second": round(speed, 2), "samples": round(n, 2), "trusted": trusted}
                for c, speed, n, trusted in curve.points()
            ]
    view: dict[str, Any] = {
        "healthy": backend.healthy,
        "draining": backend.draining,
        "ejected_seconds_left": round(max(0.0, backend.ejected_until - now), 3),
        "in_flight": backend.in_flight,
        "max_concurrency": backend.max_concurrency,
        "engine": {
            "stale": not engine.fresh(now, settings.scrape.stale_after),
            "age_seconds": round(now - engine.scraped_at, 3) if engine.scraped_at else None,
            "running": engine.running,
            "waiting": engine.waiting,
            "kv_usage": engine.kv_usage,
            # The last measured, kept while an idle engine drafts nothing (used for routing up to
            # scrape.acceptance_max_age).
            "acceptance": acceptance[0] if acceptance else None,
            "accept_length": acceptance[1] if acceptance else None,
            "acceptance_age_seconds": round(now - acceptance[2], 3) if acceptance else None,
            "stated_max_concurrency": backend.stated_concurrency,
            "kv_per_request": round(backend.kv_per_request, 6),
        },
        "oldest_waiting_first_token_seconds": round(backend.oldest_waiting_first_token(now), 3),
        "ttft_seconds": {
            "p50": percentile(ttfts, 0.5),
            "p95": percentile(ttfts, 0.95),
            "samples": len(ttfts),
        },
        "speed_curve": curves,
    }
    if standard is not None:
        view["learned_crossover"] = {kind: crossover(speeds, backend.name, standard, kind) for kind in CONTENT_KINDS}
    return view
