"""The policy's view of the pools at one moment: live state in, `PoolState` per pool out.

A function of the pools, the learned speeds and `now`; the thresholds come from the request's
settings (router.plan). It reads the pools but changes nothing.
"""

from __future__ import annotations

import itertools

from router.backends.backend import Backend
from router.backends.pools import Pool, Pools
from router.routing.conversations import Cached
from router.routing.learn import Predictions, SpeedModel
from router.routing.policy import PoolState

# The duration assumed of a request while no pool has measured one, for the prediction.
UNMEASURED_DURATION = 10.0


def snapshot(
    pools: Pools,
    speeds: SpeedModel,
    *,
    now: float,
    stale_after: float,
    kv_threshold: float,
    acceptance_max_age: float,
    tokens: int | None = None,
    cached: Cached | None = None,
    load_bound: int = 0,
    prefill_token_seconds: float = 0.0,
    min_gain: float = 0.0,
) -> dict[str, PoolState]:
    """The live state of every pool, as the policy sees it for a request of `tokens` (its length
    at its end, router.content; None: not known).

    With `cached` (its conversation, router.conversations), the backend most likely holding the
    longest prefix of its prompt is the pool's preferred one unless it is `load_bound` requests
    busier than the pool's emptiest (else, or where none holds any, the one whose first token is
    predicted `min_gain` sooner than on the emptiest, its prefill queue counted, if one is; else the
    emptiest), and each backend's predicted first token includes the prefill of the part of the
    prompt it does not hold (no more is held than its engine's free KV space), at its learned rate
    (else `prefill_token_seconds`)."""
    # A pool that has measured no request yet takes the mean of those that have: the same model
    # and the same requests. An assumed constant would make it look many times slower or faster
    # than one that has, and decide the burst that arrives before it has finished one.
    measured = [pool.mean_duration for pool in pools if pool.mean_duration is not None]
    unmeasured = sum(measured) / len(measured) if measured else UNMEASURED_DURATION
    states = {}
    for pool in pools:
        accepting = [b for b in pool.backends if b.accepting]
        if not accepting:
            draining = any(b.healthy and b.draining for b in pool.backends)
            states[pool.name] = PoolState(pool.speculative, healthy=False, draining=draining)
            continue
        # Each backend's projection and engine room, once: the queue and the predictions read them.
        kv = {b.name: b.kv_projected(now, stale_after, tokens) for b in accepting}
        room = {b.name: b.has_engine_room(now, stale_after, kv_threshold, tokens) for b in accepting}
        projected = [usage for usage in kv.values() if usage is not None]
        # Requests waiting inside an engine count as a queue only on two scrapes running and
        # while the engine shows no room of its own: one noisy reading moves nobody.
        queued = sum(
            b.engine.reading.queued or 0
            for b in accepting
            if b.engine.reading.fresh(now, stale_after) and not room[b.name]
        )
        in_queue = pool.queued()
        load = {b.name: b.concurrency(now, stale_after) for b in accepting}
        best = min(accepting, key=lambda b: (load[b.name] / b.max_concurrency, b.name))
        concurrency = load[best.name]
        gain = best.engine.accept_length(now, acceptance_max_age)
        holds = {b.name: _held(b, cached.held.get(b.name, 0), now, stale_after) for b in accepting} if cached else {}
        # Priced: each backend's prefill of the part of the prompt it does not hold.
        prefills = {b.name: prefill_seconds(b, cached.tokens - holds[b.name], prefill_token_seconds)
                    for b in accepting} if cached else {}  # fmt: skip
        backlog = {b.name: b.first_tokens.ahead(now) for b in accepting} if cached else {}  # sent before it
        # A backend that has served no first token yet is taken at the least overhead the others
        # measured: at none, it would look the soonest however busy, and take every cold prompt.
        overhead = min((o for b in accepting if (o := b.first_tokens.overhead) is not None), default=0.0)
        ttfts = {
            b.name: predicted_ttft(
                b,
                pool,
                now=now,
                kv_threshold=kv_threshold,
                stale_after=stale_after,
                unmeasured=unmeasured,
                prefill=prefills.get(b.name),
                overhead=overhead,
                projected=kv[b.name],
                engine_room=room[b.name],
                queued=in_queue,
            )
            for b in accepting
        }
        prefer, held = None, 0
        if cached is not None:
            # The backend holding the longest prefix; if none holds any, where the conversation
            # (named by its session) last went.
            holder = max(accepting, key=lambda b: (holds[b.name], b.name == cached.last, -load[b.name]))
            known = holds[holder.name] or holder.name == cached.last
            if known and holder.has_room and load[holder.name] - concurrency <= load_bound:
                prefer, held = holder.name, holds[holder.name]
        soonest = min(ttfts, key=lambda name: ttfts[name])
        if cached is not None and prefer is None and ttfts[soonest] < ttfts[best.name] * (1 - min_gain):
            # None holds it: where its first token comes `min_gain` sooner than on the emptiest
            # (the prompts queued there for their prefill counted), else the emptiest.
            prefer = soonest
        chosen = prefer if prefer is not None else soonest
        ttft = ttfts[chosen]
        states[pool.name] = PoolState(
            speculative=pool.speculative,
            concurrency=concurrency,
            has_room=not in_queue and any(b.has_room for b in accepting),
            engine_queued=queued,
            kv_usage=min(projected, default=None),  # the emptiest backend is where it would go
            ttft=ttft,
            speed=Predictions(speeds, best.name, concurrency + 1, gain=gain, fallback=not pool.speculative),
            prefer=prefer,
            held=held,
            home=cached is not None and cached.home == pool.name,
            settled=cached is not None and cached.settled,
            prefill=prefills[chosen] + backlog[chosen] if cached else 0.0,
            batch=cached is not None and any(b.batch_work for b in accepting if b.name == chosen),
        )
    return states


