#!/usr/bin/env bash
# docs/dashboard.png again: the simulated cluster at real time under a load that spills and errs,
# scraped by a real Prometheus every second for 6 minutes, then the panels drawn from it.
#   OUT=/tmp/dash PROMETHEUS=/usr/bin/prometheus docs/bench/dashboard/run.sh   (ports 18900, 19090)
set -u
repo=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "${OUT:-/tmp/dash}" && cd "${OUT:-/tmp/dash}"
V=$repo/.venv/bin
P=${PROMETHEUS:-prometheus}
cp "$repo/deploy/prometheus/rules.yml" .
cat > prometheus.yml <<YML
global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: [rules.yml]
scrape_configs:
  - job_name: specroute
    static_configs: [{targets: ["127.0.0.1:18900"]}]
YML
$V/specroute serve --port 18900 --log-level warning > router.log 2>&1 &
router=$!
$P --config.file=prometheus.yml --storage.tsdb.path=tsdb --web.listen-address=127.0.0.1:19090 > prom.log 2>&1 &
prom=$!
sleep 10
# interactive users arriving together beside a batch job: the speculative pool fills and spills
$V/specroute bench mixed --base-url http://127.0.0.1:18900/v1 --interactive 24 --together --batch 64 \
  --duration 300 --think 3 --max-tokens 256 --out mixed > bench.log 2>&1 &
bench=$!
# a few client errors and an unknown pool, for the errors-by-code panel
for i in $(seq 1 60); do
  curl -s -o /dev/null http://127.0.0.1:18900/v1/chat/completions -H 'content-type: application/json' -d '{bad'
  curl -s -o /dev/null http://127.0.0.1:18900/v1/chat/completions -H 'content-type: application/json' \
    -H 'x-route-pool: nowhere' -d '{"model":"glm-5.3-flash","messages":[{"role":"user","content":"hi"}]}'
  sleep 5
done
wait $bench
sleep 5
$V/python "$repo/scripts/render_dashboard.py" --prometheus http://127.0.0.1:19090 --minutes 6 --out "${OUT:-/tmp/dash}/dashboard.png" > render.log 2>&1
kill $router $prom
echo done > done
