"""What an engine says about itself during a sweep's round, read from its vLLM `/metrics`.

`sim fit` needs what the client cannot see: how many requests the engine ran at once before the
rest waited, the KV cache it states, and how many of its guesses it accepted. A target that is
not an engine (a router, a peer's gateway) has no such metrics: the round then has no `engine`
figures and the fit works from the client's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True)
class EngineRound:
    """One round as the engine saw it: peaks over the round and the speculation counters' change."""

    kv_cache_tokens: int | None = None
    peak_running: int = 0
    peak_waiting: int = 0
    peak_kv_usage: float = 0.0
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    readings: int = 0
    _first: dict[str, float] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("_first")
        return data

    def read(self, text: str) -> None:
        counters: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                if name == "vllm:num_requests_running":
                    self.peak_running = max(self.peak_running, int(sample.value))
                elif name == "vllm:num_requests_waiting":
                    self.peak_waiting = max(self.peak_waiting, int(sample.value))
                elif name == "vllm:kv_cache_usage_perc":
                    self.peak_kv_usage = max(self.peak_kv_usage, float(sample.value))
                elif name == "vllm:cache_config_info":
                    self.kv_cache_tokens = _stated_tokens(sample.labels) or self.kv_cache_tokens
                elif name in _COUNTERS:
                    counters[name] = counters.get(name, 0.0) + float(sample.value)
        self.readings += 1
        if not self._first:
            self._first = counters
            return
        for name, value in counters.items():
            setattr(self, _COUNTERS[name], value - self._first.get(name, 0.0))


_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def _stated_tokens(labels: dict[str, str]) -> int | None:
    try:
        if "kv_cache_size_tokens" in labels:
            return int(float(labels["kv_cache_size_tokens"]))
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return None


class EngineWatch:
    """Reads `<origin>/metrics` every `interval` seconds (wall clock) while a round runs."""

    def __init__(self, base_url: str, *, interval: float = 0.5) -> None:
        self._url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
        self._interval = interval
        self.available = True  # until a reading fails: then the target is no engine and is not asked again

    async def watch(self, session: aiohttp.ClientSession, round_: EngineRound, stop: asyncio.Event) -> None:
        while self.available:
            await self._read(session, round_)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
            if stop.is_set():
                await self._read(session, round_)  # the counters at the round's end
                return

    async def _read(self, session: aiohttp.ClientSession, round_: EngineRound) -> None:
        try:
            async with session.get(self._url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                text = await response.text() if response.status == 200 else ""
            if "vllm:" not in text:
                self.available = False
                return
            round_.read(text)
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError):
            self.available = False
