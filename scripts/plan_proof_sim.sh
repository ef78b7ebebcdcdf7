#!/usr/bin/env bash
# The planner's proof on the simulator (docs/benchmarks.md §14): record the field note's mixed
# workload through the router on the embedded eight-node cluster, plan every split from that
# record, and compare the plan's figures for the split that ran (4 + 4) with the measured run.
# Usage: flock /tmp/specroute-bench.lock scripts/plan_proof_sim.sh OUT_DIR [TIME_SCALE]
set -euo pipefail
out=${1:?output directory}
scale=${2:-10}
mkdir -p "$out"
port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rm -f "$out/traffic.jsonl" "$out/traffic.jsonl.1"
SPECROUTE_TRAFFIC__PATH="$out/traffic.jsonl" specroute serve --port "$port" --time-scale "$scale" \
  --log-level warning > "$out/serve.log" 2>&1 &
router=$!
trap 'kill $router 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/readyz" > /dev/null && break; sleep 0.2; done
# The measured run: 4 interactive users and a 124-request batch job, 512-token answers, 300 s
# (DURATION=...).
specroute bench mixed --base-url "http://127.0.0.1:$port/v1" --time-scale "$scale" --interactive 4 \
  --batch 124 --duration "${DURATION:-300}" --out "$out/measured" > "$out/measured.log" 2>&1
sleep 2  # the record's last second written
kill $router; wait $router 2>/dev/null || true
specroute trace export "$out/traffic.jsonl" --out "$out/record.jsonl"
# The plan, from that record; then the same with the batch traffic doubled.
specroute plan --record "$out/record.jsonl" --record-time-scale "$scale" --nodes 8 --time-scale "$scale" --out "$out/plan"
specroute plan --record "$out/record.jsonl" --record-time-scale "$scale" --nodes 8 --time-scale "$scale" --batch-scale 2 --out "$out/plan-batch2"
python scripts/plan_compare.py "$out/plan/plan.json" "$out/measured/mixed.json" "4 speculative + 4 standard" "$out/comparison.md"
