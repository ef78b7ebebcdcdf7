#!/usr/bin/env python3
"""Start time and idle memory of `specroute serve --config FILE` in front of two simulated engines.

Start time: from launching the process to the first 200 from `/healthz`, in wall time and in the
CPU time the process used until then (which other load on the machine barely moves). Idle memory: the
router's RSS (and its peak, VmHWM) after it has served nothing for --idle seconds. Each run is a
new process; the table gives the median of --runs. `--specroute` picks the installation to
measure, so two checkouts can be compared with the same script:

    python scripts/bench_startup.py --specroute /path/to/other/.venv/bin/specroute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from loopback import free_port


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError):
        return False


def up_after(url: str, process: subprocess.Popen[bytes], timeout: float = 60) -> float:
    """Seconds until `url` answers 200, polling every 5 ms."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {process.returncode}")
        if answers(url):
            return time.monotonic() - started
        time.sleep(0.005)
    raise SystemExit(f"{url}: not up after {timeout} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used: unlike wall time, barely moved by other load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM")}


def one_run(specroute: str, config: Path, port: int, idle: float) -> dict[str, float]:
    launched = time.monotonic()
    router = subprocess.Popen([specroute, "serve", "--config", str(config), "--log-level", "warning"])
    try:
        up_after(f"http://127.0.0.1:{port}/healthz", router)
        start = time.monotonic() - launched
        cpu = cpu_seconds(router.pid)
        time.sleep(idle)  # nothing to wait for: the point is to measure a router left alone
        return {"start_s": start, "start_cpu_s": cpu, **memory_mb(router.pid)}
    finally:
        router.terminate()
        router.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specroute", default=str(Path(sys.executable).parent / "specroute"))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--idle", type=float, default=3.0, help="seconds the router idles before RSS is read")
    args = parser.parse_args()
    engines = []
    try:
        urls = []
        for profile in ("fast", "team"):
            port = free_port()
            command = [args.specroute, "sim", "--profile", profile, "--port", str(port)]
            engine = subprocess.Popen(command, stdout=subprocess.DEVNULL)  # its banner is not the result
            engines.append(engine)
            urls.append(f"http://127.0.0.1:{port}")
            up_after(urls[-1] + "/health", engine)
        port = free_port()
        config = Path(tempfile.mkdtemp()) / "router.yaml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "listen": {"host": "127.0.0.1", "port": port},
                    "pools": {
                        "fast": {"speculative": True, "backends": {"fast-1": {"url": urls[0]}}},
                        "team": {"speculative": False, "backends": {"team-1": {"url": urls[1]}}},
                    },
                }
            )
        )
        runs = [one_run(args.specroute, config, port, args.idle) for _ in range(args.runs)]
    finally:
        for engine in engines:
            engine.terminate()
            engine.wait(30)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(json.dumps({"specroute": args.specroute, "runs": runs, "median": median}, indent=2))
    print(
        f"median of {len(runs)}: start {median['start_s']:.2f} s ({median['start_cpu_s']:.2f} s CPU), "
        f"idle RSS {median['VmRSS']:.1f} MB, peak RSS {median['VmHWM']:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
