"""CPU the simulated engine spends per generated token, over HTTP, for a kind of request.

Starts `specroute sim` in its own process (from this checkout, or the one `--source` names), runs
`--streams` concurrent streamed chat requests of `--tokens` tokens each, `--rounds` times, and
prints the engine process's CPU time (user + system, from /proc) per token delivered, in µs.
Linux only. Run with the tools extra (httpx):

    python scripts/bench_sim_cost.py --variant plain --variant logprobs --variant n4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 5},
    "n4": {"n": 4},
    "json": {"response_format": {"type": "json_object"}},
}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _round(url: str, body: dict[str, Any], streams: int) -> int:
    async def one(client: httpx.AsyncClient) -> int:
        tokens = 0
        async with client.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams)) as client:
        return sum(await asyncio.gather(*(one(client) for _ in range(streams))))


def measure(source: Path, variant: str, *, streams: int, tokens: int, rounds: int, scale: float) -> float:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(source)}
    command = [sys.executable, "-m", "router.cli", "sim", "--port", str(port), "--time-scale", str(scale)]
    process = subprocess.Popen(command, env=env, cwd=source, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the simulator did not start")
            time.sleep(0.1)
        body = {
            "model": "glm-5.3-flash",
            "messages": [{"role": "user", "content": "Tell me about tides."}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **VARIANTS[variant],
        }
        asyncio.run(_round(base + "/v1/chat/completions", body, streams))  # warm up
        before = _cpu_seconds(process.pid)
        delivered = sum(asyncio.run(_round(base + "/v1/chat/completions", body, streams)) for _ in range(rounds))
        return (_cpu_seconds(process.pid) - before) / delivered * 1e6
    finally:
        process.terminate()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=100.0)
    args = parser.parse_args()
    for variant in args.variant or ["plain"]:
        cost = measure(
            args.source, variant, streams=args.streams, tokens=args.tokens, rounds=args.rounds, scale=args.time_scale
        )
        print(f"{variant}: {cost:.1f} µs of CPU per token", flush=True)


if __name__ == "__main__":
    main()
