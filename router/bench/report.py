"""What a benchmark run leaves behind: a markdown table, JSON and CSV, and PNG plots."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt

from router.bench.scenarios import MixedResult, Summary, SweepRound


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


# -- sweep -------------------------------------------------------------------------------------


def sweep_table(rounds: Sequence[SweepRound]) -> str:
    lines = [
        "| users | total tok/s | per-user tok/s | median TTFT | worst TTFT | errors |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rounds:
        s = r.summary
        lines.append(
            f"| {r.users} | {_f(s.total_tps)} | {_f(s.per_user_tps)} | {_f(s.ttft_p50, 2)} s "
            f"| {_f(s.ttft_worst, 2)} s | {s.errors} |"
        )
    return "\n".join(lines)


def prior_block(rounds: Sequence[SweepRound], *, kind: str, base_url: str, model: str, max_tokens: int) -> str:
    """The sweep's per-user speeds as a pool's `prior_speed` (router settings), ready to paste."""
    rows = [
        f"      {r.users}: {r.summary.per_user_tps:.1f}"
        for r in rounds
        if r.summary.per_user_tps and not r.summary.errors
    ]
    return "\n".join(
        [
            f"# specroute bench sweep of {base_url} ({model}, {kind}, {max_tokens}-token answers).",
            "# Paste under the pool this engine serves (pools.<name>:); a sweep with the other --kind",
            "# adds its own table beside this one. Rounds with errors are left out.",
            "    prior_speed:",
            f"      {kind}:",
            *(f"  {row}" for row in rows),
        ]
    )


def sweep_data(rounds: Sequence[SweepRound], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON form; `specroute sim fit` reads it."""
    prompts = [r.summary.prompt_tokens for r in rounds if r.summary.prompt_tokens]
    stated = [r.engine.kv_cache_tokens for r in rounds if r.engine and r.engine.kv_cache_tokens]
    return {
        **meta,
        "prompt_tokens": prompts[0] if prompts else None,
        "kv_cache_tokens": stated[0] if stated else None,
        "rounds": [
            {
                "users": r.users,
                "total_tps": r.summary.total_tps,
                "per_user_tps": r.summary.per_user_tps,
                "median_ttft": r.summary.ttft_p50,
                "worst_ttft": r.summary.ttft_worst,
                "errors": r.summary.errors,
                "tokens": r.summary.tokens,
                **({"engine": r.engine.as_dict()} if r.engine else {}),
            }
            for r in rounds
        ],
    }


def plot_sweeps(series: Mapping[str, Sequence[SweepRound]], path: Path, title: str) -> None:
    """Total tok/s and worst TTFT (log scale) against users, one line per series."""
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rounds in series.items():
        users = [r.users for r in rounds]
        left.plot(users, [r.summary.total_tps for r in rounds], marker="o", label=name)
        right.plot(users, [r.summary.ttft_worst or float("nan") for r in rounds], marker="o", label=name)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        ticks = sorted({r.users for rounds in series.values() for r in rounds})
        axis.set_xticks(ticks, [str(t) for t in ticks])
        axis.set_xlabel("simultaneous users")
        axis.grid(True, alpha=0.3)
        axis.legend()
    left.set_ylabel("total delivered tok/s")
    right.set_ylabel("worst time to first token (s)")
    right.set_yscale("log")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- mixed / compare ---------------------------------------------------------------------------


