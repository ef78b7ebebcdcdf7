"""The `specroute` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence

import uvicorn

from router import logs
from router.app import create_app
from router.config import CONFIG_ENV, ConfigError, Settings, load_settings, masked
from router.listener import uvicorn_config
from router.server import RouterServer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specroute", description="OpenAI-compatible router for a speculative and a standard engine pool."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the router (with no configuration: in front of a simulated eight-node cluster)"
    )
    serve.add_argument("--config", help=f"YAML settings file (default: ${CONFIG_ENV})")
    serve.add_argument("--host", help="listen address (overrides listen.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides listen.port)")
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
    fit = sim_actions.add_parser("fit", help="derive a profile's speed from a `specroute bench sweep` JSON")
    fit.add_argument("sweep", help="JSON written by `specroute bench sweep --out`")
    fit.add_argument("--base", default="team", help="profile to start from (fast, team or a file)")
    fit.add_argument("--name", help="name of the new profile")
    fit.add_argument("--out", help="write the profile here (default: print it)")

    from router.bench.cli import add_parser as add_bench_parser

    add_bench_parser(commands)

    args = parser.parse_args(argv)
    if args.command == "bench":
        from router.bench.cli import run as run_bench

        return run_bench(args)
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "sim":
        return _sim(args)
    return _serve(args)


def _check_config(path: str) -> int:
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(f"{path}: invalid configuration\n{exc}", file=sys.stderr)
        return 1
    print(json.dumps(masked(settings), indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.config is None and not os.environ.get(CONFIG_ENV):
        from router.sim.cluster import serve_cluster

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
    run_router(
        settings,
        load=lambda: load_settings(path),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_format=args.log_format,
    )
    return 0


def run_router(
    settings: Settings,
    *,
    load: Callable[[], Settings] | None = None,
    host: str | None,
    port: int | None,
    log_level: str,
    log_format: logs.LogFormat | None = None,
) -> None:
    logs.configure(log_level, log_format or settings.log.format)
    config = uvicorn_config(create_app(settings, load=load), settings, host=host, port=port, log_level=log_level)
    # Once uvicorn has shut down on SIGINT or SIGTERM it raises the signal again, for the handler
    # there before it started; with this one, a router that stopped as asked exits with status 0.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, lambda number, frame: None)
    RouterServer(config).run()


def _sim(args: argparse.Namespace) -> int:
    from router.sim import calibrate, fit
    from router.sim.profile import load_profile
    from router.sim.server import create_sim_app

    if args.sim_command == "calibrate":
        checks = calibrate.calibrate(load_profile(args.fast), load_profile(args.team))
        print(calibrate.table(checks))
        failed = [c for c in checks if not c.ok]
        print(f"\n{len(checks) - len(failed)} of {len(checks)} figures within tolerance")
        return 1 if failed else 0
    if args.sim_command == "fit":
        return fit.main(args.sweep, base=args.base, name=args.name, out=args.out)
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
