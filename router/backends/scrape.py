"""Reading what the engines say about their own load from their `/metrics` (into
router.backends.engines): vLLM's and SGLang's names, a series per rank summed. The figures read:
docs/architecture.md, "What the engines say"."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
from collections.abc import Callable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from router.backends.backend import Backend
from router.backends.engines import EngineLoad
from router.backends.pools import Pools
from router.clock import Clock
from router.config import Scrape
from router.logs import Unforeseen
from router.transport import Transport, TransportError

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
_DRAFTS = "vllm:spec_decode_num_drafts_total"
_ACCEPT_LENGTH = "sglang:spec_accept_length"
_ACCEPT_RATE = "sglang:spec_accept_rate"
_CACHE_INFO = "vllm:cache_config_info"
_PREFILL_SECONDS = ("vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count")
_PROMPT_TOKENS, _CACHE_HITS = "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total"

# The samples read, and only their lines are parsed: a vLLM page is some 660 lines (55 KB) of
# which a dozen are read, and the whole of it took prometheus_client's parser 8.4 ms a scrape (0.45 ms
# for those lines).
_READ = (*_RUNNING, *_WAITING, *_KV, _ACCEPTED, _DRAFT_TOKENS, _DRAFTS, _ACCEPT_LENGTH, _ACCEPT_RATE, _CACHE_INFO,
         *_PREFILL_SECONDS, _PROMPT_TOKENS, _CACHE_HITS)  # fmt: skip
_READ_NAME = re.compile("(?:" + "|".join(map(re.escape, _READ)) + r")[{ \t]")  # not `<name>_created`
# Past this a float no longer counts in ones: no count, usage or size of an engine gets there.
_LARGEST = 2.0**53
# The most of a page read, each line and all: a vLLM 0.32 page's are 1.7 KB, 1 KB the longest. The
# parser takes up to 0.35 µs a character on the event loop, a line's square past some 100 KB.
_LONGEST_LINE, _MOST_READ = 16 * 1024, 256 * 1024

logger = logging.getLogger("specroute.backends")


def parse(text: str) -> dict[str, list[float]]:
    """The samples the router reads of a Prometheus exposition, by sample name, one value per
    label set. Their lines alone go to the parser: one of them it cannot read fails the scrape, as
    more of them than any engine sends (`_MOST_READ`); what the page holds besides them is not looked at.

    The labels of vLLM's `cache_config_info` (its stated capacity) are kept as the values of
    `vllm:cache_config_info:<label>`, for the ones that are numbers. A value that is not a finite
    number (the exposition format allows `NaN` and `+Inf`) says nothing of a load and is left
    out, as if the engine had not sent it; so is one past 2⁵³ either way (`_LARGEST`), so that
    what is worked out of them (a sum over ranks, a rounding) stays a finite number.
    """
    read, size = [], 0
    for line in text.split("\n"):
        if line.startswith(_READ) and _READ_NAME.match(line):
            size += len(line) + 1
            if len(line) > _LONGEST_LINE or size > _MOST_READ:
                raise ValueError(f"samples read past {_LONGEST_LINE} characters a line or {_MOST_READ} in all")
            read.append(line)
    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families("\n".join(read)):
        for sample in family.samples:
            if abs(sample.value) <= _LARGEST:  # not NaN; an int of any size compares
                samples.setdefault(sample.name, []).append(sample.value)
            if sample.name == _CACHE_INFO:
                for label, value in sample.labels.items():
                    with contextlib.suppress(ValueError):
                        if abs(number := float(value)) <= _LARGEST:
                            samples.setdefault(f"{_CACHE_INFO}:{label}", []).append(number)
    return samples


def _stated_concurrency(values: Mapping[str, list[float]]) -> float | None:
    """Requests the engine's KV cache holds at full length, as the engine states it."""
    stated = values.get(f"{_CACHE_INFO}:kv_cache_max_concurrency")
    if stated:
        return sum(stated)  # one series per data-parallel rank, each with its own cache
    blocks, size = values.get(f"{_CACHE_INFO}:num_gpu_blocks"), values.get(f"{_CACHE_INFO}:block_size")
    length = values.get(f"{_CACHE_INFO}:max_model_len")
    if blocks and size and length and length[0] > 0:
        return _finite(sum(blocks) * size[0] / length[0])
    return None


def _stated_kv_tokens(values: Mapping[str, list[float]]) -> float | None:
    """The size of the engine's KV cache in tokens, as it states it (of one rank: the KV usage read
    is the fullest rank's)."""
    stated = values.get(f"{_CACHE_INFO}:kv_cache_size_tokens")
    if stated:
        return min(stated)
    blocks, size = values.get(f"{_CACHE_INFO}:num_gpu_blocks"), values.get(f"{_CACHE_INFO}:block_size")
    return _finite(min(blocks) * size[0]) if blocks and size else None


def _finite(value: float) -> float | None:
    """A figure worked out of finite ones that overflowed says nothing, as a non-finite one sent."""
    return value if math.isfinite(value) else None


