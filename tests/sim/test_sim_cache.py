"""The simulated engine's prefix cache: vLLM's chained block hashes, LRU eviction under KV
pressure, and prefill charged for the uncached part of a prompt only."""

from __future__ import annotations

import pytest

from router.prompts import chat_prompt_tokens, count_tokens
from router.sim.cache import PrefixCache, block_hashes, chat_tokens, tail, text_tokens
from router.sim.engine import Engine, SimRequest
from router.sim.profile import Profile, load_profile

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "extraordinarily", "patient", "herons")


@pytest.fixture(scope="module")
def fast() -> Profile:
    return load_profile("fast")


@pytest.fixture(scope="module")
def team() -> Profile:
    return load_profile("team")


def _tokens(n: int, salt: str = "") -> list[str]:
    return [f"{salt}{WORDS[i % len(WORDS)]}{i}" for i in range(n)]


def _run(engine: Engine, request: SimRequest) -> float:
    """Steps until the request's first token; the time it took."""
    while request.first_token_at is None:
        engine.step()
    return request.first_token_at - request.arrival


def _finish(engine: Engine) -> None:
    while engine.busy:
        engine.step()


def test_token_counts_match_the_prompt_counter() -> None:
    text = "Refactor this: extraordinarily long identifiers, and (symbols)! 42 times."
    assert len(text_tokens(text)) == count_tokens(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert len(chat_tokens(messages)) == chat_prompt_tokens([m["content"] for m in messages])


def test_block_hashes_chain_so_a_block_matches_only_after_the_same_prefix() -> None:
    a = block_hashes(_tokens(64), 16)
    assert len(block_hashes(_tokens(63), 16)) == 3  # a partial block is not hashed
    changed = _tokens(64)
    changed[3] = "different"
    b = block_hashes(changed, 16)
    assert len(a) == len(b) == 4
    # Blocks 1-3 hold the same tokens, but their prefix differs: no block matches.
    assert not set(a) & set(b)
    assert block_hashes(_tokens(64), 16) == a


def test_lookup_leaves_the_last_token_to_compute_and_stops_at_the_first_miss() -> None:
    cache = PrefixCache(16)
    blocks = block_hashes(_tokens(64), 16)
    cache.hold(blocks)
    assert cache.hit_blocks(blocks, 64) == 3  # 63 tokens at most: three whole blocks
    assert cache.hit_blocks(blocks, 65) == 4
    assert cache.hit_blocks((blocks[0], b"x" * 16, blocks[2]), 64) == 1


def test_eviction_is_lru_and_a_freed_request_loses_its_tail_first() -> None:
    cache = PrefixCache(16)
    old, new = block_hashes(_tokens(48, "o"), 16), block_hashes(_tokens(48, "n"), 16)
    cache.hold(old)
    cache.hold(new)
    cache.release(old)
    cache.release(new)
    assert cache.free_tokens == 96
    assert cache.fit(64) == 2  # the two oldest: old's tail, then its middle block
    assert cache.hit_blocks(old, 49) == 1 and cache.hit_blocks(new, 49) == 3
    cache.hold(new)  # held blocks are never evicted
    assert cache.fit(0) == 1 and cache.hit_blocks(new, 49) == 3
    assert len(cache) == 3


def test_a_second_turn_prefills_only_what_the_cache_lacks(team: Profile) -> None:
    engine = Engine(team)
    history = _tokens(20_000)
    first = engine.add("t1", prompt_tokens=len(history), max_tokens=8, kind="prose",
                       blocks=block_hashes(history, team.block_size))  # fmt: skip
    cold = _run(engine, first)
    _finish(engine)
    turn = history + _tokens(300, "next")
    second = engine.add("t2", prompt_tokens=len(turn), max_tokens=8, kind="prose",
                        blocks=block_hashes(turn, team.block_size))  # fmt: skip
    warm = _run(engine, second)
    assert second.cached == 20_000 - 20_000 % team.block_size
    assert engine.counters.prefix_queries == len(history) + len(turn)
    assert engine.counters.prefix_hits == second.cached
    assert engine.counters.prompt_tokens == len(history) + len(turn)  # vLLM counts cached tokens too
    assert warm < cold / 5, (cold, warm)


def _turn(engine: Engine, name: str, prompt: list[str], answer: list[str]) -> SimRequest:
    """A request whose prompt is `prompt` and whose answer, one piece a token, is `answer`."""
    size = engine.profile.block_size
    request = engine.add(name, prompt_tokens=len(prompt), max_tokens=len(answer), kind="prose", ignore_eos=True,
                         blocks=block_hashes(prompt, size), tail=tail(prompt, size))  # fmt: skip
    request.text = iter(answer)
    return request


# An answer as the engine streams it: pieces, each one token; sent back, the text is tokenized.
ANSWER = [" herons", " wade.", "\n\n", "Patient", " herons"] * 20  # 100 pieces: 100 tokens of text


def _next_turn(prompt: list[str], answer: list[str]) -> list[str]:
    return [*prompt, *text_tokens("".join(answer)), *_tokens(40, "next")]


def test_the_answer_s_blocks_are_cached_for_the_next_turn(team: Profile) -> None:
    engine = Engine(team)
    prompt = _tokens(1_000)
    first = _turn(engine, "t1", prompt, ANSWER)
    _finish(engine)
    assert first.said == ANSWER
    # The next turn sends the answer back: its blocks hit, all but the one holding the answer's
    # last token (never computed: the request ended when it was sampled) and what follows.
    second = _turn(engine, "t2", _next_turn(prompt, ANSWER), ["."])
    _run(engine, second)
    assert second.cached == (1_000 + 100 - 1) // 16 * 16 == 1_088
    assert engine.counters.prefix_hits == second.cached


def test_an_answer_s_tail_block_is_evicted_before_its_prompt(team: Profile) -> None:
    engine = Engine(team)
    prompt = _tokens(1_000)
    _turn(engine, "t1", prompt, ANSWER)
    _finish(engine)
    assert engine.cache is not None
    engine.cache.fit(engine.cache.free_tokens - 16)  # one block goes: the answer's last
    second = _turn(engine, "t2", _next_turn(prompt, ANSWER), ["."])
    _run(engine, second)
    assert second.cached == 1_088 - 16


def test_an_answer_that_is_not_sent_back_is_not_a_hit(team: Profile) -> None:
    engine = Engine(team)
    prompt = _tokens(1_000)
    _turn(engine, "t1", prompt, ANSWER)
    _finish(engine)
    second = _turn(engine, "t2", _next_turn(prompt, [" other"] * 100), ["."])
    _run(engine, second)
    assert second.cached == 992  # the prompt's whole blocks only


def test_kv_pressure_evicts_the_cache(fast: Profile) -> None:
    engine = Engine(fast)
    history = _tokens(20_000)
    blocks = block_hashes(history, fast.block_size)
    engine.add("t1", prompt_tokens=len(history), max_tokens=8, kind="prose", blocks=blocks)
    _finish(engine)
    assert engine.cache is not None and engine.cache.free_tokens > 19_900
    # A batch job fills the speculative engine's KV: the idle conversation's blocks go.
    for i in range(23):
        engine.add(f"b{i}", prompt_tokens=2_000, max_tokens=2_000, kind="prose", ignore_eos=True)
    engine.step()
    assert engine.cache.free_tokens <= fast.kv_cache_tokens - engine.reserved < 6_000
    _finish(engine)
    again = engine.add("t2", prompt_tokens=len(history) + 10, max_tokens=8, kind="prose", blocks=blocks)
    _finish(engine)
    assert again.cached < len(history) // 2


def test_without_prefix_caching_nothing_is_cached(team: Profile) -> None:
    engine = Engine(team.model_copy(update={"prefix_caching": False}))
    blocks = block_hashes(_tokens(256), team.block_size)
    for name in ("a", "b"):
        engine.add(name, prompt_tokens=256, max_tokens=4, kind="prose", blocks=blocks)
        _finish(engine)
    assert engine.counters.prefix_hits == 0 and engine.cache is None


def test_the_shipped_profiles_cache_prefixes() -> None:
    for name in ("fast", "team"):
        assert load_profile(name).prefix_caching
