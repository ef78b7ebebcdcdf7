"""Conversations: the estimated prefix index (bounded), and the policy for a long conversation."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest

from router.backends.backend import FirstTokens
from router.backends.engines import EngineLoad, EngineView, PrefillRate
from router.config import Conversations, Routing
from router.content import request_text
from router.routing.classify import Classification
from router.routing.conversations import ConversationIndex, Prompt
from router.routing.learn import Estimate
from router.routing.policy import Decision, Policy, PoolState

INTERACTIVE = Classification("interactive", "default")
HISTORY = " ".join(f"turn {i}: the harbour fog lifted over the quay and the boats went out." for i in range(200))


def _chat(*texts: str, model: str = "glm") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": t} for t in texts]}


def _prompt(index: ConversationIndex, *texts: str, headers: dict[str, str] | None = None, **kw: Any) -> Prompt:
    payload = _chat(*texts, **kw)
    prompt = index.prompt(payload, headers or {}, client="c1", text=request_text(payload))
    assert prompt is not None
    return prompt


def test_a_later_turn_finds_its_prefix_where_the_earlier_went() -> None:
    index = ConversationIndex()
    first = _prompt(index, HISTORY)
    assert index.held(first, 0.0) == {}
    index.placed(first, backend="fast-1", pool="fast", now=0.0)
    later = _prompt(index, HISTORY, "And what did the harbour master say?")
    held = index.held(later, 1.0)
    assert set(held) == {"fast-1"}
    assert held["fast-1"] == len(HISTORY) // 256 * 64  # whole blocks of its first message
    assert later.key == first.key  # the same conversation, named by its leading text
    # Another model, or a changed beginning, shares nothing.
    assert index.held(_prompt(index, HISTORY, model="other"), 1.0) == {}
    assert index.held(_prompt(index, "Hi. " + HISTORY), 1.0) == {}


def test_a_block_counts_only_after_the_same_prefix_and_within_the_age() -> None:
    index = ConversationIndex(Conversations(max_age=10))
    prompt = _prompt(index, HISTORY)
    index.placed(prompt, backend="a", pool="p", now=0.0)
    index.placed(_prompt(index, HISTORY[:1000]), backend="b", pool="p", now=5.0)
    held = index.held(prompt, 9.0)
    assert held["b"] == 1000 // 256 * 64 < held["a"]
    assert index.held(prompt, 14.0) == {"b": held["b"]}  # a's placement is too old now
    assert index.held(prompt, 16.0) == {}


def test_the_session_header_names_the_conversation_per_client_and_model() -> None:
    index = ConversationIndex()
    headers = {"x-session-id": "s1"}
    one, two = _prompt(index, "first", headers=headers), _prompt(index, "a different text", headers=headers)
    assert one.key == two.key
    other_client = index.prompt(_chat("first"), headers, client="c2", text="first")
    assert other_client is not None and other_client.key != one.key
    assert _prompt(index, "first", headers=headers, model="m2").key != one.key


def test_only_a_session_keeps_a_short_prompt_to_its_last_backend() -> None:
    index = ConversationIndex()
    session = {"x-session-id": "s1"}
    named, bare = _prompt(index, "hi", headers=session), _prompt(index, "hi")
    for prompt in (named, bare):
        index.placed(prompt, backend="fast-1", pool="fast", now=0.0)
    assert index.cached(named, 1.0).last == "fast-1"
    # The same short text without a session holds no block anywhere: no reason to keep to fast-1.
    assert index.cached(bare, 1.0).last is None and index.cached(bare, 1.0).held == {}


def test_a_move_between_pools_is_remembered_and_settles() -> None:
    index = ConversationIndex(Conversations(settle_seconds=60))
    prompt = _prompt(index, HISTORY)
    index.placed(prompt, backend="fast-1", pool="fast", now=0.0)
    assert index.cached(prompt, 1.0).home == "fast" and not index.cached(prompt, 1.0).settled
    index.placed(prompt, backend="team-1", pool="team", now=100.0)
    assert index.cached(prompt, 101.0).settled and index.cached(prompt, 101.0).home == "team"
    assert not index.cached(prompt, 161.0).settled


def test_a_flood_of_distinct_prompts_and_sessions_stays_within_the_caps() -> None:
    """Hostile: a client sending distinct prompts and session ids without end."""
    index = ConversationIndex(Conversations(max_entries=5_000, max_conversations=500))
    tracemalloc.start()
    try:
        for i in range(3_000):
            text = f"{i} " + HISTORY[:3000]
            prompt = index.prompt(_chat(text), {"x-session-id": f"s{i}"}, client="c", text=text)
            assert prompt is not None
            index.placed(prompt, backend="fast-1", pool="fast", now=float(i))
            if i == 1_000:
                settled, _ = tracemalloc.get_traced_memory()
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index) == 5_000 + 500
    assert grown < settled * 1.2, (settled, grown)  # turned over, not grown
    # The newest are kept; the first are gone.
    assert prompt is not None
    assert index.held(prompt, 3_000.0) == {"fast-1": len(HISTORY[:3000]) // 256 * 64}


def test_a_prompt_past_max_blocks_hashes_only_its_beginning() -> None:
    index = ConversationIndex(Conversations(max_blocks=4))
    assert len(_prompt(index, HISTORY).blocks) == 4
    assert _prompt(index, HISTORY).tokens == -(-len(HISTORY) // 4)


def _decide(fast: PoolState, team: PoolState, **conversations: Any) -> Decision:
    policy = Policy(
        Routing(ttft_target=3.0, mode="adaptive"),
        interactive_pool="fast",
        batch_pool="team",
        conversations=Conversations(**conversations),
    )
    return policy.decide(INTERACTIVE, "prose", {"fast": fast, "team": team})


LONG = 20_000
FAST, SLOW = Estimate(40.0, 36.0, 44.0), Estimate(8.0, 7.0, 9.0)  # per-user tok/s, with their 95 % interval


@pytest.mark.parametrize(
    ("fast", "team", "pool", "reason"),
    [
        # Home on the speculative pool, queueing there but its first token within the target: stays.
        (PoolState(True, engine_queued=2, home=True, held=LONG, ttft=2.0), PoolState(False, ttft=5.5), "fast",
         "default"),
        # Past the target at home, and the standard pool (full prefill priced) no 30 % sooner: stays.
        (PoolState(True, engine_queued=2, home=True, held=LONG, ttft=6.0), PoolState(False, ttft=5.5), "fast",
         "default"),
        # ...but much sooner there: moves.
        (PoolState(True, engine_queued=9, home=True, held=LONG, ttft=30.0), PoolState(False, ttft=5.5), "team",
         "conversation:moved"),
        # Having just moved to the standard pool it stays there, even with the speculative pool free.
        (PoolState(True, ttft=0.2), PoolState(False, home=True, settled=True, held=LONG, ttft=9.0), "team",
         "conversation:cached"),
        # Settled or not, it stays where its cache is while its first token there is in time.
        (PoolState(True, ttft=0.2), PoolState(False, home=True, held=LONG, ttft=0.5), "team",
         "conversation:cached"),
        # A short conversation is decided as any request: the speculative pool queues, it spills.
        (PoolState(True, engine_queued=2, home=True, held=500, ttft=6.0), PoolState(False, ttft=5.5), "team",
         "spill:spec-queueing"),
        # On the standard pool, not settled there, which a batch job made the slower place: back
        # to the speculative pool, its whole prefill there within the target...
        (PoolState(True, ttft=1.5, speed={"prose": FAST}), PoolState(False, home=True, held=LONG, ttft=0.5,
         concurrency=64, speed={"prose": SLOW}), "fast", "conversation:moved"),
        # ...not having just moved there...
        (PoolState(True, ttft=1.5, speed={"prose": FAST}), PoolState(False, home=True, settled=True, held=LONG,
         ttft=0.5, speed={"prose": SLOW}), "team", "conversation:cached"),
        # ...nor to a first token there past the target, or a speculative pool that queues,
        (PoolState(True, ttft=3.5, speed={"prose": FAST}), PoolState(False, home=True, held=LONG, ttft=0.5,
         speed={"prose": SLOW}), "team", "conversation:cached"),
        (PoolState(True, ttft=1.5, engine_queued=2, speed={"prose": FAST}), PoolState(False, home=True, held=LONG,
         ttft=0.5, speed={"prose": SLOW}), "team", "conversation:cached"),
        # ...nor while the standard pool is as fast (within the noise).
        (PoolState(True, ttft=1.5, speed={"prose": FAST}), PoolState(False, home=True, held=LONG, ttft=0.5,
         speed={"prose": FAST}), "team", "conversation:cached"),
        # The standard engine holding it runs batch work: back, learned speeds or not, within the
        # target; once (having moved, it is settled)...
        (PoolState(True, ttft=1.5), PoolState(False, home=True, held=LONG, ttft=0.5, batch=True), "fast",
         "conversation:moved"),
        (PoolState(True, ttft=1.5), PoolState(False, home=True, settled=True, held=LONG, ttft=0.5, batch=True),
         "team", "conversation:cached"),
        # ...not to a first token past the target.
        (PoolState(True, ttft=3.5), PoolState(False, home=True, held=LONG, ttft=0.5, batch=True), "team",
         "conversation:cached"),
        # The home pool down: the other, whatever the settling.
        (PoolState(True, ttft=0.2), PoolState(False, healthy=False, home=True, settled=True, held=LONG), "fast",
         "default"),
    ],
)  # fmt: skip
def test_a_long_conversation_stays_where_its_cache_is(fast: PoolState, team: PoolState, pool: str, reason: str) -> None:
    decision = _decide(fast, team)
    assert (decision.pool, decision.reason) == (pool, reason)


def test_an_engine_holds_no_more_of_a_prefix_than_its_free_kv() -> None:
    view = EngineView()
    assert view.free_tokens(10.0, 5.0) is None  # nothing read yet: what was sent is taken as held
    view.observe(EngineLoad(running=3, kv_usage=0.25, kv_cache_tokens=4096, scraped_at=9.0))
    assert view.free_tokens(10.0, 5.0) == 3072
    view.observe(EngineLoad(running=16, kv_usage=1.0, kv_cache_tokens=4096, scraped_at=10.0))
    assert view.free_tokens(10.0, 5.0) == 0  # filled by others: its idle prompts are evicted
    assert view.free_tokens(20.0, 5.0) is None  # a stale reading says nothing


def test_the_prefill_rate_is_the_slope_not_the_mean() -> None:
    rate = PrefillRate()
    for tokens in (100, 400, 1600, 100, 400, 1600):
        rate.observe(tokens, 0.02 + 5e-5 * tokens)  # 20 ms a request, 50 us a token
    assert rate.seconds_per_token == pytest.approx(5e-5)
    same = PrefillRate()
    for _ in range(8):
        same.observe(500, 0.045)
    assert same.seconds_per_token is None  # no spread to fit a slope on


def test_prompts_sent_to_one_engine_queue_for_their_prefill() -> None:
    """An engine prefills the prompts it was sent one after another: the next one's first token
    comes after what is left of the queue, and a first token's time beyond its predicted prefill
    is the overhead counted for the next."""
    tokens = FirstTokens()
    assert tokens.predicted(0.0, 1.0) == 1.0  # nothing sent: its own prefill
    tokens.waiting("a", 0.0, prefill=1.2)
    tokens.waiting("b", 0.5, prefill=1.2)
    assert tokens.predicted(0.5, 1.0) == pytest.approx(1.9 + 1.0)  # a's 0.7 s left, b's 1.2, its own
    assert tokens.predicted(1.0, 1.0) == pytest.approx(1.4 + 1.0)  # drained as time passes
    assert tokens.predicted(1.5, 1.0) == pytest.approx(0.9 + 0.3 + 1.0)  # ...but a is 0.3 s late
    tokens.arrived("a", 1.5)  # 0.3 s beyond its predicted prefill
    assert tokens.predicted(2.0, 1.0) == pytest.approx(0.3 + 0.4 + 1.0)
    # b is past its predicted first token by more than the overhead: the engine runs late.
    assert tokens.predicted(4.0, 1.0) == pytest.approx(0.3 + (4.0 - 2.4 - 0.3) + 1.0)
    tokens.forget("b")
    assert tokens.predicted(4.0, 0.0) == pytest.approx(0.3)


def test_the_overhead_is_the_least_of_the_last_eight_first_tokens() -> None:
    """One fast first token does not make the engine look fast for ever: eight slower ones later,
    the least of those eight is its overhead."""
    tokens = FirstTokens()
    assert tokens.overhead is None
    for n, beyond in enumerate([0.1, 0.5, 0.4, 0.6, 0.7, 0.5, 0.8, 0.9, 0.6]):
        tokens.waiting(n, float(n))
        tokens.arrived(n, beyond)
        assert tokens.overhead == (0.1 if n < 8 else 0.4)


@pytest.mark.parametrize(
    ("fast", "team", "pool", "reason"),
    [
        # The prompts queued for their prefill (and its own) make the first token late: spill.
        (PoolState(True, ttft=4.0, prefill=2.5), PoolState(False, ttft=1.5), "team", "spill:spec-prefill"),
        # Late for another reason than the prefill queue: decided as before.
        (PoolState(True, ttft=4.0, prefill=0.5), PoolState(False, ttft=1.5), "fast", "default"),
        # The standard pool's first token no sooner, or past the target itself: stay.
        (PoolState(True, ttft=3.2, prefill=2.5), PoolState(False, ttft=3.2), "fast", "default"),
        (PoolState(True, ttft=6.0, prefill=5.0), PoolState(False, ttft=4.0), "fast", "default"),
        # Within the target where it is: stay.
        (PoolState(True, ttft=2.5, prefill=2.0), PoolState(False, ttft=0.5), "fast", "default"),
        # A standard engine running batch work: only for a first token `min_gain` (30 %) sooner.
        (PoolState(True, ttft=4.0, prefill=2.5), PoolState(False, ttft=3.0, batch=True), "fast", "default"),
        (PoolState(True, ttft=4.0, prefill=2.5), PoolState(False, ttft=2.7, batch=True), "team",
         "spill:spec-prefill"),
    ],
)  # fmt: skip
def test_a_prompt_late_for_the_prefill_queued_goes_where_its_first_token_comes_sooner(
    fast: PoolState, team: PoolState, pool: str, reason: str
) -> None:
    decision = _decide(fast, team)
    assert (decision.pool, decision.reason) == (pool, reason)
