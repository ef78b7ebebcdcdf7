"""The report of `specroute bench conversations` (router.bench.conversations): its tables, and the
issue's targets against them.

Runs are repeated in alternating order; the batch job's throughput is compared pair by pair
(each repetition's priced run against its unpriced one) over the windows it ran whole in both,
so that a run that lasted longer, or a last window cut short, does not decide the ratio.
"""

from __future__ import annotations

import statistics
from typing import Any

from router.bench.conversations import ConversationsResult, Options


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def batch_ratios(results: dict[str, list[ConversationsResult]]) -> list[float]:
    """Per repetition, the priced run's batch tok/s over the unpriced run's, over the first
    windows both ran whole (all windows where either ran none whole)."""
    ratios = []
    for priced, unpriced in zip(results.get("adaptive", []), results.get("adaptive-unpriced", []), strict=False):
        whole = [[w for w in r.windows if w.complete] for r in (priced, unpriced)]
        common = min(len(w) for w in whole)
        pair = [
            r.batch_rate(w[:common] if common else r.windows) for r, w in zip((priced, unpriced), whole, strict=True)
        ]
        if pair[1]:
            ratios.append(pair[0] / pair[1])
    return ratios


def markdown(results: dict[str, list[ConversationsResult]], options: Options, *, ttft_target: float) -> str:
    """The table of every setting and repetition run, each first turn's route, and the targets."""
    lines = [
        "| routing | first turn p50 / p95 / worst (s) | later turns p50 / p95 / worst (s) | later p95 ÷ first p95 "
        "| later turns' prompt tokens cached | longest prompt (tokens) | turns on the standard pool (beside the "
        "batch) | pool switches (out and back) | batch tok/s (whole windows) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summaries = {mode: [r.summary() for r in runs] for mode, runs in results.items()}
    reasons = []
    for mode, runs in summaries.items():
        for number, s in enumerate(runs, start=1):
            name = mode if len(runs) == 1 else f"{mode} #{number}"
            first, later = s["first"], s["later"]
            ratio = "—" if s["later_over_first_p95"] is None else f"{s['later_over_first_p95']:.2f}×"
            lines.append(
                f"| {name} | {_seconds(first['p50'])} / {_seconds(first['p95'])} / {_seconds(first['worst'])} "
                f"| {_seconds(later['p50'])} / {_seconds(later['p95'])} / {_seconds(later['worst'])} | {ratio} "
                f"| {_share(s['later_cached_share'])} | {s['longest_prompt']:,} "
                f"| {s['spills']} ({s['standard_turns_beside_batch']}) | {s['switches']} ({s['returns']}) "
                f"| {s['batch_tokens_per_second']:.0f} ({s['batch_tokens_per_second_complete']:.0f}, "
                f"{s['batch_complete_windows']}) | {s['errors']} + {s['batch_errors']} batch |"
            )
            if s["spills"]:
                reasons.append(f"{name}: {', '.join(f'{r} × {n}' for r, n in s['spill_reasons'].items())}")
    if reasons:
        lines += ["", "Turns on the standard pool, by `X-Route-Reason`: " + "; ".join(reasons) + "."]
    lines += _targets(summaries.get("adaptive", []), batch_ratios(results), ttft_target)
    lines += _first_turns(summaries)
    arrival = options.arrival if options.arrival is not None else options.think / max(1, options.users)
    header = (
        f"## conversations: {options.users} users × {options.turns} turns, a {options.context_words}-word "
        f"context then {options.turn_words} words a turn ({options.answer_tokens}-token answers, "
        f"{options.think:g} s think, first turns {arrival:g} s apart), beside a batch job of {options.batch} in "
        f"flight, {options.batch_on:g} s on / {options.batch_off:g} s off\n\n"
    )
    return header + "\n".join(lines)


def _targets(priced: list[dict[str, Any]], ratios: list[float], ttft_target: float) -> list[str]:
    if not priced:
        return []
    lines = ["", "| target (adaptive, conversations priced; every run) | measured | met |", "|---|---:|:-:|"]
    later = [s["later_over_first_p95"] for s in priced]
    met = all(r is not None and r <= 1.5 for r in later)
    shown = ", ".join("—" if r is None else f"{r:.2f}×" for r in later)
    lines.append(f"| later turns' first-token p95 ≤ 1.5× the first turn's | {shown} | {'yes' if met else 'NO'} |")
    cached = [s["later_cached_share"] for s in priced]
    met = all(c is not None and c >= 0.8 for c in cached)
    lines.append(
        f"| later turns' prompt tokens cached ≥ 80 % | {', '.join(map(_share, cached))} | {'yes' if met else 'NO'} |"
    )
    worst = [max(s["first"]["worst"] or 0.0, s["later"]["worst"] or 0.0) for s in priced]
    met = all(w <= ttft_target for w in worst)
    lines.append(
        f"| interactive first tokens within routing.ttft_target ({ttft_target:g} s) "
        f"| worst {', '.join(f'{w:.2f} s' for w in worst)} | {'yes' if met else 'NO'} |"
    )
    if ratios:
        mean = statistics.fmean(ratios)
        lines.append(
            f"| batch throughput ≥ 95 % of the unpriced run's, pair by pair over the windows both ran whole "
            f"| {', '.join(f'{r:.1%}' for r in ratios)} (mean {mean:.1%}) | {'yes' if mean >= 0.95 else 'NO'} |"
        )
    return lines


def _first_turns(summaries: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each first turn of each setting's first run, in the order sent: where it went, why, and the
    first tokens the router predicted on each pool beside the one measured."""
    lines = []
    for mode, runs in summaries.items():
        turns = [t for t in runs[0]["each_turn"] if t["turn"] == 0] if runs else []
        if not turns:
            continue
        lines += [
            "",
            f"First turns, {mode}{' #1' if len(runs) > 1 else ''}:",
            "",
            "| user | sent (s) | pool, reason | predicted fast / team (s) | first token (s) |",
            "|---:|---:|---|---:|---:|",
        ]
        for t in turns:
            predicted = t["predicted"] or {}
            lines.append(
                f"| {t['user']} | {t['start']:.2f} | {t['pool']}, `{t['reason']}` "
                f"| {_seconds(predicted.get('fast'))} / {_seconds(predicted.get('team'))} | {_seconds(t['ttft'])} |"
            )
    return lines
