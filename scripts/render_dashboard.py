"""Draw the Grafana dashboard's panels from a Prometheus server into one PNG, with matplotlib:
the same queries as deploy/grafana/dashboards/specroute.json, for where Grafana cannot run.

    python scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 10 --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

BOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "specroute.json"


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or "value"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--rate-interval", default="30s", help="what Grafana's $__rate_interval becomes")
    parser.add_argument("--out", default="docs/dashboard.png")
    args = parser.parse_args()
    board = json.loads(BOARD.read_text())
    panels = board["panels"]
    end = time.time()
    start = end - args.minutes * 60
    rows = (len(panels) + 1) // 2
    figure, axes = plt.subplots(rows, 2, figsize=(16, 3.2 * rows), squeeze=False)
    with httpx.Client(base_url=args.prometheus, timeout=30) as client:
        for axis, panel in zip(axes.flat, panels, strict=False):
            for target in panel["targets"]:
                query = target["expr"].replace("$__rate_interval", args.rate_interval)
                answer = client.get(
                    "/api/v1/query_range", params={"query": query, "start": start, "end": end, "step": 5}
                ).json()
                for series in answer["data"]["result"]:
                    times = [(float(t) - end) / 60 for t, _ in series["values"]]
                    values = [float(v) for _, v in series["values"]]
                    axis.plot(times, values, label=_legend(target["legendFormat"], series["metric"]), linewidth=1.2)
            unit = panel["fieldConfig"]["defaults"]["unit"]
            axis.set_title(panel["title"], fontsize=10, loc="left")
            axis.set_xlabel("minutes ago", fontsize=8)
            axis.set_ylabel({"s": "seconds", "percentunit": "ratio", "reqps": "requests/s"}.get(unit, ""), fontsize=8)
            axis.tick_params(labelsize=7)
            axis.grid(alpha=0.3)
            if axis.has_data():
                axis.legend(fontsize=6, loc="upper left", ncol=2)
            else:
                axis.text(0.5, 0.5, "no data", transform=axis.transAxes, ha="center", color="grey")
        for axis in axes.flat[len(panels) :]:
            axis.set_visible(False)
    figure.suptitle(f"{board['title']}: the Grafana dashboard's panels, drawn from Prometheus", fontsize=12)
    figure.tight_layout(rect=(0, 0, 1, 0.98))  # room for the title
    figure.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
