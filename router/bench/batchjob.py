"""`specroute bench batchjob`: interactive users, first alone, then while a Batch API job runs.

Phase 1: the users alone for `duration`. Phase 2: a batch of `lines` requests is uploaded and
created through the router's Batch API, and the same users run for `duration` beside it; the
batch then runs on to the end. The question: do the users' first tokens stay as they were, and
how fast does the batch go in the room they leave? Figures are in the target's real time.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.bench.load import Load, Record, Target
from router.bench.scenarios import Progress, Summary, Users
from router.content import ContentKind
from router.prompts import prompts
from router.quantiles import percentile

_ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass(slots=True)
class BatchJobResult:
    alone: Summary
    beside: Summary
    alone_ttft_p95: float | None
    beside_ttft_p95: float | None
    lines: int
    status: str = "?"
    completed: int = 0
    failed: int = 0
    batch_seconds: float = 0.0  # real time from creation to its end
    pool_tokens_per_second: float = 0.0  # the standard pool's delivered tokens while the batch ran
    mean_pool_in_flight: float = 0.0  # the router's requests in flight on the standard pool
    mean_batch_limit: float = 0.0  # the batch runner's adapted concurrency limit
    samples: list[dict[str, float]] = field(default_factory=list)

    @property
    def lines_per_second(self) -> float:
        return self.completed / self.batch_seconds if self.batch_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "alone": self.alone.as_dict(),
            "beside": self.beside.as_dict(),
            "alone_ttft_p95": self.alone_ttft_p95,
            "beside_ttft_p95": self.beside_ttft_p95,
            "batch": {
                "lines": self.lines,
                "status": self.status,
                "completed": self.completed,
                "failed": self.failed,
                "seconds": self.batch_seconds,
                "lines_per_second": self.lines_per_second,
                "pool_tokens_per_second": self.pool_tokens_per_second,
                "mean_pool_in_flight": self.mean_pool_in_flight,
                "mean_batch_limit": self.mean_batch_limit,
            },
            "samples": self.samples,
        }


def _input(target: Target, lines: int, *, kind: ContentKind, max_tokens: int) -> bytes:
    texts = prompts(kind)
    rows = []
    for i in range(lines):
        body = {
            "model": target.model,
            "messages": [{"role": "user", "content": texts[i % len(texts)]}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "min_tokens": max_tokens,
        }
        rows.append(
            json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return ("\n".join(rows) + "\n").encode()


async def batch_job(
    target: Target,
    users: Users,
    *,
    lines: int = 10_000,
    batch_max_tokens: int = 64,
    progress: Progress | None = None,
) -> BatchJobResult:
    scale = target.time_scale
    root = target.base_url.rstrip("/").removesuffix("/v1")
    headers = {"authorization": f"Bearer {target.api_key}"}

    async def phase(load: Load) -> list[Record]:
        load.records = []
        load.restart_clock()
        await users.run(load, named_by="api_key")
        return list(load.records)

    load = Load(target, max_connections=users.count + 8)
    async with httpx.AsyncClient(base_url=target.base_url.rstrip("/"), headers=headers, timeout=120) as api:
        try:
            if progress:
                progress(0.0)
            alone = await phase(load)
            if progress:
                progress(0.25)
            uploaded = await api.post(
                "/files",
                data={"purpose": "batch"},
                files={"file": ("bench.jsonl", _input(target, lines, kind=users.kind, max_tokens=batch_max_tokens))},
            )
            uploaded.raise_for_status()
            created = await api.post(
                "/batches",
                json={
                    "input_file_id": uploaded.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            created.raise_for_status()
            batch_id = created.json()["id"]
            started = time.perf_counter()
            samples: list[dict[str, float]] = []
            tokens_before = await _pool_tokens(api, root)
            sampler = asyncio.create_task(_sample(api, root, batch_id, samples, started, scale, progress, lines))
            beside = await phase(load)
            batch = await sampler
            seconds = (time.perf_counter() - started) * scale
            tokens = await _pool_tokens(api, root) - tokens_before
        finally:
            await load.aclose()
    counts = batch.get("request_counts") or {}
    return BatchJobResult(
        alone=Summary.of(alone),
        beside=Summary.of(beside),
        alone_ttft_p95=_p95(alone),
        beside_ttft_p95=_p95(beside),
        lines=lines,
        status=batch["status"],
        completed=counts.get("completed", 0),
        failed=counts.get("failed", 0),
        batch_seconds=seconds,
        # Interactive users spill onto the standard pool too: their tokens are in this figure.
        pool_tokens_per_second=tokens / seconds if seconds else 0.0,
        mean_pool_in_flight=statistics.fmean(s["pool_in_flight"] for s in samples) if samples else 0.0,
        mean_batch_limit=statistics.fmean(s["batch_limit"] for s in samples) if samples else 0.0,
        samples=samples,
    )


def _p95(records: list[Record]) -> float | None:
    return percentile([r.ttft for r in records if r.ok and r.ttft is not None], 0.95)


async def _pool_tokens(api: httpx.AsyncClient, root: str) -> float:
    """Completion tokens the standard pool delivered so far, from the router's /metrics."""
    status = (await api.get(root + "/router/status")).json()
    pool = status["routing"]["batch_pool"]
    text = (await api.get(root + "/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("specroute_completion_tokens_total{") and f'pool="{pool}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _sample(
    api: httpx.AsyncClient,
    root: str,
    batch_id: str,
    samples: list[dict[str, float]],
    started: float,
    scale: float,
    progress: Progress | None,
    lines: int,
) -> dict[str, Any]:
    """Every second until the batch ends: the standard pool's load and the batch's progress."""
    while True:
        batch = (await api.get(f"/batches/{batch_id}")).json()
        status = (await api.get(root + "/router/status")).json()
        pool = status["pools"][status["routing"]["batch_pool"]]
        samples.append(
            {
                "t": (time.perf_counter() - started) * scale,
                "completed": batch["request_counts"]["completed"],
                "pool_in_flight": pool["in_flight"],
                "batch_in_flight": status["batches"]["in_flight"],
                "batch_limit": status["batches"]["concurrency_limit"],
            }
        )
        if progress:
            progress(0.25 + 0.75 * batch["request_counts"]["completed"] / lines)
        if batch["status"] in _ENDED:
            return dict(batch)
        await asyncio.sleep(1.0)


def markdown(result: BatchJobResult, *, users: int, duration: float, scale: float) -> str:
    def seconds(value: float | None) -> str:
        return f"{value:.2f} s" if value is not None else "–"

    def speed(value: float | None) -> str:
        return f"{value:.1f}" if value is not None else "–"

    alone, beside = result.alone, result.beside
    return "\n".join(
        [
            f"# Interactive users while a {result.lines:,}-line batch runs",
            "",
            f"{users} interactive users (closed loop), {duration:g} s each phase, figures in real time"
            + (f" (simulator at {scale:g}x)" if scale != 1 else "")
            + ".",
            "",
            "| interactive users | requests | errors | first token p50 | p95 | worst | per-user tok/s |",
            "|---|---:|---:|---:|---:|---:|---:|",
            f"| alone | {alone.requests} | {alone.errors} | {seconds(alone.ttft_p50)} | "
            f"{seconds(result.alone_ttft_p95)} | {seconds(alone.ttft_worst)} | {speed(alone.per_user_tps)} |",
            f"| while the batch runs | {beside.requests} | {beside.errors} | {seconds(beside.ttft_p50)} | "
            f"{seconds(result.beside_ttft_p95)} | {seconds(beside.ttft_worst)} | {speed(beside.per_user_tps)} |",
            "",
            "| batch | value |",
            "|---|---:|",
            f"| status | {result.status} |",
            f"| lines completed / failed | {result.completed:,} / {result.failed:,} |",
            f"| time to finish | {result.batch_seconds:,.0f} s |",
            f"| lines per second | {result.lines_per_second:.2f} |",
            f"| standard pool delivered tokens/s while it ran | {result.pool_tokens_per_second:,.0f} |",
            f"| mean requests in flight on the standard pool | {result.mean_pool_in_flight:.1f} |",
            f"| mean batch concurrency limit | {result.mean_batch_limit:.1f} |",
        ]
    )