def _first(
    values: Mapping[str, list[float]], names: tuple[str, ...], combine: Callable[[list[float]], float]
) -> float | None:
    return next((combine(values[name]) for name in names if values.get(name)), None)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def engine_load(
    values: Mapping[str, list[float]], previous: Mapping[str, list[float]] | None, now: float
) -> EngineLoad:
    """The load figures from one scrape; speculation rates from the counters' change since `previous`."""
    acceptance = accept_length = draft_tokens = None
    if previous is not None and values.get(_ACCEPTED) and values.get(_DRAFT_TOKENS):

        def delta(name: str) -> float:
            return sum(values.get(name, ())) - sum(previous.get(name, ()))

        drafted, accepted, drafts = delta(_DRAFT_TOKENS), delta(_ACCEPTED), delta(_DRAFTS)
        if drafted > 0:
            acceptance = accepted / drafted
        if drafts > 0:
            accept_length = 1 + accepted / drafts
            draft_tokens = drafted / drafts
    accept_length = _first(values, (_ACCEPT_LENGTH,), _mean) or accept_length
    acceptance = _first(values, (_ACCEPT_RATE,), _mean) or acceptance
    waiting = _first(values, _WAITING, sum)
    before = _first(previous, _WAITING, sum) if previous is not None else None
    prefill = _prefill(values, previous) if previous is not None else None
    return EngineLoad(
        running=_first(values, _RUNNING, sum),
        waiting=waiting,
        queued=min(waiting, before) if waiting is not None and before is not None else None,
        kv_usage=_first(values, _KV, max),
        acceptance=acceptance,
        accept_length=accept_length,
        draft_tokens=draft_tokens,
        max_concurrency=_stated_concurrency(values),
        kv_cache_tokens=_stated_kv_tokens(values),
        block_size=_first(values, (f"{_CACHE_INFO}:block_size",), min),
        model_len=_first(values, (f"{_CACHE_INFO}:max_model_len",), min),
        prefill=prefill,
        scraped_at=now,
    )


def _prefill(values: Mapping[str, list[float]], previous: Mapping[str, list[float]]) -> tuple[float, float] | None:
    """The mean prompt tokens computed (not cached) and mean prefill seconds of the requests that
    finished prefill since the previous scrape; None if none did, or a counter went back."""

    def delta(name: str) -> float:
        return sum(values.get(name, ())) - sum(previous.get(name, ()))

    seconds, count = (delta(name) for name in _PREFILL_SECONDS)
    computed = delta(_PROMPT_TOKENS) - delta(_CACHE_HITS)
    if count < 1 or seconds < 0 or computed <= 0 or not values.get(_PROMPT_TOKENS):
        return None
    return computed / count, seconds / count


class EngineScraper:
    """Reads every backend's `/metrics` each `scrape.interval` into its `EngineView`."""

    def __init__(self, pools: Pools, transport: Transport, *, clock: Clock) -> None:
        self._pools = pools
        self._transport = transport
        self._clock = clock
        self._config = Scrape()
        self._previous: dict[str, dict[str, list[float]]] = {}
        # Requests sent to each backend (Backend.sent) when its last good reading was asked for.
        self._sent: dict[str, int] = {}
        self._unforeseen = Unforeseen(logger)

    def configure(self, config: Scrape) -> None:
        self._config = config

    async def run(self) -> None:
        while True:
            try:
                await self.scrape_all()
            except Exception as exc:  # a bug of ours: never the end of every backend's scrapes
                self._unforeseen.log(exc, "engine scrapes failed")
            await asyncio.sleep(self._config.interval)

    async def scrape_all(self) -> None:
        backends = list(self._pools.backends())
        await asyncio.gather(*(self._scrape(backend) for backend in backends))
        # What is kept of a backend goes with it (discovery's come and go, each its own name).
        names = {backend.name for backend in backends}
        self._previous = {name: values for name, values in self._previous.items() if name in names}
        self._sent = {name: sent for name, sent in self._sent.items() if name in names}
        for pool in self._pools:
            if pool.queued("interactive"):
                pool.wake()  # a reading may show KV room over the cap (router.backends.newcomers)

    async def _scrape(self, backend: Backend) -> None:
        """One backend's scrape. Whatever fails it (an answer unread, or any exception reading or
        folding it in: `Unforeseen`) leaves the last reading, which goes stale; the other
        backends' scrapes go on."""
        sent, running = backend.sent, backend.in_flight  # as the reading is asked for
        try:
            try:
                values = await self._read(backend)
            except (TransportError, TimeoutError, ValueError) as exc:
                self._failed(backend, exc)
                return
            self._fold_in(backend, values, sent=sent, running=running)
        except Exception as exc:
            self._unforeseen.log(exc, "backend %s (pool %s): a scrape failed", backend.name, backend.pool)
            self._failed(backend, exc)

    async def _read(self, backend: Backend) -> dict[str, list[float]]:
        config = self._config
        async with asyncio.timeout(config.timeout):
            status, body = await self._transport.get(
                backend.url + "/metrics", headers=backend.auth_headers, limit=config.max_bytes
            )
        if status != 200:
            raise ValueError(f"/metrics answered {status}")
        return parse(body.decode("utf-8", "replace"))

    def _failed(self, backend: Backend, exc: Exception) -> None:
        """The last load stays, and goes stale."""
        view, now = backend.engine, self._clock.now()
        scraped_at = view.reading.scraped_at
        if not view.stale and scraped_at and not view.reading.fresh(now, self._config.stale_after):
            view.stale = True
            logger.warning(
                "backend %s (pool %s) engine readings stale (no good scrape for %.1f s: %s)",
                backend.name,
                backend.pool,
                now - scraped_at,
                str(exc) or type(exc).__name__,
            )

    def _fold_in(self, backend: Backend, values: dict[str, list[float]], *, sent: int, running: int) -> None:
        view = backend.engine
        # Of the requests running as it was asked for, those sent since the last good reading was.
        before = self._sent.get(backend.name, 0)
        recent = running if before > sent else min(running, sent - before)  # (a new Backend: all)
        load = engine_load(values, self._previous.get(backend.name), self._clock.now())
        counted = view.counted(load, earlier=running - recent, recent=recent)
        view.observe(dataclasses.replace(load, own_in_flight=min(counted, backend.in_flight)))
        self._previous[backend.name] = values
        self._sent[backend.name] = sent
        if view.stale:
            view.stale = False
            logger.info("backend %s (pool %s) engine readings fresh again", backend.name, backend.pool)
