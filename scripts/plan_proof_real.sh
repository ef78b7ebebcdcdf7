#!/usr/bin/env bash
# The planner's proof on the two real vLLM servers (docs/benchmarks.md, "Planning a split"):
# fit a profile of each engine from sweeps of it, record a mixed workload through the router,
# plan from the record, then replay the same record on the real engines through the router and
# compare the plan's one-and-one split with what was measured. About 15 minutes on two cores.
# Usage: flock /tmp/specroute-real.lock scripts/plan_proof_real.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench/plan-real}
mkdir -p "$out"
scripts/real-engines install
fast=http://127.0.0.1:9211 team=http://127.0.0.1:9212 router=http://127.0.0.1:9210
scripts/real-engines serve 9211 9212 >/tmp/plan-proof-engines.log 2>&1 &
engines=$!
trap 'kill $engines ${serve:-} 2>/dev/null; wait' EXIT
up() {  # until $1 answers 200, at most $2 seconds
  local deadline=$((SECONDS + $2))
  until curl -sf -o /dev/null "$1"; do
    ((SECONDS < deadline)) || { echo "$1 not up after $2 s" >&2; exit 1; }
    sleep 1
  done
}
up $fast/health 300
up $team/health 300
answer=200
# Warm both (an engine's first requests are slow whatever the load), then sweep each directly,
# so that its /metrics are read: the speculative engine once per content kind.
for engine in $fast $team; do
  specroute bench sweep --base-url $engine/v1 --users 1,4 --max-tokens 64 --out "$out/warm" >/dev/null
done
rm -rf "$out/warm"
users=1,2,4,8,12
specroute bench sweep --base-url $fast/v1 --kind prose --users $users --max-tokens $answer --out "$out/sweep-fast-prose" >/dev/null
specroute bench sweep --base-url $fast/v1 --kind code --users $users --max-tokens $answer --out "$out/sweep-fast-code" >/dev/null
specroute bench sweep --base-url $team/v1 --kind prose --users $users --max-tokens $answer --out "$out/sweep-team-prose" >/dev/null
# Fit; a poor fit is written anyway here (--force), and its errors are published with it.
specroute sim fit "$out/sweep-fast-prose/sweep.json" "$out/sweep-fast-code/sweep.json" --base fast \
  --name real-fast --out "$out/real-fast.yaml" --force >"$out/fit-fast.txt" 2>&1
specroute sim fit "$out/sweep-team-prose/sweep.json" --base team --name real-team --out "$out/real-team.yaml" \
  --force >"$out/fit-team.txt" 2>&1

router_up() {
  rm -f "$out/traffic.jsonl" "$out/traffic.jsonl.1"
  cat >"$out/router.yaml" <<EOF2
listen: {port: 9210}
pools:
  fast: {speculative: true, backends: {fast-1: {url: $fast, max_concurrency: 32}}}
  team: {speculative: false, backends: {team-1: {url: $team, max_concurrency: 32}}}
scrape: {interval: 0.5, timeout: 2.0, stale_after: 15.0}
traffic: {path: $PWD/$out/traffic.jsonl, flush_seconds: 0.5}
EOF2
  specroute serve --config "$out/router.yaml" --log-level warning >"$out/router-$1.log" 2>&1 &
  serve=$!
  up $router/readyz 30
}
# Record: 2 interactive users (own keys, 1 s think) beside a batch job of 8 in flight, 90 s.
router_up record
specroute bench mixed --base-url $router/v1 --interactive 2 --batch 8 --think 1 --duration 90 \
  --max-tokens $answer --out "$out/recorded" >/dev/null
sleep 1
kill $serve; wait $serve 2>/dev/null || true
specroute trace export "$out/traffic.jsonl" --out "$out/record.jsonl"
# Plan from the record on the fitted profiles (one engine a pool is the 4 + 4 split).
specroute plan --record "$out/record.jsonl" --fast "$out/real-fast.yaml" --team "$out/real-team.yaml" --nodes 8 \
  --time-scale 2 --out "$out/plan" >/dev/null
# The same record, for real, through a fresh router.
router_up replay
specroute bench replay --base-url $router/v1 --record "$out/record.jsonl" --out "$out/replayed" >/dev/null
kill $serve; wait $serve 2>/dev/null || true
rm -f "$out/traffic.jsonl" "$out/traffic.jsonl.1"
python scripts/plan_compare.py "$out/plan/plan.json" "$out/replayed/replay.json" "4 speculative + 4 standard" "$out/comparison.md"
