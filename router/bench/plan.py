"""`specroute plan`: how to split N nodes between the speculative and the standard pool.

Each split of the nodes (in whole engines of each profile) runs as a simulated cluster behind the
real router (router.demo), in simulated time, and the traffic record is replayed against it
(router.bench.replay). The figures per split are the record's own classes': interactive first
token and per-user speed, batch throughput and completion, and the share of interactive requests
whose first token came within the target. The recommendation and its reason follow one rule,
stated in `recommend`.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from router.bench.compare import running_pools
from router.bench.load import Record, Target
from router.bench.replay import replay
from router.demo import PoolSpec
from router.quantiles import percentile
from router.record import Served
from router.sim.profile import Profile

# The share of interactive first tokens within the target that a split must reach to be chosen.
WITHIN_TARGET = 0.95
# The share of the best batch throughput a split may give up for faster interactive users.
BATCH_SHARE = 0.8


@dataclass(frozen=True, slots=True)
class Split:
    fast: int  # engines with speculation
    team: int  # engines without
    fast_nodes: int
    team_nodes: int

    @property
    def label(self) -> str:
        return f"{self.fast_nodes} speculative + {self.team_nodes} standard"

    def pools(self, fast: Profile, team: Profile) -> list[PoolSpec]:
        pools = []
        if self.fast:
            pools.append(PoolSpec("fast", True, (fast,) * self.fast))
        if self.team:
            pools.append(PoolSpec("team", False, (team,) * self.team))
        return pools


def splits(nodes: int, fast: Profile, team: Profile) -> list[Split]:
    """Every way to fill `nodes` with whole engines of the two profiles, all speculative first."""
    found = []
    for engines in range(nodes // fast.nodes, -1, -1):
        rest = nodes - engines * fast.nodes
        if rest % team.nodes == 0 and (engines or rest):
            found.append(Split(engines, rest // team.nodes, engines * fast.nodes, rest))
    return found


@dataclass(frozen=True, slots=True)
class Figures:
    """What one job class of the record got on one split (seconds, tokens/s: simulated time)."""

    requests: int
    errors: int
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_worst: float | None
    per_user_tps: float | None  # median over requests of tokens/s after the first token
    within_target: float  # share of the requests with a first token within the target (errors: not)
    tokens_per_s: float  # delivered tokens / completion
    completion: float  # from the class's first arrival to its last request's end

    @classmethod
    def of(cls, records: Sequence[Record], *, ttft_target: float) -> Figures:
        done = [r for r in records if r.ok]
        ttfts = [r.ttft for r in done if r.ttft is not None]
        speeds = [s for r in done if (s := r.decode_tps) is not None]
        ends = [r.start + (r.duration or 0.0) for r in done]
        completion = max(ends) - min(r.start for r in records) if done else 0.0
        tokens = sum(r.tokens for r in done)
        return cls(
            requests=len(records),
            errors=len(records) - len(done),
            ttft_p50=percentile(ttfts, 0.5),
            ttft_p95=percentile(ttfts, 0.95),
            ttft_worst=max(ttfts) if ttfts else None,
            per_user_tps=statistics.median(speeds) if speeds else None,
            within_target=sum(1 for t in ttfts if t <= ttft_target) / len(records) if records else 1.0,
            tokens_per_s=tokens / completion if completion > 0 else 0.0,
            completion=completion,
        )


@dataclass(frozen=True, slots=True)
class Outcome:
    split: Split
    interactive: Figures | None
    batch: Figures | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"label": self.split.label}


def run_split(
    split: Split,
    entries: Sequence[Served],
    *,
    fast: Profile,
    team: Profile,
    time_scale: float,
    ttft_target: float,
    progress: Callable[[float], None] | None = None,
) -> Outcome:
    """The record replayed on one split, started clean, through the router as `serve` runs it."""
    with running_pools(split.pools(fast, team), time_scale=time_scale, ttft_target=ttft_target) as base_url:
        target = Target(base_url=base_url, model=fast.model, time_scale=time_scale)
        records = asyncio.run(replay(target, entries, progress=progress))
    by_job = {
        job: Figures.of(mine, ttft_target=ttft_target)
        for job in ("interactive", "batch")
        if (mine := [r for r in records if r.label == job])
    }
    return Outcome(split, by_job.get("interactive"), by_job.get("batch"))


def recommend(
    outcomes: Sequence[Outcome], *, ttft_target: float, batch_share: float = BATCH_SHARE
) -> tuple[Outcome, str]:
    """The split to run, and why. Among the splits where at least 95 % of interactive first tokens
    come within the target, those whose batch throughput is at least `batch_share` of the best of
    them; of those, the one whose interactive users stream fastest. If no split meets the target:
    the one closest to it."""

    def within(o: Outcome) -> float:
        return o.interactive.within_target if o.interactive else 1.0

    def batch(o: Outcome) -> float:
        return o.batch.tokens_per_s if o.batch else 0.0

    def speed(o: Outcome) -> float:
        return o.interactive.per_user_tps or 0.0 if o.interactive else 0.0

    meeting = [o for o in outcomes if within(o) >= WITHIN_TARGET]
    if not meeting:
        best = max(outcomes, key=lambda o: (within(o), batch(o)))
        return best, (
            f"no split gives {WITHIN_TARGET:.0%} of interactive first tokens within {ttft_target:g} s; "
            f"{best.split.label} comes closest ({within(best):.0%})"
        )
    most = max(batch(o) for o in meeting)
    equal = [o for o in meeting if batch(o) >= batch_share * most]
    best = max(equal, key=lambda o: (speed(o), batch(o)))
    reason = [f"{within(best):.0%} of interactive first tokens within {ttft_target:g} s"]
    if best.interactive and best.interactive.per_user_tps:
        others = [o for o in equal if o is not best and o.interactive and o.interactive.per_user_tps]
        versus = "".join(f", {o.split.label}: {speed(o):.1f}" for o in others)
        reason.append(
            f"interactive users stream fastest among the splits that meet it: {speed(best):.1f} tok/s{versus}"
        )
    if best.batch:
        reason.append(f"batch {batch(best):.0f} tok/s, {batch(best) / most:.0%} of the best that meets the target")
    dropped = [o.split.label for o in outcomes if o not in meeting]
    if dropped:
        reason.append(f"{', '.join(dropped)}: under {WITHIN_TARGET:.0%} within the target")
    return best, "; ".join(reason)


def _f(value: float | None, digits: int = 1, unit: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{unit}"


def table(outcomes: Sequence[Outcome], *, ttft_target: float) -> str:
    lines = [
        f"| split (nodes) | interactive first token p50 / p95 / worst | per-user tok/s | within {ttft_target:g} s "
        "| batch tok/s | batch completion | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        i, b = o.interactive, o.batch
        first = f"{_f(i.ttft_p50, 2)} / {_f(i.ttft_p95, 2)} / {_f(i.ttft_worst, 2)} s" if i else "–"
        errors = (i.errors if i else 0) + (b.errors if b else 0)
        lines.append(
            f"| {o.split.label} | {first} | {_f(i.per_user_tps) if i else '–'} "
            f"| {f'{i.within_target:.0%}' if i else '–'} | {_f(b.tokens_per_s, 0) if b else '–'} "
            f"| {_f(b.completion, 0, ' s') if b else '–'} | {errors} |"
        )
    return "\n".join(lines)


def plot(outcomes: Sequence[Outcome], path: Path, title: str, *, ttft_target: float) -> bool:
    """The table as a figure (needs the `tools` extra); False if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return False
    labels = [o.split.label.replace(" + ", "\n+ ") for o in outcomes]
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 4))
    for axis, values, name in (
        (left, [o.interactive.ttft_p95 if o.interactive else 0 for o in outcomes], "interactive first token p95 (s)"),
        (middle, [(o.interactive.per_user_tps or 0) if o.interactive else 0 for o in outcomes], "per-user tok/s"),
        (right, [o.batch.tokens_per_s if o.batch else 0 for o in outcomes], "batch tok/s"),
    ):
        axis.bar(labels, [v or 0 for v in values], color="#4c72b0")
        axis.set_title(name, fontsize=10)
        axis.tick_params(axis="x", labelsize=8)
    left.axhline(ttft_target, color="#c44e52", linestyle="--", linewidth=1, label=f"target {ttft_target:g} s")
    left.legend(fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def recorded_at(entry: Served, time_scale: float) -> Served:
    """An entry recorded in front of a simulator running `time_scale` times faster than real time,
    in that simulator's time (the router records wall-clock times)."""
    ttft = entry.ttft * time_scale if entry.ttft is not None else None
    return replace(entry, at=entry.at * time_scale, ttft=ttft, duration=entry.duration * time_scale)


def main(args: Any) -> int:
    """`specroute plan` (its arguments: router/cli.py)."""
    import json
    import sys
    import time

    from router.bench.replay import bursts, scaled, span, synthetic
    from router.record import read_record
    from router.sim.profile import load_profile

    if args.record:
        entries = bursts(read_record(args.record), gap=args.burst_gap)
        if args.record_time_scale != 1:  # recorded in front of a simulator running N times faster
            entries = [recorded_at(e, args.record_time_scale) for e in entries]
        source = f"the record {args.record}"
        if not entries:
            print(f"{args.record}: no requests in it", file=sys.stderr)
            return 1
    else:
        entries = synthetic(
            interactive_users=args.interactive,
            interactive_every=args.interactive_every,
            batch_in_flight=args.batch,
            batch_every=args.batch_every,
            duration=args.duration,
            kind=args.kind,
            prompt_tokens=args.prompt_tokens,
            answer_tokens=args.answer_tokens,
        )
        source = (
            f"a mix of {args.interactive} interactive users (one request every {args.interactive_every:g} s each) "
            f"and a batch job ({args.batch} at once, then one every {args.batch_every:g} s) over {args.duration:g} s"
        )
    entries = scaled(entries, interactive=args.interactive_scale, batch=args.batch_scale)
    if not entries:
        print("nothing to replay: the scales leave no request", file=sys.stderr)
        return 1
    fast, team = load_profile(args.fast), load_profile(args.team)
    found = splits(args.nodes, fast, team)
    if not found:
        print(
            f"{args.nodes} nodes cannot be filled with engines of {fast.nodes} ({fast.name}) and {team.nodes} "
            f"({team.name}) nodes",
            file=sys.stderr,
        )
        return 1
    counts = {job: sum(1 for e in entries if e.job == job) for job in ("interactive", "batch")}
    scales = "" if (args.interactive_scale, args.batch_scale) == (1, 1) else (
        f", scaled: interactive ×{args.interactive_scale:g}, batch ×{args.batch_scale:g}"
    )  # fmt: skip
    print(
        f"specroute plan: {counts['interactive']} interactive and {counts['batch']} batch requests over "
        f"{span(entries):.0f} s from {source}{scales}; {len(found)} splits of {args.nodes} nodes at "
        f"{args.time_scale:g}x",
        file=sys.stderr,
    )
    outcomes = []
    for split in found:
        started = time.perf_counter()
        outcomes.append(
            run_split(split, entries, fast=fast, team=team, time_scale=args.time_scale, ttft_target=args.ttft_target)
        )
        print(f"  {split.label}: replayed in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    best, reason = recommend(outcomes, ttft_target=args.ttft_target, batch_share=args.batch_share)
    markdown = (
        f"## plan: {args.nodes} nodes, {fast.name} ({fast.nodes} nodes an engine) and {team.name} ({team.nodes})\n\n"
        f"{table(outcomes, ttft_target=args.ttft_target)}\n\n"
        f"**Recommended: {best.split.label}** — {reason}."
    )
    print(markdown)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.md").write_text(markdown + "\n")
        data = {
            "nodes": args.nodes,
            "fast": fast.name,
            "team": team.name,
            "ttft_target": args.ttft_target,
            "time_scale": args.time_scale,
            "source": source,
            "interactive_scale": args.interactive_scale,
            "batch_scale": args.batch_scale,
            "splits": [o.as_dict() for o in outcomes],
            "recommended": best.split.label,
            "reason": reason,
        }
        (out / "plan.json").write_text(json.dumps(data, indent=2) + "\n")
        title = f"{counts['interactive']} interactive + {counts['batch']} batch requests on {args.nodes} nodes"
        if not plot(outcomes, out / "plan.png", title, ttft_target=args.ttft_target):
            print("no plot: it needs the tools (pip install 'specroute[tools]')", file=sys.stderr)
        print(f"wrote {out}/", file=sys.stderr)
    return 0
