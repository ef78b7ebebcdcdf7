"""Reading engine load from real vLLM-format and SGLang-format exposition text."""

from __future__ import annotations

import asyncio
import json
import math
import ssl
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from router.backends.pools import Pools
from router.backends.scrape import EngineScraper, engine_load, parse
from router.clock import Clock, ManualClock, MonotonicClock
from router.config import Scrape, Settings
from router.sim.profile import load_profile
from router.sim.server import create_sim_app
from router.transport import EngineClient, HeadLimits, Timeouts
from tests.servers import ServerThread
from tests.wait import until, wait_until

# As vLLM's V1 engine writes it (two data-parallel engines), trimmed to the families we read plus
# neighbours that must be ignored.
VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="glm-5.3-flash"} 7.0
vllm:num_requests_running{engine="1",model_name="glm-5.3-flash"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="glm-5.3-flash"} 2.0
vllm:num_requests_waiting{engine="1",model_name="glm-5.3-flash"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="glm-5.3-flash"} 0.62
vllm:kv_cache_usage_perc{engine="1",model_name="glm-5.3-flash"} 0.41
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="glm-5.3-flash"} {drafts}
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="glm-5.3-flash"} {draft_tokens}
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="glm-5.3-flash"} {accepted}
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm-5.3-flash",position="0"} 900.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="glm-5.3-flash"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="glm-5.3-flash"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="glm-5.3-flash"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="glm-5.3-flash"} 4.2
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="glm",tp_rank="0"} 11.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="glm",tp_rank="0"} 9.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="glm",tp_rank="0"} 3.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="glm",tp_rank="0"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="glm",tp_rank="0"} 0.93
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="glm",tp_rank="0"} 0.71
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{dp_rank="0",engine_type="unified",model_name="glm",tp_rank="0"} 2.5
sglang:spec_accept_length{dp_rank="1",engine_type="unified",model_name="glm",tp_rank="0"} 3.5
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding.
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{dp_rank="0",engine_type="unified",model_name="glm",tp_rank="0"} 0.5
sglang:spec_accept_rate{dp_rank="1",engine_type="unified",model_name="glm",tp_rank="0"} 0.7
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{dp_rank="0",engine_type="unified",model_name="glm",tp_rank="0"} 400.0
"""


def _vllm(drafts: int, draft_tokens: int, accepted: int) -> str:
    return (
        VLLM.replace("{drafts}", f"{drafts}.0")
        .replace("{draft_tokens}", f"{draft_tokens}.0")
        .replace("{accepted}", f"{accepted}.0")
    )


def test_vllm_gauges_and_acceptance_over_the_interval() -> None:
    first = parse(_vllm(1000, 3000, 1500))
    load = engine_load(first, None, now=10.0)
    assert (load.running, load.waiting, load.kv_usage) == (12.0, 2.0, 0.62)  # summed; KV: the fuller
    assert load.queued is None  # one scrape cannot tell a queue from a request in passing
    assert load.acceptance is None  # counters need a previous scrape
    second = parse(_vllm(1100, 3300, 1740))
    load = engine_load(second, first, now=11.0)
    assert load.queued == 2.0  # waiting on both scrapes
    assert load.acceptance == pytest.approx(240 / 300)  # the last interval, not the lifetime 0.5
    assert load.accept_length == pytest.approx(1 + 240 / 100)
    assert load.draft_tokens == pytest.approx(3)
    assert load.scraped_at == 11.0


def test_no_speculation_traffic_leaves_acceptance_unknown() -> None:
    same = parse(_vllm(1000, 3000, 1500))
    assert engine_load(same, same, now=1.0).acceptance is None


def test_sglang_names() -> None:
    load = engine_load(parse(SGLANG), None, now=1.0)
    assert (load.running, load.waiting) == (20.0, 4.0)
    assert load.kv_usage == 0.93
    assert load.accept_length == pytest.approx(3.0)
    assert load.acceptance == pytest.approx(0.6)


def test_staleness() -> None:
    load = engine_load(parse(SGLANG), None, now=100.0)
    assert load.fresh(now=104.0, stale_after=5)
    assert not load.fresh(now=106.0, stale_after=5)


def _pools_in_front_of(url: str) -> Pools:
    """One speculative pool, `fast`, of one backend at `url`."""
    settings = Settings(pools={"fast": {"speculative": True, "backends": {"f1": {"url": url}}}})  # type: ignore[dict-item]
    pools = Pools()
    pools.configure(settings.pools, settings.health)
    return pools


def _scraper(pools: Pools, clock: Clock, config: Scrape) -> tuple[EngineClient, EngineScraper]:
    upstream = EngineClient(connections_per_origin=64, tls=ssl.create_default_context())
    scraper = EngineScraper(pools, upstream, clock=clock)
    scraper.configure(config)
    return upstream, scraper


@pytest.mark.e2e
def test_scraper_reads_a_simulated_engine_over_http() -> None:
    fast = load_profile("fast")
    # Slow enough that none of the 30 ends before the last has arrived, on a busy machine too.
    with ServerThread(create_sim_app(fast, time_scale=2)) as engine:
        pools = _pools_in_front_of(engine.url)

        async def scenario() -> None:
            upstream, scraper = _scraper(pools, MonotonicClock(), Scrape(interval=0.05, timeout=1, stale_after=5))
            requests: list[asyncio.Task[Any]] = []
            try:
                await scraper.scrape_all()
                # The engine states its capacity before any load: 2,097,152 tokens of KV cache, each
                # request of max_model_len (131,072) reserving the profile's overhead (86,933) besides.
                assert pools["fast"].backends[0].engine.stated_concurrency == pytest.approx(9.62, abs=0.01)
                # So a request of 522 tokens at its end takes those and the overhead, in blocks of 16.
                share = pools["fast"].backends[0].engine.kv_per_request(64, tokens=522)
                assert share == pytest.approx(math.ceil((522 + 86933) / 16) * 16 / 2097152, rel=1e-4)
                body = json.dumps(
                    {"model": fast.model, "prompt": "def f(x):\n    return x", "max_tokens": 512, "ignore_eos": True}
                ).encode()
                requests = [
                    asyncio.create_task(
                        upstream.request(
                            engine.url,
                            "/v1/completions",
                            headers=[],
                            body=body,
                            timeouts=Timeouts(connect=1, read=5, idle=5),
                            limits=HeadLimits(head_bytes=65536, headers=100),
                        )
                    )
                    for _ in range(30)
                ]
                backend = pools["fast"].backends[0]
                showing_all = 0

                async def all_there_on_two_scrapes() -> bool:
                    # Queued is waiting on two scrapes running, and acceptance is over the interval
                    # between two: both need two readings taken after all 30 arrived, half a second
                    # (a simulated second, dozens of steps) apart.
                    nonlocal showing_all
                    await scraper.scrape_all()
                    load = backend.engine.reading  # each scrape makes a new reading
                    showing_all = showing_all + 1 if (load.running or 0) + (load.waiting or 0) == 30 else 0
                    return showing_all >= 2 and load.acceptance is not None

                await until(all_there_on_two_scrapes, interval=0.5, timeout=30, message="two readings of all 30")
                load = backend.engine.reading
                assert load.queued == 7
                assert load.running == 23 and load.waiting == 7  # the fast profile's KV limit
                assert load.kv_usage is not None and load.kv_usage > 0.9
                assert load.acceptance is not None and 0.5 < load.acceptance <= 1  # code is guessed well
            finally:
                for task in requests:
                    task.cancel()
                await asyncio.gather(*requests, return_exceptions=True)
                await upstream.aclose()

        asyncio.run(scenario())


@pytest.mark.e2e  # an engine served on loopback
def test_a_request_sent_while_a_scrape_is_out_counts_on_top_of_its_reading() -> None:
    """Pass: the reading was taken before the request reached the engine, so the router's view is
    the reading plus that request (counting it as included would let one too many through)."""
    asked, answer = threading.Event(), threading.Event()

    async def metrics(request: Request) -> PlainTextResponse:
        asked.set()
        await asyncio.to_thread(answer.wait, 5)
        running = 'vllm:num_requests_running{model_name="m"} 3.0\n'
        return PlainTextResponse("# TYPE vllm:num_requests_running gauge\n" + running)

    with ServerThread(Starlette(routes=[Route("/metrics", metrics)])) as engine:
        pools = _pools_in_front_of(engine.url)
        pool = pools["fast"]
        clock = ManualClock()

        async def scenario() -> int:
            upstream, scraper = _scraper(pools, clock, Scrape(interval=1, timeout=5, stale_after=5))
            try:
                scrape = asyncio.create_task(scraper.scrape_all())
                await asyncio.to_thread(asked.wait, 5)
                backend = await pool.acquire("interactive")  # sent while the engine renders its reading
                answer.set()
                await scrape
            finally:
                await upstream.aclose()
            return backend.concurrency(clock.now(), stale_after=5)

        assert asyncio.run(scenario()) == 4


@pytest.mark.e2e  # an engine served on loopback
def test_a_request_the_engine_has_not_counted_yet_is_not_taken_as_counted() -> None:
    """Pass: a request sent just before a scrape, that the engine's reading does not count yet
    (it answers the scrape on another connection), still counts on top of the reading, while a
    request the reading does count is not counted twice. Taken as counted, it let one request
    too many onto the speculative engine when two routers shared it."""
    reported = {"running": 3}  # another router's three

    async def metrics(request: Request) -> PlainTextResponse:
        running = f'vllm:num_requests_running{{model_name="m"}} {reported["running"]}\n'
        return PlainTextResponse("# TYPE vllm:num_requests_running gauge\n" + running)

    with ServerThread(Starlette(routes=[Route("/metrics", metrics)])) as engine:
        pools = _pools_in_front_of(engine.url)
        pool = pools["fast"]
        clock = ManualClock()

        async def scenario() -> list[int]:
            upstream, scraper = _scraper(pools, clock, Scrape(interval=1, timeout=5, stale_after=5))
            seen = []

            async def scrape(running: int) -> None:
                reported["running"] = running
                await scraper.scrape_all()
                seen.append(backend.concurrency(clock.now(), stale_after=5))

            try:
                await scraper.scrape_all()
                backend = await pool.acquire("interactive")
                await scrape(3)  # the engine has not read it yet
                await scrape(4)  # now it has
                await scrape(4)  # and still has: sent before the reading before
                await scrape(2)  # the other router's load fell to one
                await pool.acquire("interactive")
                await scrape(2)  # not read yet, and the others' load did not change
            finally:
                await upstream.aclose()
            return seen

        assert asyncio.run(scenario()) == [4, 4, 4, 2, 3]


@pytest.mark.e2e  # an engine served on loopback
def test_an_engine_reporting_nan_or_infinity_leaves_the_router_counting_its_own() -> None:
    """Pass: `NaN` and `+Inf` (valid in the exposition format) are no reading. Read as numbers,
    they made working out the engine's load raise on every request sent to it, and stopped the
    scrapes of every engine."""
    reported = {"running": "NaN", "kv": "+Inf", "capacity": "NaN"}

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {reported["running"]}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {reported["kv"]}\n'
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{kv_cache_max_concurrency="{reported["capacity"]}"}} 1.0\n'
        )

    with ServerThread(Starlette(routes=[Route("/metrics", metrics)])) as engine:
        pools = _pools_in_front_of(engine.url)
        pool = pools["fast"]
        clock = ManualClock()

        async def scenario() -> tuple[int, float | None, float | None, int, float | None]:
            upstream, scraper = _scraper(pools, clock, Scrape(interval=1, timeout=5, stale_after=5))
            try:
                backend = await pool.acquire("interactive")
                await scraper.scrape_all()
                view = backend.engine
                hostile = (
                    backend.concurrency(clock.now(), stale_after=5),
                    view.reading.kv_usage,
                    view.stated_concurrency,
                )
                reported.update(running="3", kv="0.5", capacity="8")
                await scraper.scrape_all()  # the scrapes go on
                return *hostile, backend.concurrency(clock.now(), stale_after=5), view.stated_concurrency
            finally:
                await upstream.aclose()

        concurrency, kv, capacity, later, stated = asyncio.run(scenario())
    assert (concurrency, kv, capacity) == (1, None, None)  # the router's own request, nothing else
    assert (later, stated) == (3, 8.0)


# vLLM 0.32.0 (CPU build), `--kv-cache-memory-bytes 8M`, as its /metrics wrote it (labels trimmed).
VLLM_CACHE_CONFIG = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.92",kv_cache_max_concurrency="2.0",kv_cache_memory_bytes="8388608",\
kv_cache_size_tokens="4096",num_cpu_blocks="None",num_gpu_blocks="32",sliding_window="None"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_the_capacity_an_engine_states_is_read_from_cache_config_info() -> None:
    load = engine_load(parse(VLLM_CACHE_CONFIG), None, now=1.0)
    assert load.max_concurrency == 2.0
    # Without the stated concurrency: blocks x block size over the longest request.
    without = VLLM_CACHE_CONFIG.replace('kv_cache_max_concurrency="2.0",', 'max_model_len="2048",')
    assert engine_load(parse(without), None, now=1.0).max_concurrency == 2.0
    assert engine_load(parse(_vllm(1, 1, 1)), None, now=1.0).max_concurrency is None
    assert engine_load(parse(SGLANG), None, now=1.0).max_concurrency is None  # SGLang states none


def _socket_buffers() -> int:
    """The most the kernel buffers on a TCP connection, both ends: what an engine may have
    written past what the router read."""
    return sum(int(Path(f"/proc/sys/net/ipv4/tcp_{side}").read_text().split()[2]) for side in ("wmem", "rmem"))


@pytest.mark.e2e  # an engine served on loopback
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "endless"])
def test_a_page_past_scrape_max_bytes_fails_the_scrape_read_no_further(declared: bool) -> None:
    """Pass: a page over `scrape.max_bytes` (4 MiB) is a failed scrape: refused on its declared
    length before a byte of it is read, or read no further than the limit when it never ends.
    Read up to the 64 MiB of any GET before, a page of lines the scrape does not read cost 0.25 s
    of the event loop each scrape to decode and split."""
    limit, padding = Scrape().max_bytes, b"# " + b"x" * 61 + b"\n"
    page = {"running": 3, "size": 0}  # size: the page's bytes before its last line (0: no padding)
    streamed = {"bytes": 0, "ended": False}

    def good(running: int) -> bytes:
        return b"vllm:num_requests_running %d\n" % running

    async def endless(request: Request) -> AsyncIterator[bytes]:
        while not await request.is_disconnected():
            streamed["bytes"] += len(padding) * 1024
            yield padding * 1024
        streamed["ended"] = True

    async def metrics(request: Request) -> Response:
        if not page["size"]:
            return Response(good(page["running"]))
        if not declared:
            return StreamingResponse(endless(request))
        return Response(padding * (page["size"] // len(padding)) + good(page["running"]))

    with ServerThread(Starlette(routes=[Route("/metrics", metrics)])) as engine:
        pools = _pools_in_front_of(engine.url)
        clock = ManualClock()
        view = pools["fast"].backends[0].engine

        async def scenario() -> None:
            upstream, scraper = _scraper(pools, clock, Scrape(interval=1, timeout=30, stale_after=5))
            try:
                await scraper.scrape_all()
                assert view.reading.running == 3
                if declared:  # a page of the limit is read
                    page.update(running=4, size=limit - 64)
                    await scraper.scrape_all()
                    assert view.reading.running == 4 and len(padding * (page["size"] // 64) + good(4)) <= limit
                page.update(running=5, size=limit + 64)
                clock.advance(6)
                await scraper.scrape_all()
                assert view.stale and view.reading.running == (4 if declared else 3)  # failed: stale
                page.update(running=6, size=0)
                await scraper.scrape_all()
                assert not view.stale and view.reading.running == 6
            finally:
                await upstream.aclose()

        asyncio.run(scenario())
        if not declared:
            wait_until(lambda: streamed["ended"], message="the endless page's connection closed")
            assert limit < streamed["bytes"] <= limit + _socket_buffers() + 1024 * 1024
