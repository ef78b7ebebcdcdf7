"""`specroute bench sweep | mixed | compare | spill | batchjob | replay | conversations` (arguments: router/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from router.bench import report
from router.bench.batchjob import batch_job
from router.bench.batchjob import markdown as batchjob_markdown
from router.bench.compare import run_on_layout, running_layout
from router.bench.conversations import MODE_SETTINGS, ConversationsResult, conversations
from router.bench.conversations import Options as ConversationsOptions
from router.bench.conversations_report import batch_ratios
from router.bench.conversations_report import markdown as conversations_markdown
from router.bench.load import Target
from router.bench.plan import Figures, Outcome, Split, recorded_at
from router.bench.plan import table as plan_table
from router.bench.replay import replay
from router.bench.scenarios import FairnessResult, MixedResult, Summary, SweepRound, Users, fairness, mixed, sweep
from router.demo import LAYOUTS, LayoutName
from router.record import read_record
from router.sim.profile import load_profile

T = TypeVar("T")
console = Console(stderr=True)


def run(args: argparse.Namespace) -> int:
    out: Path = args.out or Path("bench-results") / f"{args.scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    if args.scenario == "sweep":
        return _sweep(args, out)
    if args.scenario == "mixed":
        return _mixed(args, out)
    if args.scenario == "spill":
        return _spill(args, out)
    if args.scenario == "batchjob":
        return _batchjob(args, out)
    if args.scenario == "replay":
        return _replay(args, out)
    if args.scenario == "fairness":
        return _fairness(args, out)
    if args.scenario == "conversations":
        return _conversations(args, out)
    return _compare(args, out)


def _target(args: argparse.Namespace) -> Target:
    model = args.model
    if model is None:
        response = httpx.get(
            args.base_url.rstrip("/") + "/models", headers={"authorization": f"Bearer {args.api_key}"}, timeout=10
        )
        response.raise_for_status()
        model = response.json()["data"][0]["id"]
    return Target(base_url=args.base_url, model=model, api_key=args.api_key, time_scale=args.time_scale)


def _with_progress(description: str, work: Callable[[Callable[[float], None]], Coroutine[Any, Any, T]]) -> T:
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
        console=console,
    ) as progress:  # fmt: skip
        task = progress.add_task(description, total=1.0)
        return asyncio.run(work(lambda share: progress.update(task, completed=share)))


def _finish(out: Path, markdown: str) -> int:
    (out / "report.md").write_text(markdown + "\n")
    print(markdown)
    console.print(f"[green]wrote {out}/")
    return 0


def _sweep(args: argparse.Namespace, out: Path) -> int:
    target = _target(args)
    rounds = _with_progress(
        f"sweep {args.base_url}",
        lambda progress: sweep(target, args.users, kind=args.kind, max_tokens=args.max_tokens, progress=progress),
    )
    meta = _meta(args, target)
    report.write_json(out / "sweep.json", report.sweep_data(rounds, meta))
    report.write_csv(out / "sweep.csv", [_row(r.summary, users=r.users) for r in rounds])
    report.plot_sweeps({target.base_url: rounds}, out / "sweep.png", f"{target.model}, {args.kind}")
    prior = report.prior_block(
        rounds, kind=args.kind, base_url=target.base_url, model=target.model, max_tokens=args.max_tokens
    )
    (out / f"prior-{args.kind}.yaml").write_text(prior + "\n")
    return _finish(
        out,
        f"## sweep of {target.base_url} ({target.model}, {args.kind})\n\n{report.sweep_table(rounds)}\n\n"
        f"The pool's prior speed (`prior-{args.kind}.yaml`; see README, Configuration):\n\n"
        f"```yaml\n{prior}\n```",
    )


def _users(args: argparse.Namespace, *, count: int) -> Users:
    """The interactive users of a mixed or batch-job run, from their common arguments."""
    return Users(count=count, duration=args.duration, think_time=args.think, kind=args.kind, max_tokens=args.max_tokens)


def _mixed_scenario(
    args: argparse.Namespace, *, interactive: int, batch: int, progress: Callable[[float], None] | None = None
) -> Callable[[Target], Coroutine[Any, Any, MixedResult]]:
    def scenario(target: Target) -> Coroutine[Any, Any, MixedResult]:
        return mixed(
            target,
            _users(args, count=interactive),
            batch_in_flight=batch,
            batch_header=args.batch_header,
            together=args.together,
            named_by=args.named_by,
            progress=progress,
        )

    return scenario


def _mixed(args: argparse.Namespace, out: Path) -> int:
    target = _target(args)
    result = _with_progress(
        f"mixed {args.base_url}",
        lambda progress: _mixed_scenario(args, interactive=args.interactive, batch=args.batch, progress=progress)(
            target
        ),
    )
    results = {target.base_url: result}
    _write_mixed(results, args, target, out)
    return _finish(out, f"## mixed load on {target.base_url}\n\n" + report.mixed_table(results))


def _replay(args: argparse.Namespace, out: Path) -> int:
    entries = sorted(read_record(args.record), key=lambda e: e.at)
    if args.record_time_scale != 1:
        entries = [recorded_at(e, args.record_time_scale) for e in entries]
    target = _target(args)
    records = _with_progress(f"replay {args.base_url}", lambda progress: replay(target, entries, progress=progress))
    figures = {
        job: Figures.of(mine, ttft_target=args.ttft_target)
        for job in ("interactive", "batch")
        if (mine := [r for r in records if r.label == job])
    }
    measured = Outcome(Split(0, 0, 0, 0), figures.get("interactive"), figures.get("batch"))
    report.write_json(out / "replay.json", {**_meta(args, target), "record": args.record, **measured.as_dict()})
    text = plan_table([measured], ttft_target=args.ttft_target).replace("0 speculative + 0 standard", target.base_url)
    return _finish(out, f"## replay of {args.record} on {target.base_url}\n\n{text}")


def _batchjob(args: argparse.Namespace, out: Path) -> int:
    target = _target(args)
    result = _with_progress(
        f"batchjob {args.base_url}",
        lambda progress: batch_job(
            target,
            _users(args, count=args.interactive),
            lines=args.lines,
            batch_max_tokens=args.batch_max_tokens,
            progress=progress,
        ),
    )
    report.write_json(out / "batchjob.json", {**_meta(args, target), **result.as_dict()})
    text = batchjob_markdown(result, users=args.interactive, duration=args.duration, scale=target.time_scale)
    return _finish(out, text)


def _write_mixed(results: dict[str, MixedResult], args: argparse.Namespace, target: Target, out: Path) -> None:
    report.write_json(out / "mixed.json", report.mixed_data(results, _meta(args, target)))
    rows = [
        _row(summary, layout=name, job=job)
        for name, result in results.items()
        for job, summary in (("interactive", result.interactive), ("batch", result.batch))
    ]
    report.write_csv(out / "mixed.csv", rows)
    report.plot_mixed(results, out / "mixed.png", f"{args.interactive} interactive users + {args.batch} batch")


def _compare(args: argparse.Namespace, out: Path) -> int:
    model = load_profile("fast").model
    target_meta = Target(base_url="(simulated layouts)", model=model, time_scale=args.time_scale)
    if args.compared == "sweep":
        rounds: dict[str, list[SweepRound]] = {}
        for name in LAYOUTS:
            console.print(f"[bold]{name}[/]: sweep {args.users}")
            rounds[name] = run_on_layout(
                name,
                lambda target: sweep(target, args.users, kind=args.kind, max_tokens=args.max_tokens),
                model=model,
                time_scale=args.time_scale,
            )
        report.plot_sweeps(rounds, out / "compare-sweep.png", f"three layouts of eight nodes, {args.kind}")
        report.write_json(
            out / "compare-sweep.json",
            {name: report.sweep_data(r, _meta(args, target_meta)) for name, r in rounds.items()},
        )
        rows = [_row(r.summary, layout=name, users=r.users) for name, rs in rounds.items() for r in rs]
        report.write_csv(out / "compare-sweep.csv", rows)
        markdown = "\n\n".join(f"### {name}\n\n{report.sweep_table(r)}" for name, r in rounds.items())
        return _finish(out, "## compare: sweep\n\n" + markdown)

    runs: list[tuple[LayoutName, int, int]] = [
        ("routed", args.interactive, args.batch),
        ("all-speculative", args.interactive, args.batch),
        ("all-standard", args.interactive, args.batch),
        ("fast-alone", args.interactive, 0),
        ("team-alone", 0, args.batch),
    ]
    if args.layouts:
        chosen = set(args.layouts.split(","))
        runs = [run for run in runs if run[0] in chosen]
    results: dict[str, MixedResult] = {}
    for name, interactive, batch in runs:
        console.print(f"[bold]{name}[/]")
        scenario = _mixed_scenario(args, interactive=interactive, batch=batch)
        results[name] = run_on_layout(name, scenario, model=model, time_scale=args.time_scale)
    _write_mixed(results, args, target_meta, out)
    markdown = (
        f"## compare: {args.interactive} interactive users + a {args.batch}-request batch job, "
        f"{args.max_tokens}-token answers, {args.duration:g} s\n\n"
        + report.mixed_table(results)
        + "\n\n"
        + report.verdicts_table(results)
    )
    return _finish(out, markdown)


def _meta(args: argparse.Namespace, target: Target) -> dict[str, Any]:
    return {
        "target": target.base_url,
        "model": target.model,
        "kind": args.kind,
        "answer_tokens": args.max_tokens,
        "time_scale": target.time_scale,
    }


def _row(summary: Summary, **labels: Any) -> dict[str, Any]:
    return {**labels, **summary.as_dict()}


def _spill(args: argparse.Namespace, out: Path) -> int:
    """Each point: N interactive users beside the batch job, routed in each mode, and the two
    references: the same users on the speculative engine alone, and on the standard engine
    together with the batch job. The better reference is what routing should come close to."""
    model = load_profile("fast").model
    modes = [m for m in args.modes.split(",") if m]
    points = []
    for users in args.users:
        point: dict[str, Any] = {"users": users}
        runs: list[tuple[str, LayoutName, int, str | None]] = [
            *((f"routed ({mode})", "routed", args.batch, mode) for mode in modes),
            ("speculative alone", "fast-alone", 0, None),
            ("standard with the batch", "team-alone", args.batch, None),
        ]
        for label, layout_name, batch, mode in runs:
            console.print(f"[bold]{users} users[/]: {label}")
            scenario = _mixed_scenario(args, interactive=users, batch=batch)
            result = run_on_layout(layout_name, scenario, model=model, time_scale=args.time_scale, routing_mode=mode)
            point[label] = result.interactive.as_dict()
            point[label]["on_speculative"] = sum(
                1 for r in result.records if r.label == "interactive" and r.pool == "fast"
            )
        points.append(point)
    data = {**_meta(args, Target("(simulated layouts)", model, time_scale=args.time_scale)), "points": points,
            "batch_in_flight": args.batch}  # fmt: skip
    report.write_json(out / "spill.json", data)
    report.write_csv(
        out / "spill.csv",
        [{"users": p["users"], "series": k, **v} for p in points for k, v in p.items() if k != "users"],
    )
    report.plot_spill(
        points, out / "spill.png", f"interactive users beside a {args.batch}-request batch job, {args.kind}"
    )
    return _finish(out, report.spill_table(points, modes, args))


def _fairness(args: argparse.Namespace, out: Path) -> int:
    """The chat users alone, then beside the agent under each fairness setting, each on a fresh
    speculative engine whose router has `--slots` slots on it."""
    model = load_profile("fast").model
    no_newcomers = {"SPECROUTE_FAIRNESS__NEWCOMER_SLOTS": "0"}
    runs: list[tuple[str, int, dict[str, str]]] = [
        ("chat alone", 0, {}),
        ("with the agent, fair share", args.agent, {"SPECROUTE_FAIRNESS__FAIR_SHARE": "true"}),
        ("with the agent, fair share, no room over the cap", args.agent, no_newcomers),
        ("with the agent, fair order alone", args.agent, {**no_newcomers, "SPECROUTE_FAIRNESS__KEEP_ROOM": "false"}),
        ("with the agent, first come first served", args.agent, {"SPECROUTE_FAIRNESS__FAIR_SHARE": "false"}),
    ]
    results: dict[str, FairnessResult] = {}
    for label, agent, env in runs:
        console.print(f"[bold]{label}[/]")
        scenario = functools.partial(fairness, users=_users(args, count=args.interactive), agent_in_flight=agent)
        results[label] = run_on_layout(
            "fast-alone", scenario, model=model, time_scale=args.time_scale, environ=env, slots=args.slots
        )
    alone = results["chat alone"].chat_ttft_p95
    alone_later = results["chat alone"].later_ttft_p95
    clients = args.interactive + 1
    rows = [
        "| run | chat first token p50 | chat p95 | chat p95 ÷ alone | p95 after each user's first question "
        "| ÷ alone | chat tokens/s per user | agent requests | agent share of tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, result in results.items():
        rows.append(
            f"| {label} | {_seconds(result.chat.ttft_p50)} | {_seconds(result.chat_ttft_p95)} "
            f"| {_ratio(result.chat_ttft_p95, alone)} | {_seconds(result.later_ttft_p95)} "
            f"| {_ratio(result.later_ttft_p95, alone_later)} | {_rate(result.chat.per_user_tps)} "
            f"| {result.agent.requests} | {result.agent_token_share:.0%} |"
        )
    fair = results["with the agent, fair share"]
    ratio = (fair.chat_ttft_p95 or 0) / alone if alone else float("inf")
    verdicts = [
        f"- chat first-token p95 with the agent and fair share within 1.5× of alone: {ratio:.2f}× "
        f"({'met' if ratio <= 1.5 else 'NOT met'}); after each user's first question: "
        f"{_ratio(fair.later_ttft_p95, alone_later)}",
        f"- the agent's share of tokens at least its fair share (1/{clients} = {1 / clients:.0%}): "
        f"{fair.agent_token_share:.0%} ({'met' if fair.agent_token_share >= 1 / clients else 'NOT met'})",
    ]
    data = {
        **_meta(args, Target("(simulated fast engine)", model, time_scale=args.time_scale)),
        "agent_in_flight": args.agent,
        "slots": args.slots,
        "runs": {
            label: {
                "chat": r.chat.as_dict(),
                "agent": r.agent.as_dict(),
                "chat_ttft_p95": r.chat_ttft_p95,
                "later_ttft_p95": r.later_ttft_p95,
                "agent_token_share": r.agent_token_share,
            }
            for label, r in results.items()
        },
    }
    report.write_json(out / "fairness.json", data)
    return _finish(
        out,
        f"## fairness: {args.interactive} chat users beside an agent with {args.agent} requests in flight, "
        f"{args.slots} slots on the speculative engine, {args.max_tokens}-token answers, {args.duration:g} s\n\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(verdicts),
    )


def _seconds(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "-"


def _ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}×" if value is not None and reference else "-"


def _rate(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _conversations(args: argparse.Namespace, out: Path) -> int:
    """Each routing setting on the embedded layout, started clean, `--repeat` times in alternating
    order (router.bench.conversations)."""
    fields = [f.name for f in dataclasses.fields(ConversationsOptions)]
    options = ConversationsOptions(**{name: getattr(args, name) for name in fields if hasattr(args, name)})
    model = load_profile("fast").model
    modes = [m for m in args.modes.split(",") if m]
    results: dict[str, list[ConversationsResult]] = {mode: [] for mode in modes}
    for repetition in range(args.repeat):
        for mode in modes if repetition % 2 == 0 else modes[::-1]:
            routing_mode, environ = MODE_SETTINGS[mode]
            with running_layout(
                "routed", time_scale=args.time_scale, routing_mode=routing_mode, environ=environ,
                prompt_tokens_details=True,
            ) as base_url:  # fmt: skip
                target = Target(base_url=base_url, model=model, time_scale=args.time_scale)
                results[mode].append(
                    _with_progress(
                        f"conversations: {mode} #{repetition + 1}",
                        functools.partial(conversations, target, options, mode=mode),
                    )
                )
    report.write_json(
        out / "conversations.json",
        {"options": dataclasses.asdict(options), "time_scale": args.time_scale, "batch_ratios": batch_ratios(results),
         "results": {mode: [r.summary() for r in runs] for mode, runs in results.items()}},
    )  # fmt: skip
    return _finish(out, conversations_markdown(results, options, ttft_target=3.0))