def mixed_table(results: Mapping[str, MixedResult]) -> str:
    lines = [
        "| layout | class | requests | per-user tok/s | class tok/s | TTFT p50 | TTFT p99 | worst TTFT | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        for label, s in (("interactive", result.interactive), ("batch", result.batch)):
            if not s.requests:
                continue
            lines.append(
                f"| {name} | {label} | {s.requests} | {_f(s.per_user_tps)} | {_f(s.total_tps)} "
                f"| {_f(s.ttft_p50, 2)} s | {_f(s.ttft_p99, 2)} s | {_f(s.ttft_worst, 2)} s | {s.errors} |"
            )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Verdict:
    claim: str
    value: str
    ok: bool


def mixed_verdicts(results: Mapping[str, MixedResult]) -> list[Verdict]:
    """The issue's targets for the routed layout, each against its baseline."""
    routed = results.get("routed")
    if routed is None:
        return []
    verdicts = []
    alone = results.get("fast-alone")
    if alone and alone.interactive.per_user_tps and routed.interactive.per_user_tps:
        share = routed.interactive.per_user_tps / alone.interactive.per_user_tps
        verdicts.append(
            Verdict("interactive per-user speed ≥ 95 % of the speculative engine alone", f"{share:.1%}", share >= 0.95)
        )
    alone = results.get("team-alone")
    if alone and alone.batch.total_tps:
        share = routed.batch.total_tps / alone.batch.total_tps
        verdicts.append(Verdict("batch throughput ≥ 95 % of one standard engine alone", f"{share:.1%}", share >= 0.95))
    worst = max(routed.interactive.ttft_worst or 0.0, routed.batch.ttft_worst or 0.0)
    verdicts.append(Verdict("no first token waits more than 3 s", f"worst {worst:.2f} s", worst <= 3.0))
    return verdicts


def verdicts_table(results: Mapping[str, MixedResult]) -> str:
    lines = ["| target (routed layout) | measured | met |", "|---|---:|:-:|"]
    lines += [f"| {v.claim} | {v.value} | {'yes' if v.ok else 'NO'} |" for v in mixed_verdicts(results)]
    return "\n".join(lines)


def mixed_data(results: Mapping[str, MixedResult], meta: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **meta,
        "layouts": {
            name: {"interactive": r.interactive.as_dict(), "batch": r.batch.as_dict()} for name, r in results.items()
        },
    }


def plot_mixed(results: Mapping[str, MixedResult], path: Path, title: str) -> None:
    """Per class bars: interactive per-user speed, batch throughput, worst first token."""
    names = list(results)
    figure, axes = plt.subplots(1, 3, figsize=(13, 4.2))

    def worst(result: MixedResult) -> float:
        known = [s.ttft_worst for s in (result.interactive, result.batch) if s.ttft_worst is not None]
        return max(known) if known else float("nan")

    def served(summary: Summary, value: float | None) -> float:
        return _num(value) if summary.requests else float("nan")  # no bar for a class that was not there

    panels: list[tuple[str, str, list[float]]] = [
        (
            "interactive: per-user tok/s",
            "tok/s",
            [served(results[n].interactive, results[n].interactive.per_user_tps) for n in names],
        ),
        ("batch: delivered tok/s", "tok/s", [served(results[n].batch, results[n].batch.total_tps) for n in names]),
        ("worst time to first token", "seconds (log)", [worst(results[n]) for n in names]),
    ]
    for axis, (heading, unit, values) in zip(axes, panels, strict=True):
        bars = axis.bar(names, values, color=["#4c72b0", "#dd8452", "#55a868", "#8172b3", "#937860"][: len(names)])
        axis.bar_label(bars, fmt="%.1f")
        axis.set_title(heading)
        axis.set_ylabel(unit)
        axis.tick_params(axis="x", rotation=20)
    axes[2].set_yscale("log")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _num(value: float | None) -> float:
    return float("nan") if value is None else value


# -- spill -------------------------------------------------------------------------------------


def spill_table(points: Sequence[Mapping[str, Any]], modes: Sequence[str], args: Any) -> str:
    references = ("speculative alone", "standard with the batch")
    judged = "adaptive" if "adaptive" in modes else modes[0]  # the mode set against the references
    header = ["users", *(f"routed ({m})" for m in modes), *references, f"{judged} vs the better", "worst TTFT"]
    lines = [
        f"## spill: interactive users beside a {args.batch}-request batch job ({args.kind}, "
        f"{args.max_tokens}-token answers, {args.duration:g} s a point"
        f"{', users arriving together' if getattr(args, 'together', False) else ''})\n",
        "Median per-user tok/s of the interactive users; in brackets, how many of their requests the "
        "speculative pool served.\n",
        "| " + " | ".join(header) + " |",
        "|" + "---:|" * len(header),
    ]
    for point in points:
        cells = [str(point["users"])]
        for mode in modes:
            run = point[f"routed ({mode})"]
            cells.append(f"{_f(run['per_user_tps'])} ({run['on_speculative']}/{run['requests']})")
        cells += [_f(point[name]["per_user_tps"]) for name in references]
        better = max(_num(point[name]["per_user_tps"]) for name in references)
        run = point[f"routed ({judged})"]
        cells.append(f"{_num(run['per_user_tps']) / better:.0%}" if better == better and better else "–")
        cells.append(f"{_f(run['ttft_worst'], 2)} s")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_spill(points: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    series = [key for key in points[0] if key != "users"]
    users = [p["users"] for p in points]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in series:
        left.plot(users, [_num(p[name]["per_user_tps"]) for p in points], marker="o", label=name)
        right.plot(users, [_num(p[name]["ttft_worst"]) for p in points], marker="o", label=name)
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(users, [str(u) for u in users])
        axis.set_xlabel("interactive users")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    left.set_ylabel("median per-user tok/s (interactive)")
    right.set_ylabel("worst interactive first token (s)")
    right.set_yscale("log")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- files -------------------------------------------------------------------------------------


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
