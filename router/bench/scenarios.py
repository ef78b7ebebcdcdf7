"""The benchmark's scenarios: `sweep` (the note's measurement) and `mixed` (a team at work).

Every figure is in the target's real time (wall-clock × time scale) and counts delivered tokens
only, as the engine reports them in `usage`.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import aiohttp

from router.bench.load import Job, Load, Record, Target
from router.bench.watch import EngineRound, EngineWatch
from router.content import ContentKind
from router.quantiles import percentile

Progress = Callable[[float], None]  # called with the share of the run done, 0..1


@dataclass(frozen=True, slots=True)
class Summary:
    """What a set of requests got: per-user speed, first-token times, delivered tokens."""

    requests: int
    errors: int
    tokens: int
    total_tps: float  # delivered tokens / span from first start to last end
    per_user_tps: float | None  # median over requests of tokens/s after the first token
    ttft_p50: float | None
    ttft_p99: float | None
    ttft_worst: float | None
    prompt_tokens: float | None = None
    ttft_p95: float | None = None

    @classmethod
    def of(cls, records: Sequence[Record]) -> Summary:
        done = [r for r in records if r.ok]
        ttfts = [r.ttft for r in done if r.ttft is not None]
        speeds = [s for r in done if (s := r.decode_tps) is not None]
        ends = [r.start + r.duration for r in done if r.duration is not None]
        span = (max(ends) - min(r.start for r in done)) if done else 0.0
        tokens = sum(r.tokens for r in done)
        prompts = [r.prompt_tokens for r in done if r.prompt_tokens]
        return cls(
            requests=len(records),
            errors=len(records) - len(done),
            tokens=tokens,
            total_tps=tokens / span if span > 0 else 0.0,
            per_user_tps=statistics.median(speeds) if speeds else None,
            ttft_p50=percentile(ttfts, 0.5),
            ttft_p99=percentile(ttfts, 0.99),
            ttft_worst=max(ttfts) if ttfts else None,
            prompt_tokens=statistics.median(prompts) if prompts else None,
            ttft_p95=percentile(ttfts, 0.95),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class SweepRound:
    users: int
    summary: Summary
    engine: EngineRound | None = None  # what the engine's /metrics said, when the target is one


async def sweep(
    target: Target,
    users: Sequence[int],
    *,
    kind: ContentKind = "prose",
    max_tokens: int = 512,
    pause: float = 1.0,
    progress: Progress | None = None,
) -> list[SweepRound]:
    """For each concurrency, one round of that many simultaneous requests."""
    rounds = []
    load = Load(target, max_connections=max(users) + 8)
    watch = EngineWatch(target.base_url)
    metrics = aiohttp.ClientSession()
    try:
        for done, count in enumerate(users):
            load.records = []
            load.restart_clock()
            job = Job(kind=kind, max_tokens=max_tokens)
            engine, stop = EngineRound(), asyncio.Event()
            watching = asyncio.create_task(watch.watch(metrics, engine, stop))
            records = await asyncio.gather(*(load.request(job) for _ in range(count)))
            stop.set()
            await watching
            rounds.append(SweepRound(count, Summary.of(records), engine if watch.available else None))
            if progress:
                progress((done + 1) / len(users))
            await asyncio.sleep(pause)  # let the engine settle before the next round
    finally:
        await load.aclose()
        await metrics.close()
    return rounds


@dataclass(frozen=True, slots=True)
class Users:
    """Interactive users in a closed loop, as the mixed and batch-job scenarios run them: how
    many, how long (real time) they keep starting requests, how long each thinks between its
    answers, and what they ask for."""

    count: int = 4
    duration: float = 300.0
    think_time: float = 5.0
    kind: ContentKind = "prose"
    max_tokens: int = 512

    async def run(self, load: Load, *, named_by: Literal["user", "api_key", "nothing"], together: bool = False) -> None:
        """Each user asks, thinks and asks again until `duration`. Users start a little apart, as
        people do, unless `together`. `named_by`: how user n tells itself apart, by the `user`
        field or by its own API key, either being `bench-user-<n>`; or `nothing`: every user sends
        the target's key (a placeholder) and no `user`, as an application's users do."""
        scale = load.target.time_scale

        async def user(number: int) -> None:
            name = f"bench-user-{number}"
            job = Job(
                kind=self.kind,
                max_tokens=self.max_tokens,
                user=name if named_by == "user" else None,
                api_key=name if named_by == "api_key" else None,
                label="interactive",
            )
            if not together:
                await asyncio.sleep(number * self.think_time / max(1, self.count) / scale)
            while load.now() < self.duration:
                await load.request(job)
                await asyncio.sleep(self.think_time / scale)

        await asyncio.gather(*(user(i) for i in range(self.count)))


@dataclass(frozen=True, slots=True)
class MixedResult:
    interactive: Summary
    batch: Summary
    records: list[Record]


async def mixed(
    target: Target,
    users: Users,
    *,
    batch_in_flight: int = 124,
    batch_header: bool = False,
    together: bool = False,
    named_by: Literal["user", "api_key", "nothing"] = "user",
    progress: Progress | None = None,
) -> MixedResult:
    """Interactive users in a closed loop with think time, beside a batch job keeping N in flight.

    Each interactive user sends its own `user` (or its own API key, or nothing: `named_by`); the
    batch job has one API key for all its requests and no `user`.
    By default nothing else tells the router which is which: it must find the batch job by its
    behaviour. `batch_header` adds `X-Job-Type: batch` to compare with a declared job.
    Users start a little apart, as people do; with `together`, all at the same moment (a class
    starting a lab, a demo), which is the hardest start for a router that has not seen load yet.
    Requests start until `users.duration` (real time) has passed; the run ends when the last finishes.
    """
    load = Load(target, max_connections=users.count + batch_in_flight + 8)
    duration = users.duration
    batch = Job(
        kind=users.kind,
        max_tokens=users.max_tokens,
        api_key="bench-batch-job",
        headers={"X-Job-Type": "batch"} if batch_header else {},
        label="batch",
    )

    async def batch_worker() -> None:
        while load.now() < duration:
            await load.request(batch)

    async def report_progress() -> None:
        while progress is not None:
            progress(min(1.0, load.now() / duration))
            await asyncio.sleep(0.2)

    ticker = asyncio.create_task(report_progress())
    try:
        await asyncio.gather(
            users.run(load, named_by=named_by, together=together),
            *(batch_worker() for _ in range(batch_in_flight)),
        )
    finally:
        ticker.cancel()
        await load.aclose()
    if progress:
        progress(1.0)
    records = load.records
    return MixedResult(
        interactive=Summary.of([r for r in records if r.label == "interactive"]),
        batch=Summary.of([r for r in records if r.label == "batch"]),
        records=records,
    )


@dataclass(frozen=True, slots=True)
class FairnessResult:
    """Chat users beside an agent (or alone): what each side got."""

    chat: Summary
    agent: Summary
    chat_ttft_p95: float | None
    later_ttft_p95: float | None  # of the chat users' questions after their first
    agent_token_share: float  # of the tokens delivered to both
    records: list[Record]


async def fairness(target: Target, users: Users, *, agent_in_flight: int = 10) -> FairnessResult:
    """Chat users (each its own API key, a closed loop with think time) beside a coding agent: one
    API key keeping `agent_in_flight` requests in flight, declared interactive as an agent at a
    developer's side is. Requests start until `users.duration` (real time) has passed."""
    load = Load(target, max_connections=users.count + agent_in_flight + 8)
    agent = Job(
        kind=users.kind,
        max_tokens=users.max_tokens,
        api_key="bench-agent",
        headers={"X-Job-Type": "interactive"},
        label="agent",
    )

    async def agent_worker() -> None:
        while load.now() < users.duration:
            await load.request(agent)

    try:
        await asyncio.gather(users.run(load, named_by="api_key"), *(agent_worker() for _ in range(agent_in_flight)))
    finally:
        await load.aclose()
    records = load.records
    chat = [r for r in records if r.label == "interactive"]
    agents = [r for r in records if r.label == "agent"]
    # Each user's first question starts within a think time of the run's start, the next later
    # (records count simulated seconds, as the think time does).
    later = [r for r in chat if r.start >= users.think_time]
    chat_tokens = sum(r.tokens for r in chat if r.ok)
    agent_tokens = sum(r.tokens for r in agents if r.ok)
    return FairnessResult(
        chat=Summary.of(chat),
        agent=Summary.of(agents),
        chat_ttft_p95=_ttft_p95(chat),
        later_ttft_p95=_ttft_p95(later),
        agent_token_share=agent_tokens / (chat_tokens + agent_tokens) if chat_tokens + agent_tokens else 0.0,
        records=records,
    )


def _ttft_p95(records: list[Record]) -> float | None:
    return percentile([r.ttft for r in records if r.ok and r.ttft is not None], 0.95)
