#!/usr/bin/env python3
"""What the router costs on the stream path, measured side by side with going direct.

Three processes on loopback: a minimal streaming upstream (raw ASGI under uvicorn), the router in
front of it (`specroute serve`, uvloop + httptools), and this load generator. Two measurements:

1. CPU per 1,000 streamed chunks: streams of --chunks chunks sent as fast as the upstream can,
   --streams at a time; the router's own CPU time (user + system, from /proc) divided by the
   chunks it forwarded.
2. Paced streams: --paced-streams concurrent streams at one chunk every --interval seconds, once
   direct and once through the router, same run: time to first token p50/p99 and the gap
   between chunks, each side, and the difference.
3. One stream at a time, --single requests, alternating direct and through the router: the
   time to first token the router adds to a lone request.

    python scripts/bench_router_overhead.py [--streams 32 --chunks 500 --paced-streams 128 --interval 0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
from loopback import free_port, wait_until_up

from router.quantiles import percentile

UPSTREAM = textwrap.dedent(
    """
    import asyncio, json, sys
    import uvicorn

    CHUNK = "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "word "}, "logprobs": None, "finish_reason": None}]}) + "\\n\\n"
    USAGE = "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}}) + "\\n\\n"

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":  # /health answers 200; the router's /metrics scrape, 404
            status = 200 if scope["path"] == "/health" else 404
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        count, interval = request["max_tokens"], request.get("interval", 0)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        chunk = CHUNK.encode()
        for i in range(count):
            if interval:
                await asyncio.sleep(interval)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail = USAGE.replace('"completion_tokens": 0', f'"completion_tokens": {count}') + "data: [DONE]\\n\\n"
        await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools", log_level="warning")
    """
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream(client: httpx.AsyncClient, url: str, chunks: int, interval: float) -> tuple[float, list[float]]:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": chunks, "stream": True,
            "interval": interval}  # fmt: skip
    started = time.perf_counter()
    arrivals = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return arrivals[0] - started, gaps


async def run(url: str, streams: int, chunks: int, interval: float) -> tuple[list[float], list[float]]:
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        results = await asyncio.gather(*(stream(client, url, chunks, interval) for _ in range(streams)))
    return [ttft for ttft, _ in results], [gap for _, gaps in results for gap in gaps]


def pct(values: list[float], share: float) -> float:
    return percentile(values, share) or math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=500)
    parser.add_argument("--paced-streams", type=int, default=128)
    parser.add_argument("--paced-chunks", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.02)
    parser.add_argument("--single", type=int, default=200)
    args = parser.parse_args()

    upstream_port, router_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "upstream.py"
        script.write_text(UPSTREAM)
        config = Path(tmp) / "router.yaml"
        config.write_text(
            "pools:\n"
            f"  fast: {{speculative: true, backends: {{up: {{url: 'http://127.0.0.1:{upstream_port}', "
            "max_concurrency: 1024}}}\n"
        )
        upstream = subprocess.Popen([sys.executable, str(script), str(upstream_port)])
        router = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", str(router_port),
             "--log-level", "warning"]
        )  # fmt: skip
        try:
            direct, routed = f"http://127.0.0.1:{upstream_port}", f"http://127.0.0.1:{router_port}"
            wait_until_up(direct + "/health", upstream)
            wait_until_up(routed + "/readyz", router)
            asyncio.run(run(routed, args.paced_streams, 5, 0))  # open the router's upstream connections

            before = cpu_seconds(router.pid)
            started = time.perf_counter()
            asyncio.run(run(routed, args.streams, args.chunks, 0))
            elapsed = time.perf_counter() - started
            spent = cpu_seconds(router.pid) - before
            forwarded = args.streams * args.chunks
            print(f"1. unpaced: {args.streams} streams x {args.chunks} chunks through the router in {elapsed:.2f} s")
            print(f"   router CPU {spent:.2f} s = {spent / forwarded * 1000:.3f} CPU-s per 1,000 chunks "
                  f"({forwarded / elapsed:,.0f} chunks/s end to end)")  # fmt: skip

            print(f"2. paced: {args.paced_streams} streams x {args.paced_chunks} chunks, one every "
                  f"{args.interval * 1000:.0f} ms")  # fmt: skip
            sides = {}
            for name, url in (("direct", direct), ("router", routed)):
                before = cpu_seconds(router.pid)
                sides[name] = asyncio.run(run(url, args.paced_streams, args.paced_chunks, args.interval))
                spent = cpu_seconds(router.pid) - before
            forwarded = args.paced_streams * args.paced_chunks
            print(f"   router CPU {spent:.2f} s = {spent / forwarded * 1000:.3f} CPU-s per 1,000 chunks")
            print("   side    TTFT p50   TTFT p99   gap p50   gap p99")
            for name, (ttfts, gaps) in sides.items():
                print(f"   {name:6} {pct(ttfts, .5) * 1000:7.1f}ms {pct(ttfts, .99) * 1000:8.1f}ms "
                      f"{pct(gaps, .5) * 1000:7.1f}ms {pct(gaps, .99) * 1000:7.1f}ms")  # fmt: skip
            (dt, _), (rt, _) = sides["direct"], sides["router"]
            print(f"   router adds {(statistics.median(rt) - statistics.median(dt)) * 1000:+.1f} ms to the median "
                  f"first token, {(pct(rt, .99) - pct(dt, .99)) * 1000:+.1f} ms at p99")  # fmt: skip

            lone: dict[str, list[float]] = {"direct": [], "router": []}
            before = cpu_seconds(router.pid)
            for _ in range(args.single):
                for name, url in (("direct", direct), ("router", routed)):
                    lone[name] += asyncio.run(run(url, 1, 2, 0))[0]
            spent = cpu_seconds(router.pid) - before
            d, r = statistics.median(lone["direct"]), statistics.median(lone["router"])
            print(f"3. one stream at a time, {args.single} each: median TTFT direct {d * 1000:.2f} ms, "
                  f"router {r * 1000:.2f} ms, added {(r - d) * 1000:+.2f} ms")  # fmt: skip
            # CPU time, unlike the wall-clock figures, hardly moves when other work shares the machine.
            print(f"   router CPU {spent / args.single * 1000:.2f} ms per request")
        finally:
            for process in (router, upstream):
                process.terminate()
                process.wait(10)


if __name__ == "__main__":
    main()
