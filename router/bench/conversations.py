"""`specroute bench conversations`: users in long conversations beside a batch job that comes and goes.

Each user holds one conversation, as a coding agent does: its first message carries a context
of `context_words` words (files, a long document), and every later turn sends the whole history
again (its earlier messages and the answers it got, as they were streamed) with a new message of
`turn_words` words, so the prompt grows to tens of thousands of tokens.
Beside them a batch client (`X-Job-Type: batch`) keeps `batch` requests in flight for
`batch_on` seconds, stops for `batch_off`, and so on, so the standard pool is loaded, then idle,
and the router's reasons to spill change under the conversations.

Each routing setting runs on the embedded layout (one speculative engine, one standard, both
simulated, started clean): `adaptive` with conversations priced (the default), `adaptive` with
`conversations.enabled: false`, `static`, and `round-robin` (every request pinned to the pools
in turn with `X-Route-Pool`, what a load balancer unaware of both pools and caches does).
Reported per setting: the first token of first turns and of later turns (p50, p95, worst), the
later turns' p95 over the first turns', the share of later turns' prompt tokens the engine found
cached (its usage's `prompt_tokens_details.cached_tokens`), the longest prompt, the turns the
router served on the standard pool and its reasons for them (`X-Route-Reason`), how
often consecutive turns of one conversation changed pools and how often one went out and came
straight back, and the batch job's throughput. Figures in the target's real time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.bench.load import Job, Load, Record, Target
from router.prompts import prompts
from router.quantiles import percentile

MODES = ("adaptive", "adaptive-unpriced", "static", "round-robin")
# Each mode's router: its routing mode, and settings in the environment of the layout's process.
MODE_SETTINGS: dict[str, tuple[str, dict[str, str]]] = {
    "adaptive": ("adaptive", {}),
    "adaptive-unpriced": ("adaptive", {"SPECROUTE_CONVERSATIONS__ENABLED": "false"}),
    "static": ("static", {}),
    "round-robin": ("adaptive", {"SPECROUTE_CONVERSATIONS__ENABLED": "false"}),
}
POOLS = ("fast", "team")


@dataclass(frozen=True, slots=True)
class Options:
    users: int = 6
    turns: int = 10
    context_words: int = 16000
    turn_words: int = 600
    answer_tokens: int = 256
    think: float = 5.0  # seconds between an answer and the next turn
    batch: int = 64  # batch requests in flight while the job runs
    batch_on: float = 40.0
    batch_off: float = 40.0
    batch_tokens: int = 256
    arrival: float | None = None  # seconds between users' first turns; None: think time ÷ users


@dataclass(frozen=True, slots=True)
class Window:
    """One period the batch job ran: from its start, sending until `stop`, its last answer at `end`."""

    start: float
    stop: float
    end: float
    complete: bool  # it ran its whole `batch_on`: the conversations had not ended first


@dataclass(slots=True)
class Turn:
    user: int
    turn: int
    record: Record


@dataclass(slots=True)
class ConversationsResult:
    turns: list[Turn] = field(default_factory=list)
    batch: list[Record] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        first = [t.record for t in self.turns if t.turn == 0]
        later = [t.record for t in self.turns if t.turn > 0]

        def ttfts(records: list[Record]) -> list[float]:
            return [r.ttft for r in records if r.ok and r.ttft is not None]

        def quantiles(records: list[Record]) -> dict[str, float | None]:
            values = ttfts(records)
            return {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95), "worst": max(values, default=None)}

        prompt = sum(r.prompt_tokens for r in later if r.ok and r.cached_tokens is not None)
        cached = sum(r.cached_tokens or 0 for r in later if r.ok)
        first_q, later_q = quantiles(first), quantiles(later)
        ratio = None
        if first_q["p95"] and later_q["p95"] is not None:
            ratio = later_q["p95"] / first_q["p95"]
        # Turns the router sent to the standard pool (round robin pins them there: not a spill).
        spilled = [t.record for t in self.turns if t.record.pool == POOLS[1] and t.record.reason != "pinned"]
        return {
            "turns": len(self.turns),
            "errors": sum(1 for t in self.turns if not t.record.ok),
            "first": first_q,
            "later": later_q,
            "later_over_first_p95": ratio,
            "later_cached_share": cached / prompt if prompt else None,
            "longest_prompt": max((r.prompt_tokens for r in later), default=0),
            "spills": len(spilled),
            "spill_reasons": dict(collections.Counter(r.reason for r in spilled).most_common()),
            "switches": self.switches(),
            "returns": self.returns(),
            "batch_tokens_per_second": self.batch_rate(self.windows),
            # Over the windows the batch job ran whole, beside the conversations: runs of
            # different lengths compare over like windows, not over a last one cut short.
            "batch_complete_windows": sum(w.complete for w in self.windows),
            "batch_tokens_per_second_complete": self.batch_rate([w for w in self.windows if w.complete]),
            "batch_windows": [
                {
                    "start": round(w.start, 2),
                    "end": round(w.end, 2),
                    "complete": w.complete,
                    "tokens_per_second": round(self.batch_rate([w]), 1),
                }
                for w in self.windows
            ],
            "batch_errors": sum(1 for r in self.batch if not r.ok),
            # Turns served on the standard pool while the batch job ran there: what slows it.
            "standard_turns_beside_batch": sum(
                1 for t in self.turns if t.record.pool == POOLS[1] and self._beside_batch(t.record)
            ),
            # Each turn in the order sent: where it went, why, the first tokens predicted and its own.
            "each_turn": [
                {
                    "user": t.user,
                    "turn": t.turn,
                    "start": round(t.record.start, 3),
                    "ttft": t.record.ttft,
                    "predicted": t.record.predicted,
                    "pool": t.record.pool,
                    "reason": t.record.reason,
                    "prompt_tokens": t.record.prompt_tokens,
                    "cached_tokens": t.record.cached_tokens,
                    "beside_batch": self._beside_batch(t.record),
                }
                for t in sorted(self.turns, key=lambda t: t.record.start)
            ],
        }

    def batch_rate(self, windows: list[Window]) -> float:
        """The batch job's tok/s over `windows`: the answers it started in them, over their length."""
        seconds = sum(w.end - w.start for w in windows)
        tokens = sum(r.tokens for r in self.batch if r.ok and any(w.start <= r.start < w.stop for w in windows))
        return tokens / seconds if seconds else 0.0

    def _beside_batch(self, record: Record) -> bool:
        """Whether a turn's answer ran while the batch job did."""
        end = record.start + (record.duration or 0.0)
        return any(record.start < w.end and w.start < end for w in self.windows)

    def switches(self) -> int:
        """Consecutive turns of one conversation on different pools."""
        return sum(1 for pools in self._pools() for a, b in itertools.pairwise(pools) if a and b and a != b)

    def returns(self) -> int:
        """A conversation's turn on another pool than the turns either side of it: out and back."""
        count = 0
        for pools in self._pools():
            count += sum(1 for a, b, c in zip(pools, pools[1:], pools[2:], strict=False) if a and b and a == c != b)
        return count

    def _pools(self) -> list[list[str | None]]:
        by_user: dict[int, list[Turn]] = {}
        for turn in self.turns:
            by_user.setdefault(turn.user, []).append(turn)
        return [[t.record.pool for t in sorted(turns, key=lambda t: t.turn)] for turns in by_user.values()]


