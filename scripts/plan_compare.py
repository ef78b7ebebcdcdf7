"""The plan's figures for one split beside a measured run of the same traffic, as a markdown table.

Usage: python scripts/plan_compare.py PLAN_JSON MEASURED_JSON SPLIT_LABEL OUT_MD
MEASURED_JSON: `bench replay`'s replay.json or `bench mixed`'s mixed.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(plan_path: str, measured_path: str, label: str, out: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    split = {s["label"]: s for s in plan["splits"]}[label]
    measured = json.loads(Path(measured_path).read_text())
    if "layouts" in measured:  # bench mixed: per class Summary
        run = next(iter(measured["layouts"].values()))
        interactive, batch = run["interactive"], dict(run["batch"], tokens_per_s=run["batch"]["total_tps"])
    else:
        interactive, batch = measured["interactive"], measured["batch"]
    rows = [
        ("interactive first token p50 (s)", split["interactive"]["ttft_p50"], interactive["ttft_p50"]),
        ("interactive first token p95 (s)", split["interactive"]["ttft_p95"], interactive["ttft_p95"]),
        ("interactive per-user tok/s", split["interactive"]["per_user_tps"], interactive["per_user_tps"]),
        ("batch tok/s", split["batch"]["tokens_per_s"], batch["tokens_per_s"]),
    ]
    lines = [f"| figure ({label}) | planned | measured | error |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {p:.2f} | {m:.2f} | {(p - m) / m:+.1%} |" for name, p, m in rows]
    lines.append(f"\nRecommended: {plan['recommended']} ({plan['reason']})")
    Path(out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:5])
