"""One scrape for all the workers: their expositions merged into one, as Prometheus would see a
single router.

Counters and histograms are summed (a worker's restart shows as a counter reset, which `rate()`
handles); so are the gauges that count something each worker holds (`_SUMMED`). A gauge that
every worker measures alike (an engine's KV cache, a learned crossover) takes the highest
value; health and sharing the lowest (down if any worker finds it down); `_created` and a
process's start time the earliest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

_SUMMED = frozenset(
    {
        "specroute_in_flight_requests",
        "specroute_queued_requests",
        "specroute_client_slots",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
    }
)
_LOWEST = ("_healthy", "_up", "process_start_time_seconds", "_created")


def _rule(family: Metric, sample: str) -> Callable[[Iterable[float]], float]:
    if sample.endswith(_LOWEST):
        return min
    if family.type in ("counter", "histogram", "summary", "gaugehistogram") or family.name in _SUMMED:
        return sum
    return max


def merge(expositions: list[bytes]) -> bytes:
    families: dict[str, Metric] = {}
    values: dict[tuple[str, str, tuple[tuple[str, str], ...]], list[float]] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text.decode()):
            kept = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                key = (kept.name, sample.name, tuple(sample.labels.items()))
                values.setdefault(key, []).append(sample.value)
    for (name, sample_name, labels), seen in values.items():
        family = families[name]
        family.add_sample(sample_name, dict(labels), _rule(family, sample_name)(seen))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families