def _held(backend: Backend, tokens: int, now: float, stale_after: float) -> int:
    """Of a prompt's prefix sent to `backend`, what its engine can still hold: no more than its
    free KV space, where vLLM keeps the blocks of finished requests until it needs them. An
    engine filled by other requests has evicted them."""
    free = backend.engine.free_tokens(now, stale_after)
    return tokens if free is None else min(tokens, int(free))


def prefill_seconds(backend: Backend, tokens: int, assumed_rate: float) -> float:
    """Seconds `backend` takes to prefill `tokens` prompt tokens: at its learned rate, else `assumed_rate`."""
    return max(0, tokens) * (backend.engine.prefill.seconds_per_token or assumed_rate)


def predicted_ttft(
    backend: Backend,
    pool: Pool,
    *,
    now: float,
    kv_threshold: float,
    stale_after: float,
    unmeasured: float = UNMEASURED_DURATION,
    prefill: float | None = None,
    overhead: float = 0.0,
    projected: float | None,
    engine_room: bool,
    queued: int,
) -> float:
    """The first-token wait of one more request on `backend`, predicted.

    The recent first tokens (median of the last few) and the oldest stream still waiting for
    one are what it takes now; if the request would wait for a slot (the engine has requests
    waiting, no KV headroom for it once what this router sent since the reading is counted, no
    free slot, or the router's queue is not empty), one running request must finish per request
    ahead of it, at the pool's mean request duration (`unmeasured` until it has one) over the
    requests running. Ahead of it: the engine's waiting requests, this router's requests
    projected past the KV cache (a burst faster than a scrape, router.engines) and the router's
    queue.

    With `prefill` (the seconds its own uncached prompt takes there: conversations priced), what
    it takes now is the prefill queue of the streams sent there instead (router.backends.backend),
    with `overhead` beyond it until the backend has measured its own; and the engine's waiting
    requests count only while it shows no room of its own (else they wait for their prefill,
    already in that queue).

    `projected`, `engine_room`, `queued`: the backend's `kv_projected` and `has_engine_room` and
    its pool's queue at `now`, which `snapshot` reads once for the pool's state too.
    """
    first_tokens = backend.first_tokens
    if prefill is None:
        recent = sorted(itertools.islice(reversed(first_tokens.recent), 8))  # the last 8, not a copy of all
        base = max(recent[len(recent) // 2] if recent else 0.0, first_tokens.oldest_wait(now))
    else:
        base = first_tokens.predicted(now, prefill, overhead)
    reading = backend.engine.reading
    fresh = reading.fresh(now, stale_after)
    # Priced, the prompts waiting for their prefill are the queue above: an engine with room of
    # its own that shows requests waiting is prefilling them, not out of slots.
    waiting = (reading.waiting or 0) if fresh and (prefill is None or not engine_room) else 0
    slots_full = backend.slots_used >= backend.max_concurrency
    # The projection is past the threshold whenever any request overflows.
    no_room = (fresh and not engine_room) or (projected is not None and projected >= kv_threshold)
    if not (waiting or queued or slots_full or no_room):
        return base
    overflow = backend.overflow(now, stale_after, kv_threshold)
    running = max(1.0, float(backend.in_flight - overflow), (reading.running or 0.0) if fresh else 0.0)
    duration = pool.mean_duration if pool.mean_duration is not None else unmeasured
    return base + (waiting + overflow + queued + 1) * duration / running
