"""Replaying a traffic record (router.record) against any OpenAI-compatible target.

Each request starts at its recorded time (open loop: a slower cluster does not slow the arrivals
down, as a team does not wait for the cluster), with a prompt of its recorded length and content
kind, a fixed-length answer of its recorded length, and its client's own key, so that the router
tells the recorded clients apart as it did. A request whose client declared its job type declares
it again. Records are labelled by their recorded job class.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from router.bench.load import Job, Load, Record, Target
from router.content import ContentKind
from router.record import Served

# How long a burst of arrivals may last (seconds): a steady stream of requests is not one burst.
BURST_WINDOW = 1.0


def scaled(entries: Sequence[Served], *, interactive: float = 1.0, batch: float = 1.0) -> list[Served]:
    """The record with each job class's traffic multiplied by its factor, over the same span:
    at 2, every request of the class is followed by a copy half-way to the next; at 0.5, every
    other request is kept."""
    out: list[Served] = []
    for job, factor in (("interactive", interactive), ("batch", batch)):
        mine = sorted((e for e in entries if e.job == job), key=lambda e: e.at)
        if not mine or factor <= 0:
            continue
        times = [e.at for e in mine]
        for i in range(round(len(mine) * factor)):
            position = i / factor
            low = min(int(position), len(mine) - 1)
            high = min(low + 1, len(mine) - 1)
            at = times[low] + (times[high] - times[low]) * (position - low)
            out.append(replace(mine[low], at=at))
    return sorted(out, key=lambda e: e.at)


def bursts(entries: Iterable[Served], *, gap: float, window: float = BURST_WINDOW) -> list[Served]:
    """The record with each burst's arrivals moved to its first: a burst is a run of arrivals each
    within `gap` seconds of the one before, and within `window` of the run's first.

    The router stamps a request when it starts handling it. Requests sent at once (a batch job's
    wave, and whoever sent beside it) are stamped one after another as the router takes them in,
    spread over as long as that takes; replayed at those stamps, they arrive spread out and the
    router's intake never backs up, so the ones that waited behind the wave wait no more."""
    out: list[Served] = []
    first = previous = -math.inf
    for entry in sorted(entries, key=lambda e: e.at):
        if entry.at - previous > gap or entry.at - first > window:
            first = entry.at
        previous = entry.at
        out.append(replace(entry, at=first))
    return out


def span(entries: Sequence[Served]) -> float:
    """Seconds from the first arrival to the last."""
    return entries[-1].at - entries[0].at if entries else 0.0


async def replay(
    target: Target, entries: Sequence[Served], *, progress: Callable[[float], None] | None = None
) -> list[Record]:
    """Send every entry at its time; returns when the last has ended."""
    if not entries:
        return []
    ordered = sorted(entries, key=lambda e: e.at)
    start = ordered[0].at
    total = max(span(ordered), 1e-9)
    load = Load(target, max_connections=1024)

    async def one(entry: Served) -> None:
        delay = (entry.at - start) - load.now()
        if delay > 0:
            await asyncio.sleep(delay / target.time_scale)
        if progress is not None:
            progress(min(1.0, (entry.at - start) / total))
        await load.request(_job(entry))

    try:
        await asyncio.gather(*(one(entry) for entry in ordered))
    finally:
        await load.aclose()
    return load.records


def _job(entry: Served) -> Job:
    kind: ContentKind = "code" if entry.kind == "code" else "prose"
    return Job(
        kind=kind,
        max_tokens=max(1, entry.answer_tokens),
        api_key=f"replay-{entry.client or 'anonymous'}",
        headers={"X-Job-Type": entry.job} if entry.declared else {},
        label=entry.job,
        prompt_tokens=max(8, entry.prompt_tokens) if entry.prompt_tokens else None,
    )


def synthetic(
    *,
    interactive_users: int,
    interactive_every: float,
    batch_in_flight: int,
    batch_every: float,
    duration: float,
    kind: ContentKind = "prose",
    prompt_tokens: int = 64,
    answer_tokens: int = 512,
) -> list[Served]:
    """A record made up from a mix given on the command line: each interactive user sends a
    request every `interactive_every` seconds (users spread over the first interval); a batch job
    with one key starts `batch_in_flight` requests at once, then one every `batch_every` seconds."""
    entries = []
    for user in range(interactive_users):
        offset = user * interactive_every / max(1, interactive_users)
        count = math.ceil((duration - offset) / interactive_every) if interactive_every > 0 else 0
        entries += [
            Served(offset + n * interactive_every, "interactive", kind, prompt_tokens, answer_tokens, 200,
                   client=f"user:{user}")
            for n in range(max(0, count))
        ]  # fmt: skip
    if batch_in_flight:
        entries += [Served(0.0, "batch", kind, prompt_tokens, answer_tokens, 200, client="batch") for _ in
                    range(batch_in_flight)]  # fmt: skip
        if batch_every > 0:
            entries += [
                Served(n * batch_every, "batch", kind, prompt_tokens, answer_tokens, 200, client="batch")
                for n in range(1, math.ceil(duration / batch_every))
            ]
    return sorted(entries, key=lambda e: e.at)
