"""Replaying the field note's measurement on the engine model, in simulated time.

One round: `users` requests arrive at once on a clean engine, each asking for a fixed-length
answer; the round ends when the last one finishes. This is what `calibrate` compares with the
published figures, and it takes milliseconds, not the minutes the real round took.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from router.content import ContentKind
from router.prompts import chat_prompt_tokens, prompts
from router.sim.engine import Engine
from router.sim.profile import Profile


@dataclass(frozen=True, slots=True)
class Round:
    users: int
    kind: ContentKind
    total_tps: float  # delivered tokens / round duration
    per_user_tps: float  # median over users of (tokens - 1) / (last token - first token)
    worst_ttft: float
    median_ttft: float
    peak_running: int
    peak_kv_usage: float


def replay_round(
    profile: Profile,
    users: int,
    kind: ContentKind,
    *,
    answer_tokens: int = 512,
    seed: int = 0,
    prompt_tokens: int | None = None,
) -> Round:
    """`prompt_tokens`: every prompt this long (as an engine counted a sweep's), else the
    prompt set's own, as the benchmark sends them."""
    engine = Engine(profile, seed=seed)
    texts = prompts(kind)
    requests = [
        engine.add(
            f"r{i}",
            prompt_tokens=prompt_tokens or chat_prompt_tokens([texts[i % len(texts)]]),
            max_tokens=answer_tokens,
            kind=kind,
            ignore_eos=True,
        )
        for i in range(users)
    ]
    peak_running = 0
    peak_kv = 0.0
    while engine.busy:
        engine.step()
        peak_running = max(peak_running, len(engine.running))
        peak_kv = max(peak_kv, engine.kv_usage)
        # Admission happens at the start of a step; look at the state it left.
    ttfts = [r.first_token_at - r.arrival for r in requests if r.first_token_at is not None]
    speeds = [
        (r.generated - 1) / (r.finished_at - r.first_token_at)
        for r in requests
        if r.finished_at is not None and r.first_token_at is not None and r.finished_at > r.first_token_at
    ]
    duration = max(r.finished_at or 0.0 for r in requests)
    return Round(
        users=users,
        kind=kind,
        total_tps=sum(r.generated for r in requests) / duration,
        per_user_tps=statistics.median(speeds),
        worst_ttft=max(ttfts),
        median_ttft=statistics.median(ttfts),
        peak_running=peak_running,
        peak_kv_usage=peak_kv,
    )


# Concurrencies at which `speed_curve` replays: dense where the pools cross, sparse beyond.
CURVE_LEVELS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def speed_curve(
    profile: Profile,
    kind: ContentKind,
    *,
    levels: tuple[int, ...] = CURVE_LEVELS,
    answer_tokens: int = 512,
    seeds: int = 2,
) -> dict[int, float]:
    """Per-user tokens/s by concurrency, as a sweep of `levels` would measure it on this profile
    (the mean over `seeds` replays): the prior speed of a simulated pool (`prior_speed`)."""
    return {
        users: statistics.fmean(
            replay_round(profile, users, kind, answer_tokens=answer_tokens, seed=seed).per_user_tps
            for seed in range(seeds)
        )
        for users in levels
    }
