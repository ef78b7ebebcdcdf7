#!/usr/bin/env python3
"""Lines per second of one batch through the router, on each Batch API store: SQLite (one
router), PostgreSQL (one router), PostgreSQL shared by two routers.

The engine is the tests' fake engine (tests/fake_engine.py) in this process, answering at once
(4 tokens, no delay), so the figure is what the router and its store cost per line, not what an
engine takes. Each router is `specroute serve --config FILE` in its own process (as the tests run
one: tests/servers.py, tests/batches.py), its backends and `batch.max_concurrency` at 64;
PostgreSQL is a server of its own started as the tests start it (tests/postgres.py), a fresh
database per run. The time is from `POST /v1/batches` to the batch
read `completed`, polled every 50 ms.

    python scripts/bench_batch_store.py --lines 2000 --runs 3 --out docs/bench/batch-store
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.batches import batch_input, router_config  # noqa: E402  (the repository's root, just added)
from tests.fake_engine import FakeEngine  # noqa: E402
from tests.postgres import PostgresServer  # noqa: E402
from tests.servers import ServerThread, serve  # noqa: E402

DSN_ENV = "BENCH_BATCH_STORE_DSN"


def run(engine_url: str, store: str, routers: int, lines: int, dsn: str | None, work: Path) -> float:
    """One batch of `lines` on `routers` routers; its lines per second."""
    batch: dict[str, Any] = {"store": store, "store_dir": str(work / "store"), "max_concurrency": 64}
    if store == "postgres":
        batch["postgres_dsn_env"] = DSN_ENV
    env = {DSN_ENV: dsn} if dsn is not None else {}
    with ExitStack() as stack:
        configs = [router_config(work / f"router-{i}", engine_url, slots=64, batch=batch) for i in range(routers)]
        urls = [stack.enter_context(serve(config, env=env))[1] for config in configs]
        with httpx.Client(base_url=urls[0] + "/v1", timeout=60) as client:
            uploaded = client.post(
                "/files", files={"file": ("b.jsonl", batch_input(lines))}, data={"purpose": "batch"}
            ).json()
            started = time.perf_counter()
            created = client.post(
                "/batches",
                json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            ).json()
            while (state := client.get(f"/batches/{created['id']}").json())["status"] != "completed":
                if state["status"] in ("failed", "expired", "cancelled"):
                    raise SystemExit(f"the batch ended {state['status']}: {state}")
                time.sleep(0.05)
            elapsed = time.perf_counter() - started
        assert state["request_counts"]["completed"] == lines, state
    return lines / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="directory for results.json")
    args = parser.parse_args()
    setups = [("sqlite", 1), ("postgres", 1), ("postgres", 2)]
    results: dict[str, list[float]] = {f"{store} x{routers}": [] for store, routers in setups}
    engine = FakeEngine(record=False)
    with ServerThread(engine.app()) as server, PostgresServer() as postgres:
        for _ in range(args.runs):
            for store, routers in setups:
                dsn = postgres.database("bench_" + uuid.uuid4().hex[:12]) if store == "postgres" else None
                with tempfile.TemporaryDirectory(prefix="bench-batch-store-") as work:
                    rate = run(server.url, store, routers, args.lines, dsn, Path(work))
                results[f"{store} x{routers}"].append(rate)
                print(f"{store} x{routers}: {rate:.0f} lines/s", flush=True)
    load = os.getloadavg()
    summary = {
        "lines": args.lines,
        "runs": args.runs,
        "load_average": load,
        "lines_per_second": {
            name: {"median": statistics.median(rates), "runs": rates} for name, rates in results.items()
        },
    }
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
