#!/usr/bin/env python3
"""The router's streaming path side by side with its peers, in one run (issue #13).

Targets, each in front of the same two mock engines (scripts/peers_engine.py, vLLM's stream
format), all on loopback:

    direct         the client straight to the engines (streams alternate between the two): the reference
    nginx          Debian's nginx, upstream keepalive, proxy_buffering off, access log off
    vllm-router    from PyPI, round_robin over both engines
    sglang-router  from PyPI, round_robin over both engines
    floor          scripts/peers_floor.py: uvicorn and aiohttp relaying, nothing else (the router's floor)
    floor-granian, floor-aiohttp  the same relay on Granian or on aiohttp's own server (another floor?)
    floor-protocol scripts/peers_floor_protocol.py: the relay on asyncio protocol callbacks under
                   uvloop, httptools on both sides, each body piece written straight through (the
                   floor of a streaming path at the protocol level, issue 24)
    specroute      this checkout: `specroute serve --config`, both engines in each pool,
                   max_concurrency 1024, queue 4096, every feature on
    specroute-before  the same, from another executable (--specroute-before: a change's base, to
                   measure a change side by side)
    specroute-workers  the same as specroute, with `--workers 2` (router.workers)

One closed-loop client (scripts/peers_client.py, aiohttp, its own process), two workloads:

    paced      128 streams × 64 tokens, 20 ms per token, started over 1.3 s
    saturated  64 streams × 256 tokens, the engines as fast as they can
    lone       (asked for by name) one stream of 4-token answers, one request after another:
               the target's CPU per request (`cpu_ms_per_request` in results.json)

Each (workload, target) gets fresh engines and a freshly started target; the targets run in
turn, in reverse order on every other repetition. Measured: the target's CPU (user + system
of its whole process tree, from /proc) per 1,000 content chunks the client received, first
token and inter-chunk gap p50/p99 at the client, chunks/s delivered in the steady part, errors,
peak RSS (VmHWM) and idle RSS (VmRSS right after start), summed over the process tree.

    scripts/bench_peers.sh [--quick] [--reps 2] [--out DIR] [--targets direct,nginx,...] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loopback import free_port, wait_until_up

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
TARGETS = (
    "direct",
    "nginx",
    "vllm-router",
    "sglang-router",
    "floor",
    "floor-granian",
    "floor-aiohttp",
    "floor-protocol",
    "specroute",
    "specroute-before",
    "specroute-workers",
)


@dataclass(frozen=True)
class Workload:
    name: str
    streams: int
    tokens: int
    interval: float  # seconds per token at the engine; 0: as fast as it can
    ramp: float  # seconds over which the client's streams start
    duration: float  # seconds of closed-loop requests

    def describe(self) -> str:
        pace = f"{self.interval * 1000:g} ms per token" if self.interval else "engine as fast as it can"
        ramp = f", started over {self.ramp:g} s" if self.ramp else ""
        return f"{self.streams} streams × {self.tokens} tokens, {pace}{ramp}"


# --- /proc: CPU and memory of a process tree ------------------------------------------------


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                todo += [int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split()]
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system time of the process, its threads and its live descendants."""
    ticks = 0
    for member in _tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def syscalls(pid: int) -> tuple[int, int]:
    """Read and write system calls of the process tree (/proc/PID/io: read(2)/write(2) and kin;
    libuv reads and writes sockets with these, some servers use recv/send, which are not counted)."""
    reads = writes = 0
    for member in _tree(pid):
        with contextlib.suppress(OSError):
            fields = dict(line.split(": ") for line in Path(f"/proc/{member}/io").read_text().splitlines())
            reads, writes = reads + int(fields["syscr"]), writes + int(fields["syscw"])
    return reads, writes


def memory_mb(pid: int, key: str) -> float:
    """VmRSS or VmHWM summed over the process tree, in MB."""
    kilobytes = 0
    for member in _tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    kilobytes += int(line.split()[1])
    return kilobytes / 1024


# --- the targets ---------------------------------------------------------------------------


