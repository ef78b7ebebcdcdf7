#!/usr/bin/env bash
# Reproduces the results in docs/benchmarks.md: the note's sweep on each simulated engine alone
# (prose and code), `compare` of the mixed load, and the spill sweeps. About an hour on two cores.
# Usage: scripts/run_benchmarks.sh [time-scale]   (default 5; the simulator must keep up:
# check specroute_sim_lag_seconds on the engines' /metrics if you raise it)
set -euo pipefail
cd "$(dirname "$0")/.."
scale=${1:-5}
out=docs/bench
mkdir -p "$out"

specroute sim --profile fast --port 9101 --time-scale "$scale" >/dev/null &
fast=$!
specroute sim --profile team --port 9102 --time-scale "$scale" >/dev/null &
team=$!
trap 'kill $fast $team 2>/dev/null || true' EXIT
sleep 3

for kind in prose code; do
  specroute bench sweep --base-url http://127.0.0.1:9101/v1 --kind "$kind" --time-scale "$scale" --out "$out/sweep-fast-$kind"
  specroute bench sweep --base-url http://127.0.0.1:9102/v1 --kind "$kind" --time-scale "$scale" --out "$out/sweep-team-$kind"
done
for kind in prose code; do
  python scripts/plot_sweeps.py "$out/note-$kind.png" "the note's measurement on the simulator, $kind (four nodes each)" \
    "fast (speculative)=$out/sweep-fast-$kind/sweep.json" "team (standard)=$out/sweep-team-$kind/sweep.json"
done
echo "engine lag at the end: fast $(curl -s localhost:9101/metrics | grep '^specroute_sim_lag' | cut -d' ' -f2)" \
     "team $(curl -s localhost:9102/metrics | grep '^specroute_sim_lag' | cut -d' ' -f2)"

specroute bench compare --scenario mixed --interactive 4 --batch 124 --duration 300 --think 5 \
  --max-tokens 512 --time-scale "$scale" --out "$out/compare-mixed"
# The first-token target again, closer to real time: the router's and the load generator's own
# milliseconds count `scale` times in a burst.
specroute bench compare --scenario mixed --layouts routed,team-alone --interactive 4 --batch 124 \
  --duration 300 --think 5 --max-tokens 512 --time-scale 2 --out "$out/compare-mixed-scale2"

for kind in prose code; do
  specroute bench spill --kind "$kind" --users 1,2,4,8,16,32 --batch 96 --duration 90 --think 3 \
    --max-tokens 256 --modes adaptive,static --time-scale "$scale" --out "$out/spill-$kind"
done
