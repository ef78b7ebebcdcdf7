"""The `specroute` command.

Building the argument parser imports nothing but argparse: each subcommand's code is imported
when that subcommand runs, so `serve` and `check-config` never load the simulator or the
benchmark (nor numpy and matplotlib, which only the tools need: `pip install 'specroute[tools]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router import logs
from router.config import CONFIG_ENV, ConfigError, load_settings, masked
from router.content import CONTENT_KINDS

# The packages of the `tools` extra; a subcommand that misses one says how to install them.
TOOLS = frozenset({"httpx", "numpy", "matplotlib", "rich"})
TOOLS_HINT = "pip install 'specroute[tools]'"


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "sim":
        return _sim(args)
    if args.command == "trace":
        return _trace(args)
    if args.command == "plan":
        from router.bench.plan import main as plan

        return plan(args)
    return _serve(args)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="specroute", description="OpenAI-compatible router for a speculative and a standard engine pool."
    )
    commands = root.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the router (with no configuration: in front of a simulated eight-node cluster)"
    )
    serve.add_argument("--config", help=f"YAML settings file (default: ${CONFIG_ENV})")
    serve.add_argument("--host", help="listen address (overrides listen.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    serve.add_argument("--workers", type=int, help="worker processes on the port (overrides listen.workers)")
    serve.add_argument(
        "--time-scale", type=float, default=1.0, help="simulated cluster only: run N times faster than real time"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--log-format", choices=["text", "json"], help="log lines as text or JSON (overrides log.format)"
    )

    check = commands.add_parser("check-config", help="validate a settings file and print it resolved")
    check.add_argument("file")

    sim = commands.add_parser("sim", help="run one simulated engine; or calibrate, or fit a profile")
    sim.add_argument("--profile", default="fast", help="profile name (fast, team) or a profile YAML file")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=9001)
    sim.add_argument("--time-scale", type=float, default=1.0, help="run N times faster than real time")
    sim.add_argument("--seed", type=int, default=0)
    sim_actions = sim.add_subparsers(dest="sim_command")
    calibrate = sim_actions.add_parser("calibrate", help="replay the field note on the profiles and compare")
    calibrate.add_argument("--fast", default="fast", help="profile for the speculative setup")
    calibrate.add_argument("--team", default="team", help="profile for the standard setup")
    fit = sim_actions.add_parser(
        "fit", help=f"fit a profile to `specroute bench sweep` JSON files, and check it (needs {TOOLS_HINT})"
    )
    fit.add_argument("sweep", nargs="+", help="sweep.json written by `specroute bench sweep` (one per --kind)")
    fit.add_argument("--base", default="team", help="profile to start from (fast, team or a file)")
    fit.add_argument("--name", help="name of the new profile")
    fit.add_argument("--out", help="write the profile here (default: print it)")
    fit.add_argument("--kv-cache-tokens", type=int, help="the engine's KV cache, if the sweep could not read it")
    fit.add_argument("--force", action="store_true", help="write the profile even when the fit is poor")

    trace = commands.add_parser("trace", help="the traffic record the router keeps (traffic.path)")
    trace_actions = trace.add_subparsers(dest="trace_command", required=True)
    export = trace_actions.add_parser("export", help="write the record as JSON lines, oldest first")
    export.add_argument("record", nargs="?", help="the record's file (default: traffic.path of --config)")
    export.add_argument("--config", help=f"YAML settings file (default: ${CONFIG_ENV})")
    export.add_argument("--out", help="write here (default: standard output)")

    _bench_parser(commands)
    _plan_parser(commands)
    return root


def _plan_parser(commands: Any) -> None:
    plan = commands.add_parser(
        "plan", help="replay traffic on every split of N nodes between the pools, in simulated time, and recommend one"
    )
    plan.add_argument("--record", help="a traffic record or its `trace export` (default: the mix below)")
    plan.add_argument(
        "--record-time-scale", type=float, default=1.0,
        help="the record was made in front of a simulator running N times faster than real time",
    )  # fmt: skip
    plan.add_argument("--burst-gap", type=float, default=0.1, help="arrivals this close (s): replayed as one burst")
    plan.add_argument("--nodes", type=int, default=8, help="nodes to split between the two pools")
    plan.add_argument("--fast", default="fast", help="profile of the speculative engine (name or YAML, `sim fit`)")
    plan.add_argument("--team", default="team", help="profile of the standard engine")
    plan.add_argument("--time-scale", type=float, default=5.0, help="run the simulated clusters N times faster")
    plan.add_argument("--ttft-target", type=float, default=3.0, help="interactive first-token target, seconds")
    plan.add_argument(
        "--batch-share", type=float, default=0.8,
        help="the share of the best batch throughput a split may give up for faster interactive users",
    )  # fmt: skip
    plan.add_argument("--batch-scale", type=float, default=1.0, help="multiply the batch traffic (2: doubled)")
    plan.add_argument("--interactive-scale", type=float, default=1.0, help="multiply the interactive traffic")
    plan.add_argument("--out", help="directory for plan.md, plan.json and plan.png")
    mix = plan.add_argument_group("a synthetic mix, without --record")
    mix.add_argument("--interactive", type=int, default=4, help="interactive users")
    mix.add_argument("--interactive-every", type=float, default=15.0, help="seconds between a user's requests")
    mix.add_argument("--batch", type=int, default=124, help="batch requests started at once")
    mix.add_argument("--batch-every", type=float, default=1.0, help="then one batch request every this many seconds")
    mix.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    mix.add_argument("--kind", choices=CONTENT_KINDS, default="prose")
    mix.add_argument("--prompt-tokens", type=int, default=64)
    mix.add_argument("--answer-tokens", type=int, default=512)


def _bench_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help=f"measure an OpenAI-compatible endpoint the way the note did (needs {TOOLS_HINT})"
    )
    scenarios = bench.add_subparsers(dest="scenario", required=True)

    def common(parser: argparse.ArgumentParser, *, target: bool) -> None:
        if target:
            parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
            parser.add_argument("--model", help="model name (default: the first the endpoint lists)")
            parser.add_argument("--api-key", default="none")
        parser.add_argument("--kind", choices=CONTENT_KINDS, default="prose", help="prompt set")
        parser.add_argument("--max-tokens", type=int, default=512, help="fixed answer length")
        parser.add_argument(
            "--time-scale", type=float, default=1.0 if target else 10.0,
            help="the target is a simulator running N times faster: report real-time figures",
        )  # fmt: skip
        parser.add_argument("--out", type=Path, help="directory for report.md, JSON, CSV and plots")

    def user_options(parser: argparse.ArgumentParser, *, duration: str) -> None:
        # The interactive users of the scenarios that run them (router.bench.scenarios.Users).
        parser.add_argument("--interactive", type=int, default=4, help="interactive users (closed loop)")
        parser.add_argument("--duration", type=float, default=300, help=duration)
        parser.add_argument("--think", type=float, default=5, help="an interactive user's think time, seconds")

    def mixed_options(parser: argparse.ArgumentParser) -> None:
        user_options(parser, duration="seconds (real time) to keep starting")
        parser.add_argument("--batch", type=int, default=124, help="requests the batch job keeps in flight")
        parser.add_argument("--batch-header", action="store_true", help="the batch job sends X-Job-Type: batch")
        parser.add_argument(
            "--together", action="store_true", help="interactive users arrive at the same moment (default: apart)"
        )
        parser.add_argument(
            "--named-by", choices=["user", "api_key", "nothing"], default="user",
            help="how each interactive user says who it is: the body's `user`, its own API key, or neither",
        )  # fmt: skip

    def users(value: str) -> list[int]:
        return [int(v) for v in value.split(",") if v]

    sweep_parser = scenarios.add_parser("sweep", help="one round per concurrency, like the note")
    common(sweep_parser, target=True)
    sweep_parser.add_argument("--users", type=users, default=[1, 2, 4, 8, 16, 32, 64, 128])

    mixed_parser = scenarios.add_parser("mixed", help="interactive users beside a batch job")
    common(mixed_parser, target=True)
    mixed_options(mixed_parser)

    compare = scenarios.add_parser("compare", help="a scenario on each layout of eight simulated nodes")
    common(compare, target=False)
    compare.add_argument("--scenario", dest="compared", choices=["mixed", "sweep"], default="mixed")
    compare.add_argument("--users", type=users, default=[1, 2, 4, 8, 16, 32, 64, 128])
    compare.add_argument(
        "--layouts", help="mixed only: run just these, comma-separated (routed, all-speculative, all-standard, "
        "fast-alone, team-alone)",
    )  # fmt: skip
    mixed_options(compare)

    replay = scenarios.add_parser(
        "replay", help="send a traffic record's requests at their recorded times (what `plan` predicts, measured)"
    )
    common(replay, target=True)
    replay.add_argument("--record", required=True, help="a traffic record or its `trace export`")
    replay.add_argument(
        "--record-time-scale", type=float, default=1.0,
        help="the record was made in front of a simulator running N times faster than real time",
    )  # fmt: skip
    replay.add_argument("--ttft-target", type=float, default=3.0, help="interactive first-token target, seconds")

    batchjob = scenarios.add_parser(
        "batchjob", help="interactive users alone, then while a Batch API job runs (the router's /v1/batches)"
    )
    common(batchjob, target=True)
    user_options(batchjob, duration="seconds (real time) of each phase")
    batchjob.add_argument("--lines", type=int, default=10_000, help="requests in the batch")
    batchjob.add_argument("--batch-max-tokens", type=int, default=64, help="answer length of each batch line")

    fair = scenarios.add_parser(
        "fairness", help="chat users beside an agent with many requests in flight, with and without fair share"
    )
    common(fair, target=False)
    user_options(fair, duration="seconds (real time) of each run")
    fair.set_defaults(interactive=5, duration=120, think=3, max_tokens=256, time_scale=2.0)
    fair.add_argument("--agent", type=int, default=10, help="requests the agent keeps in flight")
    fair.add_argument("--slots", type=int, default=8, help="the router's slots on the speculative engine")

    spill = scenarios.add_parser(
        "spill", help="interactive users from few to many on top of a batch job: where does routing put them?"
    )
    common(spill, target=False)
    mixed_options(spill)
    spill.set_defaults(batch=96, duration=120, think=3, max_tokens=256)
    spill.add_argument("--users", type=users, default=[1, 2, 4, 8, 16, 32], help="interactive users per point")
    spill.add_argument("--modes", default="adaptive,static", help="routing modes to run, comma-separated")

    talks = scenarios.add_parser(
        "conversations", help="users in long conversations beside a batch job that comes and goes, per routing"
    )
    talks.add_argument("--users", type=int, default=6, help="conversations at once")
    talks.add_argument("--turns", type=int, default=10, help="turns of each conversation")
    talks.add_argument("--context-words", type=int, default=16000, help="words of the context the first turn sends")
    talks.add_argument("--turn-words", type=int, default=600, help="words of each new user message")
    talks.add_argument("--answer-tokens", type=int, default=256, help="fixed answer length")
    talks.add_argument("--think", type=float, default=5, help="seconds between an answer and the next turn")
    talks.add_argument("--batch", type=int, default=64, help="batch requests in flight while the job runs")
    talks.add_argument("--batch-on", type=float, default=40, help="seconds the batch job runs at a time")
    talks.add_argument("--batch-off", type=float, default=40, help="seconds it pauses between")
    talks.add_argument("--arrival", type=float, help="seconds between users' first turns (default: think ÷ users)")
    talks.add_argument("--repeat", type=int, default=1, help="runs of every setting, in alternating order")
    talks.add_argument(
        "--modes", default="adaptive,adaptive-unpriced,static,round-robin", help="routing settings, comma-separated"
    )
    talks.add_argument("--time-scale", type=float, default=4.0, help="the simulated engines run N times faster")
    talks.add_argument("--out", type=Path, help="directory for report.md and JSON")


def _missing_tools(command: str, exc: ModuleNotFoundError) -> int:
    """Say how to install the tools, if a missing one is what failed; re-raise anything else."""
    if (exc.name or "").partition(".")[0] not in TOOLS:
        raise exc
    print(f"specroute {command} needs the tools ({exc.name} is not installed): {TOOLS_HINT}", file=sys.stderr)
    return 1


def _bench(args: argparse.Namespace) -> int:
    try:
        from router.bench.cli import run
    except ModuleNotFoundError as exc:
        return _missing_tools("bench", exc)
    return run(args)


def _trace(args: argparse.Namespace) -> int:
    from router.record import read_record

    path = args.record
    if path is None:
        try:
            path = load_settings(args.config).traffic.path
        except ConfigError as exc:
            print(f"invalid configuration\n{exc}", file=sys.stderr)
            return 1
        if path is None:
            print("no traffic record: traffic.path is not set", file=sys.stderr)
            return 1
    if not Path(path).exists():
        print(f"no traffic record at {path}", file=sys.stderr)
        return 1
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115 (closed below, or stdout)
    try:
        count = 0
        for entry in read_record(path):
            out.write(json.dumps(entry.as_dict()) + "\n")
            count += 1
    finally:
        if args.out:
            out.close()
    print(f"{count} requests", file=sys.stderr)
    return 0


def _check_config(path: str) -> int:
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(f"{path}: invalid configuration\n{exc}", file=sys.stderr)
        return 1
    print(json.dumps(masked(settings), indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.workers is not None and not 1 <= args.workers <= 64:
        print("--workers: from 1 to 64", file=sys.stderr)
        return 2
    if args.config is None and not os.environ.get(CONFIG_ENV):
        from router.demo import serve_cluster

        if (args.workers or 1) > 1:
            print("--workers needs a configuration (--config): the simulated cluster is one process", file=sys.stderr)
            return 2

        logs.configure(args.log_level, args.log_format or "text")
        asyncio.run(
            serve_cluster(
                host=args.host,
                port=args.port,
                time_scale=args.time_scale,
            )
        )
        return 0
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"invalid configuration\n{exc}", file=sys.stderr)
        return 1
    path = args.config
    workers = args.workers or settings.listen.workers
    if workers > 1:
        from router.workers.supervisor import serve_workers

        logs.configure(args.log_level, args.log_format or settings.log.format)
        return serve_workers(
            config=path or os.environ[CONFIG_ENV],
            workers=workers,
            host=args.host or settings.listen.host,
            port=settings.listen.port if args.port is None else args.port,
            memory=settings.classify.client_memory_seconds,
            max_clients=settings.state.max_clients,
            log_level=args.log_level,
            log_format=args.log_format,
        )
    from router.server.run import run_router

    run_router(
        settings,
        load=lambda: load_settings(path),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    return 0


def _sim(args: argparse.Namespace) -> int:
    import uvicorn

    from router.sim import calibrate
    from router.sim.profile import load_profile
    from router.sim.server import create_sim_app

    if args.sim_command == "calibrate":
        checks = calibrate.calibrate(load_profile(args.fast), load_profile(args.team))
        print(calibrate.table(checks))
        failed = [c for c in checks if not c.ok]
        print(f"\n{len(checks) - len(failed)} of {len(checks)} figures within tolerance")
        return 1 if failed else 0
    if args.sim_command == "fit":
        try:
            from router.sim import fit
        except ModuleNotFoundError as exc:
            return _missing_tools("sim fit", exc)
        return fit.main(
            args.sweep,
            base=args.base,
            name=args.name,
            out=args.out,
            kv_cache_tokens=args.kv_cache_tokens,
            force=args.force,
        )
    profile = load_profile(args.profile)
    print(f"specroute sim: {profile.name} engine ({profile.model}) at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(
        create_sim_app(profile, time_scale=args.time_scale, seed=args.seed),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
