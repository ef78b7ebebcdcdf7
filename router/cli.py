"""The `specroute` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

import uvicorn

from router.app import create_app
from router.config import ConfigError, Settings, load_settings, masked


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specroute", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the router")
    serve.add_argument("--config", help="YAML settings file (default: $SPECROUTE_CONFIG)")
    serve.add_argument("--host", help="listen address (overrides listen.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    check = commands.add_parser("check-config", help="validate a settings file and print it resolved")
    check.add_argument("file")

    args = parser.parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.file)
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
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"invalid configuration\n{exc}", file=sys.stderr)
        return 1
    run_router(settings, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def run_router(settings: Settings, *, host: str | None, port: int | None, log_level: str) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    uvicorn.run(
        create_app(settings),
        host=host or settings.listen.host,
        port=port if port is not None else settings.listen.port,
        loop="uvloop",
        http="httptools",
        access_log=False,  # the router writes its own, one line per request
        server_header=False,
        log_level=log_level,
    )


if __name__ == "__main__":
    sys.exit(main())
