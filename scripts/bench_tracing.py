#!/usr/bin/env python3
"""What tracing costs per request: two routers side by side, one with `tracing.enabled`, one without.

Processes on loopback: the minimal streaming upstream of bench_router_overhead.py, two routers in
front of it (`specroute serve`; the same settings but `tracing`), and this load generator, which
also runs an OTLP/HTTP sink that answers every export (so the traced router's exporter does all
its work: it encodes and sends every span). Requests alternate between the two routers, so both
see the same machine:

1. one stream at a time (--single of each): the median first token, and each router's CPU per request;
2. --streams concurrent streams of --chunks chunks, --rounds rounds each: each router's CPU per request.

    python scripts/bench_tracing.py [--single 300 --streams 32 --chunks 20 --rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from bench_router_overhead import UPSTREAM, cpu_seconds, run
from loopback import free_port, wait_until_up


class _Sink(BaseHTTPRequestHandler):
    exports = 0
    received = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).exports += 1
        type(self).received += int(self.headers.get("content-length", 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single", type=int, default=300)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    upstream_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "upstream.py"
        script.write_text(UPSTREAM)
        upstream = subprocess.Popen([sys.executable, str(script), str(upstream_port)])
        routers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        for name, tracing in (
            ("off", "{enabled: false}"),
            ("on", f"{{enabled: true, endpoint: 'http://127.0.0.1:{sink.server_port}/v1/traces', sample_ratio: 1}}"),
        ):
            port = free_port()
            config = Path(tmp) / f"{name}.yaml"
            config.write_text(
                "pools:\n"
                f"  fast: {{speculative: true, backends: {{up: {{url: 'http://127.0.0.1:{upstream_port}', "
                "max_concurrency: 1024}}}\n"
                f"tracing: {tracing}\n"
            )
            process = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--port", str(port),
                 "--log-level", "warning"]
            )  # fmt: skip
            routers[name] = (process, f"http://127.0.0.1:{port}")
        try:
            wait_until_up(f"http://127.0.0.1:{upstream_port}/health", upstream)
            for process, url in routers.values():
                wait_until_up(url + "/readyz", process)
                asyncio.run(run(url, args.streams, 5, 0))  # open its upstream connections

            ttfts: dict[str, list[float]] = {name: [] for name in routers}
            cpu = dict.fromkeys(routers, 0.0)
            for _ in range(args.single):
                for name, (process, url) in routers.items():
                    before = cpu_seconds(process.pid)
                    ttfts[name] += asyncio.run(run(url, 1, 2, 0))[0]
                    cpu[name] += cpu_seconds(process.pid) - before
            print(f"1. one stream at a time, {args.single} each, alternating")
            print("   tracing  TTFT p50   router CPU per request")
            for name in routers:
                ttft, spent = statistics.median(ttfts[name]), cpu[name] / args.single
                print(f"   {name:7} {ttft * 1000:7.2f}ms {spent * 1000:8.2f} ms")
            added = statistics.median(ttfts["on"]) - statistics.median(ttfts["off"])
            print(f"   tracing adds {added * 1000:+.2f} ms to the median first token; CPU ratio on/off "
                  f"{cpu['on'] / cpu['off']:.2f}")  # fmt: skip

            cpu = dict.fromkeys(routers, 0.0)
            for _ in range(args.rounds):
                for name, (process, url) in routers.items():
                    before = cpu_seconds(process.pid)
                    asyncio.run(run(url, args.streams, args.chunks, 0))
                    cpu[name] += cpu_seconds(process.pid) - before
            requests = args.rounds * args.streams
            print(
                f"2. {args.streams} concurrent streams x {args.chunks} chunks, {args.rounds} rounds each, alternating"
            )
            for name in routers:
                print(f"   tracing {name:3}: router CPU {cpu[name] / requests * 1000:.2f} ms per request")
            print(f"   CPU ratio on/off {cpu['on'] / cpu['off']:.2f}, "
                  f"+{(cpu['on'] - cpu['off']) / requests * 1000:.2f} ms per request")  # fmt: skip
        finally:
            for process, _ in routers.values():
                process.terminate()
                process.wait(10)
            upstream.terminate()
            upstream.wait(10)
    print(f"the sink received {_Sink.exports} exports, {_Sink.received:,} bytes")
    sink.shutdown()


if __name__ == "__main__":
    main()
