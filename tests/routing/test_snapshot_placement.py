"""The snapshot's view of a pool for one request: the KV its engines' requests in flight hold, and
the backend a cold prompt of a conversation is placed on."""

from __future__ import annotations

import dataclasses

import pytest

from router.backends.engines import EngineLoad
from router.backends.pools import Pools
from router.config import Settings
from router.routing.conversations import Cached
from router.routing.learn import SpeedModel
from router.routing.policy import PoolState
from router.routing.snapshot import snapshot

NOW = 100.0
CACHE = 2_097_152  # the shipped `team` profile's KV cache, in tokens
BATCH = 60 + 256  # a batch job's request: a short prompt and its answer
PROMPT = 29_000 + 256  # a long conversation's turn: its history and its answer


def _pools(backends: dict[str, int]) -> Pools:
    """A standard pool of the named backends (each with that many slots) and a speculative one."""
    settings = Settings.model_validate(
        {
            "pools": {
                "fast": {"speculative": True, "backends": {"f1": {"url": "http://127.0.0.1:1"}}},
                "team": {
                    "speculative": False,
                    "backends": {
                        name: {"url": f"http://127.0.0.1:{2 + i}", "max_concurrency": slots}
                        for i, (name, slots) in enumerate(backends.items())
                    },
                },
            }
        }
    )
    pools = Pools()
    pools.configure(settings.pools, settings.health)
    return pools


def _states(
    pools: Pools, tokens: int | None, cached: Cached | None = None, *, load_bound: int = 0, now: float = NOW
) -> dict[str, PoolState]:
    """The pools' states, with conversations' settings as shipped (a 30 % gain to leave the emptiest)."""
    return snapshot(
        pools,
        SpeedModel(),
        now=now,
        stale_after=5.0,
        kv_threshold=0.9,
        acceptance_max_age=300.0,
        tokens=tokens,
        cached=cached,
        load_bound=load_bound,
        prefill_token_seconds=5e-5,
        min_gain=0.3,
    )


def _read(pools: Pools, name: str, *, running: int, kv_usage: float, own: int = 0) -> None:
    """A fresh reading of a standard engine stating its cache; `own`: this router's requests it counts."""
    backend = next(b for b in pools["team"].backends if b.name == name)
    reading = EngineLoad(running=running, waiting=0, kv_usage=kv_usage, scraped_at=NOW, own_in_flight=own)
    backend.engine.observe(dataclasses.replace(reading, kv_cache_tokens=CACHE, block_size=16))


