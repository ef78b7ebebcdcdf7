#!/usr/bin/env python3
"""Soak: the router under mixed streaming load with random faults; then the proofs.

Processes on loopback: two chaos engines (pool `fast` and pool `team`, each `soak.py engine`),
the router (`specroute serve --config`), and this load generator.

Faults at the engines, drawn per request: a 503 before the response (to be retried elsewhere),
a stream that dies mid-way (connection dropped), a stream that stalls past `timeouts.idle`; and
per engine an outage every --outage-every seconds: the process is killed, so connections are
refused, and started again on its port 5 s later (health checks readmit it).
Faults at the clients: cancellations before the response, right after it starts, mid-stream;
non-streaming requests; a batch client with many requests in flight; a few invalid bodies.
Clients back off 1 s after a 503, as its Retry-After asks; otherwise there is no think time.
With --wire the engines also misbehave on the wire: interim 1xx answers before the real one, and
answers sent a second time, unasked, on idle keep-alive connections. Every request carries its
own X-Request-Id and the engine echoes it in its answer's id: an answer with another request's
id is unexpected.

At the end: every request's outcome (an `unexpected` one is a defect: a 500, a stream cut
without an error event, an error not in OpenAI's shape, a client-side exception); the router's
in-flight and queue gauges (must read 0); each engine's open requests (must be 0: no upstream
request left open); the router's RSS over time (must be flat).

    python scripts/soak.py --requests 10000 --out docs/soak/10k      # the 10,000-request run
    python scripts/soak.py --duration 1800 --out docs/soak/30min     # the 30-minute soak
    python scripts/soak.py --requests 1000 --wire --out /tmp/soak     # faults on the wire too

Exit status 1 if any of the proofs fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from loopback import free_port, wait_until_up

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' fake engine, from the repo
from tests.fake_engine import Chaos, FakeEngine, Fault
from tests.wire import WireChaos, WireServer

MODEL = "soak-model"
TOKEN_DELAY = 0.03  # seconds between an engine's tokens
FAULTS: dict[Fault, float] = {"503": 0.03, "die": 0.02, "stall": 0.01}  # per request, at the engine
# With --wire: a tenth of the answers come after `100 Continue` and `103 Early Hints`, and a tenth
# are sent a second time on the idle connection: a client that read that copy as the answer to its
# next request would hand one client another's answer.
WIRE_CHAOS = WireChaos(interim=0.1, late=0.1, late_after=0.02)


# ---------------------------------------------------------------------------------------------
# The chaos engine (`soak.py engine --port P`): the tests' fake engine, drawing faults per request;
# with --wire, served by a small server of the tests' that also misbehaves on the wire.


def run_engine(port: int, *, wire: bool, seed: int) -> None:
    engine = FakeEngine(model=MODEL, token_delay=TOKEN_DELAY, chaos=Chaos(FAULTS, seed=seed), record=False)
    if not wire:
        uvicorn.run(engine.app(), host="127.0.0.1", port=port, log_level="error", access_log=False)
        return

    async def serve() -> None:
        server = await WireServer(engine.app(), WIRE_CHAOS).start("127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


# ---------------------------------------------------------------------------------------------
# Processes.


class Engine:
    def __init__(self, name: str, *, wire: bool, seed: int) -> None:
        self.name = name
        self.wire = wire
        self.seed = seed
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = self._start()
        self.outages = 0

    def _start(self) -> subprocess.Popen[bytes]:
        # Its dying streams make uvicorn log a traceback each: not news here.
        command = [sys.executable, __file__, "engine", "--port", str(self.port), "--seed", str(self.seed)]
        command += ["--wire"] if self.wire else []
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.outages += 1

    def restart(self) -> None:
        self.seed += 1000  # a new incarnation draws other faults
        self.process = self._start()

    def stats(self) -> dict[str, int]:
        answer: dict[str, int] = httpx.get(self.url + "/stats", timeout=5).json()
        return answer


def router_config(fast: Engine, team: Engine, port: int) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "pools": {
            "fast": {
                "speculative": True,
                "backends": {"fast-1": {"url": fast.url, "max_concurrency": 24}},
                "queue_size": 64,
                "queue_timeout": 10,
            },
            "team": {
                "speculative": False,
                "backends": {"team-1": {"url": team.url, "max_concurrency": 64}},
                "queue_size": 128,
                "queue_timeout": 10,
            },
        },
        "timeouts": {"idle": 2, "read": 30},
        "health": {"interval": 1, "unhealthy_after": 1, "healthy_after": 1, "ejection_seconds": 2},
        "scrape": {"interval": 5},
    }


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------------------------
# The load.

EXPECTED = {"ok", "cancelled", "stream-error", "400", "502", "503", "504"}


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random, user: str) -> str:
    """Send one request of a random kind; return its outcome."""
    streaming = rng.random() < 0.8
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write about the sea." if rng.random() < 0.5 else "```py\nx=1\n```"}],
        "max_tokens": rng.randrange(8, 48),
        "stream": streaming,
        "user": user,
    }
    content = json.dumps(body).encode()
    invalid = rng.random() < 0.01
    if invalid:
        content = content[: len(content) // 2]
    cancel = rng.choice(["before-response", "after-start", "mid-stream"]) if rng.random() < 0.08 else None
    # The engine answers with this id in its own (`cmpl-<id>`): an answer with another id was
    # meant for another request.
    request_id = f"{user}-{rng.getrandbits(64):016x}"
    headers = {"content-type": "application/json", "x-request-id": request_id}
    own = f"cmpl-{request_id}"

    async def send() -> str:
        async with client.stream("POST", url, content=content, headers=headers) as response:
            if cancel == "after-start":
                return "cancelled"
            if response.status_code != 200:
                raw = await response.aread()
                return error_outcome(response.status_code, raw, invalid)
            if invalid:
                return "unexpected:invalid-body-accepted"
            if not streaming:
                answer = json.loads(await response.aread())
                if answer.get("id") != own:
                    return "unexpected:another-request's-answer"
                return "ok" if answer.get("choices") else "unexpected:no-choices"
            events = []
            stop_after = rng.randrange(1, 8) if cancel == "mid-stream" else None
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if f'"id": "{own}"' not in line and '"id": "cmpl-' in line:
                        return "unexpected:another-request's-answer"
                    if stop_after is not None and len(events) >= stop_after:
                        return "cancelled"
            return stream_outcome(events)

    try:
        if cancel == "before-response":
            try:
                return await asyncio.wait_for(send(), rng.uniform(0.001, 0.05))
            except TimeoutError:
                return "cancelled"
        return await send()
    except (httpx.HTTPError, ValueError) as exc:
        return f"unexpected:{type(exc).__name__}"


def error_outcome(status: int, raw: bytes, invalid: bool) -> str:
    try:
        error = json.loads(raw)["error"]
        shaped = {"message", "type", "param", "code"} <= error.keys()
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not shaped:
        return f"unexpected:unshaped-{status}"
    if status == 400:
        return "400" if invalid else "unexpected:400"
    return f"{status} {error['code']}" if str(status) in EXPECTED else f"unexpected:{status}"


def stream_outcome(events: list[str]) -> str:
    if events and events[-1] == "[DONE]":
        return "ok" if "[DONE]" not in events[:-1] else "unexpected:done-twice"
    if events:
        try:
            last = json.loads(events[-1])
        except ValueError:
            return "unexpected:cut-mid-event"
        if "error" in last and "[DONE]" not in events:
            return "stream-error"
    return "unexpected:cut-without-error-event"


async def load(url: str, *, concurrency: int, requests: int | None, duration: float | None, seed: int) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    stop_at = time.monotonic() + duration if duration else None
    issued = 0

    def more() -> bool:
        nonlocal issued
        if requests is not None and issued >= requests:
            return False
        if stop_at is not None and time.monotonic() >= stop_at:
            return False
        issued += 1
        return True

    async def worker(number: int) -> None:
        rng = random.Random(seed * 1000 + number)
        # A quarter of the workers are one batch job (one `user`, many requests in flight); the
        # others are interactive users, one request at a time each.
        user = "batch-job" if number % 4 == 0 else f"user-{number}"
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=4)) as client:
            while more():
                outcome = await one_request(client, url, rng, user)
                outcomes[outcome] += 1
                if outcome.startswith("503"):
                    await asyncio.sleep(1)  # back off, as Retry-After asks (it is at least 1 s)

    await asyncio.gather(*(worker(n) for n in range(concurrency)))
    return outcomes


# ---------------------------------------------------------------------------------------------
# The run.


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def settle(check: Any, timeout: float = 15) -> Any:
    deadline = time.monotonic() + timeout
    value = check()
    while value and time.monotonic() < deadline:
        time.sleep(0.25)
        value = check()
    return value


def soak(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fast, team = Engine("fast-1", wire=args.wire, seed=args.seed), Engine("team-1", wire=args.wire, seed=args.seed + 1)
    engines = [fast, team]
    port = free_port()
    config = Path(tempfile.mkdtemp()) / "router.yaml"
    config.write_text(json.dumps(router_config(fast, team, port)))  # JSON is YAML
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECROUTE_")}
    log = (out / "router.log").open("wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(config), "--log-level", "warning"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for engine in engines:
            wait_until_up(engine.url + "/health", engine.process)
        wait_until_up(base + "/readyz", router)
        return _run(args, out, base, router.pid, engines)
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(timeout=60)
        log.close()
        for engine in engines:
            engine.process.kill()
            engine.process.wait()


def _run(args: argparse.Namespace, out: Path, base: str, router_pid: int, engines: list[Engine]) -> int:
    started = time.monotonic()
    rss: list[tuple[float, float]] = [(0.0, rss_mb(router_pid))]
    outages: list[str] = []

    async def watch(done: asyncio.Event) -> None:
        """Sample the router's RSS; take an engine out now and then."""
        next_outage = args.outage_every
        turn = 0
        while not done.is_set():
            with_timeout = asyncio.create_task(done.wait())
            await asyncio.wait([with_timeout], timeout=args.sample_every)
            with_timeout.cancel()
            now = time.monotonic() - started
            rss.append((round(now, 1), rss_mb(router_pid)))
            if args.outage_every and now >= next_outage and not done.is_set():
                engine = engines[turn % len(engines)]
                turn += 1
                engine.kill()
                outages.append(f"{now:.0f} s: {engine.name} killed")
                await asyncio.sleep(5)
                engine.restart()
                next_outage = now + args.outage_every

    async def main() -> Counter[str]:
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        try:
            return await load(
                base + "/v1/chat/completions",
                concurrency=args.concurrency,
                requests=args.requests,
                duration=args.duration,
                seed=args.seed,
            )
        finally:
            done.set()
            await watcher

    outcomes = asyncio.run(main())
    elapsed = time.monotonic() - started
    for engine in engines:  # an engine restarted at the very end may still be starting
        wait_until_up(engine.url + "/health", engine.process)

    def gauges() -> float:
        text = httpx.get(base + "/metrics", timeout=5).text
        return metric_sum(text, "specroute_in_flight_requests") + metric_sum(text, "specroute_queued_requests")

    left_in_router = settle(gauges)
    left_at_engines = settle(lambda: sum(engine.stats().get("open", 0) for engine in engines))
    rss.append((round(time.monotonic() - started, 1), rss_mb(router_pid)))
    unexpected = {k: v for k, v in outcomes.items() if k.split()[0] not in EXPECTED}
    warm = next((mb for t, mb in rss if t >= elapsed * 0.25), rss[0][1])
    result = {
        "requests": sum(outcomes.values()),
        "seconds": round(elapsed, 1),
        "outcomes": dict(outcomes.most_common()),
        "unexpected": unexpected,
        "router_gauges_at_end": left_in_router,
        "engine_open_at_end": left_at_engines,
        "engine_stats_last_incarnation": {e.name: e.stats() for e in engines},
        "outages": outages,
        "rss_mb": rss,
        "rss_growth_after_warmup_mb": round(rss[-1][1] - warm, 1),
    }
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    report = render(result)
    (out / "report.md").write_text(report)
    plot(rss, out / "rss.png")
    print(report)
    grew = result["rss_growth_after_warmup_mb"] > max(10.0, 0.1 * warm)
    return 1 if unexpected or left_in_router or left_at_engines or grew else 0


