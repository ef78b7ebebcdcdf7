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
        in_queue = pool.queued()
        # Each backend read once, in one pass: the queue, the predictions and the placement below
        # take these (a request's whole snapshot runs on every request routed).
        seen = [_Seen(b, now, stale_after, kv_threshold, tokens, cached, prefill_token_seconds) for b in accepting]
        # Requests waiting inside an engine count as a queue only on two scrapes running and
        # while the engine shows no room of its own: one noisy reading moves nobody.
        queued = sum(s.reading.queued or 0 for s in seen if s.fresh and not s.room)
        best = min(seen, key=_emptiest)
        concurrency = best.load
        # A backend that has served no first token yet is taken at the least overhead the others
        # measured: at none, it would look the soonest however busy, and take every cold prompt.
        overhead = min((s.overhead for s in seen if s.overhead is not None), default=0.0)
        for s in seen:
            s.ttft = predicted_ttft(s, pool, now, stale_after, kv_threshold, unmeasured, overhead, in_queue)
        prefer, held = None, 0
        if cached is not None:
            # The backend holding the longest prefix; if none holds any, where the conversation
            # (named by its session) last went.
            holder = max(seen, key=lambda s: (s.held, s.backend.name == cached.last, -s.load))
            known = holder.held or holder.backend.name == cached.last
            if known and holder.backend.has_room and holder.load - concurrency <= load_bound:
                prefer, held = holder, holder.held
        soonest = min(seen, key=_ttft)
        if cached is not None and prefer is None and soonest.ttft < best.ttft * (1 - min_gain):
            # None holds it: where its first token comes `min_gain` sooner than on the emptiest
            # (the prompts queued there for their prefill counted), else the emptiest.
            prefer = soonest
        chosen = prefer if prefer is not None else soonest
        states[pool.name] = PoolState(
            speculative=pool.speculative,
            concurrency=concurrency,
            has_room=not in_queue and any(b.has_room for b in accepting),
            engine_queued=queued,
            # The emptiest backend is where it would go.
            kv_usage=min((s.projected for s in seen if s.projected is not None), default=None),
            ttft=chosen.ttft,
            speed=Predictions(
                speeds,
                best.backend.name,
                concurrency + 1,
                gain=best.backend.engine.accept_length(now, acceptance_max_age),
                fallback=not pool.speculative,
            ),
            prefer=prefer.backend.name if prefer is not None else None,
            held=held,
            home=cached is not None and cached.home == pool.name,
            settled=cached is not None and cached.settled,
            prefill=chosen.prefill + chosen.backlog if chosen.prefill is not None else 0.0,
            batch=cached is not None and bool(chosen.backend.batch_work),
        )
    return states


class _Seen:
    """One backend as the snapshot reads it, each figure once: its engine's reading and whether it
    is fresh, its KV projected and engine room once one more request of `tokens` is sent, its load,
    and, with the request's conversation (`cached`), what it holds of the prompt, the prefill of
    the rest and the prefill queued ahead of it there. `ttft`: its predicted first token."""

    __slots__ = (
        "backend",
        "backlog",
        "fresh",
        "held",
        "load",
        "overhead",
        "prefill",
        "projected",
        "reading",
        "room",
        "ttft",
    )
    prefill: float | None

    def __init__(
        self,
        backend: Backend,
        now: float,
        stale_after: float,
        kv_threshold: float,
        tokens: int | None,
        cached: Cached | None,
        prefill_token_seconds: float,
    ) -> None:
        self.backend = backend
        self.reading = backend.engine.reading
        self.fresh, self.projected, self.room, self.load = backend.outlook(now, stale_after, kv_threshold, tokens)
        self.overhead = backend.first_tokens.overhead
        self.held, self.prefill, self.backlog = 0, None, 0.0  # conversations not priced
        if cached is not None:
            self.held = _held(backend, cached.held.get(backend.name, 0), now, stale_after)
            # Priced: its prefill of the part of the prompt it does not hold, after those sent before it.
            self.prefill = prefill_seconds(backend, cached.tokens - self.held, prefill_token_seconds)
            self.backlog = backend.first_tokens.ahead(now)
        self.ttft = 0.0


def _emptiest(seen: _Seen) -> tuple[float, str]:
    return seen.load / seen.backend.max_concurrency, seen.backend.name


def _ttft(seen: _Seen) -> float:
    return seen.ttft


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
    seen: _Seen,
    pool: Pool,
    now: float,
    stale_after: float,
    kv_threshold: float,
    unmeasured: float,
    overhead: float,
    queued: int,
) -> float:
    """The first-token wait of one more request on a backend (as the snapshot `seen` it), predicted.

    The recent first tokens (median of the last few) and the oldest stream still waiting for
    one are what it takes now; if the request would wait for a slot (the engine has requests
    waiting, no KV headroom for it once what this router sent since the reading is counted, no
    free slot, or the router's queue, `queued`, is not empty), one running request must finish per
    request ahead of it, at the pool's mean request duration (`unmeasured` until it has one) over
    the requests running. Ahead of it: the engine's waiting requests, this router's requests
    projected past the KV cache (a burst faster than a scrape, router.engines) and the router's
    queue.

    With its `prefill` (the seconds its own uncached prompt takes there: conversations priced), what
    it takes now is the prefill queue of the streams sent there instead (router.backends.backend),
    with `overhead` beyond it until the backend has measured its own; and the engine's waiting
    requests count only while it shows no room of its own (else they wait for their prefill,
    already in that queue).
    """
    backend, prefill, reading, fresh = seen.backend, seen.prefill, seen.reading, seen.fresh
    first_tokens = backend.first_tokens
    if prefill is None:
        recent = sorted(itertools.islice(reversed(first_tokens.recent), 8))  # the last 8, not a copy of all
        base = max(recent[len(recent) // 2] if recent else 0.0, first_tokens.oldest_wait(now))
    else:
        base = first_tokens.predicted(now, prefill, overhead, ahead=seen.backlog)
    # Priced, the prompts waiting for their prefill are the queue above: an engine with room of
    # its own that shows requests waiting is prefilling them, not out of slots.
    waiting = (reading.waiting or 0) if fresh and (prefill is None or not seen.room) else 0
    slots_full = backend.slots_used >= backend.max_concurrency
    # The projection is past the threshold whenever any request overflows.
    no_room = (fresh and not seen.room) or (seen.projected is not None and seen.projected >= kv_threshold)
    if not (waiting or queued or slots_full or no_room):
        return base
    overflow = backend.overflow(now, stale_after, kv_threshold)
    running = max(1.0, float(backend.in_flight - overflow), (reading.running or 0.0) if fresh else 0.0)
    duration = pool.mean_duration if pool.mean_duration is not None else unmeasured
    return base + (waiting + overflow + queued + 1) * duration / running