def test_a_batch_job_of_short_requests_leaves_room_for_a_long_prompt() -> None:
    """A standard engine running 64 short batch requests, 16 of them sent since its reading: each
    is projected at what it holds (its 316 tokens), and the long turn at its own 29,256. Taking
    every request in flight at the long turn's size projected the engine 108 % full, and the
    policy never sent the turn there (spill:spec-prefill found no room)."""
    pools = _pools({"t1": 128})
    backend = pools["team"].backends[0]
    _read(pools, "t1", running=48, kv_usage=0.02, own=48)
    backend.in_flight = 64
    backend.holding.update({n: BATCH for n in range(64)})
    long_turn = -(-PROMPT // 16) * 16 / CACHE
    # The reading's 48 grow to 320 tokens each at most (they show 0.02 / 48 each, more already).
    expected = 0.02 + 16 * 320 / CACHE + long_turn
    assert _states(pools, PROMPT)["team"].kv_usage == pytest.approx(expected)
    assert backend.overflow(NOW, 5.0, 0.9) == 0


def test_long_requests_in_flight_are_not_taken_at_a_short_ones_size() -> None:
    """The other way round: eight long turns sent since an idle reading hold 11 % of the cache
    each; a short request next is projected past them, not at 8 of its own size."""
    pools = _pools({"t1": 128})
    backend = pools["team"].backends[0]
    _read(pools, "t1", running=0, kv_usage=0.0)
    backend.in_flight = 8
    backend.holding.update({n: 240_000 for n in range(8)})
    projected = _states(pools, BATCH)["team"].kv_usage
    assert projected == pytest.approx((8 * 240_000 + 320) / CACHE)
    assert projected is not None and projected >= 0.9
    # Of those eight, the KV cache holds seven below the threshold: one waits in the engine.
    assert backend.overflow(NOW, 5.0, 0.9) == 1


def test_requests_in_flight_of_unknown_length_are_taken_as_the_engine_shows_them() -> None:
    pools = _pools({"t1": 128})
    backend = pools["team"].backends[0]
    _read(pools, "t1", running=10, kv_usage=0.1)  # 1 % a request, as seen
    backend.in_flight = 4  # sent since, no answer limit: lengths unknown
    assert _states(pools, PROMPT)["team"].kv_usage == pytest.approx(0.1 + 4 * 0.01 + -(-PROMPT // 16) * 16 / CACHE)


@pytest.mark.anyio
async def test_a_cold_prompt_goes_where_its_first_token_comes_soonest() -> None:
    """Two standard backends: t1 is the emptier, but three long prompts sent to it are still
    waiting for their prefill; t2 runs more requests, none waiting for a first token. A cold
    prompt of a conversation (no backend holds any of it) goes to t2, where its first token
    comes sooner; without a conversation, to the emptiest as before."""
    pools = _pools({"t1": 32, "t2": 32})
    t1, t2 = pools["team"].backends
    for name in ("t1", "t2"):
        _read(pools, name, running=0, kv_usage=0.0)
    t1.in_flight, t2.in_flight = 3, 8
    for n in range(3):
        t1.first_tokens.waiting(n, NOW, prefill=1.0)  # 20,000 tokens each at 50 us a token
    cold = Cached(tokens=20_000, held={})
    states = _states(pools, 20_256, cold)
    assert states["team"].prefer == "t2"
    assert states["team"].prefill == pytest.approx(1.0)  # its own prefill, nothing ahead of it
    assert (await pools["team"].acquire("interactive", prefer=states["team"].prefer)).name == "t2"
    assert _states(pools, 20_256)["team"].prefer is None
    assert (await pools["team"].acquire("interactive")).name == "t1"


def test_a_backend_that_has_measured_nothing_does_not_look_the_soonest() -> None:
    """t1 has served first tokens, 0.2 s beyond their prefill each; t2 has just joined the pool
    and runs three requests (a name that resolved to it again, router.backends.discovery). Taken
    at no overhead, t2 looked the soonest for every cold prompt however busy; taken at t1's, the
    two are equal and the emptier takes it."""
    pools = _pools({"t1": 32, "t2": 32})
    t1, t2 = pools["team"].backends
    for name in ("t1", "t2"):
        _read(pools, name, running=0, kv_usage=0.0)
    t1.first_tokens.waiting("earlier", NOW - 5, prefill=0.1)
    t1.first_tokens.arrived("earlier", 0.3)
    t2.in_flight = 3
    states = _states(pools, 256, Cached(tokens=200, held={}))
    assert states["team"].prefer is None  # neither is sooner: the emptiest, t1
    assert states["team"].ttft == pytest.approx(0.2 + 200 * 5e-5)


def test_a_pool_runs_batch_work_where_the_conversation_would_go() -> None:
    """Of two standard backends, t2 holds the conversation's prefix and t1 runs the batch job: the
    pool is said to run batch work for it only once t2 runs some too, and only where its
    conversation is priced (router.routing.policy)."""
    pools = _pools({"t1": 32, "t2": 32})
    t1, t2 = pools["team"].backends
    t1.batch_work.add("batch-1")
    held = Cached(tokens=20_000, held={"t2": 19_000}, home="team")
    assert _states(pools, 20_256, held)["team"].prefer == "t2"
    assert not _states(pools, 20_256, held)["team"].batch
    t2.batch_work.add("batch-2")
    assert _states(pools, 20_256, held)["team"].batch
    assert not _states(pools, 20_256)["team"].batch  # not priced


def test_requests_waiting_for_their_prefill_are_not_a_wait_for_a_slot() -> None:
    """An engine with room of its own shows a request waiting: a long prompt sent before this
    one, being prefilled. Priced, its first token is that prefill queue and its own prefill (it
    was 15-30 s: one request's whole duration per request waiting, in the conversations
    benchmark, for a first token of 3 s); unpriced, as before; and a wait still once the engine
    shows no room."""
    pools = _pools({"t1": 32})
    backend, pool = pools["team"].backends[0], pools["team"]
    pool.mean_duration = 60.0
    backend.engine.observe(EngineLoad(running=3, waiting=1, kv_usage=0.1, scraped_at=NOW, kv_cache_tokens=CACHE))
    backend.in_flight = 4
    backend.first_tokens.waiting("earlier", NOW, prefill=1.0)
    cold = Cached(tokens=20_000, held={})
    assert _states(pools, 20_256, cold)["team"].ttft == pytest.approx(1.0 + 1.0)  # its queue, then its own
    assert _states(pools, 20_256)["team"].ttft == pytest.approx(2 * 60.0 / 4)
    backend.engine.observe(EngineLoad(running=3, waiting=1, kv_usage=0.95, scraped_at=NOW, kv_cache_tokens=CACHE))
    waited = _states(pools, 20_256, cold)["team"].ttft
    assert waited is not None and waited > 30.0


def test_the_backend_holding_the_prefix_is_preferred_within_the_load_bound() -> None:
    """t2 holds 6,400 tokens of the prompt, as much as its engine's free KV still holds: it is
    preferred while it runs at most `load_bound` more requests than the emptiest, and the pool's
    first token and prefill are its own (the queue sent there before, then the rest of the prompt)
    even where t1 would be sooner."""
    pools = _pools({"t1": 32, "t2": 32})
    t2 = pools["team"].backends[1]
    _read(pools, "t1", running=0, kv_usage=0.0)
    _read(pools, "t2", running=0, kv_usage=0.0)
    t2.first_tokens.waiting("earlier", NOW, prefill=1.0)  # sent before it: 1 s of prefill ahead
    t2.in_flight = 2
    cached = Cached(tokens=20_000, held={"t2": 6_400})
    state = _states(pools, 20_256, cached, load_bound=2)["team"]
    assert (state.prefer, state.held) == ("t2", 6_400)
    assert state.prefill == pytest.approx(1.0 + 13_600 * 5e-5)
    assert state.ttft == pytest.approx(1.0 + 13_600 * 5e-5)  # t1's would be 20,000 tokens' alone: 1 s
    t2.in_flight = 3  # one past the bound: t1, the emptiest and the soonest
    state = _states(pools, 20_256, cached, load_bound=2)["team"]
    assert (state.prefer, state.held) == (None, 0)
    assert state.ttft == pytest.approx(1.0)
    # An engine filled by others since has evicted most of it: what its free KV can hold.
    t2.in_flight = 2
    _read(pools, "t2", running=0, kv_usage=1 - 2**-10)  # 2,048 tokens free
    assert _states(pools, 20_256, cached, load_bound=2)["team"].held == 2_048


def test_of_backends_holding_as_much_the_emptier_is_preferred() -> None:
    pools = _pools({"t1": 32, "t2": 32, "t3": 32})
    t1, t2, t3 = pools["team"].backends
    t1.in_flight, t2.in_flight, t3.in_flight = 3, 1, 0
    cached = Cached(tokens=20_000, held={"t1": 640, "t2": 640})
    assert _states(pools, 20_256, cached, load_bound=4)["team"].prefer == "t2"
    # None holds any: where the conversation last went, named by its session.
    cold = Cached(tokens=20_000, held={}, last="t1")
    assert _states(pools, 20_256, cold, load_bound=4)["team"].prefer == "t1"


def test_the_emptiest_backend_is_the_least_loaded_for_its_slots() -> None:
    """t1 runs 2 requests of its 8 slots, t2 4 of its 64: the pool's concurrency is t2's."""
    pools = _pools({"t1": 8, "t2": 64})
    t1, t2 = pools["team"].backends
    t1.in_flight, t2.in_flight = 2, 4
    assert _states(pools, 256)["team"].concurrency == 4


def test_requests_waiting_in_an_engine_are_a_queue_only_on_a_fresh_reading() -> None:
    pools = _pools({"t1": 32})
    backend = pools["team"].backends[0]
    backend.engine.observe(EngineLoad(running=32, waiting=3, queued=3, kv_usage=0.95, scraped_at=NOW))
    assert _states(pools, 256)["team"].engine_queued == 3
    assert _states(pools, 256, now=NOW + 5.1)["team"].engine_queued == 0
