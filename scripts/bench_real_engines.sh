#!/usr/bin/env bash
# The mixed load on two real vLLM servers (scripts/real-engines): interactive users beside a
# batch job, through the router and against each engine alone, at a few user counts; and how
# the router decided (specroute_route_decisions_total, counted per run). docs/benchmarks.md,
# "On real engines". About 15 minutes on two cores.
# Usage: scripts/bench_real_engines.sh [users ...]   (default 2 4 8 16)
#        TOGETHER=1 scripts/bench_real_engines.sh 24 32   the users arrive at the same moment
#        (results named *-N-together)
set -euo pipefail
cd "$(dirname "$0")/.."
users=("$@")
((${#users[@]})) || users=(2 4 8 16)
out=docs/bench/real
duration=${DURATION:-30}
tag=${TOGETHER:+-together}
mkdir -p "$out"

scripts/real-engines install
fast=http://127.0.0.1:9201 team=http://127.0.0.1:9202 router=http://127.0.0.1:9200
scripts/real-engines serve 9201 9202 >"$out/engines.log" 2>&1 &
engines=$!
warmed=$(mktemp -d)
trap 'kill $engines ${serve:-} 2>/dev/null; wait; rm -rf "$warmed"' EXIT

up() {  # until $1 answers 200, at most $2 seconds
  local deadline=$((SECONDS + $2))
  until curl -sf -o /dev/null "$1"; do
    ((SECONDS < deadline)) || { echo "$1 not up after $2 s" >&2; exit 1; }
    sleep 1
  done
}
up $fast/health 300
up $team/health 300

# An engine's first requests after it starts are slow (the first 2-4 s to a first token, whatever
# the load): warm both with the first point's load, directly, before the router starts, so the
# routed run is not charged for it and the router starts cold (it has seen no engine loaded).
warm=(--interactive "${users[0]}" --batch 8 --duration 5 --think 1 --max-tokens 256 --batch-header ${TOGETHER:+--together})
for engine in $fast $team; do
  specroute bench mixed --base-url $engine/v1 "${warm[@]}" --out "$warmed" >/dev/null
done

cat >"$out/router.yaml" <<EOF
listen: {port: 9200}
pools:
  fast: {speculative: true, backends: {fast-1: {url: $fast, max_concurrency: 32}}}
  team: {speculative: false, backends: {team-1: {url: $team, max_concurrency: 32}}}
scrape: {interval: 0.5}
EOF
specroute serve --config "$out/router.yaml" >"$out/router.log" 2>&1 &
serve=$!
up $router/readyz 30

decisions() { curl -s $router/metrics | grep '^specroute_route_decisions_total' || true; }

for u in "${users[@]}"; do
  common=(--interactive "$u" --batch 8 --duration "$duration" --think 1 --max-tokens 256 --batch-header
          ${TOGETHER:+--together})
  decisions >"$out/decisions-before-$u$tag.txt"
  specroute bench mixed --base-url $router/v1 "${common[@]}" --out "$out/routed-$u$tag"
  decisions >"$out/decisions-after-$u$tag.txt"
  specroute bench mixed --base-url $fast/v1 "${common[@]}" --out "$out/fast-alone-$u$tag"
  specroute bench mixed --base-url $team/v1 "${common[@]}" --out "$out/team-alone-$u$tag"
done

report=$out/report-$(IFS=-; echo "${users[*]}")$tag.md
python3 - "$out" "$tag" "${users[@]}" <<'EOF' | tee "$report"
import json, re, sys
from collections import Counter
from pathlib import Path

out, tag, users = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]

def interactive(name: str) -> dict:
    data = json.loads((out / name / "mixed.json").read_text())
    [layout] = data["layouts"].values()
    return layout["interactive"]

def counts(path: Path) -> Counter:
    found = Counter()
    for line in path.read_text().splitlines():
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        found[labels["job_class"], labels["pool"], labels["reason"]] += float(line.rsplit(" ", 1)[1])
    return found

def ms(value) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms"

print("| users | layout | requests | TTFT p50 | TTFT p99 | worst TTFT | per-user tok/s | errors |")
print("|---:|---|---:|---:|---:|---:|---:|---:|")
for u in users:
    for layout in ("routed", "fast-alone", "team-alone"):
        s = interactive(f"{layout}-{u}{tag}")
        speed = "–" if s["per_user_tps"] is None else f"{s['per_user_tps']:.0f}"
        print(f"| {u} | {layout} | {s['requests']} | {ms(s['ttft_p50'])} | {ms(s['ttft_p99'])} "
              f"| {ms(s['ttft_worst'])} | {speed} | {s['errors']} |")
print()
print("| users | job | pool | reason | requests |")
print("|---:|---|---|---|---:|")
for u in users:
    delta = counts(out / f"decisions-after-{u}{tag}.txt") - counts(out / f"decisions-before-{u}{tag}.txt")
    for (job, pool, reason), n in sorted(delta.items()):
        print(f"| {u} | {job} | {pool} | {reason} | {n:.0f} |")
EOF