def _words(rng: random.Random, count: int) -> str:
    """`count` words of the shipped prose, from a place of the user's own."""
    words = " ".join(prompts("prose")).split()
    start = rng.randrange(len(words))
    return " ".join(words[(start + i) % len(words)] for i in range(count))


async def conversations(
    target: Target, options: Options, progress: Callable[[float], None] | None = None, *, mode: str
) -> ConversationsResult:
    """Run the users' conversations to their end beside the batch job; the job stops with them."""
    result = ConversationsResult()
    load = Load(target, max_connections=options.users + options.batch + 8)
    pools = itertools.cycle(POOLS)

    def pinned() -> dict[str, str]:
        return {"X-Route-Pool": next(pools)} if mode == "round-robin" else {}

    async def user(number: int) -> None:
        rng = random.Random(number)
        context = f"User {number}'s context: {_words(rng, options.context_words)}\n\n"
        messages: list[dict[str, str]] = []
        arrival = options.arrival if options.arrival is not None else options.think / max(1, options.users)
        await asyncio.sleep(number * arrival / target.time_scale)  # apart
        for turn in range(options.turns):
            said = f"User {number}, turn {turn}: {_words(rng, options.turn_words)}"
            messages.append({"role": "user", "content": context + said if turn == 0 else said})
            job = Job(
                max_tokens=options.answer_tokens,
                label="conversation",
                headers=pinned(),
                messages=tuple(messages),
                keep_text=True,
                api_key=f"conversation-{number}",  # a client of its own, not the batch job's
            )
            record = await load.request(job)
            result.turns.append(Turn(number, turn, record))
            # The answer goes back into the history as it was streamed, as a chat client sends it.
            messages.append({"role": "assistant", "content": record.text or ""})
            if progress is not None:
                progress(len(result.turns) / (options.users * options.turns))
            await asyncio.sleep(options.think / target.time_scale)

    async def batch_request() -> None:
        job = Job(
            max_tokens=options.batch_tokens,
            label="batch",
            headers={"X-Job-Type": "batch", **pinned()},
            api_key="batch-job",
        )
        result.batch.append(await load.request(job))

    async def batch_job(done: asyncio.Event) -> None:
        while not done.is_set():
            started = load.now()
            running: set[asyncio.Task[None]] = set()
            deadline = started + options.batch_on
            while load.now() < deadline and not done.is_set():
                while len(running) < options.batch:
                    task = asyncio.create_task(batch_request())
                    running.add(task)
                    task.add_done_callback(running.discard)
                await asyncio.sleep(0.05)
            stopped, complete = load.now(), not done.is_set()
            if running:
                await asyncio.gather(*running)
            result.windows.append(Window(started, stopped, load.now(), complete))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), options.batch_off / target.time_scale)

    done = asyncio.Event()
    try:
        batch = asyncio.create_task(batch_job(done))
        await asyncio.gather(*(user(n) for n in range(options.users)))
        done.set()
        await batch
    finally:
        await load.aclose()
    return result