def render(result: dict[str, Any]) -> str:
    lines = [
        f"**{result['requests']:,} requests in {result['seconds']:.0f} s**",
        "",
        "| outcome | requests |",
        "|---|---|",
        *(f"| {k} | {v:,} |" for k, v in result["outcomes"].items()),
        "",
        f"- unexpected outcomes: {sum(result['unexpected'].values())}",
        f"- router in-flight + queued gauges at the end: {result['router_gauges_at_end']:g}",
        f"- requests still open at the engines at the end: {result['engine_open_at_end']}",
        f"- engine outages: {len(result['outages'])} ({'; '.join(result['outages']) or 'none'})",
        f"- router RSS: {result['rss_mb'][0][1]:.1f} MB at start, "
        f"{max(mb for _, mb in result['rss_mb']):.1f} MB peak, {result['rss_mb'][-1][1]:.1f} MB at the end; "
        f"growth after the first quarter: {result['rss_growth_after_warmup_mb']:+.1f} MB",
    ]
    return "\n".join(lines) + "\n"


def plot(rss: list[tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3))
    axes.plot([t / 60 for t, _ in rss], [mb for _, mb in rss])
    axes.set_xlabel("minutes")
    axes.set_ylabel("router RSS, MB")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command")
    engine = commands.add_parser("engine", help="run one chaos engine (used by the soak itself)")
    engine.add_argument("--port", type=int, required=True)
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--wire", action="store_true")
    parser.add_argument("--wire", action="store_true", help="engines also misbehave on the wire: 1xx, late copies")
    parser.add_argument("--requests", type=int, help="stop after this many requests")
    parser.add_argument("--duration", type=float, help="stop after this many seconds")
    parser.add_argument("--concurrency", type=int, default=48, help="requests in flight from the load generator")
    parser.add_argument("--outage-every", type=float, default=120, help="seconds between engine outages (0: none)")
    parser.add_argument("--sample-every", type=float, default=10, help="seconds between RSS samples")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="soak-results")
    args = parser.parse_args()
    if args.command == "engine":
        run_engine(args.port, wire=args.wire, seed=args.seed)
        return 0
    if args.requests is None and args.duration is None:
        parser.error("give --requests or --duration")
    return soak(args)


if __name__ == "__main__":
    sys.exit(main())
