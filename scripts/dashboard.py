"""Write the Grafana dashboard, deploy/grafana/dashboards/specroute.json, from the panel list below.

    python scripts/dashboard.py            # write it
    python scripts/dashboard.py --check    # exit 1 if the committed file is not what this writes

Every query here is run against a real Prometheus by tests/test_prometheus.py. `$__rate_interval`
is Grafana's; the tests put a fixed window in its place.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "specroute.json"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # provisioned under this uid (deploy/grafana)
RATE = "$__rate_interval"


@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    description: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    width: int = 12


def _quantile(q: float, metric: str, by: str, where: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{where}[{RATE}])))"


PANELS: tuple[Panel, ...] = (
    Panel(
        "Interactive first token, p50 and p95, by pool",
        "From arrival at the router to the first generated text: the objective this router exists for.",
        (
            (
                _quantile(0.5, "specroute_time_to_first_token_seconds", "pool", '{job_class="interactive"}'),
                "p50 {{pool}}",
            ),
            (
                _quantile(0.95, "specroute_time_to_first_token_seconds", "pool", '{job_class="interactive"}'),
                "p95 {{pool}}",
            ),
        ),
        unit="s",
    ),
    Panel(
        "First token p50 and p95 by job class and pool",
        "Batch work may wait; interactive work should not.",
        (
            (
                _quantile(0.5, "specroute_time_to_first_token_seconds", "pool, job_class"),
                "p50 {{job_class}} on {{pool}}",
            ),
            (
                _quantile(0.95, "specroute_time_to_first_token_seconds", "pool, job_class"),
                "p95 {{job_class}} on {{pool}}",
            ),
        ),
        unit="s",
    ),
    Panel(
        "Tokens per second by pool",
        "Completion tokens delivered, from the engines' usage.",
        ((f"sum by (pool) (rate(specroute_completion_tokens_total[{RATE}]))", "{{pool}}"),),
        unit="short",
    ),
    Panel(
        "Requests per second by job class and pool",
        "Every answered request, streamed or not.",
        (
            (
                f"sum by (pool, job_class) (rate(specroute_request_duration_seconds_count[{RATE}]))",
                "{{job_class}} on {{pool}}",
            ),
        ),
        unit="reqps",
    ),
    Panel(
        "In flight by backend",
        "Requests the router has sent to each backend and not yet finished.",
        (("sum by (pool, backend) (specroute_in_flight_requests)", "{{backend}} ({{pool}})"),),
    ),
    Panel(
        "Queued in the router by pool and job class",
        "Requests waiting for a slot because every backend of the pool is at max_concurrency.",
        (("sum by (pool, job_class) (specroute_queued_requests)", "{{job_class}} on {{pool}}"),),
    ),
    Panel(
        "Engine running and waiting",
        "As each engine reports in its /metrics (several routers see the same engine: max).",
        (
            ("max by (pool, backend) (specroute_engine_running_requests)", "running {{backend}}"),
            ("max by (pool, backend) (specroute_engine_waiting_requests)", "waiting {{backend}}"),
        ),
    ),
    Panel(
        "Engine KV cache usage",
        "Past routing.kv_threshold, interactive work spills off the speculative pool.",
        (("max by (pool, backend) (specroute_engine_kv_cache_usage_ratio)", "{{backend}}"),),
        unit="percentunit",
    ),
    Panel(
        "Speculative acceptance",
        "Accepted / drafted tokens per scrape interval; adaptive routing scales its predictions by it.",
        (("max by (pool, backend) (specroute_engine_spec_acceptance_ratio)", "{{backend}}"),),
        unit="percentunit",
    ),
    Panel(
        "Learned crossover",
        "Concurrency from which a speculative backend is predicted slower than the standard pool, by content.",
        (("max by (backend, content) (specroute_learned_crossover)", "{{backend}} {{content}}"),),
    ),
    Panel(
        "Spills off the speculative pool, by reason",
        "Interactive requests sent to the standard pool, and why (X-Route-Reason).",
        ((f'sum by (reason) (rate(specroute_route_decisions_total{{reason=~"spill:.*"}}[{RATE}]))', "{{reason}}"),),
        unit="reqps",
    ),
    Panel(
        "Errors by code",
        "Requests the router answered with an error of its own, by its code (queue_full, pool_unavailable, …).",
        ((f'sum by (code) (rate(specroute_requests_total{{code!=""}}[{RATE}]))', "{{code}}"),),
        unit="reqps",
    ),
    Panel(
        "Queue wait p95 by pool",
        "Time spent in the router's queue before a backend slot freed.",
        ((_quantile(0.95, "specroute_queue_wait_seconds", "pool"), "{{pool}}"),),
        unit="s",
    ),
    Panel(
        "Backends healthy",
        "1 while a backend passes its health checks (any router that sees it healthy).",
        (("max by (pool, backend) (specroute_backend_healthy)", "{{backend}}"),),
    ),
)


def dashboard() -> dict[str, object]:
    panels = []
    for index, panel in enumerate(PANELS):
        panels.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": panel.title,
                "description": panel.description,
                "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": panel.width, "x": (index % 2) * 12, "y": (index // 2) * 8},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                "targets": [
                    {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(panel.targets)
                ],
            }
        )
    return {
        "uid": "specroute",
        "title": "specroute",
        "description": "The router in front of a speculative and a standard engine pool.",
        "tags": ["specroute", "llm"],
        "timezone": "utc",
        "refresh": "5s",
        "schemaVersion": 39,
        "time": {"from": "now-15m", "to": "now"},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed dashboard is out of date")
    args = parser.parse_args()
    if args.check:
        if OUT.read_text() != render():
            print(f"{OUT} is out of date: run python scripts/dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
