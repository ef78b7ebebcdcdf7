"""One scrape for all the workers: what each kind of series becomes when merged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.workers.exposition import merge


def worker(requests: float, in_flight: float, kv: float, healthy: float, seconds: list[float]) -> bytes:
    registry = CollectorRegistry()
    Counter("specroute_requests", "Requests.", ["pool"], registry=registry).labels("fast").inc(requests)
    Gauge("specroute_in_flight_requests", "In flight.", registry=registry).set(in_flight)
    Gauge("specroute_engine_kv_cache_usage_ratio", "KV.", registry=registry).set(kv)
    Gauge("specroute_backend_healthy", "Healthy.", registry=registry).set(healthy)
    histogram = Histogram("specroute_ttft_seconds", "TTFT.", buckets=(0.1, 1), registry=registry)
    for value in seconds:
        histogram.observe(value)
    return generate_latest(registry)


def samples(text: bytes) -> dict[str, float]:
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
    }


def test_counters_histograms_and_held_gauges_are_summed_the_rest_are_not() -> None:
    merged = samples(merge([worker(3, 2, 0.5, 1, [0.05, 2]), worker(4, 1, 0.25, 0, [0.5])]))
    assert merged["specroute_requests_total[('pool', 'fast')]"] == 7
    assert merged["specroute_in_flight_requests[]"] == 3
    assert merged["specroute_engine_kv_cache_usage_ratio[]"] == 0.5  # the highest reading
    assert merged["specroute_backend_healthy[]"] == 0  # down if any worker finds it down
    assert merged["specroute_ttft_seconds_count[]"] == 3
    assert merged["specroute_ttft_seconds_bucket[('le', '0.1')]"] == 1
    assert merged["specroute_ttft_seconds_bucket[('le', '1.0')]"] == 2


def test_one_worker_merged_is_itself() -> None:
    alone = worker(3, 2, 0.5, 1, [0.05])
    assert samples(merge([alone])) == samples(alone)
