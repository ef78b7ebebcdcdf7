#!/usr/bin/env python3
"""Peak memory of `specroute serve` while it takes one large batch file on `POST /v1/files`,
makes a batch of it, and gives it back.

Writes a JSONL batch file of about --mb megabytes (--lines requests, each with a long prompt),
starts `specroute serve --config FILE` (its batch store in a fresh directory; no engine listens),
and reads the router's peak RSS (VmHWM) once it is up, then the peak of a router process that
did one step: the file uploaded with curl (which streams it from disk, so the client's memory is
not the question); on the same store, a batch created from it (`POST /v1/batches`, then
cancelled); the file downloaded (`GET /v1/files/{id}/content`).

    python scripts/bench_upload.py --specroute /path/to/.venv/bin/specroute --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loopback import free_port


def write_batch_file(path: Path, *, lines: int, megabytes: float) -> int:
    """`lines` chat requests whose prompts fill about `megabytes` in all; the file's size."""
    prompt = "x" * max(1, int(megabytes * 1e6 / lines) - 200)
    with path.open("w") as out:
        for i in range(lines):
            body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": f"{i} {prompt}"}]}
            row = {"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            out.write(json.dumps(row) + "\n")
    return path.stat().st_size


def up(url: str, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url}: not up after {timeout} s")


def peak_mb(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM")}


def curl(*args: str) -> bytes:
    """curl's output; it streams a file from disk, so the client's memory is not the question."""
    command = ["curl", "-sS", "--fail-with-body", "--max-time", "600", "-H", "Authorization: Bearer bench", *args]
    answer = subprocess.run(command, capture_output=True)
    if answer.returncode:
        raise SystemExit(f"{args[-1]}: {answer.stdout[:500]!r} {answer.stderr[:500]!r}")
    return answer.stdout


@contextmanager
def router(specroute: str, config: Path, port: int) -> Iterator[int]:
    """`specroute serve --config FILE`, up; its pid."""
    process = subprocess.Popen([specroute, "serve", "--config", str(config), "--log-level", "error"])
    try:
        up(f"http://127.0.0.1:{port}/healthz", process)
        yield process.pid
    finally:
        process.terminate()
        process.wait(30)


def one_run(specroute: str, batch_file: Path, workdir: Path) -> dict[str, float]:
    """Each step in a router of its own on the same store, so that what one step left allocated
    (Python keeps memory it has freed) does not count in the next one's peak."""
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1"
    store = Path(tempfile.mkdtemp(dir=workdir, prefix="store-"))
    config = workdir / f"router-{port}.yaml"
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens: no line is ever sent
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                "listen": {"host": "127.0.0.1", "port": port},
                "pools": {
                    "fast": {"speculative": True, "backends": {"fast-1": {"url": unreachable}}},
                    "team": {"speculative": False, "backends": {"team-1": {"url": unreachable}}},
                },
                "batch": {"store_dir": str(store)},
            }
        )
    )
    with router(specroute, config, port) as pid:
        idle = peak_mb(pid)["VmHWM"]
        started = time.monotonic()
        uploaded = json.loads(
            curl("-F", "purpose=batch", "-F", f"file=@{batch_file};type=application/jsonl", base + "/files")
        )
        seconds = time.monotonic() - started
        if uploaded.get("bytes") != batch_file.stat().st_size:
            raise SystemExit(f"the upload was not taken: {uploaded}")
        upload = peak_mb(pid)["VmHWM"]
    with router(specroute, config, port) as pid:
        params = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        batch = json.loads(curl("-H", "Content-Type: application/json", "-d", json.dumps(params), base + "/batches"))
        create = peak_mb(pid)["VmHWM"]
        curl("-X", "POST", f"{base}/batches/{batch['id']}/cancel")
        deadline = time.monotonic() + 120  # its end written here, not in the next router
        while json.loads(curl(f"{base}/batches/{batch['id']}"))["status"] != "cancelled":
            if time.monotonic() > deadline:
                raise SystemExit("the batch was not cancelled in time")
            time.sleep(0.2)
    with router(specroute, config, port) as pid:
        curl("-o", os.devnull, f"{base}/files/{uploaded['id']}/content")
        download = peak_mb(pid)["VmHWM"]
    return {
        "upload_seconds": seconds,
        "idle_peak_mb": idle,
        "upload_peak_mb": upload,
        "create_peak_mb": create,
        "download_peak_mb": download,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specroute", default=str(Path(sys.executable).parent / "specroute"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mb", type=float, default=200.0, help="size of the batch file, in megabytes (10^6)")
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--dir", default=None, help="where the file and the stores go (default: a temp dir)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(dir=args.dir, prefix="bench-upload-"))
    batch_file = workdir / "batch.jsonl"
    size = write_batch_file(batch_file, lines=args.lines, megabytes=args.mb)
    try:
        runs = [one_run(args.specroute, batch_file, workdir) for _ in range(args.runs)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    print(json.dumps({"specroute": args.specroute, "file_bytes": size, "runs": runs, "median": median}, indent=2))
    print(
        f"median of {len(runs)}: a {size / 1e6:.1f} MB file uploaded in {median['upload_seconds']:.1f} s; "
        f"router peak RSS: idle {median['idle_peak_mb']:.1f} MB, upload {median['upload_peak_mb']:.1f} MB, "
        f"batch created from it {median['create_peak_mb']:.1f} MB, download {median['download_peak_mb']:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
