"""The load generator: streaming requests against any OpenAI-compatible `base_url`.

Each request is a streamed chat completion, sent with aiohttp's client and read with the router's
stream watcher: the official SDK's per-chunk objects, or httpx's connection pool, would cost more
CPU at 256 streams than the target being measured. Per request it records the time to
the first chunk that carries generated text, the completion tokens the server reports in
`usage`, the duration and the status.

With `time_scale` N (a simulated target running N times faster than real time), every wall-clock
duration is multiplied by N, so the figures are in the target's real time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from router.content import ContentKind
from router.prompts import prompt_of_length, prompts
from router.sse import StreamWatch, prompt_tokens


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str
    model: str
    api_key: str = "none"
    time_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Job:
    """What one request asks for, and who it says it is."""

    kind: ContentKind = "prose"
    max_tokens: int = 512
    fixed_length: bool = True  # ignore_eos + min_tokens: every answer exactly max_tokens long
    api_key: str | None = None  # overrides the target's key: how a batch job identifies itself
    user: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    label: str = "all"
    messages: tuple[dict[str, str], ...] = ()  # the chat to send; empty: one of the shipped prompts
    prompt_tokens: int | None = None  # a shipped prompt about this long; None: the set's texts as they are
    keep_text: bool = False  # keep the answer's text (a conversation sends it back)


@dataclass(slots=True)
class Record:
    label: str
    start: float  # real-time seconds since the run began
    ttft: float | None = None
    duration: float | None = None
    tokens: int = 0
    prompt_tokens: int = 0
    status: int = 0
    error: str | None = None
    pool: str | None = None
    reason: str | None = None  # the router's `X-Route-Reason`
    text: str | None = None  # the answer's text, where the job keeps it
    cached_tokens: int | None = None  # prompt tokens the engine found cached, where its usage says
    # Each pool's first token as the router predicted it (`X-Route-Predicted-TTFT`), in real time.
    predicted: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def decode_tps(self) -> float | None:
        """Tokens per second after the first: the speed a user watches the answer arrive at."""
        if self.ttft is None or self.duration is None or self.tokens < 2 or self.duration <= self.ttft:
            return None
        return (self.tokens - 1) / (self.duration - self.ttft)


KEEP_ALIVE_SECONDS = 4.0


class Load:
    """Sends requests and keeps their records; one per run."""

    def __init__(self, target: Target, *, max_connections: int = 512) -> None:
        self.target = target
        self.records: list[Record] = []
        self._max_connections = max_connections
        self._client: aiohttp.ClientSession | None = None  # made in the running event loop
        self._url = target.base_url.rstrip("/") + "/chat/completions"
        self._origin = time.perf_counter()
        self._counter = 0

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            self._client = aiohttp.ClientSession(
                # Idle connections are dropped before the server would close them (uvicorn, under the
                # router and the engines, after 5 s): a user thinking 5 s at 1x got a POST written
                # to a connection being closed, a ServerDisconnectedError counted as an error.
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEP_ALIVE_SECONDS),
                # A round of the note waits minutes for a first token: no read timeout worth having.
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=3600),
                auto_decompress=False,
            )
        return self._client

    def now(self) -> float:
        """Real-time seconds since the run began."""
        return (time.perf_counter() - self._origin) * self.target.time_scale

    def restart_clock(self) -> None:
        self._origin = time.perf_counter()

    def _body(self, job: Job) -> dict[str, Any]:
        texts = prompts(job.kind)
        self._counter += 1
        index = self._counter % len(texts)
        content = prompt_of_length(job.kind, job.prompt_tokens, index) if job.prompt_tokens else texts[index]
        body: dict[str, Any] = {
            "model": self.target.model,
            "messages": list(job.messages) or [{"role": "user", "content": content}],
            "max_tokens": job.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if job.fixed_length:
            body["ignore_eos"] = True
            body["min_tokens"] = job.max_tokens
        if job.user:
            body["user"] = job.user
        return body

    async def request(self, job: Job) -> Record:
        record = Record(job.label, self.now())
        self.records.append(record)
        headers = {
            "content-type": "application/json",
            "authorization": f"Bearer {job.api_key or self.target.api_key}",
            **job.headers,
        }
        body = json.dumps(self._body(job)).encode()
        started = time.perf_counter()
        try:
            async with self._session().post(self._url, headers=headers, data=body) as response:
                record.status = response.status
                record.pool = response.headers.get("x-route-pool")
                record.reason = response.headers.get("x-route-reason")
                record.predicted = _predicted(response.headers.get("x-route-predicted-ttft"), self.target.time_scale)
                if response.status != 200:
                    record.error = (await response.read())[:200].decode(errors="replace")
                    return record
                watch = StreamWatch(drop_usage_chunk=False)
                stream = bytearray() if job.keep_text else None
                async for chunk in response.content.iter_any():
                    watch.feed(chunk)
                    if stream is not None:
                        stream += chunk
                    if record.ttft is None and watch.saw_content:
                        record.ttft = (time.perf_counter() - started) * self.target.time_scale
                watch.flush()
                record.error = watch.error
                if stream is not None:
                    record.text = _content(bytes(stream))
                record.tokens = watch.completion_tokens or 0
                record.prompt_tokens = prompt_tokens(watch.usage) or 0
                details = (watch.usage or {}).get("prompt_tokens_details")
                if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                    record.cached_tokens = details["cached_tokens"]
        except (TimeoutError, aiohttp.ClientError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            record.duration = (time.perf_counter() - started) * self.target.time_scale
        return record


def _predicted(header: str | None, time_scale: float) -> dict[str, float] | None:
    """`fast=1.712, team=0.904` as {pool: seconds} in the target's real time; None if absent or malformed."""
    if not header:
        return None
    predicted = {}
    for part in header.split(","):
        pool, _, seconds = part.strip().partition("=")
        try:
            predicted[pool] = float(seconds) * time_scale
        except ValueError:
            return None
    return predicted


def _content(stream: bytes) -> str:
    """A chat stream's generated text: every chunk's `delta.content`, joined."""
    parts: list[str] = []
    for line in stream.splitlines():
        if not line.startswith(b"data: {"):
            continue
        for choice in json.loads(line[6:]).get("choices") or ():
            parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)