class Stack:
    """The engines and one target, started fresh, stopped on exit."""

    def __init__(self, target: str, workload: Workload, args: argparse.Namespace, tmp: Path) -> None:
        self.target, self.workload, self.args, self.tmp = target, workload, args, tmp
        self.processes: list[subprocess.Popen[bytes]] = []
        self.engines = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
        self.proxy: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> Stack:
        try:
            for url in self.engines:
                engine = self._start([sys.executable, str(SCRIPTS / "peers_engine.py"), "--port", url.rsplit(":", 1)[1],
                                      "--interval", str(self.workload.interval)])  # fmt: skip
                wait_until_up(url + "/health", engine)
            if self.target != "direct":
                port = free_port()
                self.url = f"http://127.0.0.1:{port}"
                self.proxy = self._start(self._command(port))
                ready = "/readyz" if self.target.startswith("specroute") else "/health"
                wait_until_up(self.url + ready, self.proxy, 60)
                if self.target == "specroute-workers":
                    _every_worker(self.url, 2)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def client_urls(self) -> list[str]:
        if self.target == "direct":
            return self.engines[:1] if self.args.specroute_layout == "single" else self.engines
        return [self.url]

    def _start(self, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{Path(command[0]).name}-{len(self.processes)}.log").open("wb")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.processes.append(process)
        return process

    def _command(self, port: int) -> list[str]:
        cache, (a, b) = self.args.cache, self.engines
        if self.target == "nginx":
            config, errors = self._nginx_conf(port), self.tmp / "nginx-error.log"
            return [self.args.nginx, "-p", str(self.tmp), "-c", str(config), "-e", str(errors)]
        if self.target == "vllm-router":
            return [str(cache / "vllm-router/bin/vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                    "--worker-urls", a, b, "--policy", "round_robin", "--log-level", "warning",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--worker-startup-check-interval", "1"]  # fmt: skip
        if self.target == "sglang-router":
            return [str(cache / "sglang-router/bin/sglang-router"), "launch", "--host", "127.0.0.1",
                    "--port", str(port), "--worker-urls", a, b, "--policy", "round_robin", "--log-level", "warn",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--worker-startup-check-interval", "1"]  # fmt: skip
        if self.target == "floor-protocol":
            return [str(cache / "tools/bin/python"), str(SCRIPTS / "peers_floor_protocol.py"), "--port", str(port),
                    "--engine", a, "--engine", b]  # fmt: skip
        if self.target.startswith("floor"):  # floor, floor-granian, floor-aiohttp
            server = self.target.partition("-")[2] or "uvicorn"
            return [str(cache / "tools/bin/python"), str(SCRIPTS / "peers_floor.py"), "--port", str(port),
                    "--engine", a, "--engine", b, "--server", server]  # fmt: skip
        if self.target.startswith("specroute"):
            executable = self.args.specroute_before if self.target == "specroute-before" else self.args.specroute
            return [executable, "serve", "--config", str(self._specroute_conf()), "--host", "127.0.0.1",
                    "--port", str(port), "--log-level", self.args.specroute_log_level,
                    *(["--workers", "2"] if self.target == "specroute-workers" else [])]  # fmt: skip
        raise SystemExit(f"unknown target {self.target!r}")

    def _nginx_conf(self, port: int) -> Path:
        a, b = (url.removeprefix("http://") for url in self.engines)
        path = self.tmp / "nginx.conf"
        path.write_text(textwrap.dedent(f"""\
            daemon off;
            worker_processes auto;
            pid {self.tmp}/nginx.pid;
            error_log {self.tmp}/nginx-error.log warn;
            events {{ worker_connections 8192; }}
            http {{
                access_log off;
                client_body_temp_path {self.tmp}/body;
                proxy_temp_path {self.tmp}/proxy;
                fastcgi_temp_path {self.tmp}/fastcgi;
                uwsgi_temp_path {self.tmp}/uwsgi;
                scgi_temp_path {self.tmp}/scgi;
                upstream engines {{
                    server {a};
                    server {b};
                    keepalive 512;
                }}
                server {{
                    listen 127.0.0.1:{port} backlog=4096;
                    location / {{
                        proxy_pass http://engines;
                        proxy_http_version 1.1;
                        proxy_set_header Connection "";
                        proxy_buffering off;
                        proxy_read_timeout 600s;
                    }}
                }}
            }}
            """))  # fmt: skip
        return path

    def _specroute_conf(self) -> Path:
        a, b = self.engines
        path = self.tmp / "router.yaml"
        if self.args.specroute_layout == "single":  # scripts/bench_router_overhead.py's: one pool, one engine
            backend = f"{{url: '{a}', max_concurrency: 1024}}"
            path.write_text(f"pools:\n  fast: {{speculative: true, backends: {{up: {backend}}}}}\n")
            return path
        path.write_text(textwrap.dedent(f"""\
            pools:
              fast:
                speculative: true
                queue_size: 4096
                backends:
                  fast-a: {{url: "{a}", max_concurrency: 1024}}
                  fast-b: {{url: "{b}", max_concurrency: 1024}}
              team:
                speculative: false
                queue_size: 4096
                backends:
                  team-a: {{url: "{a}", max_concurrency: 1024}}
                  team-b: {{url: "{b}", max_concurrency: 1024}}
            """))  # fmt: skip
        return path


def _every_worker(url: str, count: int) -> None:
    """Wait until each worker answers: else the first measured seconds would go to one."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(url + "/router/status", timeout=5) as answer,
        ):
            if json.load(answer).get("workers", {}).get("answered") == count:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url}: not every worker answers")


# --- one measurement -----------------------------------------------------------------------


def measure(
    target: str, workload: Workload, args: argparse.Namespace, rep: int, *, profile: bool = False
) -> dict[str, object]:
    with (
        _workdir(args, f"{target}-{workload.name}-{rep}") as tmp,
        Stack(target, workload, args, Path(tmp)) as stack,
    ):
        watched = stack.proxy.pid if stack.proxy else None
        idle = memory_mb(watched, "VmRSS") if watched else None
        client = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "peers_client.py"), *(f"--url={u}" for u in stack.client_urls()),
             "--streams", str(workload.streams), "--tokens", str(workload.tokens), "--ramp", str(workload.ramp),
             "--duration", str(workload.duration)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert client.stdin and client.stdout
        if client.stdout.readline().strip() != "ready":
            raise SystemExit(f"{target}: the client did not start (exit {client.wait()})")
        engines_before = sum(cpu_seconds(p.pid) for p in stack.processes[:2])
        before = cpu_seconds(watched) if watched else 0.0
        calls_before = syscalls(watched) if watched else (0, 0)
        profiler = _profile(watched, workload, args) if profile and watched else None
        client.stdin.write("go\n")
        client.stdin.flush()
        line = client.stdout.readline()
        if not line:
            raise SystemExit(f"{target}: the client ended without results (exit {client.wait()})")
        result = json.loads(line)
        cpu = cpu_seconds(watched) - before if watched else None
        calls = (
            [after - earlier for after, earlier in zip(syscalls(watched), calls_before, strict=True)]
            if watched
            else None
        )
        engines_cpu = sum(cpu_seconds(p.pid) for p in stack.processes[:2]) - engines_before
        client.wait(30)
        if profiler:
            profiler.wait(60)
        chunks = result["chunks"] or 1
        return {
            "target": target,
            "workload": workload.name,
            "rep": rep,
            **result,
            "cpu_s": cpu,
            "cpu_per_1000_chunks": None if cpu is None else cpu / chunks * 1000,
            "cpu_ms_per_request": None if cpu is None or not result["requests"] else cpu / result["requests"] * 1000,
            "engines_cpu_per_1000_chunks": engines_cpu / chunks * 1000,
            "reads_per_chunk": calls[0] / chunks if calls else None,
            "writes_per_chunk": calls[1] / chunks if calls else None,
            "idle_rss_mb": idle,
            "peak_rss_mb": memory_mb(watched, "VmHWM") if watched else None,
        }


@contextlib.contextmanager
def _workdir(args: argparse.Namespace, name: str) -> Iterator[str]:
    """Where a measurement's processes keep their logs: kept under --out with --keep-logs."""
    if args.keep_logs:
        path = args.out / "logs" / name
        path.mkdir(parents=True, exist_ok=True)
        yield str(path)
        return
    with tempfile.TemporaryDirectory(prefix=f"peers-{name}-") as tmp:
        yield tmp


def _profile(pid: int, workload: Workload, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    out = args.out / f"profile-specroute-{workload.name}.txt"
    return subprocess.Popen(
        [str(args.cache / "tools/bin/py-spy"), "record", "--nonblocking", "--rate", "250", "--format", "raw",
         "--duration", str(max(1, int(workload.duration))), "--pid", str(pid), "--output", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


# --- the report ----------------------------------------------------------------------------


def _fmt(values: list[object], spec: str, unit: str = "") -> str:
    shown = ["–" if v is None else format(v, spec) + unit for v in values]
    return " / ".join(shown)


def table(results: list[dict[str, object]], workloads: list[Workload], targets: list[str]) -> str:
    lines = [
        "| workload | target | CPU-s per 1,000 chunks | CPU ms per request | first token p50 | first token p99 "
        "| gap p50 | gap p99 | chunks/s | errors | peak RSS | idle RSS | client CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in workloads:
        for i, target in enumerate(targets):
            runs = sorted((r for r in results if r["workload"] == workload.name and r["target"] == target),
                          key=lambda r: r["rep"])  # type: ignore[arg-type,return-value]  # fmt: skip
            if not runs:
                continue

            def col(key: str, runs: list[dict[str, object]] = runs) -> list[object]:
                return [r[key] for r in runs]

            name = f"**{target}**" if target.startswith("specroute") else target
            lines.append(
                f"| {workload.describe() if i == 0 else ''} | {name} | {_fmt(col('cpu_per_1000_chunks'), '.4f')} "
                f"| {_fmt(col('cpu_ms_per_request'), '.3f')} "
                f"| {_fmt(col('ttft_p50_ms'), '.1f', ' ms')} | {_fmt(col('ttft_p99_ms'), '.1f', ' ms')} "
                f"| {_fmt(col('gap_p50_ms'), '.1f', ' ms')} | {_fmt(col('gap_p99_ms'), '.1f', ' ms')} "
                f"| {_fmt(col('chunks_per_s'), ',.0f')} | {_fmt(col('errors'), 'd')} "
                f"| {_fmt(col('peak_rss_mb'), '.0f', ' MB')} | {_fmt(col('idle_rss_mb'), '.0f', ' MB')} "
                f"| {_fmt(col('client_cpu_share'), '.0%')} |"
            )
    return "\n".join(lines)


def _describe_run(args: argparse.Namespace) -> dict[str, object]:
    def output(command: list[str]) -> str:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPO)
            return (done.stdout + done.stderr).strip()
        except OSError:
            return "?"

    commit = output(["git", "rev-parse", "--short", "HEAD"])
    if output(["git", "status", "--porcelain", "--untracked-files=no"]):
        commit += " (with uncommitted changes)"
    return {
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "nginx": output([args.nginx, "-v"]).removeprefix("nginx version: "),
        "vllm-router": _version(output([str(args.cache / "vllm-router/bin/pip"), "show", "vllm-router"])),
        "sglang-router": _version(output([str(args.cache / "sglang-router/bin/pip"), "show", "sglang-router"])),
        "specroute": args.specroute,
        "specroute_before": args.specroute_before,
        "specroute_log_level": args.specroute_log_level,
        "reps": args.reps,
    }


def _version(shown: str) -> str:
    return next((line.split()[-1] for line in shown.splitlines() if line.startswith("Version:")), "?")


def _workloads(args: argparse.Namespace, names: str | None = None) -> list[Workload]:
    paced = Workload("paced", args.paced_streams, args.paced_tokens, args.interval, args.ramp, args.paced_duration)
    saturated = Workload("saturated", args.sat_streams, args.sat_tokens, 0.0, args.sat_ramp, args.sat_duration)
    lone = Workload("lone", 1, args.lone_tokens, 0.0, 0.0, args.lone_duration)
    return [w for w in (paced, saturated, lone) if w.name in (names or args.workloads).split(",")]


def _default_specroute() -> str:
    local = REPO / ".venv/bin/specroute"
    return str(local) if local.exists() else shutil.which("specroute") or "specroute"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, required=True, help="where scripts/bench_peers.sh installed the peers")
    parser.add_argument("--out", type=Path, default=Path("bench-peers-out"), help="directory for results.md/.json")
    parser.add_argument("--reps", type=int, default=2)
    other_floors = ("floor-granian", "floor-aiohttp")  # asked for by name only
    parser.add_argument("--targets", default=",".join(t for t in TARGETS if t not in other_floors))
    parser.add_argument("--workloads", default="paced,saturated")
    parser.add_argument("--paced-streams", type=int, default=128)
    parser.add_argument("--paced-tokens", type=int, default=64)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds per token, paced workload")
    parser.add_argument("--ramp", type=float, default=1.3, help="seconds over which the paced streams start")
    parser.add_argument("--paced-duration", type=float, default=8.0, help="seconds of closed-loop requests")
    parser.add_argument("--sat-streams", type=int, default=64)
    parser.add_argument("--sat-tokens", type=int, default=256)
    parser.add_argument("--sat-ramp", type=float, default=0.0)
    parser.add_argument("--sat-duration", type=float, default=6.0)
    parser.add_argument("--lone-tokens", type=int, default=4, help="lone workload: one stream of short answers")
    parser.add_argument("--lone-duration", type=float, default=8.0)
    parser.add_argument("--specroute", default=_default_specroute(), help="the specroute executable to measure")
    parser.add_argument("--specroute-before", default=None,
                        help="target specroute-before: another specroute (a change's base)")  # fmt: skip
    parser.add_argument("--specroute-log-level", default="warning", help="as in the issue's run: warning")
    parser.add_argument("--specroute-layout", choices=["issue", "single"], default="issue",
                        help="issue: both engines in each of two pools; single: one pool, one engine")  # fmt: skip
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    parser.add_argument("--profile", nargs="?", const="saturated", choices=["paced", "saturated"],
                        help="then one specroute run of this workload under py-spy, not in the table")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: small counts, one repetition")
    parser.add_argument("--keep-logs", action="store_true", help="keep every process's log under --out/logs")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.paced_streams, args.paced_tokens, args.ramp, args.paced_duration = 1, 16, 16, 0.2, 1.0
        args.sat_streams, args.sat_tokens, args.sat_duration = 8, 64, 1.0
    args.out.mkdir(parents=True, exist_ok=True)
    targets = [t for t in args.targets.split(",") if t]
    if "specroute-before" in targets and not args.specroute_before:
        raise SystemExit("target specroute-before needs --specroute-before")
    if unknown := set(targets) - set(TARGETS):
        raise SystemExit(f"unknown targets: {', '.join(sorted(unknown))}")
    workloads = _workloads(args)
    header = _describe_run(args)
    print(json.dumps(header), file=sys.stderr)

    results: list[dict[str, object]] = []
    for rep in range(1, args.reps + 1):
        order = targets if rep % 2 else targets[::-1]
        for workload in workloads:
            for target in order:
                result = measure(target, workload, args, rep)
                results.append(result)
                print(f"rep {rep} {workload.name:9} {target:13} " + json.dumps(
                    {k: result[k] for k in ("cpu_per_1000_chunks", "ttft_p50_ms", "chunks_per_s", "errors")}
                ), file=sys.stderr, flush=True)  # fmt: skip
    header["load_average_at_end"] = os.getloadavg()

    if args.profile and "specroute" in targets:
        [profiled] = _workloads(args, args.profile)
        measure("specroute", profiled, args, 0, profile=True)
        _summarise_profile(args.out / f"profile-specroute-{profiled.name}.txt", args.out / "profile-top.txt")

    report = "\n".join([
        f"commit {header['commit']}, {header['date']}, {header['cores']} cores, load average "
        f"{header['load_average_at_start'][0]:.1f} at the start, {header['load_average_at_end'][0]:.1f} at the end; "  # type: ignore[index]
        f"{args.reps} repetition(s), values per repetition separated by /; nginx {header['nginx']}, "
        f"vllm-router {header['vllm-router']}, sglang-router {header['sglang-router']}",
        "",
        table(results, workloads, targets),
        "",
    ])  # fmt: skip
    (args.out / "results.md").write_text(report)
    (args.out / "results.json").write_text(json.dumps({"run": header, "results": results}, indent=1) + "\n")
    print(report)


def _summarise_profile(raw: Path, out: Path, top: int = 30) -> None:
    """py-spy's collapsed stacks as two short lists: where the samples are (self) and under what (total)."""
    if not raw.exists():
        out.write_text("py-spy wrote no profile (is ptrace allowed here?)\n")
        return
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        samples += count
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + count

    def listing(counts: dict[str, int]) -> Iterator[str]:
        for frame, count in sorted(counts.items(), key=lambda item: -item[1])[:top]:
            yield f"{count / samples * 100:5.1f}%  {frame}"

    out.write_text("\n".join([f"{samples} samples", "", "self:", *listing(own), "", "total (inclusive):",
                              *listing(total), ""]))  # fmt: skip


if __name__ == "__main__":
    main()
