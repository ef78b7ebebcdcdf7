"""`GET /router/status`: the live view of every pool and backend, as JSON."""

from __future__ import annotations

from typing import Any

from router.backends.backend import Backend
from router.backends.pools import Pool, Pools
from router.content import CONTENT_KINDS
from router.logs import client_hash
from router.quantiles import percentile
from router.request.plan import Plan
from router.routing.learn import SpeedModel, crossover


def status(plan: Plan, pools: Pools, speeds: SpeedModel, *, now: float) -> dict[str, Any]:
    standard = [b.name for pool in pools if not pool.speculative for b in pool.backends]
    routing = plan.routing
    return {
        "routing": {
            "mode": routing.mode,
            "interactive_pool": plan.interactive_pool,
            "batch_pool": plan.batch_pool,
            "crossover": routing.crossover,
            "kv_threshold": routing.kv_threshold,
            "ttft_target": routing.ttft_target,
        },
        "pools": {
            pool.name: {
                "speculative": pool.speculative,
                "accepting": pool.accepting,
                "in_flight": pool.in_flight,
                "queued": {"interactive": pool.queued("interactive"), "batch": pool.queued("batch")},
                "clients": _shares(pool, plan.top_clients),
                "backends": {
                    backend.name: _backend(backend, speeds, standard if pool.speculative else None, now, plan)
                    for backend in pool.backends
                },
            }
            for pool in pools
        },
    }


def _shares(pool: Pool, top: int) -> dict[str, Any]:
    """Who holds the pool's slots: the top clients by a hash of their identity, then the rest."""
    named, others = pool.shares(top)
    held = sum(slots for _, slots in named) + others
    return {
        "fair_share": pool.fair_share,
        "keep_room": pool.fair_share and pool.active.keep_room,
        "active_clients": len(pool.active),
        "held_back": pool.held_back,
        "newcomer_slots": pool.newcomers.slots if pool.fair_share else 0,
        "newcomers_admitted": pool.newcomers.admitted,
        "top": [
            {"client": client_hash(client), "slots": slots, "share": round(slots / held, 4)} for client, slots in named
        ],
        "others": {"clients": max(0, len(pool.held) - len(named)), "slots": others},
    }


def _backend(
    backend: Backend, speeds: SpeedModel, standard: list[str] | None, now: float, plan: Plan
) -> dict[str, Any]:
    engine = backend.engine.reading
    acceptance = backend.engine.acceptance
    ttfts = list(backend.first_tokens.recent)
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
        "ejected_seconds_left": round(backend.outlier.ejected_left(now), 3),
        "in_flight": backend.in_flight,
        "max_concurrency": backend.max_concurrency,
        "engine": {
            "stale": not engine.fresh(now, plan.stale_after),
            "age_seconds": round(now - engine.scraped_at, 3) if engine.scraped_at else None,
            "running": engine.running,
            "waiting": engine.waiting,
            "kv_usage": engine.kv_usage,
            # The last measured, kept while an idle engine drafts nothing (used for routing up to
            # scrape.acceptance_max_age).
            "acceptance": acceptance.ratio if acceptance else None,
            "accept_length": acceptance.length if acceptance else None,
            "acceptance_age_seconds": round(now - acceptance.measured_at, 3) if acceptance else None,
            "stated_max_concurrency": backend.engine.stated_concurrency,
            "kv_per_request": round(backend.engine.kv_per_request(backend.max_concurrency), 6),
        },
        "oldest_waiting_first_token_seconds": round(backend.first_tokens.oldest_wait(now), 3),
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
