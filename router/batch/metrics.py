"""The Batch API's metrics, on the router's registry."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.batch.store import STATUSES


class BatchMetrics(Collector):
    """Counters are updated as lines finish; the gauges are what the runner saw at its last tick
    (a scrape does not touch the store)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lines = Counter(
            "specroute_batch_lines",
            "Batch lines answered and recorded, by result: completed (engine 2xx) or failed.",
            ["result"],
            registry=registry,
        )
        self.retries = Counter(
            "specroute_batch_line_retries",
            "Batch lines put back for later after a 429, 502, 503 or 504 (no room, or the engine failed).",
            registry=registry,
        )
        self.by_status: dict[str, int] = {}
        self.limit = 0
        self.in_flight: Callable[[], int] = lambda: 0  # the runner's count, read at scrape time
        self.per_second: Callable[[], float] = lambda: 0.0  # the runner's rate, read at scrape time
        registry.register(self)

    def collect(self) -> Iterable[Metric]:
        batches = GaugeMetricFamily("specroute_batches", "Batches in the store, by status.", labels=["status"])
        for status in STATUSES:
            batches.add_metric([status], self.by_status.get(status, 0))
        yield batches
        yield GaugeMetricFamily(
            "specroute_batch_concurrency_limit",
            "Batch lines this router allows in flight now (adapted to what live traffic leaves free).",
            value=self.limit,
        )
        yield GaugeMetricFamily(
            "specroute_batch_lines_in_flight", "Batch lines being run by this router now.", value=self.in_flight()
        )
        yield GaugeMetricFamily(
            "specroute_batch_lines_per_second",
            "Batch lines this router recorded per second over the last minute.",
            value=self.per_second(),
        )
